"""Linear + GELU on JAX arrays under jax.custom_vjp. On the CPU: XLA's own dot, then the custom
call fusedlayers_linear_gelu_forward (backends/xla/linear_gelu_ffi.cc: csrc's bias + GELU epilogue),
whose backward is the epilogue's gradient (with dbias) and XLA's dgrad and wgrad dots. On CUDA
(CUDA builds): the whole op on cuBLASLt as the torch extension runs it, GEMMs and epilogues
(fusedlayers_linear_gelu_gemm_*, backends/xla/linear_gelu_cublaslt_ffi.cc), which is faster than
XLA's dot with its own fused bias + GELU. Same contract as fusedlayers.torch.linear_gelu. The dots
run at full float32 precision (no TF32), accumulating in float32 for half inputs, as the torch
op's GEMMs."""

from functools import partial

import jax
import jax.numpy as jnp

from ..bench.case import Case
from . import _op

__all__ = ["dense_gelu", "linear_gelu"]

_HIGHEST = jax.lax.Precision.HIGHEST


def linear_gelu(x, weight, bias=None, approximate: str = "none") -> jax.Array:
    """y = gelu(x @ weight^T + bias) (Hendrycks & Gimpel 2016, arXiv:1606.08415). x:
    (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None; one
    floating dtype. approximate: 'none' (erf) or 'tanh'. Returns (..., out_features). While
    tracing, raises ValueError on shape/approximate mismatches and TypeError on dtypes
    (csrc/gemm/linear_gelu.h's rules and messages)."""
    return _matmul_epilogue(x, weight, bias, approximate, True)


def dense_gelu(x, kernel, bias=None, approximate: str = "none") -> jax.Array:
    """gelu(x @ kernel + bias) with a Keras Dense kernel (in_features, out_features)."""
    return _matmul_epilogue(x, kernel, bias, approximate, False)


def _matmul_epilogue(x, w, bias, approximate, transpose):
    x, w, bias = _op.prepare("linear_gelu", x=x, weight=w, bias=bias)
    if not isinstance(approximate, str):
        raise TypeError(f"fusedlayers.linear_gelu: approximate must be 'none' or 'tanh', got "
                        f"{type(approximate).__name__} {approximate!r}")
    # csrc takes the weight's sizes as (out_features, in_features) whatever its layout
    sizes = w.shape if transpose else w.shape[::-1]
    _op.check("linear_gelu", x, jax.ShapeDtypeStruct(sizes, w.dtype), bias, approximate)
    in_features, out_features = sizes[1], sizes[0]
    y = _linear_gelu(x.reshape(-1, in_features), w, bias, approximate, transpose)
    return y.reshape(*x.shape[:-1], out_features)


def _dot(a, b, transpose_b=False):
    # Accumulation in float32 (float64 for float64), rounded once to a's dtype.
    acc = jnp.float64 if a.dtype == jnp.float64 else jnp.float32
    return jax.lax.dot_general(a, b, (((1,), (1 if transpose_b else 0,)), ((), ())),
                               precision=_HIGHEST, preferred_element_type=acc).astype(a.dtype)


def _cublaslt():
    """Whether this build has the cuBLASLt handlers (CUDA builds)."""
    return hasattr(_op.lib, "fusedlayers_xla_linear_gelu_gemm_workspace_size")


def _by_platform(x2, xla, cublaslt):
    """cublaslt() on CUDA where built (not float64, which cuBLASLt's path does not take), else
    xla()."""
    if not _cublaslt() or x2.dtype == jnp.float64:
        return xla()
    return _op.platform_dependent(x2, default=xla, cuda=cublaslt)


