"""The FP8 linear layer on JAX arrays: `fp8_linear` (weight [out, in], as F.linear) and `fp8_dense`
(a Flax/Keras kernel [in, out]) under jax.custom_vjp, over fp8_quantize and fp8_gemm: the forward's
GEMM and the backward's dgrad and wgrad GEMMs in FP8 as an Fp8Recipe says, the same operands and
bits as fusedlayers.torch.fp8_linear. The GEMMs' rules: csrc/fp8/fp8_gemm.h."""

from functools import partial

import jax
import jax.numpy as jnp

from ..fp8_recipe import Fp8Recipe
from .fp8 import Fp8Quantized, fp8_quantize
from .fp8_gemm import fp8_gemm

__all__ = ["fp8_dense", "fp8_linear"]

# cuBLASLt's FP8 GEMMs take contracted and output sizes in multiples of 16 (fp8_gemm.h).
MULTIPLE = 16


def supports(in_features: int, out_features: int) -> bool:
    """Whether a linear layer of these sizes can run its GEMMs in FP8."""
    return in_features % MULTIPLE == 0 and out_features % MULTIPLE == 0


def fp8_linear(x, weight, bias=None, recipe: Fp8Recipe | None = None) -> jax.Array:
    """y = x @ weight^T + bias with its GEMMs in FP8 (fusedlayers.torch.fp8_linear's contract).

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None;
    float32, float16 or bfloat16 (the parameters may be float32 masters under bfloat16 x). Each
    call quantizes x and weight as `recipe` says (default Fp8Recipe(): blockwise E4M3, all three
    GEMMs in FP8) and multiplies them on fp8_gemm; the backward quantizes dy the same way. The
    GEMMs left out of recipe.gemms run in x's dtype, accumulating in float32.
    in_features and out_features must be multiples of 16; a call whose token count (x's rows) is
    not a positive multiple of 16 runs as the plain product (the FP8 GEMMs' rule).
    Returns (..., out_features) in x's dtype; the gradients come in x's, weight's and bias's
    dtypes. Raises ValueError for shapes off those rules. FP8 training: Micikevicius et al.
    2022, arXiv:2209.05433; the blockwise recipe: DeepSeek-AI 2024, arXiv:2412.19437.
    """
    return _linear(x, weight, bias, recipe, False, "fp8_linear")


def fp8_dense(x, kernel, bias=None, recipe: Fp8Recipe | None = None) -> jax.Array:
    """fp8_linear with a Flax/Keras kernel (in_features, out_features): x @ kernel + bias."""
    return _linear(x, kernel, bias, recipe, True, "fp8_dense")


def _linear(x, w, bias, recipe, in_out, op):
    recipe = recipe or Fp8Recipe()
    x, w = jnp.asarray(x), jnp.asarray(w)
    bias = None if bias is None else jnp.asarray(bias)
    in_features, out_features = w.shape[::-1] if not in_out else w.shape
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != in_features:
        raise ValueError(f"fusedlayers.{op}: x's last dimension must be the weight's "
                         f"in_features {in_features}, got x {list(x.shape)} and weight "
                         f"{list(w.shape)}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"fusedlayers.{op}: bias must have shape [{out_features}], got "
                         f"{list(bias.shape)}")
    if not supports(in_features, out_features):
        raise ValueError(f"fusedlayers.{op}: in_features and out_features must be multiples of "
                         f"{MULTIPLE}, got weight {list(w.shape)}")
    x2 = x.reshape(-1, in_features)
    if x2.shape[0] == 0 or x2.shape[0] % MULTIPLE:
        y = _dot(x2, w, not in_out, x.dtype)
        y = y if bias is None else y + bias.astype(x.dtype)
    else:
        y = _fp8(x2, w, bias, recipe, in_out)
    return y.reshape(*x.shape[:-1], out_features)


def _dot(a, b, transpose_b, dtype):
    """a @ b (b^T with transpose_b) accumulated in float32, rounded once to dtype: the GEMMs a
    recipe leaves out of FP8."""
    return jax.lax.dot_general(a, b.astype(a.dtype), (((1,), (1 if transpose_b else 0,)),
                                                      ((), ())),
                               preferred_element_type=jnp.float32).astype(dtype)


