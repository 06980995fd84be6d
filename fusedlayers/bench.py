"""`python -m fusedlayers bench`: fused vs unfused eager vs torch.compile(unfused), per op, shape,
dtype and pass, with the device's own ceilings measured in the same run.

Memory-bound ops (relu_scale, layer_norm, rms_norm) report GB/s over the fewest bytes the op must move
(each input read once, each output written once; for the backward, what it must keep from the
forward: layer_norm's input, relu_scale's sign bits) and the percentage of the measured copy
bandwidth (bytes read + written by a large tensor copy); their forward also gets a "copy" row, a
copy of the input moving the same bytes, which is the floor at that size (a small op pays launch
and tail costs that the large copy amortizes); under half dtypes a "fused-w32" row runs the
same op with float32 parameters (mixed precision's layout). linear_gelu reports TFLOP/s over
2*M*N*K per GEMM (one forward, three for forward+backward) and the percentage of the measured
GEMM rate of the same dtype, with a "gemm" row: the bare GEMMs of the same shape, the floor
under any epilogue. Times are medians. On CUDA each variant is captured once in a CUDA
graph and its replays are timed with CUDA events (triton.testing.do_bench when present), so the
numbers are the kernels' and not Python's launch overhead; a variant that cannot be captured is
timed directly. On the CPU: the wall clock around synchronous calls.

With peers (`--peers`, CUDA), other libraries' kernels for the same call join the rows where
they import: Liger-Kernel's Triton LayerNorm and RMSNorm (liger_kernel.ops, its defaults:
RMSNorm's "llama" casting, backward in place), and QuACK's RMSNorm (`quack.rmsnorm`).
"""

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from . import reference
from . import torch as fused


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    pass_: str
    impl: str
    ms: float
    rate: float  # GB/s or TFLOP/s
    unit: str
    pct_of_peak: float


def _graphed(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream), or fn if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return fn
    return graph.replay


def _median_ms(fn, device: torch.device, reps: int, graph: bool = True) -> float:
    if device.type == "cuda":
        fn = _graphed(fn) if graph else fn
        try:
            from triton.testing import do_bench
            return do_bench(fn, warmup=25, rep=100, return_mode="median")
        except ImportError:
            pass
        fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# Untimed rounds first on the CPU: until glibc's malloc has raised its mmap threshold past an
# output's size, each call's output is fresh memory, page-faulted in on first touch (measured: a
# 1024 x 4097 float32 LayerNorm output, 4096 faults, 4 ms on a 0.7 ms op, for up to 6 calls of
# either implementation), which a median of 15 interleaved calls did not always hide.
CPU_WARMUP_ROUNDS = 8


def _median_ms_each(fns: dict, device: torch.device, reps: int) -> dict:
    """The median ms of each of fns, by name. On the CPU they run interleaved, one call of each
    per round, so a host whose speed drifts (shared cores, clock changes) slows every variant
    alike instead of whichever ran during a slow spell."""
    if device.type == "cuda":
        # Like copy_bandwidth_gbs, the copy is not graphed (a memcpy node is slower).
        return {name: _median_ms(fn, device, reps, graph=name != "copy")
                for name, fn in fns.items()}
    for _ in range(CPU_WARMUP_ROUNDS):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth_gbs(device: torch.device, reps: int) -> float:
    """Bytes read + written per second by a device-to-device copy of a large tensor."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    # Not graphed: a captured copy_ becomes a memcpy node that runs slower than the copy kernel.
    ms = _median_ms(lambda: dst.copy_(src), device, reps, graph=False)
    return 2 * src.nbytes / ms / 1e6


def gemm_tflops(device: torch.device, dtype: torch.dtype, reps: int) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _median_ms(lambda: a @ b, device, reps)
    return 2 * n**3 / ms / 1e9


def _fwd_bwd(fn, inputs):
    grad = torch.randn_like(fn())  # made once: the timed region is forward + backward only

    def run():
        torch.autograd.grad(fn(), inputs, grad)
    return run


OPS = ("relu_scale", "layer_norm", "rms_norm", "linear_gelu")


def _peers(op: str, x, w, b, eps: float) -> dict:
    """Other libraries' kernels for the same call, by name, where they import (CUDA only)."""
    peers = {}
    if x.device.type != "cuda":
        return peers
    try:
        if op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            peers["liger"] = lambda: LigerLayerNormFunction.apply(x, w, b, eps)
        else:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            peers["liger"] = lambda: LigerRMSNormFunction.apply(x, w, eps)
    except ImportError:
        pass
    if op == "rms_norm":
        try:
            from quack import rmsnorm
            peers["quack"] = lambda: rmsnorm(x, w, eps)
        except ImportError:
            pass
    return peers


