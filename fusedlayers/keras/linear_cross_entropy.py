"""LinearCrossEntropy for Keras 3: a language model's output projection and its cross-entropy as
one op (fusedlayers.linear_cross_entropy of Keras' backend), never materializing the
(..., vocab) logits; its loss joins the model's losses, so `fit` trains on it."""

import keras
from keras import ops

from .. import _args
from ._layer import FusedLayer, framework

__all__ = ["LinearCrossEntropy"]


@keras.saving.register_keras_serializable(package="fusedlayers")
class LinearCrossEntropy(FusedLayer):
    """`call(inputs, target, num_items_in_batch=None)`: the cross-entropy of
    `softcap(inputs @ kernel^T + bias)` against integer `target`, without the logits.

    inputs (..., hidden) in the layer's compute dtype; target integer (...); kernel
    (vocab_size, hidden): the layout of a Keras `Embedding`'s embeddings, so a tied head passes
    that matrix's values (`tied_embedding`) instead of owning one. reduction 'mean' (over
    targets other than ignore_index, or over num_items_in_batch when given), 'sum' or 'none'
    (per target, 0 where ignored); label_smoothing, softcap (Gemma 2) and z_loss (PaLM) as
    fusedlayers.torch.linear_cross_entropy. Returns the loss in float32 (float64 for a float64
    compute dtype), computed from its float32 value, as Keras' own losses are under mixed
    precision: never rounded through a half-precision compute dtype; a 'mean' or
    'sum' loss is also added to the layer's losses (`add_loss`), so a model whose output it is
    trains with `compile(optimizer)` and `fit` and no loss argument. Raises ValueError for a
    non-positive vocab_size or a bad reduction, and what the backend's op raises for shapes and
    dtypes.
    """

    def __init__(self, vocab_size: int, use_bias: bool = False, reduction: str = "mean",
                 ignore_index: int = -100, label_smoothing: float = 0.0,
                 softcap: float | None = None, z_loss: float = 0.0,
                 tied_embedding: keras.layers.Embedding | None = None,
                 kernel_initializer="glorot_uniform", **kwargs):
        _args.loss_layer("LinearCrossEntropy", reduction, vocab_size=vocab_size)
        super().__init__(**kwargs)
        self.vocab_size, self.use_bias, self.reduction = vocab_size, use_bias, reduction
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.softcap, self.z_loss = softcap, z_loss
        self.tied_embedding = tied_embedding
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel = self.bias = None

    def build(self, inputs_shape, target_shape=None):
        if self.tied_embedding is None:
            self.kernel = self.add_weight(name="kernel", shape=(self.vocab_size, inputs_shape[-1]),
                                          initializer=self.kernel_initializer)
        if self.use_bias:
            self.bias = self.add_weight(name="bias", shape=(self.vocab_size,),
                                        initializer="zeros")

    def call(self, inputs, target, num_items_in_batch=None):
        dtype = self.compute_dtype
        kernel = self.kernel if self.tied_embedding is None else self.tied_embedding.embeddings
        loss = framework("LinearCrossEntropy").linear_cross_entropy(
            ops.cast(inputs, dtype), ops.cast(kernel, dtype), target,
            linear_bias=None if self.bias is None else ops.cast(self.bias, dtype),
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, softcap=self.softcap, z_loss=self.z_loss,
            num_items_in_batch=num_items_in_batch, loss_dtype=self._loss_dtype())
        if self.reduction != "none":
            self.add_loss(loss)
        return loss

    def _loss_dtype(self) -> str:
        return "float64" if self.compute_dtype == "float64" else "float32"

    def compute_output_spec(self, inputs, target, num_items_in_batch=None):
        shape = tuple(target.shape) if self.reduction == "none" else ()
        return keras.KerasTensor(shape, dtype=self._loss_dtype())

    def get_config(self):
        if self.tied_embedding is not None:
            raise NotImplementedError("LinearCrossEntropy: a layer tied to an Embedding is saved "
                                      "with its model's code, not from its config")
        return {**super().get_config(), "vocab_size": self.vocab_size, "use_bias": self.use_bias,
                "reduction": self.reduction, "ignore_index": self.ignore_index,
                "label_smoothing": self.label_smoothing, "softcap": self.softcap,
                "z_loss": self.z_loss,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}
