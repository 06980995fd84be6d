"""The FP8 GEMM on TensorFlow tensors: the FusedlayersFp8Gemm op (backends/tensorflow/fp8_gemm.cc),
csrc's CPU reference, the bits of fusedlayers.torch.fp8_gemm on the CPU. The math and its rules:
csrc/fp8/fp8_gemm.h. A CPU kernel alone (the TF op library links no cuBLASLt): on a GPU
TensorFlow runs it on its CPU; outside XLA."""

import tensorflow as tf

from . import _op
from .fp8 import Fp8Quantized, scale_storage

__all__ = ["fp8_gemm"]


def fp8_gemm(a: Fp8Quantized, a_scaling: str, b: Fp8Quantized, b_scaling: str,
             out_dtype=tf.bfloat16, bias=None, fast_accum: bool = False) -> tf.Tensor:
    """d = dequant(a) @ dequant(b)^T (+ bias), the FP8 GEMM of two fp8_quantize outputs
    (fusedlayers.torch.fp8_gemm's contract: a [m, k], b [n, k] quantized along k; scalings
    tensorwise x tensorwise, 1x128 x 128x128 or 1x128 x 1x128; k a positive multiple of 16, n of
    16 and, with block scales, m too; bias [n] with bfloat16 or float16 outputs only).
    out_dtype: tf.bfloat16 (default), float16 or float32. Returns d [m, n] of out_dtype, each
    operand dequantized to float32 and summed over k in order in float32 (fast_accum is CUDA's
    and ignored here). Not differentiable. Raises InvalidArgumentError with csrc's message for
    shapes, scalings, formats or dtypes off those rules."""
    if _op.lib is None:
        _op.prepare("fp8_gemm")
    out_dtype = tf.as_dtype(out_dtype)
    if out_dtype not in (tf.float32, tf.float16, tf.bfloat16):
        raise _op.invalid(f"fusedlayers.fp8_gemm: out_dtype must be float32, float16 or "
                          f"bfloat16, got {out_dtype.name}")
    qa, qb = tf.convert_to_tensor(a.data), tf.convert_to_tensor(b.data)
    (m, k), n = qa.shape, qb.shape[0]
    bias_t = tf.zeros((0,), out_dtype) if bias is None else tf.cast(bias, out_dtype)
    return _op.lib.fusedlayers_fp8_gemm(
        qa, scale_storage(tf.convert_to_tensor(a.scale_inv), a_scaling, m, k), qb,
        scale_storage(tf.convert_to_tensor(b.scale_inv), b_scaling, n, k), bias_t,
        a_scaling=a_scaling, b_scaling=b_scaling, has_bias=bias is not None,
        fast_accum=bool(fast_accum))
