"""`python -m fusedlayers bench`: fused vs unfused eager vs torch.compile(unfused), per op, shape,
dtype and pass, with the device's own ceilings measured in the same run. The ops, their shapes
and units come from the op table (fusedlayers.ops); each op's torch module builds its case
(`bench_case`: the fused call, the unfused one, the work done, more variants).

Memory-bound ops (the table's "GB/s" ops) report GB/s over the fewest bytes the op must move
(each input read once, each output written once; for the backward, what it must keep from the
forward: layer_norm's input, relu_scale's sign bits) and the percentage of the measured copy
bandwidth (bytes read + written by a large tensor copy); their forward also gets a "copy" row, a
copy of the input into a tensor made once (as the ceiling's copy), moving the same bytes, which is
the floor at that size (a small op pays launch and tail costs that the large copy amortizes, and
bytes that fit in a CPU's caches move faster); under half dtypes a "fused-w32" row runs the
same op with float32 parameters (mixed precision's layout). GEMM-bound ops (linear_gelu) report
TFLOP/s over 2*M*N*K per GEMM (one forward, three for forward+backward) and the percentage of
the measured GEMM rate of the same dtype, with a "gemm" row: the bare GEMMs of the same shape,
the floor under any epilogue. Every row is timed in rounds interleaved with the other rows of
its case and pass (time_rounds; bench.table says how a row's spread and its speedups' intervals
come from them). On CUDA each variant is captured once in a CUDA graph and its replays are timed
with CUDA events (triton.testing.do_bench when present), so the numbers are the kernels' and not
Python's launch overhead; a variant that cannot be captured is timed directly. On the CPU: the
wall clock around synchronous calls, one call of each variant in turn after untimed rounds, with
glibc's malloc keeping freed memory (keep_freed_memory), so that rows time the kernels and not
page faults of memory the allocator gave back. The CPU's torch.compile rows are compiled before
any row is timed, by this process and a second one at once (precompile): the timed run loads
them from Inductor's on-disk caches, and the compiles, mostly single-threaded, take about half
the time.

With peers (`--peers`, CUDA), other libraries' kernels for the same call join the rows where
they import: Liger-Kernel's Triton LayerNorm and RMSNorm (liger_kernel.ops, its defaults:
RMSNorm's "llama" casting, backward in place), and QuACK's RMSNorm (`quack.rmsnorm`).
"""

import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from .. import ops
from .table import FLOORS, Row, did_not_run, out_of_memory, row, shape_name, shapes


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


# Per round on CUDA: do_bench's warm-up and measuring time (ms), or, without triton, CUDA-event
# timed calls.
CUDA_WARMUP_MS, CUDA_ROUND_MS = 5, 30


def _cuda_ms(fn, reps: int) -> float:
    """The median ms of fn's device work on the current stream."""
    try:
        from triton.testing import do_bench
        return do_bench(fn, warmup=CUDA_WARMUP_MS, rep=CUDA_ROUND_MS, return_mode="median")
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


