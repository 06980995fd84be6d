"""grouped_gemm on torch tensors: `fusedlayers::grouped_gemm` (backends/torch/grouped_gemm.cpp:
schema, kernels, autograd), its fake kernels, the functional API, the unfused reference and the
bench case. The math: csrc/gemm/grouped_gemm.h."""

import torch
import torch.nn.functional as F

from ..bench.case import Case
from . import _op

__all__ = ["grouped_gemm"]

grouped_gemm_op = _op.handle("grouped_gemm")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                 transposed: bool = False) -> torch.Tensor:
    """Each group's rows of x times its own weight, as a mixture-of-experts layer's experts
    multiply their rows (MegaBlocks' dropless grouped GEMM, Gale et al. 2022, arXiv:2211.15841):
        y[rows of g] = x[rows of g] @ W_g,
    group g owning the rows [offsets[g - 1], offsets[g]) (offsets[-1] = 0: moe_permute's
    offsets, torch.nn.functional.grouped_mm's `offs`); rows past the last end get zeros.
    x: (rows, k). weight: (num_groups, n, k), W_g = weight[g].T as nn.Linear's (out, in), or
    with transposed=True (num_groups, k, n), W_g = weight[g]; one dtype with x, float32, float64,
    float16 or bfloat16. offsets: (num_groups,) int32 on x's device, read there (no host sync:
    CUDA-graph safe), each at least the one before it and at most x's rows: on the CPU a bad
    one raises ValueError naming offsets; on CUDA the kernels clamp them (wrong values, never a
    read or write out of bounds).
    Returns y (rows, n) in x's dtype, accumulated in float32 (float64 for float64), the same bits
    on every run. On CUDA: CUTLASS's Hopper grouped GEMM (sm90, bfloat16, k and n multiples of 8,
    16-byte aligned data, a build with CUTLASS's headers), else a tiled kernel; on the CPU a
    loop. Differentiable in x and weight (dgrad dx = dy @ W_g^T and wgrad dW_g = x_g^T dy_g,
    zeros for a group with no rows). Raises TypeError for dtypes, ValueError for shapes or
    devices.
    """
    return grouped_gemm_op(x, weight, offsets, transposed)


def reference(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
              transposed: bool = False) -> torch.Tensor:
    """The same in stock torch ops with no data-dependent shape (ONNX export writes it): each
    row's group as the number of ends at or before it, its weight gathered, a batched product;
    rows past the last end take a zero weight."""
    rows = torch.arange(x.shape[0], device=x.device)
    group = (rows[:, None] >= offsets.long()[None, :]).sum(1)
    w = weight if transposed else weight.transpose(1, 2)  # (num_groups, k, n)
    w = torch.cat([w, w.new_zeros(1, *w.shape[1:])])[group]
    return torch.bmm(x[:, None, :], w)[:, 0]


@_op.register_fake("grouped_gemm")
def _(x, weight, offsets, transposed=False):
    _op.check_devices("grouped_gemm", "x", x, weight=weight, offsets=offsets)
    return x.new_empty(x.shape[0], weight.shape[2] if transposed else weight.shape[1])


@_op.register_fake("grouped_gemm_backward")
def _(dy, x, weight, offsets, transposed, output_mask):
    _op.check_devices("grouped_gemm_backward", "dy", dy, x=x, weight=weight, offsets=offsets)
    return (torch.empty_like(x) if output_mask[0] else x.new_empty(0),
            torch.empty_like(weight) if output_mask[1] else x.new_empty(0))


EXPORT_DECOMPOSITIONS = {"grouped_gemm": reference}  # ONNX export writes the unfused formula
DECOMPOSITIONS = {}  # Inductor keeps the op whole: data-dependent groups


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False) -> Case:
    """shape: (tokens, k, n, num_groups, top_k), an MoE layer's expert GEMM over its tokens *
    top_k routed rows (the bench's routing), weight (num_groups, n, k); the eager row is torch's
    grouped_mm on the same operands. Work: 2 * rows * k * n flops forward, twice that backward
    (dgrad and wgrad)."""
    from .moe_permute import bench_routing, moe_permute

    tokens, k, n, groups, top_k = shape
    index, _ = bench_routing(tokens, groups, top_k, device)
    x = torch.randn(tokens, k, device=device, dtype=dtype)
    xs, _, offsets = moe_permute(x, index, groups)
    xs.requires_grad_()
    w = (torch.randn(groups, n, k, device=device, dtype=dtype) / k ** 0.5).requires_grad_()
    flops = 2 * tokens * top_k * k * n
    eager = lambda: F.grouped_mm(xs, w.transpose(1, 2), offs=offsets)  # noqa: E731
    # "gemm", the floor of a TFLOP/s op's rows: here the framework's GEMM is the eager row
    return Case(lambda: grouped_gemm(xs, w, offsets), eager, [xs, w],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants={"gemm": eager})