def _gemm_workspace(backward: bool):
    def size(x):  # x: the call's first row-wise operand, (m, k) or dy (m, n)
        n = x.shape[-1]
        return _op.lib.fusedlayers_xla_linear_gelu_gemm_workspace_size(
            backward, x.size // n if n else 0, n, _op.csrc_dtype(x.dtype))
    return size


def _forward(x2, w, bias, approximate, transpose, with_pre):
    return _by_platform(x2, lambda: _xla_forward(x2, w, bias, approximate, transpose, with_pre),
                        lambda: _cublaslt_forward(x2, w, bias, approximate, transpose, with_pre))


def _cublaslt_forward(x2, w, bias, approximate, transpose, with_pre):
    y = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0] if transpose else w.shape[1]), x2.dtype)
    pre = y if with_pre else jax.ShapeDtypeStruct((0,), x2.dtype)
    return _op.call("linear_gelu_gemm_forward", (pre, y), x2, w,
                    _op.absent(x2.dtype) if bias is None else bias,
                    roles="xpp->xx" if with_pre else "xpp->px", rows=1,
                    workspace=_gemm_workspace(False), has_bias=bias is not None,
                    in_out=not transpose, approximate=approximate, with_pre=with_pre)


def _xla_forward(x2, w, bias, approximate, transpose, with_pre):
    h = _dot(x2, w, transpose)
    rows_cols = _op.like(h)
    pre = rows_cols if with_pre else jax.ShapeDtypeStruct((0,), h.dtype)
    return _op.call("linear_gelu_forward", (pre, rows_cols), h,
                    _op.absent(h.dtype) if bias is None else bias,
                    roles="xp->xx" if with_pre else "xp->px", rows=1, has_bias=bias is not None,
                    approximate=approximate, with_pre=with_pre)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_gelu(x2, w, bias, approximate, transpose):
    return _forward(x2, w, bias, approximate, transpose, False)[1]


def _linear_gelu_fwd(x2, w, bias, approximate, transpose):
    pre, y = _forward(x2, w, bias, approximate, transpose, True)
    return y, (x2, w, pre, bias is not None)


def _linear_gelu_bwd(approximate, transpose, saved, dy):
    x2, w, pre, has_bias = saved
    dbias = jax.ShapeDtypeStruct((pre.shape[1],) if has_bias else (0,), pre.dtype)
    dx, dw, db = _by_platform(
        x2, lambda: _xla_backward(approximate, transpose, x2, w, pre, has_bias, dy, dbias),
        lambda: _op.call("linear_gelu_gemm_backward", (_op.like(x2), _op.like(w), dbias),
                         dy, x2, w, pre, roles="xxpx->xss", rows=1,
                         workspace=_gemm_workspace(True), has_bias=has_bias,
                         in_out=not transpose, approximate=approximate))
    return dx, dw, db if has_bias else None


def _xla_backward(approximate, transpose, x2, w, pre, has_bias, dy, dbias):
    dpre, dbias = _op.call("linear_gelu_backward",
                           (_op.like(pre), dbias), dy, pre,
                           roles="xx->xs", rows=1,
                           workspace=_op.workspace("epilogue", pre.shape[1]),
                           has_bias=has_bias, approximate=approximate)
    dx = _dot(dpre, w, not transpose)  # dpre (m, out) @ W (out, in)
    dw = _dot(dpre.T, x2) if transpose else _dot(x2.T, dpre)  # in W's layout
    return dx, dw, dbias


_linear_gelu.defvjp(_linear_gelu_fwd, _linear_gelu_bwd)


def bench_case(shape, dtype) -> Case:
    """Against XLA's dot + bias + jax.nn.gelu (erf), as flax's Dense with a GELU would run (its
    dot in x's dtype, at the precision of ours: full float32, no TF32); "gemm": the bare dot."""
    m, k, n = shape
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = jax.random.normal(keys[1], (n, k), dtype) / k ** 0.5
    b = jax.random.normal(keys[2], (n,), dtype) / k ** 0.5  # pre-activations ~ N(0, 1)
    flops = 2 * m * n * k
    return Case(lambda x, w, b: linear_gelu(x, w, b),
                lambda x, w, b: jax.nn.gelu(jax.numpy.matmul(x, w.T, precision=_HIGHEST) + b,
                                            approximate=False), [x, w, b],
                {"fwd": flops, "fwd+bwd": 3 * flops},
                variants={"gemm": lambda x, w, b: jax.numpy.matmul(x, w.T, precision=_HIGHEST)})