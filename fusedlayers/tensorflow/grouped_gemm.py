"""grouped_gemm on TensorFlow tensors: the FusedlayersGroupedGemm op
(backends/tensorflow/grouped_gemm.cc) and its gradient. Same contract as
fusedlayers.torch.grouped_gemm; csrc/gemm/grouped_gemm.h checks the arguments
(InvalidArgumentError)."""

import functools

import tensorflow as tf

from .. import _csrc_check
from ..bench.case import Case
from . import _op
from .moe_permute import bench_routing, index_tensor, moe_permute

__all__ = ["grouped_gemm"]


def grouped_gemm(x, weight, offsets, *, transposed: bool = False) -> tf.Tensor:
    """y[rows of g] = x[rows of g] @ W_g, as fusedlayers.torch.grouped_gemm: x (rows, k),
    weight (num_groups, n, k), or (num_groups, k, n) transposed, one dtype; offsets
    (num_groups,) int32, the groups' row ends (moe_permute's; each at least the one before it, at
    most x's rows: InvalidArgumentError naming offsets otherwise, except under XLA on the GPU,
    whose kernels clamp them). Returns y (rows, n) in x's dtype; rows past the last end are
    zeros. Differentiable in x and weight."""
    x, weight = _op.prepare("grouped_gemm", x=x, weight=weight)
    offsets = index_tensor("grouped_gemm", "offsets", offsets, int32_only=True)
    return _op.lib.fusedlayers_grouped_gemm(x, weight, offsets, transposed=bool(transposed))


def hopper(x, n: int, groups: int) -> bool:
    """Whether a visible GPU (the first) runs x (rows, k) times (groups, n, k) weights on
    grouped_gemm's Hopper kernels (csrc's rule, fusedlayers_xla_grouped_gemm_path)."""
    arch = _gpu_arch()
    if arch is None or x.shape.rank != 2 or x.shape[1] is None:
        return False
    return _csrc_check.grouped_gemm_hopper(_op.clib, x.shape[0] or 0, x.shape[1], n, groups,
                                           _op.FLOATS.index(x.dtype), arch)


@functools.cache
def _gpu_arch() -> int | None:
    """The first visible GPU's compute capability (major * 10 + minor), asked once; None
    without one."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    major, minor = tf.config.experimental.get_device_details(gpus[0]).get(
        "compute_capability", (0, 0))
    return major * 10 + minor


@_op.register_gradient("FusedlayersGroupedGemm")
def _grouped_gemm_grad(op, dy):
    x, weight, offsets = op.inputs
    dx, dweight = _op.lib.fusedlayers_grouped_gemm_grad(
        tf.cast(dy, x.dtype), x, weight, offsets, transposed=op.get_attr("transposed"))
    return dx, dweight, None


def reference(x, weight, offsets, transposed: bool = False):
    """The same in TF ops: a matmul per group over its rows (tf.split by the offsets), zeros
    after the last group. The groups' weights by tf.unstack, whose gradient is one stack (a
    slice's gradient is a dense tensor of the whole weight's shape, one per group)."""
    groups = int(weight.shape[0])
    starts = tf.concat([[0], offsets[:-1]], 0)
    rest = tf.shape(x)[0] - offsets[-1]
    parts = tf.split(x, tf.concat([offsets - starts, [rest]], 0), num=groups + 1)
    w = tf.unstack(weight, num=groups)
    out = [tf.matmul(parts[g], w[g], transpose_b=not transposed) for g in range(groups)]
    cols = weight.shape[2] if transposed else weight.shape[1]
    return tf.concat(out + [tf.zeros([rest, cols], x.dtype)], 0)


def bench_case(shape, dtype: tf.DType) -> Case:
    """shape (tokens, k, n, num_groups, top_k), as torch's: the routed rows of the bench's
    routing times (num_groups, n, k) weights, against a matmul per group (reference)."""
    tokens, k, n, groups, top_k = shape
    index, _ = bench_routing(tokens, groups, top_k, dtype)
    xs, _, offsets = moe_permute(_op.random((tokens, k), dtype), index, groups)
    w = _op.random((groups, n, k), dtype, seed=1, scale=k ** -0.5)
    flops = 2 * tokens * top_k * k * n
    eager = lambda x, w: reference(x, w, offsets)  # noqa: E731
    # "gemm", the floor of a TFLOP/s op's rows: here the framework's GEMMs are the eager row
    return Case(lambda x, w: grouped_gemm(x, w, offsets), eager, [xs, w],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants={"gemm": eager})
