"""fuse()'s rule for Hugging Face causal LMs: in training with labels, the LM head and the
model's loss run as one `linear_cross_entropy` and the logits are never made (the output's
`logits` is None, as Liger-Kernel's patched models return them).

Per model instance, nothing global: the model gets, on the instance, a forward that calls its
class's own forward (its decorators, its base model, its post-processing, every term it adds to
the loss after the cross-entropy, such as MoE routers' `router_aux_loss_coef * aux_loss`) while
its `lm_head` gets, on the instance, a forward that hands the hidden states over instead of
projecting them, and its `loss_function` computes Hugging Face's causal-LM loss (labels shifted
left, ignore_index -100, mean over the non-ignored labels or sum / `num_items_in_batch`, given
`shift_labels`) on those hidden states, with Gemma 2's `final_logit_softcapping`. In eval(),
without labels or without grad mode, the model runs as before. A model is fused only where a
probe batch gives the same loss both ways, with the router's logits on where the forward takes
`output_router_logits` (a model that scales its logits otherwise, say, is left and reported).
`del model.forward, model.lm_head.forward, model._loss_function` undoes it."""

import inspect
import types

import torch
from torch import nn

from .linear_cross_entropy import linear_cross_entropy

# |fused - model's| / max(1, |model's|) allowed on the probe: both losses are float32 from the
# logits in the model's dtype, which the fused op's GEMM may round differently in half precision.
_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 5e-3}


def fuse_causal_lm(model: nn.Module) -> tuple[bool, str | None]:
    """(fused, why not): gives `model` the fused forward if it is a Hugging Face causal LM whose
    loss the probe confirms; why is None for modules that are not causal LMs at all."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or config is None or \
            not type(model).__name__.endswith("ForCausalLM"):
        return False, None
    if "forward" in vars(model) or "forward" in vars(head) or "_loss_function" in vars(model):
        return False, "its forward, its lm_head's forward or its loss_function is already an " \
                      "instance's own"
    loss_fn = getattr(model, "loss_function", None)
    if getattr(loss_fn, "__name__", None) != "ForCausalLMLoss":
        return False, f"its loss is {getattr(loss_fn, '__name__', loss_fn)!r}, not Hugging " \
                      f"Face's ForCausalLMLoss"
    head.forward = types.MethodType(_head_forward, head)
    model.forward = types.MethodType(_fused_forward, model)
    model._loss_function = types.MethodType(_fused_loss, model)
    model._fusedlayers_softcap = getattr(config, "final_logit_softcapping", None)
    model._fusedlayers_loss = loss_fn
    why = _probe(model)
    if why is not None:
        del model.forward, head.forward, model._loss_function
        del model._fusedlayers_softcap, model._fusedlayers_loss
        return False, why
    return True, None


def _head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    captured = getattr(self, "_fusedlayers_hidden", None)
    if captured is None:
        return type(self).forward(self, hidden)
    captured.append(hidden)
    return hidden[..., :0]  # what the model's post-processing of the logits runs on


def _fused_forward(self, *args, labels=None, _fusedlayers_force=False, **kwargs):
    """The class's forward; in training with labels, with the LM head and loss fused."""
    cls_forward = type(self).forward
    if labels is None or not (_fusedlayers_force or (self.training and torch.is_grad_enabled())):
        return cls_forward(self, *args, labels=labels, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    head = self.lm_head
    head._fusedlayers_hidden = []
    try:
        out = cls_forward(self, *args, labels=labels, return_dict=True, **kwargs)
    finally:
        head._fusedlayers_hidden = None
    out = type(out)(**{k: v for k, v in out.items() if k != "logits"}, logits=None)
    return out if return_dict else out.to_tuple()


def _fused_loss(self, logits, labels, vocab_size=None, **kwargs):
    """The model's loss_function: in the fused forward, the causal-LM loss from the hidden states
    its lm_head handed over (logits is then their empty slice); else the model's own."""
    captured = getattr(self.lm_head, "_fusedlayers_hidden", None)
    if not captured:
        return self._fusedlayers_loss(logits, labels, vocab_size, **kwargs)
    hidden = captured.pop()
    return causal_lm_loss(hidden, self.lm_head.weight, labels, linear_bias=self.lm_head.bias,
                          softcap=self._fusedlayers_softcap, **kwargs)


def causal_lm_loss(hidden: torch.Tensor, linear_weight: torch.Tensor, labels: torch.Tensor, *,
                   linear_bias=None, softcap=None, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, **_) -> torch.Tensor:
    """Hugging Face's ForCausalLMLoss of `hidden @ linear_weight^T + linear_bias` without the
    logits: hidden (batch, seq, H) predicts labels (batch, seq) shifted left by one (or
    `shift_labels` as given); the mean over non-ignored labels, or their sum divided by
    num_items_in_batch (gradient accumulation). Returns a float32 loss, as Hugging Face's (which
    upcasts the logits) does for every model dtype: computed from the float32 row losses, never
    rounded through a half-precision dtype."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if hidden.shape[:-1] != shift_labels.shape:  # logits_to_keep kept the last positions only
        shift_labels = shift_labels[..., -hidden.shape[-2]:]
    return linear_cross_entropy(hidden, linear_weight, shift_labels, linear_bias=linear_bias,
                                ignore_index=ignore_index, softcap=softcap,
                                num_items_in_batch=num_items_in_batch, loss_dtype=torch.float32)


def takes_router_logits(model: nn.Module) -> bool:
    """Whether the model's forward takes output_router_logits (MoE LMs whose loss may add the
    router's load-balancing term)."""
    return "output_router_logits" in inspect.signature(type(model).forward).parameters


def _probe(model: nn.Module) -> str | None:
    """Why the fused loss differs from the model's own on a probe batch, or None. The probe
    turns on what the class adds to the loss (the router's load-balancing term where the forward
    takes output_router_logits) and divides by num_items_in_batch."""
    like = model.lm_head.weight
    if like.device.type == "meta":
        return "no parameters on a real device to probe it with"
    vocab = model.lm_head.out_features
    gen = torch.Generator(device=like.device).manual_seed(0)
    ids = torch.randint(0, vocab, (2, 6), generator=gen, device=like.device)
    kwargs = dict(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(7))
    if takes_router_logits(model):
        kwargs["output_router_logits"] = True
    was_training = model.training
    model.eval()  # no dropout: both passes see the same function
    try:
        with torch.no_grad():
            try:
                want = type(model).forward(model, **kwargs).loss
            except Exception:
                if "output_router_logits" not in kwargs:
                    raise
                # A class whose own forward fails with the router's term on (one that does not
                # hand the flag to its decoder: no router logits, an int aux_loss) is probed
                # without it, as it can then only be trained.
                del kwargs["output_router_logits"]
                want = type(model).forward(model, **kwargs).loss
            got = model(**kwargs, _fusedlayers_force=True).loss
    except Exception as e:  # a forward the capture does not fit: left as it is
        return f"the probe failed ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    tol = _TOLERANCE.get(like.dtype, 1e-5)  # float32, float64
    if want is None or not torch.isfinite(want) or \
            abs(float(got) - float(want)) > tol * max(1.0, abs(float(want))):
        return f"its loss differs from the fused one on a probe ({float(got):.6g} vs " \
               f"{float(want) if want is not None else None})"
    return None
