"""`python -m fusedlayers bench --framework jax`: each op of fusedlayers.jax against XLA's own
computation of it (flax's layers where flax imports, else the same math in jax.numpy), as each
op's JAX module builds them (`bench_case`), forward and forward + backward, on the device JAX
runs on.

Device time per call: each variant runs `iters` times inside one jitted lax.fori_loop, so host
dispatch is amortised, and its carry holds every output of the last call (XLA drops outputs
nobody reads); the input of each call passes through an optimization barrier with the loop
index, so XLA cannot hoist the loop-invariant call out of the loop. A round times each variant
of a case and pass in turn: the median of `reps` runs of its loop, divided by `iters`; rows
report their rounds as the torch bench's do (bench.table). A negation of x (a copy XLA cannot
elide), timed the same way, is the ceiling of the memory-bound ops and, at each shape, their
floor.
"""

import statistics
import time

import jax
import jax.numpy as jnp

from .. import ops
from .table import Row, interleaved_rounds, row, shape_name, shapes


def _looped(fn, inputs, iters: int):
    """A jitted function of the inputs (arguments, not captured constants) running fn iters
    times and returning the last call's outputs."""
    def loop(*inputs):
        def body(i, carry):
            args = jax.lax.optimization_barrier((inputs, i))[0]
            return fn(*args)

        first = jax.eval_shape(fn, *inputs)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), first)
        return jax.lax.fori_loop(0, iters, body, zeros)

    jitted = jax.jit(loop)
    return lambda: jitted(*inputs)


def _fwd_bwd(fn, n_inputs: int):
    """fn and its vjp for a cotangent dy given as the last argument: a random array, not a
    constant XLA could fold into the backward."""
    def run(*args):
        y, vjp = jax.vjp(fn, *args[:n_inputs])
        return y, vjp(args[n_inputs])
    return run


def _cotangent(fn, inputs):
    """A random cotangent for fn's outputs on inputs."""
    return jax.tree.map(lambda s: jax.random.normal(jax.random.key(1), s.shape, s.dtype),
                        jax.eval_shape(fn, *inputs))


def _ms(loop, reps: int, iters: int) -> float:
    """The median ms per call of `reps` runs of a compiled loop of `iters` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop())
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times)


def time_rounds(fns: dict, inputs, rounds: int, reps: int, iters: int) -> dict:
    """name -> each round's ms per call of fns[name](*inputs), the fns timed in turn each round,
    after each loop's compilation and a warm-up run; `inputs` a list, or one list per name."""
    def warm_up(loop):
        try:
            jax.block_until_ready(loop())
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise MemoryError(str(e)) from e

    loops = {name: _looped(fn, inputs[name] if isinstance(inputs, dict) else inputs, iters)
             for name, fn in fns.items()}
    return interleaved_rounds(loops, rounds, lambda loop: _ms(loop, reps, iters), warm_up)


def copy_bandwidth_gbs(rounds: int, reps: int, iters: int) -> float:
    n = 1 << 28 if jax.default_backend() == "gpu" else 1 << 25
    x = jnp.ones((n,), jnp.float32)
    # one read, one write (a copy XLA elides); the fastest round: the ceiling
    ms = min(time_rounds({"copy": jnp.negative}, [x], rounds, reps, iters)["copy"])
    return 2 * x.nbytes / ms / 1e6


def gemm_tflops(dtype, rounds: int, reps: int, iters: int) -> float:
    n = 8192 if jax.default_backend() == "gpu" else 1024
    a = jnp.ones((n, n), dtype)

    def gemm(a):
        return jnp.matmul(a, a, preferred_element_type=jnp.float32).astype(dtype)
    ms = min(time_rounds({"gemm": gemm}, [a], rounds, reps, iters)["gemm"])
    return 2 * n ** 3 / ms / 1e9


ROUNDS, REPS = 5, 4  # rounds of every row, and loop runs per round


def run(dtypes=("float32", "bfloat16"), quick: bool = False, reps: int = REPS,
        op_names=ops.NAMES, iters: int | None = None, rounds: int = ROUNDS
        ) -> tuple[list[Row], dict]:
    """Rows "jax-fused", "jax-xla", the case's variants ("jax-gemm") and "jax-copy" for the
    memory-bound forwards, of every op, shape, dtype and pass, each timed in `rounds` rounds
    interleaved with the others of its case and pass, and the ceilings measured for them."""
    unknown = set(op_names) - set(ops.NAMES)
    if unknown:
        raise ValueError(f"bench: ops must be among {ops.NAMES}, got {sorted(unknown)}")
    gpu = jax.default_backend() == "gpu"
    iters = iters or (50 if gpu else 3)
    device = "cuda" if gpu else "cpu"
    ceilings = {"copy_gbs": copy_bandwidth_gbs(rounds, reps, iters)}
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(jnp, dtype_name)
        ceilings[f"gemm_tflops_{dtype_name}"] = gemm_tflops(dtype, rounds, reps, iters)
        for op in ops.OPS:
            if op.name not in op_names:
                continue
            for shape in shapes(device, quick)[op.name]:
                case = ops.module(op, "jax").bench_case(shape, dtype)
                for pass_ in ("fwd", "fwd+bwd"):
                    impls = {"jax-fused": case.fused, "jax-xla": case.eager,
                             **{"jax-" + name: fn for name, fn in case.variants.items()}}
                    if op.bench_unit == "GB/s" and pass_ == "fwd":
                        impls["jax-copy"] = lambda x, *_: -x  # same bytes as the forward
                    if pass_ == "fwd":
                        times = time_rounds(impls, case.inputs, rounds, reps, iters)
                    else:  # each impl's own cotangent (a variant may return other shapes)
                        n = len(case.inputs)
                        times = time_rounds({impl: _fwd_bwd(fn, n) for impl, fn in impls.items()},
                                            {impl: [*case.inputs, _cotangent(fn, case.inputs)]
                                             for impl, fn in impls.items()},
                                            rounds, reps, iters)
                    rows += [row(op, shape_name(shape), dtype_name, pass_, impl, ms,
                                 case.work[pass_], ceilings) for impl, ms in times.items()]
    return rows, ceilings
