"""The FP8 GEMM on torch tensors: `fusedlayers::fp8_gemm` (backends/torch/fp8_gemm.cpp), its fake
kernel, the functional API and the unfused float64 reference. The math and its rules:
csrc/fp8/fp8_gemm.h."""

import numpy as np
import torch

from . import _op
from .fp8 import BLOCK, Fp8Quantized

__all__ = ["fp8_gemm"]
fp8_gemm_op = _op.handle("fp8_gemm")


def fp8_gemm(a: Fp8Quantized, a_scaling: str, b: Fp8Quantized, b_scaling: str,
             out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
             fast_accum: bool = False) -> torch.Tensor:
    """d = dequant(a) @ dequant(b)^T (+ bias), the FP8 GEMM of two fp8_quantize outputs.

    a: [m, k] and b: [n, k], each an Fp8Quantized (its `data` and `scale_inv`; both quantized
    along k, the contracted dimension, as a linear layer's x [tokens, in] and weight
    [out, in] are), scaled as `a_scaling` / `b_scaling` say: "tensorwise" with "tensorwise",
    "1x128" with "128x128" (DeepSeek-V3's activations by weights) or "1x128" with "1x128" (a
    weight gradient's operands, both blocked along the tokens). E4M3 or E5M2 operands (not both
    E5M2; blockwise scalings take E4M3). k must be a positive multiple of 16, n a multiple of 16
    and, with block scales, m too (cuBLASLt's FP8 kernels). out_dtype: torch.bfloat16 (default),
    float16 or float32; bias: [n] (bfloat16 or float16 outputs only), added before the rounding
    to out_dtype. fast_accum: Hopper's FP8 accumulation without
    its periodic promotion (faster, less accurate; tensorwise only, CUDA only).

    Returns d [m, n] of out_dtype. CPU: each operand dequantized to float32 and summed over k in
    order in float32 (the reference every device is tested against); CUDA: cuBLASLt's scaled
    matmul (block scales need cuBLASLt >= 12.9 and an sm_90 GPU; tensorwise sm_89+). Raises
    TypeError for non-FP8 operands or scales not float32, ValueError for mismatched shapes,
    another scaling pair or sizes off the rules above.
    """
    return fp8_gemm_op(a.data, a.scale_inv, a_scaling, b.data, b.scale_inv, b_scaling,
                       out_dtype, bias, fast_accum)


@_op.register_fake("fp8_gemm")
def _(a, a_scale_inv, a_scaling, b, b_scale_inv, b_scaling, out_dtype, bias=None,
      fast_accum=False):
    _op.check_devices("fp8_gemm", "a", a, b=b, a_scale_inv=a_scale_inv, b_scale_inv=b_scale_inv,
                      bias=bias)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fusedlayers.fp8_gemm: a [m, k] and b [n, k] must share k, got a "
                         f"{list(a.shape)} and b {list(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, scaling: str) -> np.ndarray:
    """q [rows, cols] (FP8) times its scales, in float64: the operand a GEMM multiplies."""
    values = q.float().double().cpu().numpy()
    s = scale_inv.double().cpu().numpy()
    rows, cols = values.shape
    if scaling == "tensorwise":
        return values * s.reshape(())
    if scaling == "1x128":  # s: [rows, blocks]
        return values * np.repeat(s, BLOCK, axis=1)[:, :cols]
    return values * np.repeat(np.repeat(s, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]


def reference(a: Fp8Quantized, a_scaling: str, b: Fp8Quantized, b_scaling: str,
              bias: torch.Tensor | None = None) -> np.ndarray:
    """The unfused computation in float64 (numpy): dequant(a) @ dequant(b)^T (+ bias), not yet
    rounded to the output's dtype."""
    d = dequantize(a.data, a.scale_inv, a_scaling) @ dequantize(b.data, b.scale_inv,
                                                                 b_scaling).T
    return d if bias is None else d + bias.double().cpu().numpy()
