"""LinearCrossEntropy for Flax NNX: a language model's output projection and its cross-entropy
as one op (fusedlayers.jax.linear_cross_entropy), never materializing the (..., vocab) logits.
Flax has no such module; optax's softmax_cross_entropy_with_integer_labels takes the logits."""

import jax.numpy as jnp
from flax import nnx

from .. import _args
from ..jax import linear_cross_entropy

__all__ = ["LinearCrossEntropy"]


class LinearCrossEntropy(nnx.Module):
    """`__call__(x, target, num_items_in_batch=None)`: the cross-entropy of
    `softcap(x @ kernel^T + bias)` against integer `target`, without the logits.

    x (..., in_features); target integer (...); kernel (vocab_size, in_features) (nnx.Embed's
    embedding layout: a tied head passes `embedding=` that module's Param instead of owning one),
    bias (vocab_size,) with use_bias. dtype: the computation's (default: x's); param_dtype the
    parameters'. reduction, ignore_index, label_smoothing, softcap (Gemma 2) and z_loss (PaLM) as
    fusedlayers.jax.linear_cross_entropy. Returns a scalar ('mean', 'sum') or target's shape
    ('none') in float32 (float64 for a float64 computation), computed from its float32 value and
    never rounded through a half-precision computation dtype (as optax's losses on upcast
    logits). Raises ValueError for a non-positive size or a bad reduction, and what
    fusedlayers.jax.linear_cross_entropy raises (while tracing)."""

    def __init__(self, in_features: int, vocab_size: int, *, use_bias: bool = False,
                 reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, softcap: float | None = None,
                 z_loss: float = 0.0, dtype=None, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), embedding: nnx.Param | None = None,
                 rngs: nnx.Rngs):
        _args.loss_layer("LinearCrossEntropy", reduction, in_features=in_features,
                         vocab_size=vocab_size)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.label_smoothing, self.softcap, self.z_loss = label_smoothing, softcap, z_loss
        self.dtype = dtype
        self.kernel = embedding if embedding is not None else nnx.Param(
            kernel_init(rngs.params(), (vocab_size, in_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((vocab_size,), param_dtype)) if use_bias else None

    def __call__(self, x, target, num_items_in_batch=None):
        dtype = self.dtype or x.dtype
        return linear_cross_entropy(
            x.astype(dtype), self.kernel[...].astype(dtype), target,
            linear_bias=None if self.bias is None else self.bias[...].astype(dtype),
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, softcap=self.softcap, z_loss=self.z_loss,
            num_items_in_batch=num_items_in_batch,
            loss_dtype=jnp.promote_types(dtype, jnp.float32))
