"""The TensorFlow cases of `python -m fusedlayers bench`: each op of fusedlayers.tensorflow against
the unfused TensorFlow / Keras ops a Keras model would run instead, as each op's TensorFlow module
builds them (`bench_case`), forward and forward + backward (a GradientTape over every input).
Their floors are TensorFlow's own: for the memory-bound ops a copy of x ("tf-copy", forward), for
linear_gelu the bare tf.matmul ("tf-gemm").

On the CPU (`case`) they are rows of the torch bench, on its shapes: both run inside
tf.function, as Keras' fit runs them, each call timed by the torch bench's CPU clock.

On TensorFlow's default device (`run`, `bench --framework tensorflow`: its GPU, where it sees
one, on the torch CUDA cases' shapes), also under XLA (jit_compile=True: "tf-fused-xla", the ops'
XLA kernels, against "tf-eager-xla", XLA's fusion of the unfused ops). Device time per call: one
tf.function makes `iters` calls, each on arguments of its own (the same tensors passed again:
distinct graph inputs, so neither TensorFlow's optimizer nor XLA merges the calls) and returns
every call's outputs (nothing pruned); a round times each variant of a case and pass in turn,
`reps` runs of its tf.function enqueued back to back and synchronised once
(tf.test.experimental.sync_devices()), so that the host's dispatch overlaps the device's work;
rows report their rounds as the torch bench's do (bench.table). An op whose device time is
shorter than TensorFlow's dispatch of it stays bounded by the dispatch (its "tf-copy" row shows
that floor). A negation of a large tensor is the copy ceiling, tf.matmul of 8192 x 8192 the GEMM
one (TensorFlow's default precision: TF32 for float32 on a GPU that has it)."""

import time

import tensorflow as tf

from .. import ops
from .table import Row, interleaved_rounds, row, shape_name, shapes


