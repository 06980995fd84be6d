"""The FP8 linear layer on torch tensors: `fp8_linear` (an autograd function over fp8_quantize
and fp8_gemm: the forward's GEMM and the backward's dgrad and wgrad GEMMs in FP8 as an
Fp8Recipe says), the module `Fp8Linear` (a drop-in nn.Linear) and the unfused reference. The
GEMMs' rules: csrc/fp8/fp8_gemm.h; the quantization's: csrc/fp8/fp8.h."""

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8_recipe import Fp8Recipe
from .fp8 import Fp8Quantized, fp8_quantize, quantize_input
from .fp8_gemm import dequantize, fp8_gemm

__all__ = ["Fp8Linear", "fp8_dense", "fp8_linear"]

# cuBLASLt's FP8 GEMMs take contracted and output sizes in multiples of 16 (fp8_gemm.h).
MULTIPLE = 16


def supports(in_features: int, out_features: int) -> bool:
    """Whether a linear layer of these sizes can run its GEMMs in FP8."""
    return in_features % MULTIPLE == 0 and out_features % MULTIPLE == 0


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """y's dtype: the autocast dtype where autocast is on for x's device (as F.linear under
    autocast), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with the recipe's GEMMs in FP8. Saved for the backward: x^T in FP8 where
    wgrad is FP8 (else x), W^T in FP8 where dgrad is FP8 and the recipe keeps it (else W)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])
        gemms = recipe.gemms
        wgrad = "wgrad" in gemms and weight.requires_grad
        dgrad = "dgrad" in gemms and x.requires_grad
        keep_w_t = dgrad and not recipe.recompute_fp8_weights
        pow2 = recipe.power_of_2_scales
        if "fprop" in gemms or wgrad:
            qx = quantize_input(x, recipe.input_scaling, "e4m3", wgrad, pow2,
                                recipe.input_t_scaling)
        if "fprop" in gemms or keep_w_t:
            qw = fp8_quantize(weight, recipe.weight_scaling, "e4m3", keep_w_t, pow2)
        if "fprop" in gemms:
            # FP8 GEMMs add a bias in their epilogue for half-precision outputs only
            in_epilogue = bias is not None and out_dtype != torch.float32
            y = fp8_gemm(qx, recipe.input_scaling, qw, recipe.weight_scaling, out_dtype,
                         bias.to(out_dtype) if in_epilogue else None, recipe.fast_accum)
            if bias is not None and not in_epilogue:
                y = y + bias
        else:
            y = F.linear(x2.to(out_dtype), weight.to(out_dtype),
                         None if bias is None else bias.to(out_dtype))
        saved_x = (qx.data_t, qx.scale_inv_t) if wgrad else (x2, None)
        saved_w = (qw.data_t, qw.scale_inv_t) if keep_w_t else (weight, None)
        ctx.save_for_backward(*saved_x, *saved_w)
        ctx.recipe, ctx.wgrad, ctx.dgrad = recipe, wgrad, dgrad
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        recipe = ctx.recipe
        x_t, x_t_scale, w_t, w_t_scale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        pow2 = recipe.power_of_2_scales
        s_in, s_w = recipe.input_scaling, recipe.weight_scaling
        dx = dw = db = None
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if ctx.dgrad or ctx.wgrad:
            qdy = fp8_quantize(dy2, s_in, recipe.grad_format, ctx.wgrad and need_dw, pow2)
        if need_dx:
            if ctx.dgrad:  # dx = dy W: W^T [in, out] is b
                if recipe.recompute_fp8_weights:  # W was saved: its FP8 W^T made here
                    qw = fp8_quantize(w_t, s_w, "e4m3", True, pow2)
                    w_t, w_t_scale = qw.data_t, qw.scale_inv_t
                dx = fp8_gemm(qdy, s_in, Fp8Quantized(w_t, w_t_scale, None, None), s_w,
                              ctx.x_dtype)
            else:
                dx = (dy2 @ w_t.to(dy2.dtype)).to(ctx.x_dtype)
            dx = dx.reshape(ctx.x_shape)
        if need_dw:
            if ctx.wgrad:  # dW = dy^T x: dy^T [out, tokens] is a, x^T [in, tokens] is b
                dw = fp8_gemm(Fp8Quantized(qdy.data_t, qdy.scale_inv_t, None, None), s_in,
                              Fp8Quantized(x_t, x_t_scale, None, None), recipe.input_t_scaling,
                              ctx.w_dtype)
            else:
                dw = (dy2.t() @ x_t.to(dy2.dtype)).to(ctx.w_dtype)
        if need_db:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: Fp8Recipe | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias with its GEMMs in FP8, replacing `F.linear(x, weight, bias)`.

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None;
    float32, float16 or bfloat16 (the parameters may be float32 masters under bfloat16 x). Each
    call quantizes x and weight as `recipe` says (default Fp8Recipe(): blockwise E4M3, all three
    GEMMs in FP8) and multiplies them on cuBLASLt's FP8 GEMM; the backward quantizes dy the same
    way. in_features and out_features must be multiples of 16; a call whose token count (x's
    rows) is not a positive multiple of 16 runs as F.linear (the FP8 GEMMs' rule).
    Returns (..., out_features) in x's dtype, or the autocast dtype under torch.autocast; the
    gradients come in x's, weight's and bias's dtypes.
    Raises ValueError for shapes off those rules. FP8 training: Micikevicius et al. 2022,
    arXiv:2209.05433; the blockwise recipe: DeepSeek-AI 2024, arXiv:2412.19437.
    """
    recipe = recipe or Fp8Recipe()
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fusedlayers.fp8_linear: x's last dimension must be weight's "
                         f"in_features {weight.shape[1]}, got x {list(x.shape)}")
    if not supports(weight.shape[1], weight.shape[0]):
        raise ValueError(f"fusedlayers.fp8_linear: in_features and out_features must be "
                         f"multiples of {MULTIPLE}, got weight {list(weight.shape)}")
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tokens == 0 or tokens % MULTIPLE != 0:
        return F.linear(x, weight, bias)
    return _Fp8Linear.apply(x, weight, bias, recipe, _out_dtype(x))


