"""The FP8 gated MLP on torch tensors: `fp8_gated_mlp`, down(act(x W_gate^T) * (x W_up^T)) with
its six GEMMs in FP8 and every quantization of an activation or gradient fused into the op that
produces it where fusedlayers owns that op: the gated activation writes the down projection's
FP8 input (fp8_gated), its backward the gate/up projection's FP8 gradient
(fp8_gated_backward). x is quantized once for both gate and up, whose weights run as one GEMM
(as Transformer Engine's LayerNormMLP runs its fc1); nothing is saved in bf16 but the gate/up
output the activation's backward reads. `applies` is the rule under which GatedMLP (fuse()'s
gated MLP) takes this path; `reference` is the unfused composition of Fp8Linear layers."""

import torch
import torch.nn.functional as F

from ..fp8_recipe import Fp8Recipe
from .fp8 import Fp8Quantized, fp8_quantize, quantize_input
from .fp8_gated import fp8_gated, fp8_gated_backward
from .fp8_gemm import fp8_gemm
from .fp8_linear import MULTIPLE, Fp8Linear, _out_dtype, fp8_linear

__all__ = ["fp8_gated_mlp"]

# The gated activation's FP8 form takes widths in whole 128-blocks (fp8_gated.h).
BLOCK = 128
ALL_GEMMS = frozenset(("fprop", "dgrad", "wgrad"))


def _t(data, scale_inv) -> Fp8Quantized:
    return Fp8Quantized(data, scale_inv, None, None)


def _release(saved: torch.Tensor) -> None:
    """Free a saved tensor's memory past its last use in the backward, as autograd frees the
    saved tensors of each node of an unfused graph once that node has run (one node holding
    them all would keep them to its end; Transformer Engine frees its saved activations in the
    same way). Eager only: a traced backward's buffers are the compiler's."""
    if not torch.compiler.is_compiling():
        saved.data = torch.empty(0, dtype=saved.dtype, device=saved.device)


def _quantize_gate_up(w_gate, w_up, scaling: str, transpose: bool, pow2: bool) -> Fp8Quantized:
    """W_gu = [W_gate; W_up] (or W_gate alone, the stacked gate_up) in FP8, its transpose where
    asked; the stacked copy not held past the quantization."""
    return fp8_quantize(w_gate if w_up is None else torch.cat([w_gate, w_up]), scaling, "e4m3",
                        transpose, pow2)