def _fwd_bwd(fn, inputs):
    """fn's outputs and its gradients with respect to every input, for a fixed random output
    gradient (the outputs too: under XLA a forward nobody reads would not be computed)."""
    out = fn(*inputs)  # rope has two outputs: a gradient for each
    grad = tf.nest.map_structure(lambda y: tf.random.normal(y.shape, dtype=y.dtype), out)

    def run(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = fn(*args)
        return y, tape.gradient(y, args, output_gradients=grad)
    return run


def _impls(op: ops.Op, shape, dtype_name: str):
    """(the op's bench case, {impl: {pass: fn of the case's inputs}}): "fused", "eager", the
    case's variants ("gemm") and, forward only, "copy"."""
    c = ops.module(op, "tensorflow").bench_case(shape, getattr(tf, dtype_name))
    fwd_only = {}
    if op.bench_unit == "GB/s":  # TF names a graph's inputs after the arguments: no `*_`
        fwd_only["copy"] = lambda x, *params: tf.raw_ops.DeepCopy(x=x)
    impls = {}
    for impl, fn in (("fused", c.fused), ("eager", c.eager), *c.variants.items(),
                     *fwd_only.items()):
        impls[impl] = {"fwd": fn}
        if impl not in fwd_only:
            impls[impl]["fwd+bwd"] = _fwd_bwd(fn, c.inputs)
    return c, impls


def case(op: ops.Op, shape, dtype_name: str) -> tuple[dict, dict]:
    """The CPU rows of the torch bench: (work by pass, {impl: {pass: fn}}) of op at shape, each
    fn a call of the tf.function of "tf-fused", "tf-eager", the case's variants ("tf-gemm") and,
    forward only, "tf-copy"."""
    c, impls = _impls(op, shape, dtype_name)
    out = {}
    for impl, passes in impls.items():
        # No Python control flow to convert: AutoGraph would only warn that it cannot parse
        # two lambdas on one line.
        out["tf-" + impl] = {pass_: lambda f=tf.function(fn, autograph=False): f(*c.inputs)
                             for pass_, fn in passes.items()}
    return c.work, out


def _looped(fn, inputs, iters: int, jit: bool):
    """A call running fn `iters` times inside one tf.function (XLA-compiled when jit), each call
    on its own arguments, returning every call's outputs."""
    k = len(inputs)

    def calls(*args):
        return [fn(*args[i * k:(i + 1) * k]) for i in range(iters)]
    compiled = tf.function(calls, jit_compile=jit, autograph=False)
    args = list(inputs) * iters
    return lambda: compiled(*args)


def _ms(loop, reps: int, iters: int) -> float:
    """ms per call of `reps` runs of a loop of `iters` calls enqueued back to back (a run's
    outputs dropped as it is enqueued: the host runs ahead of the device), synchronised once."""
    t0 = time.perf_counter()
    for _ in range(reps):
        loop()
    tf.test.experimental.sync_devices()
    return (time.perf_counter() - t0) * 1e3 / (reps * iters)


def time_rounds(fns: dict, inputs, rounds: int, reps: int, iters: int) -> dict:
    """name -> each round's ms per call of fns[name] = (fn, jit) on `inputs`, the fns timed in
    turn each round after each loop's compilation and a warm-up run."""
    def warm_up(loop):
        try:
            loop()
            tf.test.experimental.sync_devices()
        except tf.errors.ResourceExhaustedError as e:
            raise MemoryError(str(e)) from e

    loops = {name: _looped(fn, inputs, iters, jit) for name, (fn, jit) in fns.items()}
    return interleaved_rounds(loops, rounds, lambda loop: _ms(loop, reps, iters), warm_up)


def copy_bandwidth_gbs(rounds: int, reps: int, iters: int, gpu: bool) -> float:
    x = tf.ones((1 << 28 if gpu else 1 << 25,), tf.float32)
    # one read, one write; the fastest round: the ceiling
    ms = min(time_rounds({"copy": (tf.negative, False)}, [x], rounds, reps, iters)["copy"])
    return 2 * x.shape.num_elements() * 4 / ms / 1e6


def gemm_tflops(dtype, rounds: int, reps: int, iters: int, gpu: bool) -> float:
    n = 8192 if gpu else 1024
    a = tf.ones((n, n), dtype)
    ms = min(time_rounds({"gemm": (tf.matmul, False)}, [a, a], rounds, reps, iters)["gemm"])
    return 2 * n ** 3 / ms / 1e9


ROUNDS, REPS = 5, 5  # rounds of every row, and loop runs per round


def device_name() -> str:
    gpus = tf.config.list_physical_devices("GPU")
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU") \
        if gpus else "CPU"
    return f"{name} (TensorFlow {tf.__version__})"


def run(dtypes=("float32", "bfloat16"), quick: bool = False, reps: int = REPS,
        op_names=ops.NAMES, iters: int | None = None, rounds: int = ROUNDS, on_rows=None
        ) -> tuple[list[Row], dict]:
    """Rows "tf-fused", "tf-eager", "tf-fused-xla", "tf-eager-xla", the case's variants
    ("tf-gemm") and "tf-copy" for the memory-bound forwards, of every op, shape, dtype and pass
    on TensorFlow's default device, each timed in `rounds` rounds interleaved with the others of
    its case and pass, and the ceilings measured for them; on_rows(rows, ceilings) after each
    case."""
    unknown = set(op_names) - set(ops.NAMES)
    if unknown:
        raise ValueError(f"bench: ops must be among {ops.NAMES}, got {sorted(unknown)}")
    gpu = bool(tf.config.list_physical_devices("GPU"))
    iters = iters or (10 if gpu else 2)
    ceilings = {"copy_gbs": copy_bandwidth_gbs(rounds, reps, iters, gpu)}
    rows = []
    for dtype_name in dtypes:
        ceilings[f"gemm_tflops_{dtype_name}"] = gemm_tflops(getattr(tf, dtype_name), rounds,
                                                            reps, iters, gpu)
        for op in ops.OPS:
            if op.name not in op_names:
                continue
            for shape in shapes("cuda" if gpu else "cpu", quick)[op.name]:
                c, impls = _impls(op, shape, dtype_name)
                for pass_ in ("fwd", "fwd+bwd"):
                    fns = {}
                    for impl, passes in impls.items():
                        if pass_ in passes:
                            fns["tf-" + impl] = (passes[pass_], False)
                            if impl in ("fused", "eager"):
                                fns[f"tf-{impl}-xla"] = (passes[pass_], True)
                    times = time_rounds(fns, c.inputs, rounds, reps, iters)
                    rows += [row(op, shape_name(shape), dtype_name, pass_, impl, ms,
                                 c.work[pass_], ceilings) for impl, ms in times.items()]
                if on_rows is not None:
                    on_rows(rows, ceilings)
    return rows, ceilings