# On the CPU: untimed rounds first (the heap grows to what every variant needs before any call
# is timed), then rounds of about CPU_ROUND_MS of calls of each variant (at least one), as on
# CUDA, unless `reps` fixes the calls per round; under --quick, QUICK_WARMUP_ROUNDS and
# QUICK_ROUND_MS.
CPU_WARMUP_ROUNDS, CPU_ROUND_MS = 2, 20
QUICK_WARMUP_ROUNDS, QUICK_ROUND_MS = 1, 10
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for the next allocation: no trimming of the heap's
    top, and every allocation from the heap (no mmap). By default it returns the top of the heap
    to the system once more than twice the largest freed tensor sits free there, and it maps
    blocks of 32 MiB and more (at most: its largest mmap threshold) afresh, unless the heap
    happens to hold a free block that size; either way the next call's outputs are page-faulted
    in again, at a cost of up to several times the kernel's, paid by whichever variant runs next
    (a fused op timed after its unfused reference paid for the reference's temporaries) or not,
    by what ran before in the process (a bfloat16 GEMM with a 32 MiB output took 18 or 9 ms).
    False where the C library has no mallopt or refuses (not glibc): the bench then times its
    default."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return (mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1) & (mallopt(M_MMAP_MAX, 0) == 1)


def time_rounds(fns: dict, device: torch.device, rounds: int, reps: int | None = None,
                uncaptured=frozenset(), fallible=frozenset(), quick: bool = False) -> dict:
    """Each of fns timed in `rounds` interleaved rounds: name -> each round's ms, or, for a fn
    whose warm-up raised (out of memory; any error of a fn in `fallible`: other libraries'
    calls, torch.compile of the unfused computation), why it did not run (table.did_not_run).
    In a round every fn is timed once after the other: on CUDA the median of its calls over
    CUDA_ROUND_MS (reps CUDA-event timed calls without triton); on the CPU its calls, one of
    each fn in turn, `reps` of them or as many as fill CPU_ROUND_MS (at least one), after
    CPU_WARMUP_ROUNDS untimed ones (QUICK_* with quick): the round's median (a floor's, FLOORS
    of any framework: its fastest call, as a floor bounds the others and a shared host's noise
    moves a median by more than a GEMM's epilogue costs). On CUDA every fn
    but those in `uncaptured` (and the copy) is timed as the replay of its CUDA graph.
    Interleaving makes a host whose speed drifts (shared cores, clock changes) slow every fn
    alike instead of whichever ran in a slow spell."""
    times, ready = {}, {}
    for name, fn in fns.items():
        try:
            if device.type != "cuda":
                per_call = []
                for _ in range(QUICK_WARMUP_ROUNDS if quick else CPU_WARMUP_ROUNDS):
                    t0 = time.perf_counter()
                    fn()
                    per_call.append((time.perf_counter() - t0) * 1e3)
                budget = QUICK_ROUND_MS if quick else CPU_ROUND_MS
                calls = reps or max(1, round(budget / min(per_call)))
                ready[name] = (fn, calls)
            # Like copy_bandwidth_gbs, the copy is not graphed (a memcpy node is slower).
            elif name == "copy" or name in uncaptured:
                fn()
                ready[name] = fn
            else:
                ready[name] = _graphed(fn)
        except Exception as e:  # noqa: BLE001 (the row says which error)
            if not (out_of_memory(e) or name in fallible):
                raise
            times[name] = did_not_run(e)
    times.update({name: [] for name in ready})
    if device.type == "cuda":
        for _ in range(rounds):
            for name, fn in ready.items():
                times[name].append(_cuda_ms(fn, reps or 10))
        return times
    for _ in range(rounds):
        calls = {name: [] for name in ready}
        for i in range(max(n for _, n in ready.values())):
            for name, (fn, n) in ready.items():
                if i < n:
                    t0 = time.perf_counter()
                    fn()
                    calls[name].append((time.perf_counter() - t0) * 1e3)
        for name, t in calls.items():
            times[name].append(min(t) if name.removeprefix("tf-") in FLOORS
                               else statistics.median(t))
    return times


def peak_mib(fn, device: torch.device) -> float | None:
    """On CUDA: the most memory one call of fn allocates above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def copy_bandwidth_gbs(device: torch.device, rounds: int, reps: int) -> float:
    """Bytes read + written per second by a device-to-device copy of a large tensor (its fastest
    round: the ceiling)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    # Not graphed (named "copy"): a captured copy_ becomes a memcpy node that runs slower than
    # the copy kernel.
    ms = min(time_rounds({"copy": lambda: dst.copy_(src)}, device, rounds, reps)["copy"])
    return 2 * src.nbytes / ms / 1e6


def gemm_tflops(device: torch.device, dtype: torch.dtype, rounds: int, reps: int) -> float:
    """The rate of a square GEMM (its fastest round: the ceiling)."""
    n = 8192 if device.type == "cuda" else 512  # CPU bfloat16 GEMMs may be a slow loop
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = min(time_rounds({"gemm": lambda: a @ b}, device, rounds, reps)["gemm"])
    return 2 * n**3 / ms / 1e9


def _fwd_bwd(fn, inputs):
    """Forward + backward of fn with a gradient for each output (rope has two), made at the
    first call (a warm-up, where a fn that cannot run raises): the timed calls run the passes
    only."""
    grad = []

    def run():
        out = fn()
        if not grad:
            grad.append(tuple(map(torch.randn_like, out)) if isinstance(out, tuple)
                        else torch.randn_like(out))
        torch.autograd.grad(out, inputs, grad[0])
    return run


OPS = ops.NAMES


ROUNDS = 5  # rounds of every row


def run(device: str = "cpu", dtypes=("float32", "bfloat16"), quick: bool = False,
        compile: bool = True, reps: int | None = None, op_names=OPS,
        peers: bool = False, tensorflow: bool = True, rounds: int = ROUNDS,
        on_rows=None) -> tuple[list[Row], dict]:
    """Rows of every op, shape, dtype, pass and variant, and the ceilings measured for them, each
    row timed in `rounds` rounds interleaved with the others of its case and pass (time_rounds:
    `reps` calls a round on the CPU). On the CPU, with `tensorflow` and the op library loadable,
    TensorFlow's rows follow each dtype's torch rows (fusedlayers.bench.tensorflow_ops).
    on_rows(rows, ceilings), where given, is called after each case with all rows so far (the
    CLI prints the new ones and rewrites its JSON: a run that dies keeps what it measured). Each
    case's tensors, graphs and compiled code are released before the next is made."""
    unknown = set(op_names) - set(OPS)
    if unknown:
        raise ValueError(f"bench: ops must be among {OPS}, got {sorted(unknown)}")
    dev = torch.device(device)
    if dev.type == "cpu":
        keep_freed_memory()
        if compile:
            precompile([(op.name, shape, dtype_name) for dtype_name in dtypes for op in ops.OPS
                        if op.name in op_names for shape in shapes("cpu", quick)[op.name]],
                       peers)
    ceilings = {"copy_gbs": copy_bandwidth_gbs(dev, rounds, reps)}
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        ceilings[f"gemm_tflops_{dtype_name}"] = gemm_tflops(dev, dtype, rounds, reps)
        for op in ops.OPS:
            if op.name not in op_names:
                continue
            for shape in shapes(dev.type, quick)[op.name]:
                case = ops.module(op, "torch").bench_case(shape, dtype, dev, peers)
                rows += _case_rows(op, shape_name(shape), dtype_name, case, dev, compile,
                                   rounds, reps, ceilings, quick)
                del case
                _release(dev)
                if on_rows:
                    on_rows(rows, ceilings)
        if tensorflow and dev.type == "cpu" and _tensorflow_usable():
            rows += _tensorflow_rows(quick, dtype_name, op_names, rounds, reps, ceilings)
            if on_rows:
                on_rows(rows, ceilings)
    return rows, ceilings


def precompile(cases: list, peers: bool) -> None:
    """Compiles torch.compile's rows of the CPU cases (op name, shape, dtype name), both passes,
    as _case_rows will run them, into Inductor's on-disk caches (its FX graph and AOTAutograd
    caches), in two processes at once: this one takes the cases from the first on, a second
    one (started with this one's thread count) from the last back, each claiming a case before
    compiling it, until they meet; each compiles in its own process (Inductor's compile_threads
    1, which its caches' keys leave out: no pool of compile workers beside the two). Nothing is
    timed meanwhile. Where those caches are off, the timed run compiles each case itself."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    if not (inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache):
        return
    with tempfile.TemporaryDirectory() as claims:
        spec = {"cases": cases, "peers": peers, "claims": claims}
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; from fusedlayers.bench.ops import _compile_cases; "
             "_compile_cases(sys.argv[1])",
             json.dumps({**spec, "reverse": True, "threads": torch.get_num_threads()})],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"})
        try:
            with inductor_config.patch(compile_threads=1):
                _compile_cases(json.dumps(spec))
        finally:
            child.wait()


def _compile_cases(spec: str) -> None:
    """precompile's work: each case not claimed yet (in order, or from the last with
    "reverse"), claimed by creating its file in "claims", its unfused computation compiled and
    run once per pass (a compile that fails is left to the timed run, which reports it)."""
    spec = json.loads(spec)
    if "threads" in spec:
        torch.set_num_threads(spec["threads"])
    cpu = torch.device("cpu")
    by_name = {op.name: op for op in ops.OPS}
    order = list(enumerate(spec["cases"]))
    for i, (name, shape, dtype_name) in reversed(order) if spec.get("reverse") else order:
        try:
            os.close(os.open(os.path.join(spec["claims"], str(i)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return  # the other process compiles this one and those beyond it
        case = ops.module(by_name[name], "torch").bench_case(
            tuple(shape), getattr(torch, dtype_name), cpu, spec["peers"])
        for pass_ in ("fwd", "fwd+bwd"):
            torch._dynamo.reset()
            fn = torch.compile(case.eager)
            try:
                if pass_ == "fwd":
                    torch.no_grad()(fn)()
                else:
                    _fwd_bwd(fn, list(case.inputs))()
            except Exception:  # noqa: BLE001 (the timed run reports it)
                pass
        del case
        _release(cpu)


def _release(dev: torch.device) -> None:
    """Frees what a finished case held: its graphs' memory pools and compiled code (collected
    with the closures that hold them), then the caching allocator's free blocks, which a later
    case of other sizes could not reuse."""
    torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def _case_rows(op, shape: str, dtype_name: str, case, dev: torch.device, compile: bool,
               rounds: int, reps: int, ceilings: dict, quick: bool) -> list:
    rows = []
    for pass_ in ("fwd", "fwd+bwd"):
        impls = {"fused": case.fused, "eager": case.eager, **case.variants,
                 **(case.fwd_only if pass_ == "fwd" else {})}
        if compile:  # a fresh compile per case and pass: no recompile-limit fallbacks
            torch._dynamo.reset()
            impls["compile"] = torch.compile(case.eager)
        if op.bench_unit == "GB/s" and pass_ == "fwd":  # same bytes as the forward: the floor
            nbytes = case.work["fwd"] // 2  # read and written once each
            src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            impls["copy"] = lambda src=src, dst=torch.empty_like(src): dst.copy_(src)
        timed = {}
        for impl, fn in impls.items():
            fn, leaves = fn if isinstance(fn, tuple) else (fn, case.inputs[1:])
            timed[impl] = fn if pass_ == "fwd" else _fwd_bwd(fn, [case.inputs[0], *leaves])
            if pass_ == "fwd":
                timed[impl] = torch.no_grad()(timed[impl])
        for impl, ms in time_rounds(timed, dev, rounds, reps, case.uncaptured,
                                    fallible={*case.uncaptured, "compile"},
                                    quick=quick).items():
            rows.append(row(op, shape, dtype_name, pass_, impl, ms, case.work[pass_],
                            ceilings))
            if not rows[-1].not_run:
                rows[-1].peak_mib = peak_mib(timed[impl], dev)
    return rows


def _tensorflow_usable() -> bool:
    try:
        from ..tensorflow import _op
    except ImportError:
        return False
    return _op.LOAD_ERROR is None


def _tensorflow_rows(quick: bool, dtype_name: str, op_names, rounds: int, reps: int,
                     ceilings: dict) -> list:
    """The same ops in TensorFlow on the CPU (fusedlayers.bench.tensorflow_ops), as "tf-fused"
    and "tf-eager" rows, timed interleaved like the torch ones."""
    from . import tensorflow_ops
    sizes = shapes("cpu", quick)
    rows = []
    for op in ops.OPS:
        if op.name not in op_names:
            continue
        for shape in sizes[op.name]:
            work, impls = tensorflow_ops.case(op, shape, dtype_name)
            for pass_ in ("fwd", "fwd+bwd"):
                timed = {impl: passes[pass_] for impl, passes in impls.items() if pass_ in passes}
                for impl, ms in time_rounds(timed, torch.device("cpu"), rounds, reps,
                                            quick=quick).items():
                    rows.append(row(op, shape_name(shape), dtype_name, pass_, impl, ms,
                                     work[pass_], ceilings))
    return rows


