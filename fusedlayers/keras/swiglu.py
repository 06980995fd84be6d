"""GatedMLP for Keras 3: a Llama-style feed-forward block, down(act(gate(x)) * up(x)), with
act(gate) * up as one fused op (fusedlayers.swiglu or fusedlayers.geglu) on every backend, and
its projections in FP8 (Fp8Dense) when given a recipe."""

import dataclasses
import functools

import keras

from ..fp8_recipe import Fp8Recipe
from ._layer import FusedLayer, framework
from .fp8_dense import Fp8Dense

__all__ = ["GatedMLP"]

_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@keras.saving.register_keras_serializable(package="fusedlayers")
class GatedMLP(FusedLayer):
    """down(act(gate(x)) * up(x)) with three `Dense` sublayers, `gate_proj` and `up_proj`
    (in, hidden_dim) and `down_proj` (hidden_dim, in), as Llama's MLP (activation='silu',
    SwiGLU) or Gemma's ('gelu_tanh', GeGLU; 'gelu' the erf form). Shazeer 2020, "GLU Variants
    Improve Transformer", arXiv:2002.05202.

    Input (..., in_features) -> output of the same shape; the Dense layers follow the layer's
    dtype policy. recipe (a fusedlayers.Fp8Recipe or its fields as a dict): the three
    projections as Fp8Dense with that recipe (the same weights and names; their GEMMs in FP8).
    Raises ValueError for a non-positive hidden_dim or another activation.
    """

    def __init__(self, hidden_dim: int, activation: str = "silu", use_bias: bool = False,
                 kernel_initializer="glorot_uniform", recipe=None, **kwargs):
        if not isinstance(hidden_dim, int) or hidden_dim <= 0:
            raise ValueError(f"GatedMLP: hidden_dim must be a positive integer, got "
                             f"{hidden_dim!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"GatedMLP: activation must be one of {', '.join(_ACTIVATIONS)}, "
                             f"got {activation!r}")
        super().__init__(**kwargs)
        self.hidden_dim, self.activation, self.use_bias = hidden_dim, activation, use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.recipe = Fp8Recipe(**recipe) if isinstance(recipe, dict) else recipe
        dense = dict(use_bias=use_bias, kernel_initializer=self.kernel_initializer,
                     dtype=self.dtype_policy)
        self._dense = keras.layers.Dense if recipe is None else functools.partial(
            Fp8Dense, recipe=self.recipe)
        self.gate_proj = self._dense(hidden_dim, name="gate_proj", **dense)
        self.up_proj = self._dense(hidden_dim, name="up_proj", **dense)
        self.down_proj = None  # built with the input's width
        self._dense_args = dense

    def build(self, input_shape):
        self.gate_proj.build(input_shape)
        self.up_proj.build(input_shape)
        self.down_proj = self._dense(input_shape[-1], name="down_proj", **self._dense_args)
        self.down_proj.build((*input_shape[:-1], self.hidden_dim))

    def call(self, inputs):
        fl = framework("GatedMLP")
        gate, up = self.gate_proj(inputs), self.up_proj(inputs)
        if self.activation == "silu":
            h = fl.swiglu(gate, up)
        else:
            h = fl.geglu(gate, up, "tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(h)

    def get_config(self):
        return {**super().get_config(), "hidden_dim": self.hidden_dim,
                "activation": self.activation, "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "recipe": None if self.recipe is None else dataclasses.asdict(self.recipe)}