def fp8_dense(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None = None,
              recipe: Fp8Recipe | None = None) -> torch.Tensor:
    """fp8_linear with a Keras kernel (in_features, out_features): x @ kernel + bias (its
    transpose quantized as the weight; the kernel's gradient in its layout)."""
    return fp8_linear(x, kernel.t(), bias, recipe)


class Fp8Linear(nn.Linear):
    """nn.Linear with its GEMMs in FP8 (fp8_linear) as `recipe` says; same Parameters,
    initialisation and state_dict as nn.Linear (weights stay in their dtype: the quantization
    happens in each forward). Sizes off fp8_linear's rules run as nn.Linear. Input
    (..., in_features) -> output (..., out_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Fp8Recipe | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe or Fp8Recipe()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | None = None) -> "Fp8Linear":
        """An Fp8Linear sharing `linear`'s Parameters (nothing copied)."""
        fp8 = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe,
                  device="meta")
        fp8.weight, fp8.bias = linear.weight, linear.bias
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not supports(self.in_features, self.out_features):
            return super().forward(x)
        return fp8_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              recipe: Fp8Recipe | None = None) -> torch.Tensor:
    """The unfused forward in float64: x and weight quantized as the recipe says, dequantized,
    multiplied (+ bias)."""
    recipe = recipe or Fp8Recipe()
    x2 = x.reshape(-1, x.shape[-1])
    qx = fp8_quantize(x2, recipe.input_scaling, "e4m3", power_of_2_scales=recipe.power_of_2_scales)
    qw = fp8_quantize(weight, recipe.weight_scaling, "e4m3",
                      power_of_2_scales=recipe.power_of_2_scales)
    y = torch.from_numpy(dequantize(qx.data, qx.scale_inv, recipe.input_scaling) @
                         dequantize(qw.data, qw.scale_inv, recipe.weight_scaling).T)
    if bias is not None:
        y = y + bias.double().cpu()
    return y.reshape(*x.shape[:-1], weight.shape[0])