def _weight_operands(w, recipe, in_out, fprop, dgrad):
    """The weight's FP8 operands (fprop's b: [out, in]; dgrad's b: [in, out]), None where that
    GEMM is not FP8: one quantization of w with its transpose where both are needed."""
    s, pow2 = recipe.weight_scaling, recipe.power_of_2_scales
    if not (fprop or dgrad):
        return None, None
    # w's own layout serves one GEMM, its transpose the other
    own, other = (dgrad, fprop) if in_out else (fprop, dgrad)
    q = fp8_quantize(w, s, "e4m3", other, pow2)
    first = Fp8Quantized(q.data, q.scale_inv, None, None) if own else None
    second = Fp8Quantized(q.data_t, q.scale_inv_t, None, None) if other else None
    return (second, first) if in_out else (first, second)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8(x2, w, bias, recipe, in_out):
    return _fp8_fwd(x2, w, bias, recipe, in_out)[0]


def _fp8_fwd(x2, w, bias, recipe, in_out):
    gemms = recipe.gemms
    fprop, dgrad, wgrad = ("fprop" in gemms), ("dgrad" in gemms), ("wgrad" in gemms)
    s_in, s_w, pow2 = recipe.input_scaling, recipe.weight_scaling, recipe.power_of_2_scales
    out_dtype = x2.dtype
    keep_w = dgrad and not recipe.recompute_fp8_weights  # else the backward quantizes w again
    w_fprop, w_dgrad = _weight_operands(w, recipe, in_out, fprop, keep_w)
    qx = fp8_quantize(x2, s_in, "e4m3", wgrad, pow2, recipe.input_t_scaling) \
        if fprop or wgrad else None
    if fprop:
        # FP8 GEMMs add a bias in their epilogue for half-precision outputs only
        in_epilogue = bias is not None and out_dtype != jnp.float32
        y = fp8_gemm(qx, s_in, w_fprop, s_w, out_dtype, bias if in_epilogue else None,
                     recipe.fast_accum)
        if bias is not None and not in_epilogue:
            y = y + bias.astype(out_dtype)
    else:
        y = _dot(x2, w, not in_out, out_dtype)
        y = y if bias is None else y + bias.astype(out_dtype)
    saved_x = Fp8Quantized(qx.data_t, qx.scale_inv_t, None, None) if wgrad else x2
    saved_w = w_dgrad if keep_w else w
    zeros = (jnp.zeros((0,), x2.dtype), jnp.zeros((0,), w.dtype),
             None if bias is None else jnp.zeros((0,), bias.dtype))
    return y, (saved_x, saved_w, zeros)


def _fp8_bwd(recipe, in_out, saved, dy):
    saved_x, saved_w, (x_like, w_like, b_like) = saved
    gemms = recipe.gemms
    dgrad, wgrad = ("dgrad" in gemms), ("wgrad" in gemms)
    s_in, s_w, pow2 = recipe.input_scaling, recipe.weight_scaling, recipe.power_of_2_scales
    qdy = fp8_quantize(dy, s_in, recipe.grad_format, wgrad, pow2) if dgrad or wgrad else None
    if dgrad:  # dx = dy W: W^T [in, out] is b
        if recipe.recompute_fp8_weights:
            saved_w = _weight_operands(saved_w, recipe, in_out, False, True)[1]
        dx = fp8_gemm(qdy, s_in, saved_w, s_w, x_like.dtype)
    else:  # saved_w is w itself
        dx = _dot(dy, saved_w, in_out, x_like.dtype)
    if wgrad:  # dW = dy^T x: dy^T [out, tokens] and x^T [in, tokens]; a kernel's is its transpose
        dy_t = Fp8Quantized(qdy.data_t, qdy.scale_inv_t, None, None)
        s_x_t = recipe.input_t_scaling
        if in_out and s_x_t == s_in:
            dw = fp8_gemm(saved_x, s_in, dy_t, s_in, w_like.dtype)
        else:  # 128x128 tiles are the GEMM's b alone: the kernel's gradient as dW^T
            dw = fp8_gemm(dy_t, s_in, saved_x, s_x_t, w_like.dtype)
            dw = dw.T if in_out else dw
    else:  # saved_x is x itself
        a, b = (saved_x, dy) if in_out else (dy, saved_x)
        dw = jax.lax.dot_general(a.astype(dy.dtype), b.astype(dy.dtype), (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        dw = dw.astype(dy.dtype).astype(w_like.dtype)  # a GEMM in the layer's dtype
    db = None if b_like is None else dy.sum(0, dtype=jnp.float32).astype(b_like.dtype)
    return dx, dw, db


_fp8.defvjp(_fp8_fwd, _fp8_bwd)

