"""`python -m fusedlayers bench --fp8`: FP8 quantization (fusedlayers.torch.fp8_quantize) in GB/s
of the bytes it must move (x read once, the FP8 values written, and x^T's with the
cast-transpose) against the device's copy bandwidth, beside the same quantization in stock torch
ops, eager and under torch.compile (as torchao's float8 casts run), timed in interleaved rounds
on the same tensor.

Shapes: Llama-3-8B's at 8192 tokens on CUDA (the norm's output 8192 x 4096 and the SwiGLU's
8192 x 14336 in 1x128 blocks and tensorwise, the down projection's weight 4096 x 14336 in
128x128 tiles); 1024 x 1024 on the CPU. x in bfloat16, E4M3.

Each quantization's "copy" row: a copy of x (its bytes read and written), the bandwidth a
tensor of that size reaches, beside the large copy's that "% copy" is of.

The fused producers' rows (output "swiglu", "swiglu'"): fp8_gated (SwiGLU's output quantized
with its x^T, from the halves of one gate/up projection) and fp8_gated_backward ([dgate | dup]
quantized with its transpose), beside the two ops they replace (fusedlayers' swiglu then
fp8_quantize) and stock torch eager and compiled; their bytes: gate and up (and dy) read once,
the FP8 values written.
"""

import statistics
from dataclasses import asdict, dataclass

import torch

import torch.nn.functional as F

from ..torch import fp8_quantize, swiglu
from ..torch.fp8_gated import fp8_gated, fp8_gated_backward
from .ops import copy_bandwidth_gbs, time_rounds
from .table import format_speedup, speedup

HEADER = (f"{'shape':<14} {'scaling':<11} {'output':<15} {'impl':<12} {'ms':>9} {'GB/s':>8} "
          f"{'% copy':>7}  {'vs eager':<20} {'vs compile':<20}")
E4M3_MAX = 448.0


@dataclass
class Fp8Row:
    shape: tuple
    scaling: str
    transpose: bool
    impl: str
    ms: float | None
    gbs: float | None
    pct_of_copy: float | None
    rounds_ms: list | None
    vs_eager: dict | None = None
    vs_compile: dict | None = None
    not_run: str = ""
    producer: str = ""


def cases(device_type: str) -> list[tuple]:
    """(shape, scaling, transpose, producer): activations and their x^T (1x128, tensorwise), a
    weight, and the gated activation's FP8 forms (producer "swiglu" / "swiglu'")."""
    if device_type != "cuda":
        return [((1024, 1024), s, t, None) for s in ("1x128", "tensorwise")
                for t in (False, True)] + [((1024, 1024), "128x128", True, None)] + \
            [((256, 1024), "1x128", True, p) for p in ("swiglu", "swiglu'")]
    acts = [((8192, 4096), s, t, None) for s in ("1x128", "tensorwise") for t in (False, True)]
    acts += [((8192, 14336), "1x128", t, None) for t in (False, True)]
    return acts + [((4096, 14336), "128x128", True, None)] + \
        [((8192, 14336), "1x128", True, p) for p in ("swiglu", "swiglu'")]


