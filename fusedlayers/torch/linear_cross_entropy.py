"""Linear + cross-entropy on torch tensors without the logits: `fusedlayers::linear_cross_entropy`
(a custom op: under torch.compile it stays one op, never decomposed into the logits it exists to
avoid) on the pass `fusedlayers::linear_cross_entropy_pass` (backends/torch/
linear_cross_entropy.cpp), its autograd and fake kernel, and the unfused reference. The math and
the chunking: csrc/loss/linear_cross_entropy.h."""

import torch
import torch.nn.functional as F

from .. import _args
from . import _op

__all__ = ["linear_cross_entropy"]

_pass = _op.handle("linear_cross_entropy_pass")


def linear_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor,
                         *, linear_bias: torch.Tensor | None = None, reduction: str = "mean",
                         ignore_index: int = -100, label_smoothing: float = 0.0,
                         softcap: float | None = None, z_loss: float = 0.0,
                         num_items_in_batch: int | torch.Tensor | None = None,
                         loss_dtype: torch.dtype | str | None = None) -> torch.Tensor:
    """cross_entropy(softcap(input @ linear_weight^T + linear_bias), target) without the
    (..., V) logits: the arguments and result of PyTorch's `F.linear_cross_entropy` where they
    share them, plus Gemma 2's `softcap` (`softcap * tanh(z / softcap)` on the logits) and PaLM's
    `z_loss` (`z_loss * logsumexp(z)^2` added to each non-ignored token's loss).

    input (..., H), linear_weight (V, H) and linear_bias (V,) of one dtype (float32/float64/
    float16/bfloat16), target integer (...) of class indices in [0, V) or ignore_index.
    reduction: 'mean' (over the non-ignored targets, or over `num_items_in_batch` when given: the
    count of a whole accumulated batch, as Hugging Face's Trainer passes it), 'sum' or 'none'
    (the loss of each target, 0 where ignored). Logsumexp, max and sums in float32 (float64 for
    float64); the logits chunk and the gradients in input's dtype. Returns input's dtype, as
    PyTorch's F.linear_cross_entropy does, unless `loss_dtype` (a floating dtype) is given: then
    the float32 (float64) loss cast to it, never rounded through input's dtype (pass
    torch.float32 for the loss to log from a bfloat16 or float16 model, as Hugging Face's and
    Liger-Kernel's losses are). Under autocast, input, weight and bias are cast to its dtype
    first, as F.linear's are.
    Memory: the gradients of input, weight and bias plus one chunk of logits (rows x V), never
    N x V: equal chunks of at most 4096 rows whose logits take at most twice input's size plus
    half the weight's, or 2^24 logits (csrc's rule). With reduction 'mean' or 'sum' and an argument requiring grad, the gradients are
    computed during the forward and scaled in the backward (three GEMMs in all); with 'none'
    the backward recomputes the logits (four).

    Raises ValueError for a bad reduction, shapes, label_smoothing outside [0, 1], a negative or
    infinite softcap or z_loss, num_items_in_batch without reduction 'mean', or (on the CPU) a
    target outside [0, V) other than ignore_index (on CUDA its loss is NaN); TypeError for dtypes
    (loss_dtype included).
    """
    _args.linear_cross_entropy(reduction, num_items_in_batch, softcap, input.shape,
                               target.shape)
    if isinstance(loss_dtype, str):  # a dtype's name, as JAX and TensorFlow take it (Keras)
        loss_dtype = getattr(torch, loss_dtype, loss_dtype)
    if loss_dtype is not None and not (isinstance(loss_dtype, torch.dtype) and
                                       loss_dtype.is_floating_point):
        raise TypeError(f"fusedlayers.linear_cross_entropy: loss_dtype must be None or a "
                        f"floating dtype, got {loss_dtype!r}")
    device = input.device.type
    if torch.is_autocast_enabled(device):  # as F.linear under autocast: in its dtype
        dtype = torch.get_autocast_dtype(device)
        input, linear_weight = input.to(dtype), linear_weight.to(dtype)
        linear_bias = None if linear_bias is None else linear_bias.to(dtype)
    items = num_items_in_batch
    if items is not None and not isinstance(items, torch.Tensor):
        items = torch.tensor(float(items))
    loss = _linear_cross_entropy(input.reshape(-1, input.shape[-1]), linear_weight, linear_bias,
                                 target.reshape(-1), items, reduction, ignore_index,
                                 float(label_smoothing), float(softcap or 0.0), float(z_loss))
    loss = loss.to(loss_dtype or input.dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _loss_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scale(target, items, reduction, ignore_index, like):
    """The factor of the reduction: 1 for 'sum', 1 / count for 'mean' (a 1-element tensor)."""
    if reduction == "sum":
        return torch.ones(1, dtype=_loss_dtype(like), device=like.device)
    count = (target != ignore_index).sum() if items is None else items.to(like.device)
    return (1.0 / count.to(_loss_dtype(like))).reshape(1)


@torch.library.custom_op("fusedlayers::linear_cross_entropy", mutates_args=())
def _op_forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, items: torch.Tensor | None, reduction: str,
                ignore_index: int, label_smoothing: float, softcap: float, z_loss: float,
                grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dinput, dweight, dbias): the loss in float32 (float64 for float64 input), the
    gradients of the reduced loss (empty unless grads)."""
    scale = _scale(target, items, reduction, ignore_index, input)
    rows, dx, dw, db = _pass(input, weight, bias, target, scale if grads else None, ignore_index,
                             label_smoothing, softcap, z_loss)
    loss = rows if reduction == "none" else rows.sum() * scale[0]
    return loss, dx, dw, db


@_op_forward.register_fake
def _(input, weight, bias, target, items, reduction, ignore_index, label_smoothing, softcap,
      z_loss, grads):
    n = input.shape[0]
    loss = input.new_empty((n,) if reduction == "none" else (), dtype=_loss_dtype(input))
    if not grads:
        return loss, input.new_empty(0), input.new_empty(0), input.new_empty(0)
    return (loss, torch.empty_like(input), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else input.new_empty(0))


@_op.register_fake("linear_cross_entropy_pass")
def _(input, weight, bias, target, grad_scale, ignore_index, label_smoothing, softcap, z_loss):
    _op.check_devices("linear_cross_entropy", "input", input, linear_weight=weight,
                      linear_bias=bias, target=target, grad_scale=grad_scale)
    loss = input.new_empty(input.shape[:1], dtype=_loss_dtype(input))
    if grad_scale is None:
        return loss, input.new_empty(0), input.new_empty(0), input.new_empty(0)
    return (loss, torch.empty_like(input), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else input.new_empty(0))


def _linear_cross_entropy(input, weight, bias, target, items, reduction, ignore_index,
                          label_smoothing, softcap, z_loss):
    # Gradients in the forward where the loss is a scalar: its grad only scales them.
    grads = reduction != "none" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, weight, bias))
    return _op_forward(input, weight, bias, target, items, reduction, ignore_index,
                       label_smoothing, softcap, z_loss, grads)[0]


def _setup_context(ctx, inputs, output):
    input, weight, bias, target, items, reduction, ignore_index, *options, grads = inputs
    ctx.reduction, ctx.has_bias, ctx.grads = reduction, bias is not None, grads
    # The gradient outputs are never differentiated: no zero tensors of their sizes (dW's is the
    # weight's) for their gradients in the backward.
    ctx.set_materialize_grads(False)
    ctx.args = (ignore_index, *options)
    # Eagerly the first backward scales the forward's gradients in place (no second dW, as large
    # as the weight): they are held outside the saved tensors, whose versions autograd checks,
    # and a later backward (retain_graph, gradcheck) recomputes from the saved inputs. Traced
    # (torch.compile, AOTAutograd: tensor subclasses) or as subclasses (DTensor) the gradients
    # are saved tensors, scaled out of place.
    ctx.in_place = grads and not torch.compiler.is_compiling() and all(
        type(g) is torch.Tensor for g in output[1:])
    ctx.grads_once = [g.detach() for g in output[1:]] if ctx.in_place else None
    if grads and not ctx.in_place:
        ctx.save_for_backward(*output[1:])
    else:
        ctx.save_for_backward(input, weight, bias, target, items)


def _backward(ctx, dloss, *_):
    none = (None,) * 8  # target, items and the options
    if dloss is None:  # no gradient reaches the loss (grads are not materialized)
        return (None,) * 3 + none
    if ctx.grads and (ctx.grads_once or not ctx.in_place):
        # computed in the forward for a scale of 1: times the loss's gradient
        dx, dw, db = ctx.grads_once or ctx.saved_tensors
        g = dloss.to(dx.dtype)
        if ctx.in_place:  # one vectorized pass over each (a 0-d CUDA operand of mul_ is not)
            ctx.grads_once = None
            torch._foreach_mul_([dx, dw, db], g)
            return (dx, dw, db if ctx.has_bias else None, *none)
        return (dx * g, dw * g, db * g if ctx.has_bias else None, *none)
    # the backward recomputes the logits, each row's gradient scaled by its share of dloss
    input, weight, bias, target, items = ctx.saved_tensors
    scale = dloss.reshape(-1).to(_loss_dtype(input))
    if ctx.reduction != "none":
        scale = scale * _scale(target, items, ctx.reduction, ctx.args[0], input)
    _, dx, dw, db = _pass(input, weight, bias, target, scale, *ctx.args)
    return (dx, dw, db if ctx.has_bias else None, *none)


_op_forward.register_autograd(_backward, setup_context=_setup_context)


def reference(input, linear_weight, target, *, linear_bias=None, reduction="mean",
              ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0,
              num_items_in_batch=None):
    """The unfused computation linear_cross_entropy replaces: the logits in full, then
    F.cross_entropy (in the logits' dtype, as PyTorch computes it; pass float64 tensors for the
    exact loss)."""
    z = F.linear(input, linear_weight, linear_bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1)
    rows = F.cross_entropy(z, t, reduction="none", ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(z, -1) ** 2 * (t != ignore_index)
    if reduction == "none":
        return rows.reshape(target.shape)
    if reduction == "sum":
        return rows.sum()
    count = (t != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    return rows.sum() / count


# Inductor keeps the op whole: decomposed, it would be the logits it exists to avoid.
DECOMPOSITIONS = {}


def _decomposed(input, weight, bias, target, items, reduction, ignore_index, label_smoothing,
                softcap, z_loss, grads):
    """The operator in aten ops, returning what it returns (csrc/loss/linear_cross_entropy.h's
    formulas on the whole N x V logits): what torch.onnx.export writes, and what fake-tensor
    tracing (AOTAutograd) reads from the same table."""
    acc = _loss_dtype(input)
    u = F.linear(input, weight, bias).to(acc)  # the logits in input's dtype, then acc
    z = softcap * torch.tanh(u / softcap) if softcap else u
    v = z.shape[-1]
    lse = torch.logsumexp(z, -1)
    kept = target != ignore_index
    t = torch.where(kept, target, 0)
    picked = z.gather(1, t[:, None])[:, 0]
    rows = (1 - label_smoothing) * (lse - picked) + label_smoothing * (lse - z.mean(-1))
    rows = torch.where(kept, rows + z_loss * lse ** 2, 0)
    scale = _scale(target, items, reduction, ignore_index, input)
    loss = rows if reduction == "none" else rows.sum() * scale[0]
    if not grads:
        empty = input.new_empty(0)
        return loss, empty, empty, empty
    dz = torch.softmax(z, -1) * (1 + 2 * z_loss * lse)[:, None] - label_smoothing / v
    dz = (dz - (1 - label_smoothing) * F.one_hot(t, v).to(acc)) * (kept * scale)[:, None]
    du = (dz * (1 - (z / softcap) ** 2) if softcap else dz).to(input.dtype)
    db = du.to(acc).sum(0).to(input.dtype) if bias is not None else input.new_empty(0)
    return loss, du @ weight, du.t() @ input, db


EXPORT_DECOMPOSITIONS = {"linear_cross_entropy": _decomposed}


def bench_case(shape, dtype: torch.dtype, device: torch.device, peers: bool = False):
    """At (tokens, hidden, vocab), targets fixed (1 in 7 ignored), weight ~ N(0, 1 / hidden):
    against the unfused head and loss as Hugging Face runs them (the logits in dtype, the loss
    on their float32 copy); "gemm": the logits' GEMM alone (with the backward: the three GEMMs,
    the floor); with `peers`, PyTorch's own F.linear_cross_entropy with its chunked options
    (torch 2.13 on), and on CUDA Liger-Kernel's fused linear cross-entropy and Apple's Cut
    Cross-Entropy where installed."""
    from ..bench.case import Case
    n, h, v = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h ** 0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    t = t.to(device)
    flops = 2 * n * h * v
    case = Case(lambda: linear_cross_entropy(x, w, t),
                lambda: F.cross_entropy(F.linear(x, w).float(), t), [x, w],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants={"gemm": lambda: x @ w.t()})
    if peers and hasattr(torch.nn, "LinearCrossEntropyOptions"):  # PyTorch's own, chunked
        options = torch.nn.LinearCrossEntropyOptions()
        case.variants["torch-lce"] = lambda: F.linear_cross_entropy(x, w, t, options=options)
    if peers and device.type == "cuda":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            liger = LigerFusedLinearCrossEntropyLoss()
            case.variants["liger"] = lambda: liger(w, x, t)
        except ImportError:
            pass
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
            case.variants["cce"] = lambda: cce(x, w, t)
        except ImportError:
            pass
    case.uncaptured = {"torch-lce", "liger", "cce"}
    return case
