"""The FP8 GEMM on JAX arrays: the custom call fusedlayers_fp8_gemm (backends/xla/fp8_gemm_ffi.cc),
the same csrc op as fusedlayers.torch.fp8_gemm (the CPU reference, cuBLASLt's scaled matmul on
CUDA). The math and its rules: csrc/fp8/fp8_gemm.h. A whole op (_op.plain_call)."""

import jax
import jax.numpy as jnp
import numpy as np

from .. import _csrc_check
from . import _op
from .fp8 import Fp8Quantized, format_name, scale_storage

__all__ = ["fp8_gemm"]

_OUT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def fp8_gemm(a: Fp8Quantized, a_scaling: str, b: Fp8Quantized, b_scaling: str,
             out_dtype=jnp.bfloat16, bias=None, fast_accum: bool = False) -> jax.Array:
    """d = dequant(a) @ dequant(b)^T (+ bias), the FP8 GEMM of two fp8_quantize outputs.

    a: [m, k] and b: [n, k], each an Fp8Quantized (its `data` and `scale_inv`, both quantized
    along k), scaled as `a_scaling` / `b_scaling` say: "tensorwise" with "tensorwise", "1x128"
    with "128x128" (DeepSeek-V3's activations by weights) or "1x128" with "1x128" (a weight
    gradient's operands). E4M3 or E5M2 operands (not both E5M2; blockwise scalings take E4M3).
    k must be a positive multiple of 16, n a multiple of 16 and, with block scales, m too.
    out_dtype: jnp.bfloat16 (default), float16 or float32; bias: [n] (bfloat16 or float16
    outputs only), added before the rounding to out_dtype. fast_accum: Hopper's FP8
    accumulation without its periodic promotion (tensorwise only; ignored on the CPU).

    Returns d [m, n] of out_dtype: on the CPU each operand dequantized to float32 and summed over
    k in order in float32 (fusedlayers.torch.fp8_gemm's bits); on CUDA cuBLASLt's scaled matmul
    (block scales: cuBLASLt >= 12.9 on sm_90). Not differentiable (fp8_linear's custom_vjp calls
    it for each GEMM). While tracing, raises TypeError for non-FP8 operands or out_dtype, and
    ValueError for mismatched shapes, another scaling pair or sizes off the rules above
    (csrc/fp8/fp8_gemm.h's messages).
    """
    if _op.lib is None:
        _op.prepare("fp8_gemm")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"fusedlayers.fp8_gemm: out_dtype must be float32, float16 or bfloat16, "
                        f"got {out_dtype}")
    qa, qb = jnp.asarray(a.data), jnp.asarray(b.data)
    sa, sb = jnp.asarray(a.scale_inv), jnp.asarray(b.scale_inv)
    for name, s in (("a", sa), ("b", sb)):
        if s.dtype != jnp.float32:
            raise TypeError(f"fusedlayers.fp8_gemm: {name}_scale_inv must be float32, got "
                            f"{s.dtype}")
    bias = None if bias is None else jnp.asarray(bias)
    _op.check("fp8_gemm", tuple(qa.shape), format_name(qa.dtype), tuple(sa.shape), a_scaling,
              tuple(qb.shape), format_name(qb.dtype), tuple(sb.shape), b_scaling,
              _op.csrc_dtype(out_dtype), None if bias is None else jax.ShapeDtypeStruct(
                  bias.shape, out_dtype), bool(fast_accum))
    (m, k), n = qa.shape, qb.shape[0]
    results = (jax.ShapeDtypeStruct((m, n), out_dtype),
               jax.ShapeDtypeStruct((_csrc_check.fp8_gemm_workspace_size(_op.lib),), jnp.uint8))
    operands = (qa, scale_storage(sa, a_scaling, m, k), qb, scale_storage(sb, b_scaling, n, k),
                _op.absent(out_dtype) if bias is None else bias.astype(out_dtype))
    return _op.plain_call("fp8_gemm", results, *operands, a_scaling=a_scaling,
                          b_scaling=b_scaling, has_bias=np.bool_(bias is not None),
                          fast_accum=np.bool_(fast_accum))[0]


def dequantize(q, scale_inv, scaling: str) -> np.ndarray:
    """q [rows, cols] (FP8) times its scales, in float64: the operand a GEMM multiplies."""
    values = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    s = np.asarray(scale_inv, np.float64)
    rows, cols = values.shape
    if scaling == "tensorwise":
        return values * s.reshape(())
    block = 128
    if scaling == "1x128":  # s: [rows, blocks]
        return values * np.repeat(s, block, axis=1)[:, :cols]
    return values * np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:rows, :cols]


def reference(a: Fp8Quantized, a_scaling: str, b: Fp8Quantized, b_scaling: str,
              bias=None) -> np.ndarray:
    """The unfused computation in float64 (numpy): dequant(a) @ dequant(b)^T (+ bias), not yet
    rounded to the output's dtype."""
    d = dequantize(a.data, a.scale_inv, a_scaling) @ dequantize(b.data, b.scale_inv,
                                                                 b_scaling).T
    return d if bias is None else d + np.asarray(bias, np.float64)