class _Fp8GatedMLP(torch.autograd.Function):
    """y = down(act(gate) * up), [gate | up] = x W_gu^T. W_gu is gate_up, or gate and up
    stacked (their gradients split back)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, activation: str, recipe: Fp8Recipe, out_dtype):
        s_in, s_w, pow2 = recipe.input_scaling, recipe.weight_scaling, recipe.power_of_2_scales
        s_in_t = recipe.input_t_scaling
        keep_w_t = not recipe.recompute_fp8_weights
        qx = quantize_input(x, s_in, "e4m3", True, pow2, s_in_t)
        qw_gu = _quantize_gate_up(w_gate, w_up, s_w, keep_w_t, pow2)
        gate_up = fp8_gemm(qx, s_in, qw_gu, s_w, out_dtype)
        saved = [qx.data_t, qx.scale_inv_t, *((qw_gu.data_t, qw_gu.scale_inv_t) if keep_w_t
                                               else (w_gate, w_up)), gate_up]
        del qx, qw_gu  # their row-major forms are this GEMM's alone
        gate, up = gate_up.chunk(2, dim=-1)
        qh = fp8_gated(gate, up, activation, s_in, "e4m3", True, pow2, s_in_t)
        qw_down = fp8_quantize(w_down, s_w, "e4m3", keep_w_t, pow2)
        y = fp8_gemm(qh, s_in, qw_down, s_w, out_dtype)
        ctx.save_for_backward(*saved, qh.data_t, qh.scale_inv_t,
                              *((qw_down.data_t, qw_down.scale_inv_t) if keep_w_t
                                else (w_down, None)))
        ctx.activation, ctx.recipe, ctx.split = activation, recipe, w_up is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.w_dtypes = (w_gate.dtype, None if w_up is None else w_up.dtype, w_down.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        (x_t, x_t_scale, w_gu_t, w_gu_t_scale, gate_up, h_t, h_t_scale, w_down_t,
         w_down_t_scale) = ctx.saved_tensors
        if gate_up.numel() == 0:
            raise RuntimeError("fusedlayers.fp8_gated_mlp: a second backward through one forward "
                               "(retain_graph=True) is not supported: the first frees the saved "
                               "activations as it goes; run the forward again")
        recipe = ctx.recipe
        s_in, s_w, pow2 = recipe.input_scaling, recipe.weight_scaling, recipe.power_of_2_scales
        s_in_t, fmt = recipe.input_t_scaling, recipe.grad_format
        recompute = recipe.recompute_fp8_weights  # the weights were saved: FP8 W^T made here
        if recompute:
            q = fp8_quantize(w_down_t, s_w, "e4m3", True, pow2)
            w_down_t, w_down_t_scale = q.data_t, q.scale_inv_t
            del q  # its row-major form: unused
        dy2 = dy.reshape(-1, dy.shape[-1])
        qdy = fp8_quantize(dy2, s_in, fmt, True, pow2)
        # down: dh = dy W_down (W_down^T [ffn, hidden] is b); dW_down = dy^T h
        dh = fp8_gemm(qdy, s_in, _t(w_down_t, w_down_t_scale), s_w, gate_up.dtype)
        _release(w_down_t)
        dw_down = fp8_gemm(_t(qdy.data_t, qdy.scale_inv_t), s_in, _t(h_t, h_t_scale), s_in_t,
                           ctx.w_dtypes[2])
        del qdy
        _release(h_t)
        gate, up = gate_up.chunk(2, dim=-1)
        qdgu = fp8_gated_backward(dh, gate, up, ctx.activation, s_in, fmt, True, pow2)
        del dh, gate, up  # not held through the gate/up GEMMs
        _release(gate_up)
        if recompute:
            q = _quantize_gate_up(w_gu_t, w_gu_t_scale, s_w, True, pow2)
            w_gu_t, w_gu_t_scale = q.data_t, q.scale_inv_t
            del q
        # gate/up: dx = d[gate | up] W_gu; dW_gu = d[gate | up]^T x
        dx = fp8_gemm(qdgu, s_in, _t(w_gu_t, w_gu_t_scale), s_w, ctx.x_dtype)
        _release(w_gu_t)
        dw_gu = fp8_gemm(_t(qdgu.data_t, qdgu.scale_inv_t), s_in, _t(x_t, x_t_scale), s_in_t,
                         ctx.w_dtypes[0])
        if ctx.split:
            dw_gate, dw_up = dw_gu.chunk(2, dim=0)
            dw_up = dw_up.to(ctx.w_dtypes[1])
        else:
            dw_gate, dw_up = dw_gu, None
        return dx.reshape(ctx.x_shape), dw_gate, dw_up, dw_down, None, None, None


def fp8_gated_mlp(x: torch.Tensor, gate_up_weight, down_weight: torch.Tensor,
                  activation: str = "silu", recipe: Fp8Recipe | None = None) -> torch.Tensor:
    """down(act(x @ W_gate^T) * (x @ W_up^T)) with its six GEMMs in FP8, the quantizations of the
    activation and of its gradient fused into the gated op (Llama's, Mistral's, Qwen's MLP).

    x: (..., hidden); gate_up_weight: a pair (W_gate, W_up) of (ffn, hidden) or one (2 ffn,
    hidden) whose halves are gate and up (Phi-3); down_weight: (hidden, ffn); no biases.
    activation: "silu" (SwiGLU), "gelu" or "gelu_tanh" (GeGLU). recipe: Fp8Recipe (default
    blockwise E4M3) with all three GEMMs in FP8. Weights may be float32 masters; the gate/up
    output runs in the autocast dtype (else x's), which must be float16 or bfloat16.
    Returns (..., hidden) in that dtype; gradients in x's and the weights' dtypes.
    Raises ValueError where `applies` says no: ffn off whole 128-blocks, hidden off multiples of
    16, a token count not a positive multiple of 16, or a recipe leaving a GEMM out; TypeError
    for float32 activations. FP8 training: Micikevicius et al. 2022, arXiv:2209.05433; the
    blockwise recipe: DeepSeek-AI 2024, arXiv:2412.19437.
    """
    recipe = recipe or Fp8Recipe()
    w_gate, w_up = gate_up_weight if isinstance(gate_up_weight, (tuple, list)) else \
        (gate_up_weight, None)
    error = _argument_error(x, w_gate, w_up, down_weight, recipe)
    if error:
        raise type(error)(f"fusedlayers.fp8_gated_mlp: {error}")
    return _Fp8GatedMLP.apply(x, w_gate, w_up, down_weight, activation, recipe, _out_dtype(x))


def _argument_error(x, w_gate, w_up, w_down, recipe) -> Exception | None:
    """The error fp8_gated_mlp raises for these arguments (its message without the op's name),
    or None where it takes them."""
    hidden = x.shape[-1]
    ffn = w_gate.shape[0] if w_up is not None else w_gate.shape[0] // 2
    shapes = [tuple(w.shape) for w in (w_gate, w_up, w_down) if w is not None]
    want = [(ffn, hidden), (ffn, hidden)] if w_up is not None else [(2 * ffn, hidden)]
    if shapes != [*want, (hidden, ffn)]:
        return ValueError(f"weights of shapes {shapes} do not make an MLP of width {hidden}")
    if ffn % BLOCK or hidden % MULTIPLE:
        return ValueError(f"ffn must be a multiple of {BLOCK} and hidden of {MULTIPLE}, got {ffn}, "
                          f"{hidden}")
    tokens = x.numel() // hidden if hidden else 0
    if tokens == 0 or tokens % MULTIPLE:
        return ValueError(f"the token count must be a positive multiple of {MULTIPLE}, got "
                          f"{tokens}")
    if frozenset(recipe.gemms) != ALL_GEMMS:
        return ValueError(f"the recipe must run all three GEMMs in FP8, got "
                          f"{sorted(recipe.gemms)}")
    if _out_dtype(x) not in (torch.float16, torch.bfloat16):
        return TypeError(f"activations must have dtype float16 or bfloat16, got "
                         f"{_out_dtype(x)}")
    return None


def applies(mlp, x: torch.Tensor) -> bool:
    """Whether GatedMLP `mlp` runs as fp8_gated_mlp on x: its projections Fp8Linear layers of one
    recipe, without biases, and fp8_gated_mlp's rules hold (else it runs its layers one by
    one, each Fp8Linear quantizing its own input)."""
    roles = ("gate_up", "down") if "gate_up" in mlp.names else ("gate", "up", "down")
    layers = [getattr(mlp, mlp.names[r]) for r in roles]
    if not all(type(m) is Fp8Linear and m.bias is None for m in layers):
        return False
    if any(m.recipe != layers[0].recipe for m in layers):
        return False
    w_gate, w_up = (layers[0].weight, None) if len(layers) == 2 else \
        (layers[0].weight, layers[1].weight)
    return _argument_error(x, w_gate, w_up, layers[-1].weight, layers[0].recipe) is None


def reference(x, gate_up_weight, down_weight, activation="silu", recipe=None) -> torch.Tensor:
    """The unfused composition: each projection an fp8_linear of its own, the activation and the
    product in torch."""
    recipe = recipe or Fp8Recipe()
    if isinstance(gate_up_weight, (tuple, list)):
        gate = fp8_linear(x, gate_up_weight[0], None, recipe)
        up = fp8_linear(x, gate_up_weight[1], None, recipe)
    else:
        gate, up = fp8_linear(x, gate_up_weight, None, recipe).chunk(2, dim=-1)
    act = {"silu": F.silu, "gelu": F.gelu,
           "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
    return fp8_linear(act(gate) * up, down_weight, None, recipe)
