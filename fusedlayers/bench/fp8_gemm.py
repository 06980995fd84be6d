"""`python -m fusedlayers bench --fp8`, the GEMM rows: fusedlayers.torch.fp8_gemm in TFLOP/s at
each scaling (blockwise 1x128 x 128x128 as a layer's fprop and dgrad, 1x128 x 1x128 as its
wgrad, tensorwise) beside `torch._scaled_mm` in the same scaling on the same operands and the
bf16 GEMM (torch.mm, cuBLAS) of the same shape, timed in interleaved rounds.

Shapes: Llama-3-8B's at 8192 tokens on CUDA (m = 8192; k x n = 4096 x 14336 as gate/up,
14336 x 4096 as down, 4096 x 4096 as an attention projection; and the weight gradients' m x k x
n = 14336 x 8192 x 4096 and 4096 x 8192 x 14336, contracting over the tokens, where 1x128 x
128x128 is a recipe's x^T in tiles: Fp8Recipe(wgrad_x_scaling="128x128")); 256 x 512 x 512 on
the CPU.
"""

import statistics
from dataclasses import asdict, dataclass

import torch

from ..torch import fp8_gemm, fp8_quantize
from .ops import time_rounds
from .table import format_speedup, speedup

HEADER = (f"{'m x k x n':<18} {'scaling':<18} {'impl':<12} {'ms':>8} {'TFLOP/s':>8}  "
          f"{'vs bf16':<20} {'vs _scaled_mm':<20}")
PAIRS = {"1x128 x 128x128": ("1x128", "128x128"), "1x128 x 1x128": ("1x128", "1x128"),
         "tensorwise": ("tensorwise", "tensorwise")}


@dataclass
class GemmRow:
    shape: tuple
    scaling: str
    impl: str
    ms: float | None
    tflops: float | None
    rounds_ms: list | None
    vs_bf16: dict | None = None
    vs_scaled_mm: dict | None = None
    not_run: str = ""


def shapes(device_type: str) -> list[tuple]:
    if device_type != "cuda":
        return [(256, 512, 512)]
    return [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 4096), (14336, 8192, 4096),
            (4096, 8192, 14336)]


def scaled_mm(a, a_scaling, b, b_scaling):
    """torch._scaled_mm on the same operands: its b is ours transposed (k x n, column-major),
    its scales ours in the layouts it reads (1x128: [rows, blocks] column-major; 128x128 of
    b^T: our tiles' scales transposed, column-major with padded columns)."""
    sa = a.scale_inv
    sb = b.scale_inv.t() if b_scaling == "128x128" else b.scale_inv
    return torch._scaled_mm(a.data, b.data.t(), sa, sb, out_dtype=torch.bfloat16)


def run(device: str = "cuda", rounds: int = 5, reps: int = 20, log=print) -> list[GemmRow]:
    dev = torch.device(device)
    rows = []
    for m, k, n in shapes(dev.type):
        flops = 2 * m * n * k
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        fns = {"bf16": lambda: torch.mm(x, w.t())}
        operands = {}
        for name, (sa, sb) in PAIRS.items():
            operands[name] = (fp8_quantize(x, sa), sa, fp8_quantize(w, sb), sb)
        for name, ops in operands.items():
            fns[f"ours {name}"] = lambda ops=ops: fp8_gemm(*ops)
            if dev.type == "cuda":
                fns[f"_scaled_mm {name}"] = lambda ops=ops: scaled_mm(*ops)
        times = time_rounds(fns, dev, rounds, reps,
                            fallible={f for f in fns if f.startswith("_scaled_mm")})
        for impl, t in times.items():
            scaling = "bf16" if impl == "bf16" else impl.split(" ", 1)[1]
            who = impl.split(" ", 1)[0] if impl != "bf16" else "torch.mm"
            if isinstance(t, str):
                row = GemmRow((m, k, n), scaling, who, None, None, None, not_run=t)
            else:
                ms = statistics.median(t)
                peer = times.get(f"_scaled_mm {scaling}")
                row = GemmRow((m, k, n), scaling, who, ms, flops / ms / 1e9, t,
                              speedup(times["bf16"], t) if impl != "bf16" else None,
                              speedup(peer, t) if who == "ours" and isinstance(peer, list)
                              else None)
            rows.append(row)
            log(format_row(row))
        del fns, operands, x, w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_row(r: GemmRow) -> str:
    shape = "x".join(map(str, r.shape))
    if r.ms is None:
        return f"{shape:<18} {r.scaling:<18} {r.impl:<12} did not run: {r.not_run}"
    return (f"{shape:<18} {r.scaling:<18} {r.impl:<12} {r.ms:>8.4f} {r.tflops:>8.1f}  "
            f"{format_speedup(r.vs_bf16):<20} {format_speedup(r.vs_scaled_mm):<20}")


def rows_json(rows: list[GemmRow]) -> list[dict]:
    return [asdict(r) for r in rows]