def shapes(device: torch.device, quick: bool) -> dict:
    """The shapes each op is timed at on `device`: (rows, cols), or linear_gelu's (m, k, n)."""
    cuda = device.type == "cuda"
    ew_shapes = [(32768, 4096)] if cuda else [(1024, 1024)]
    ln_shapes = ([(32768, 768), (32768, 1024), (32768, 2048), (32768, 4096), (8192, 8192),
                  (8192, 12288)] if cuda else [(4096, 768), (1024, 4097)])
    lin_shapes = ([(8192, 4096, 16384), (4096, 1024, 4096)] if cuda else [(2048, 512, 2048)])
    if quick:
        ew_shapes, ln_shapes, lin_shapes = ew_shapes[:1], ln_shapes[:1], lin_shapes[-1:]
    return {"relu_scale": ew_shapes, "layer_norm": ln_shapes, "rms_norm": ln_shapes,
            "linear_gelu": lin_shapes}


def _cases(device: torch.device, quick: bool, peers: bool = False):
    """(op, shape, builder) where builder(dtype) -> (fused_fn, unfused_fn, inputs, work,
    extra_fwd, extra): extra_fwd holds more forward-only variants by name, extra more variants
    of both passes (the peers; a (fn, leaves) pair where the backward's leaves are not
    `inputs`'s parameters)."""
    cuda = device.type == "cuda"
    sizes = shapes(device, quick)
    ew_shapes, ln_shapes, lin_shapes = (sizes[op] for op in ("relu_scale", "layer_norm",
                                                              "linear_gelu"))

    def rand(*shape, dtype):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    for rows, cols in ew_shapes:
        def relu_case(dtype, rows=rows, cols=cols):
            x = rand(rows, cols, dtype=dtype)
            return (lambda: fused.relu_scale(x, 0.5), lambda: reference.relu_scale(x, 0.5), [x],
                    x.numel() * x.element_size(), {}, {})
        yield "relu_scale", f"{rows}x{cols}", relu_case
    def fp32_params(dtype, fn, *params):
        """For half inputs, the fused op again with float32 parameters (mixed precision's
        layout): "fused-w32", timed beside the same-dtype parameters of the "fused" row."""
        if dtype not in (torch.float16, torch.bfloat16):
            return {}
        params32 = [p.detach().float().requires_grad_() for p in params]
        return {"fused-w32": (lambda: fn(*params32), params32)}

    for rows, cols in ln_shapes:
        def ln_case(dtype, rows=rows, cols=cols):
            x, w, b = rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype), rand(cols, dtype=dtype)
            fused_ln = lambda w, b: fused.layer_norm(x, cols, w, b)  # noqa: E731
            return (lambda: fused_ln(w, b), lambda: reference.layer_norm(x, cols, w, b), [x, w, b],
                    x.numel() * x.element_size(), {},
                    {**fp32_params(dtype, fused_ln, w, b),
                     **(_peers("layer_norm", x, w, b, 1e-5) if peers else {})})
        yield "layer_norm", f"{rows}x{cols}", ln_case
    for rows, cols in ln_shapes:
        def rms_case(dtype, rows=rows, cols=cols):
            x, w = rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype)
            fused_rms = lambda w: fused.rms_norm(x, cols, w, 1e-6)  # noqa: E731
            return (lambda: fused_rms(w), lambda: F.rms_norm(x, (cols,), w, 1e-6), [x, w],
                    x.numel() * x.element_size(), {},
                    {**fp32_params(dtype, fused_rms, w),
                     **(_peers("rms_norm", x, w, None, 1e-6) if peers else {})})
        yield "rms_norm", f"{rows}x{cols}", rms_case
    for m, k, n in lin_shapes:
        def lin_case(dtype, m=m, k=k, n=n):
            x, w, b = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype), rand(n, dtype=dtype)
            # The tanh form: ours, and PyTorch's own cuBLASLt GELU_BIAS epilogue (CUDA only).
            extra = {"fused-tanh": lambda: fused.linear_gelu(x, w, b, "tanh")}
            if cuda:
                extra["addmm-act"] = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)
            # The bare GEMMs of the same shape (forward; with the backward, dgrad and wgrad too):
            # the floor under any epilogue.
            gemm = {"gemm": (lambda: x @ w.t(), [w])}
            return (lambda: fused.linear_gelu(x, w, b), lambda: reference.linear_gelu(x, w, b),
                    [x, w, b], 2 * m * n * k, extra, gemm)
        yield "linear_gelu", f"({m}x{k})x({k}x{n})", lin_case


