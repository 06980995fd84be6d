"""What an op's `bench_case` returns: one op at one shape and dtype, as the bench times it.
Imports no framework."""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Case:
    fused: Callable     # the fused op on `inputs`
    eager: Callable     # the unfused computation it replaces, on the same inputs
    inputs: list        # x first, then the parameters the backward differentiates
    work: dict          # pass ("fwd", "fwd+bwd") -> bytes moved (GB/s ops) or flops (TFLOP/s)
    # More variants of the forward only, by name (fn), and of both passes (fn, or (fn, leaves)
    # where the backward's leaves are not `inputs[1:]`). A variant named "gemm" (the bare GEMMs)
    # is the floor its framework's rows of a TFLOP/s op are judged by (bench.table).
    fwd_only: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)
    # Variants timed as called, not captured in a CUDA graph: other libraries' calls that wait
    # on the host (a failed capture leaves torch's CUDA generator expecting one).
    uncaptured: set = field(default_factory=set)


def memory_work(x_bytes: int, saved_bytes: int) -> dict:
    """The fewest bytes an elementwise or row op moves: the forward reads x and writes y; the
    backward reads dy, writes dx and reads what the forward saved for it."""
    return {"fwd": 2 * x_bytes, "fwd+bwd": 4 * x_bytes + saved_bytes}