def unfused(x: torch.Tensor, scaling: str, transpose: bool):
    """The same quantization in stock torch ops (amax, the multiplier, the saturated cast; x^T
    as a copy of x's transpose quantized the same way). Sizes: multiples of 128."""
    def one(a):
        rows, cols = a.shape
        if scaling == "tensorwise":
            blocks = a.float().reshape(1, -1)
        elif scaling == "1x128":
            blocks = a.float().reshape(rows, cols // 128, 128)
        else:
            blocks = a.float().reshape(rows // 128, 128, cols // 128, 128).transpose(1, 2)
        amax = blocks.abs().amax(dim=-1 if scaling != "128x128" else (-2, -1), keepdim=True)
        s = torch.where(amax == 0, 1.0, E4M3_MAX / amax)
        q = (blocks * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        if scaling == "128x128":
            q = q.transpose(1, 2)
        return q.reshape(rows, cols), 1.0 / s
    q = one(x)
    return (*q, *one(x.t().contiguous())) if transpose else q


def producer_fns(producer: str, x: torch.Tensor, scaling: str, compile: bool):
    """The gated activation's FP8 form on gate and up of x's shape (the halves of one
    projection): fused, as fusedlayers' two ops, in torch eager and compiled; and its bytes."""
    gate, up = torch.randn(x.shape[0], 2 * x.shape[1], device=x.device,
                           dtype=x.dtype).chunk(2, dim=-1)
    if producer == "swiglu":
        def eager(gate, up):
            return unfused(F.silu(gate) * up, scaling, True)
        fns = {"fusedlayers": lambda: fp8_gated(gate, up, "silu", scaling, "e4m3", True),
               "two ops": lambda: fp8_quantize(swiglu(gate, up), scaling, "e4m3", True)}
        args, read = (gate, up), 2
    else:
        dy = x

        def eager(dy, gate, up):
            s = torch.sigmoid(gate.float())
            dgate = dy.float() * up.float() * s * (1 + gate.float() * (1 - s))
            dup = dy.float() * gate.float() * s
            return unfused(torch.cat([dgate.to(dy.dtype), dup.to(dy.dtype)], -1), scaling, True)
        fns = {"fusedlayers": lambda: fp8_gated_backward(dy, gate, up, "silu", scaling, "e4m3",
                                                         True),
               "two ops": lambda: fp8_quantize(
                   torch.cat(torch.ops.fusedlayers.swiglu_backward(dy, gate, up), -1), scaling,
                   "e4m3", True)}
        args, read = (dy, gate, up), 3
    fns["eager"] = lambda: eager(*args)
    if compile:
        compiled = torch.compile(eager, dynamic=False)
        fns["compile"] = lambda: compiled(*args)
    outputs = 1 if producer == "swiglu" else 2
    return fns, x.numel() * (read * x.element_size() + 2 * outputs)


def run(device: str = "cuda", rounds: int = 5, reps: int = 20, compile: bool = True,
        log=print) -> list[Fp8Row]:
    dev = torch.device(device)
    copy_gbs = copy_bandwidth_gbs(dev, rounds, reps)
    log(f"copy: {copy_gbs:.0f} GB/s")
    rows = []
    for shape, scaling, transpose, producer in cases(dev.type):
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        dst = None
        if producer:
            fns, work = producer_fns(producer, x, scaling, compile)
        else:
            dst = torch.empty_like(x)
            fns = {"fusedlayers": lambda: fp8_quantize(x, scaling, "e4m3", transpose),
                   "eager": lambda: unfused(x, scaling, transpose),
                   "copy": lambda: dst.copy_(x)}
            if compile:
                compiled = torch.compile(unfused, dynamic=False)
                fns["compile"] = lambda: compiled(x, scaling, transpose)
            work = x.numel() * (x.element_size() + (2 if transpose else 1))
        times = time_rounds(fns, dev, rounds, reps, fallible={"compile"})
        output = producer or ("x, x^T" if transpose else "x")
        for impl, t in times.items():
            if isinstance(t, str):
                row = Fp8Row(shape, scaling, transpose, impl, None, None, None, None, not_run=t,
                             producer=producer or "")
            else:
                ms = statistics.median(t)
                gbs = (2 * x.nbytes if impl == "copy" else work) / ms / 1e6
                ratio = {k: speedup(times[k], t) for k in ("eager", "compile")
                         if impl == "fusedlayers" and isinstance(times.get(k), list)}
                row = Fp8Row(shape, scaling, transpose, impl, ms, gbs, 100 * gbs / copy_gbs, t,
                             ratio.get("eager"), ratio.get("compile"), producer=producer or "")
            rows.append(row)
            log(format_row(row, output))
        del fns, x, dst
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_row(r: Fp8Row, output: str) -> str:
    shape = "x".join(map(str, r.shape))
    if r.ms is None:
        return f"{shape:<14} {r.scaling:<11} {output:<15} {r.impl:<12} did not run: {r.not_run}"
    return (f"{shape:<14} {r.scaling:<11} {output:<15} {r.impl:<12} {r.ms:>9.4f} "
            f"{r.gbs:>8.1f} {r.pct_of_copy:>6.1f}%  {format_speedup(r.vs_eager):<20} "
            f"{format_speedup(r.vs_compile):<20}")
