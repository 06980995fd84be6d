"""The FP8 linear layer on TensorFlow tensors: `fp8_linear` (weight [out, in]) and `fp8_dense` (a
Keras kernel [in, out]) under tf.custom_gradient, over fp8_quantize and fp8_gemm: the forward's
GEMM and the backward's dgrad and wgrad GEMMs in FP8 as an Fp8Recipe says, the operands and bits
of fusedlayers.torch.fp8_linear. The GEMMs' rules: csrc/fp8/fp8_gemm.h. Outside XLA (the FP8 ops
have no XLA kernels): a Keras model with these layers compiles with jit_compile=False."""

import tensorflow as tf

from ..fp8_recipe import Fp8Recipe
from . import _op
from .fp8 import Fp8Quantized, fp8_quantize
from .fp8_gemm import fp8_gemm

__all__ = ["fp8_dense", "fp8_linear"]

MULTIPLE = 16  # cuBLASLt's FP8 GEMMs take contracted and output sizes in multiples of 16


def fp8_linear(x, weight, bias=None, recipe: Fp8Recipe | None = None) -> tf.Tensor:
    """y = x @ weight^T + bias with its GEMMs in FP8 (fusedlayers.torch.fp8_linear's contract:
    weight (out_features, in_features), both multiples of 16; a token count off 16 runs as the
    plain product, decided at run time where a tf.function leaves it unknown; y in x's dtype,
    the gradients in x's, weight's and bias's dtypes; the GEMMs left out of recipe.gemms run in
    x's dtype). Raises InvalidArgumentError for shapes off those rules."""
    return _linear(x, weight, bias, recipe, False, "fp8_linear")


def fp8_dense(x, kernel, bias=None, recipe: Fp8Recipe | None = None) -> tf.Tensor:
    """fp8_linear with a Keras kernel (in_features, out_features): x @ kernel + bias."""
    return _linear(x, kernel, bias, recipe, True, "fp8_dense")


def _linear(x, w, bias, recipe, in_out, op):
    recipe = recipe or Fp8Recipe()
    x, w = tf.convert_to_tensor(x), tf.convert_to_tensor(w)
    bias = None if bias is None else tf.convert_to_tensor(bias)
    in_features, out_features = (w.shape[0], w.shape[1]) if in_out else (w.shape[1], w.shape[0])
    if w.shape.rank != 2 or x.shape[-1] != in_features:
        raise _op.invalid(f"fusedlayers.{op}: x's last dimension must be the weight's "
                          f"in_features {in_features}, got x {x.shape.as_list()} and weight "
                          f"{w.shape.as_list()}")
    if in_features % MULTIPLE or out_features % MULTIPLE:
        raise _op.invalid(f"fusedlayers.{op}: in_features and out_features must be multiples "
                          f"of {MULTIPLE}, got weight {w.shape.as_list()}")
    x2 = tf.reshape(x, (-1, in_features))

    def plain():
        y = _dot(x2, w, not in_out, x.dtype)
        return y if bias is None else y + tf.cast(bias, x.dtype)

    def fp8():
        linear = _fp8(recipe, in_out, bias is not None)
        return linear(x2, w) if bias is None else linear(x2, w, bias)
    tokens = x2.shape[0]
    if tokens is None:  # a tf.function's unknown batch: the FP8 GEMMs' rule at run time
        rows = tf.shape(x2)[0]
        y = tf.cond(tf.logical_and(rows > 0, rows % MULTIPLE == 0), fp8, plain)
    else:
        y = fp8() if tokens and tokens % MULTIPLE == 0 else plain()
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [out_features]], 0))


def _dot(a, b, transpose_b, dtype):
    """a @ b (b^T) in a's dtype: the GEMMs a recipe leaves out of FP8."""
    return tf.cast(tf.matmul(a, tf.cast(b, a.dtype), transpose_b=transpose_b), dtype)


def _weight_operands(w, recipe, in_out, fprop, dgrad):
    """The weight's FP8 operands (fprop's b [out, in], dgrad's b [in, out]), None where that GEMM
    is not FP8: one quantization with its transpose where both are needed."""
    if not (fprop or dgrad):
        return None, None
    own, other = (dgrad, fprop) if in_out else (fprop, dgrad)
    q = fp8_quantize(w, recipe.weight_scaling, "e4m3", other, recipe.power_of_2_scales)
    first = Fp8Quantized(q.data, q.scale_inv, None, None) if own else None
    second = Fp8Quantized(q.data_t, q.scale_inv_t, None, None) if other else None
    return (second, first) if in_out else (first, second)


def _fp8(recipe, in_out, with_bias=False):
    gemms = recipe.gemms
    fprop, dgrad, wgrad = ("fprop" in gemms), ("dgrad" in gemms), ("wgrad" in gemms)
    s_in, s_w, pow2 = recipe.input_scaling, recipe.weight_scaling, recipe.power_of_2_scales
    s_x_t = recipe.input_t_scaling

    @tf.custom_gradient
    def linear(x2, w, *bias):
        b = bias[0] if bias else None
        out_dtype = x2.dtype
        keep_w = dgrad and not recipe.recompute_fp8_weights  # else grad quantizes w again
        w_fprop, w_dgrad = _weight_operands(w, recipe, in_out, fprop, keep_w)
        qx = fp8_quantize(x2, s_in, "e4m3", wgrad, pow2, s_x_t) if fprop or wgrad else None
        if fprop:
            in_epilogue = b is not None and out_dtype != tf.float32
            y = fp8_gemm(qx, s_in, w_fprop, s_w, out_dtype, b if in_epilogue else None,
                         recipe.fast_accum)
            if b is not None and not in_epilogue:
                y = y + tf.cast(b, out_dtype)
        else:
            y = _dot(x2, w, not in_out, out_dtype)
            y = y if b is None else y + tf.cast(b, out_dtype)
        saved_x = Fp8Quantized(qx.data_t, qx.scale_inv_t, None, None) if wgrad else x2

        def grad(dy):
            qdy = fp8_quantize(dy, s_in, recipe.grad_format, wgrad, pow2) if dgrad or wgrad \
                else None
            if dgrad:  # dx = dy W: W^T [in, out] is b
                w_b = w_dgrad if keep_w else _weight_operands(w, recipe, in_out, False, True)[1]
                dx = fp8_gemm(qdy, s_in, w_b, s_w, x2.dtype)
            else:
                dx = _dot(dy, w, in_out, x2.dtype)
            if wgrad:  # dW = dy^T x; a kernel's is its transpose
                dy_t = Fp8Quantized(qdy.data_t, qdy.scale_inv_t, None, None)
                if in_out and s_x_t == s_in:
                    dw = fp8_gemm(saved_x, s_in, dy_t, s_in, w.dtype)
                else:  # 128x128 tiles are the GEMM's b alone: the kernel's gradient as dW^T
                    dw = fp8_gemm(dy_t, s_in, saved_x, s_x_t, w.dtype)
                    dw = tf.transpose(dw) if in_out else dw
            else:
                a, bb = (saved_x, dy) if in_out else (dy, saved_x)
                dw = tf.cast(tf.matmul(tf.cast(a, dy.dtype), tf.cast(bb, dy.dtype),
                                       transpose_a=True), w.dtype)
            if b is None:
                return dx, dw
            return dx, dw, tf.cast(tf.reduce_sum(tf.cast(dy, tf.float32), 0), b.dtype)
        return y, grad
    return linear
