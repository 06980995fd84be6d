"""grouped_gemm on JAX arrays: the custom calls fusedlayers_grouped_gemm_{forward,backward}
(backends/xla/grouped_gemm_ffi.cc) under jax.custom_vjp. Same contract as
fusedlayers.torch.grouped_gemm; csrc/gemm/grouped_gemm.h has the math and checks the arguments. The
calls are whole ops (_op.plain_call): under a sharded jit XLA hands them whole arrays; inside
shard_map each device runs its own rows."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _csrc_check
from ..bench.case import Case
from . import _op

__all__ = ["grouped_gemm"]


def grouped_gemm(x, weight, offsets, *, transposed: bool = False) -> jax.Array:
    """Each group's rows of x times its weight: y[rows of g] = x[rows of g] @ W_g, group g owning
    the rows [offsets[g - 1], offsets[g]) (offsets as moe_permute returns them; rows past the
    last end get zeros), W_g = weight[g] of shape (n, k) (nn.Linear's (out, in)) or (k, n) with
    transposed. x (rows, k), weight (num_groups, n, k) or (num_groups, k, n), one dtype of
    float32/float64/float16/bfloat16; offsets (num_groups,) int32, row ends (each at least the one
    before it, at most x's rows: on the CPU a bad one fails the computation with csrc's message
    naming offsets; on CUDA the kernels clamp them). Returns y (rows, n) in x's
    dtype, accumulated in float32 (float64 for float64): on CUDA the Hopper kernels (CUTLASS's
    sm90 grouped GEMM) where they take the operands (bfloat16, k and n multiples of 8), else a
    tiled kernel; on the CPU a loop. Differentiable in x and weight (the dgrad and the wgrad,
    grouped GEMMs too). While tracing, raises TypeError for dtypes and ValueError for shapes
    (csrc/gemm/grouped_gemm.h)."""
    x, = _op.prepare("grouped_gemm", x=x)
    weight = jnp.asarray(weight)
    offsets = jnp.asarray(offsets)
    _op.check("grouped_gemm", x, weight, tuple(offsets.shape), offsets.dtype == jnp.int32,
              bool(transposed))
    return _grouped_gemm(*_op.same_varying(x, weight, offsets), bool(transposed))


def _workspace(x, weight, transposed) -> int:
    n = weight.shape[2] if transposed else weight.shape[1]
    return _csrc_check.grouped_gemm_workspace_size(_op.lib, x.shape[0], x.shape[1], n,
                                                   weight.shape[0], _op.csrc_dtype(x.dtype))


def _forward(x, weight, offsets, transposed):
    n = weight.shape[2] if transposed else weight.shape[1]
    results = (jax.ShapeDtypeStruct((x.shape[0], n), x.dtype),
               jax.ShapeDtypeStruct((_workspace(x, weight, transposed),), jnp.uint8))
    return _op.plain_call("grouped_gemm_forward", results, x, weight, offsets,
                          transposed=np.bool_(transposed))[0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_gemm(x, weight, offsets, transposed):
    return _forward(x, weight, offsets, transposed)


def _grouped_gemm_fwd(x, weight, offsets, transposed):
    return _forward(x, weight, offsets, transposed), (x, weight, offsets)


def _grouped_gemm_bwd(transposed, saved, dy):
    x, weight, offsets = saved
    results = (_op.like(x), _op.like(weight),
               jax.ShapeDtypeStruct((_workspace(x, weight, transposed),), jnp.uint8))
    dx, dweight, _ = _op.plain_call("grouped_gemm_backward", results, dy.astype(x.dtype), x,
                                    weight, offsets, transposed=np.bool_(transposed))
    return dx, dweight, np.zeros(offsets.shape, jax.dtypes.float0)


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


GEMMS = ("fusedlayers", "framework")


def grouped_linear(x, weight, offsets, transposed: bool, gemm: str | None = None) -> jax.Array:
    """The experts' GEMM of moe_experts: grouped_gemm, or XLA's jax.lax.ragged_dot (the
    framework's). gemm None: grouped_gemm on CUDA where its Hopper kernels take the operands
    (csrc's rule, fusedlayers_xla_grouped_gemm_path, for the first GPU's compute capability),
    ragged_dot elsewhere (the CPU, other GPUs, where the tiled kernel would be slower); "fusedlayers"
    or "framework" forces one. Raises ValueError for another gemm."""
    if gemm is not None and gemm not in GEMMS:
        raise ValueError(f"fusedlayers.moe_experts: gemm must be one of {', '.join(GEMMS)} or "
                         f"None, got {gemm!r}")

    def ours():
        return grouped_gemm(x, weight, offsets, transposed=transposed)

    def framework():
        w = weight if transposed else jnp.swapaxes(weight, 1, 2)
        return jax.lax.ragged_dot(x, w, jnp.diff(offsets, prepend=0))
    if gemm is not None:
        return ours() if gemm == "fusedlayers" else framework()
    if not _hopper(x, weight, transposed):
        return framework()
    return _op.platform_dependent(x, default=framework, cuda=ours)


def _hopper(x, weight, transposed) -> bool:
    """Whether CUDA runs these operands on grouped_gemm's Hopper kernels (the first GPU's)."""
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:  # no CUDA backend
        return False
    major, minor = (int(v) for v in gpus[0].compute_capability.split("."))
    n = weight.shape[2] if transposed else weight.shape[1]
    return _csrc_check.grouped_gemm_hopper(_op.lib, x.shape[0], x.shape[1], n, weight.shape[0],
                                           _op.csrc_dtype(x.dtype), major * 10 + minor)


def reference(x, weight, offsets, *, transposed=False):
    """The same with jax.lax.ragged_dot (XLA's grouped GEMM), rows past the last end zeroed."""
    w = weight if transposed else jnp.swapaxes(weight, 1, 2)
    sizes = jnp.diff(offsets, prepend=0)
    y = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    rows = jnp.arange(x.shape[0])
    return jnp.where((rows < offsets[-1])[:, None], y, 0).astype(x.dtype)


def bench_case(shape, dtype) -> Case:
    """shape (tokens, k, n, num_groups, top_k), as torch's: the routed rows of the bench's
    routing times (num_groups, n, k) weights, against jax.lax.ragged_dot (reference) under jit,
    and tokamax's Pallas Mosaic GPU ragged_dot where tokamax is importable (on CUDA, 16-bit
    dtypes). Work:
    2 * rows * k * n flops forward, twice that backward."""
    from .moe_permute import bench_routing, moe_permute

    tokens, k, n, groups, top_k = shape
    key = jax.random.split(jax.random.key(0), 2)
    index, _ = bench_routing(tokens, groups, top_k, dtype)
    xs, _, offsets = moe_permute(jax.random.normal(key[0], (tokens, k), dtype), index, groups)
    w = (jax.random.normal(key[1], (groups, n, k)) / k ** 0.5).astype(dtype)
    flops = 2 * tokens * top_k * k * n
    eager = lambda x, w: reference(x, w, offsets)  # noqa: E731
    variants = {"gemm": eager}  # the floor of a TFLOP/s op's rows: the framework's GEMM
    if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        try:  # tokamax's Pallas Mosaic GPU kernel takes 16-bit inputs only
            import tokamax
        except ImportError:
            tokamax = None
        if tokamax is not None:
            sizes = jnp.diff(offsets, prepend=0)
            variants["tokamax"] = lambda x, w: tokamax.ragged_dot(
                x, jnp.swapaxes(w, 1, 2), sizes, implementation="mosaic")
    return Case(lambda x, w: grouped_gemm(x, w, offsets), eager, [xs, w],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants=variants)