def run(device: str = "cpu", dtypes=("float32", "bfloat16"), quick: bool = False,
        compile: bool = True, reps: int = 20, op_names=OPS,
        peers: bool = False, tensorflow: bool = True) -> tuple[list[Row], dict]:
    """Rows of every op, shape, dtype, pass and variant, and the ceilings measured for them. On
    the CPU, with `tensorflow` and the op library loadable, TensorFlow's rows follow each dtype's
    torch rows (fusedlayers.bench_tf)."""
    unknown = set(op_names) - set(OPS)
    if unknown:
        raise ValueError(f"bench: ops must be among {OPS}, got {sorted(unknown)}")
    dev = torch.device(device)
    ceilings = {"copy_gbs": copy_bandwidth_gbs(dev, reps)}
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        ceilings[f"gemm_tflops_{dtype_name}"] = gemm_tflops(dev, dtype, reps)
        for op, shape, build in _cases(dev, quick, peers):
            if op not in op_names:
                continue
            fused, unfused, inputs, work, extra_fwd, extra = build(dtype)
            for pass_ in ("fwd", "fwd+bwd"):
                impls = {"fused": fused, "eager": unfused, **extra,
                         **(extra_fwd if pass_ == "fwd" else {})}
                if compile:  # a fresh compile per case and pass: no recompile-limit fallbacks
                    torch._dynamo.reset()
                    impls["compile"] = torch.compile(unfused)
                if op != "linear_gelu" and pass_ == "fwd":
                    impls["copy"] = inputs[0].clone  # same bytes as the forward: the floor
                timed = {}
                for impl, fn in impls.items():
                    fn, leaves = fn if isinstance(fn, tuple) else (fn, inputs[1:])
                    timed[impl] = fn if pass_ == "fwd" else _fwd_bwd(fn, [inputs[0], *leaves])
                    if pass_ == "fwd":
                        timed[impl] = torch.no_grad()(timed[impl])
                for impl, ms in _median_ms_each(timed, dev, reps).items():
                    rows.append(_row(op, shape, dtype_name, pass_, impl, ms, work,
                                     inputs[0].element_size(), ceilings))
        if tensorflow and dev.type == "cpu" and _tensorflow_usable():
            rows += _tensorflow_rows(quick, dtype_name, op_names, reps, ceilings)
    return rows, ceilings


def _row(op: str, shape: str, dtype_name: str, pass_: str, impl: str, ms: float, work: int,
         element_size: int, ceilings: dict) -> Row:
    """A timing as a Row: TFLOP/s of the GEMMs (linear_gelu) or GB/s of the fewest bytes."""
    if op == "linear_gelu":
        flops = work * (1 if pass_ == "fwd" else 3)
        rate, unit = flops / ms / 1e9, "TFLOP/s"
        peak = ceilings[f"gemm_tflops_{dtype_name}"]
    else:
        # fwd: read x, write y; bwd adds read dy, write dx, and reads x again (the norms) or
        # writes and reads 1 bit per element (relu_scale).
        saved = 2 * work / (8 * element_size) if op == "relu_scale" else work
        nbytes = 2 * work if pass_ == "fwd" else 4 * work + saved
        rate, unit, peak = nbytes / ms / 1e6, "GB/s", ceilings["copy_gbs"]
    return Row(op, shape, dtype_name, pass_, impl, ms, rate, unit, 100 * rate / peak)


def _tensorflow_usable() -> bool:
    try:
        from .tensorflow import _op
    except ImportError:
        return False
    return _op.LOAD_ERROR is None


def _tensorflow_rows(quick: bool, dtype_name: str, op_names, reps: int, ceilings: dict) -> list:
    """The same ops in TensorFlow on the CPU (fusedlayers.bench_tf), as "tf-fused" and
    "tf-eager" rows, timed interleaved like the torch ones."""
    from . import bench_tf
    sizes = {op: s for op, s in shapes(torch.device("cpu"), quick).items() if op in op_names}
    rows = []
    for op, shape, work, element_size, impls in bench_tf.cases(sizes, dtype_name):
        for pass_ in ("fwd", "fwd+bwd"):
            timed = {impl: passes[pass_] for impl, passes in impls.items()}
            for impl, ms in _median_ms_each(timed, torch.device("cpu"), reps).items():
                rows.append(_row(op, shape, dtype_name, pass_, impl, ms, work, element_size,
                                 ceilings))
    return rows


def format_table(rows: list[Row], ceilings: dict, device_name: str) -> str:
    lines = [f"device: {device_name}",
             "ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()),
             f"{'op':<12}{'shape':<24}{'dtype':<10}{'pass':<9}{'impl':<9}"
             f"{'ms':>10}{'rate':>12}{'unit':>9}{'% peak':>8}"]
    for r in rows:
        lines.append(f"{r.op:<12}{r.shape:<24}{r.dtype:<10}{r.pass_:<9}{r.impl:<9}"
                     f"{r.ms:>10.4f}{r.rate:>12.1f}{r.unit:>9}{r.pct_of_peak:>7.1f}%")
    return "\n".join(lines)


def write_json(path: str, rows: list[Row], ceilings: dict, device_name: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": device_name, "ceilings": ceilings,
                   "rows": [asdict(r) for r in rows]}, f, indent=1)


def plot(path: str, rows: list[Row], device_name: str) -> None:
    """One bar group per (op, shape, dtype, pass): % of the device ceiling for each impl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.op, r.shape, r.dtype, r.pass_) for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    pct = {(r.op, r.shape, r.dtype, r.pass_, r.impl): r.pct_of_peak for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(keys)), 7))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ax.bar([k + i * width for k in range(len(keys))],
               [pct.get((*key, impl), 0) for key in keys], width, label=impl)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([" ".join(k) for k in keys], rotation=75, fontsize=7)
    ax.set_ylabel("% of measured copy bandwidth / GEMM rate")
    ax.set_title(f"fusedlayers bench on {device_name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
