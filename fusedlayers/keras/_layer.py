"""What the Keras layers share (one module per op, fusedlayers/keras/<op>.py): their base class,
the fusedlayers package of Keras' backend, and normalization over any axes. The same layer runs
on the TensorFlow op library under the TensorFlow backend and on the torch extension under
KERAS_BACKEND=torch: the layers call the public functions of the fusedlayers package of Keras'
backend."""

import importlib

import keras
from keras import constraints, initializers, ops, regularizers

_FRAMEWORKS = {"tensorflow": "fusedlayers.tensorflow", "torch": "fusedlayers.torch",
               "jax": "fusedlayers.jax"}


def framework(layer: str):
    """The fusedlayers package (fusedlayers.tensorflow, fusedlayers.torch or fusedlayers.jax) of
    Keras' backend; TypeError naming `layer` on another backend."""
    backend = keras.backend.backend()
    if backend not in _FRAMEWORKS:
        raise TypeError(f"fusedlayers.keras.{layer}: Keras' {backend!r} backend has no fusedlayers "
                        f"kernels; use KERAS_BACKEND=tensorflow, torch or jax")
    return importlib.import_module(_FRAMEWORKS[backend])


def on_trailing_axes(inputs, axis, norm):
    """norm(x, norm_shape) over the axes `axis` of inputs, which the kernels take as x's trailing
    dims: other axes are moved there and back."""
    ndim = len(inputs.shape)
    axes = sorted(a % ndim for a in axis)
    perm = [d for d in range(ndim) if d not in axes] + axes
    trailing = perm == list(range(ndim))
    x = inputs if trailing else ops.transpose(inputs, perm)
    y = norm(x, [inputs.shape[a] for a in axes])
    return y if trailing else ops.transpose(y, [perm.index(d) for d in range(ndim)])


def normalization_axis(axis, layer: str):
    """Keras' `axis` argument of a normalization layer: an int, or a list of ints."""
    if isinstance(axis, (list, tuple)):
        return list(axis)
    if isinstance(axis, int):
        return axis
    raise TypeError(f"{layer}: axis must be an int or a list/tuple of ints, got {axis!r}")


class FusedLayer(keras.layers.Layer):
    """The base of fusedlayers' Keras layers. `fuse_replaces`: the Keras layer class that
    fusedlayers.keras.fuse swaps for this one (same config keys and weights, in order), if any.
    The ops compile under XLA on every backend (TF's XLA kernels, JAX's custom calls,
    torch.compile's custom ops), so the layers keep Keras' default supports_jit."""

    fuse_replaces = None

    def compute_output_shape(self, input_shape):
        return input_shape




class DenseWeights(FusedLayer):
    """A layer with Dense's weights: `kernel` (in, units) and `bias`, with Dense's arguments for
    them (units, use_bias, their initializers, regularizers and constraints), defaults and config
    keys. Input (..., in_features) -> output (..., units)."""

    def __init__(self, units: int, use_bias: bool = True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, kernel_constraint=None, bias_constraint=None,
                 **kwargs):
        if not isinstance(units, int) or units <= 0:
            raise ValueError(f"{type(self).__name__}: units must be a positive integer, got "
                             f"{units!r}")
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units, self.use_bias = units, use_bias
        self.kernel_initializer = initializers.get(kernel_initializer)
        self.bias_initializer = initializers.get(bias_initializer)
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.input_spec = keras.layers.InputSpec(min_ndim=2)
        self.supports_masking = True  # as Dense: the mask passes through unchanged

    def build(self, input_shape):
        in_features = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel", shape=(in_features, self.units), initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, constraint=self.kernel_constraint)
        self.bias = (self.add_weight(
            name="bias", shape=(self.units,), initializer=self.bias_initializer,
            regularizer=self.bias_regularizer, constraint=self.bias_constraint)
            if self.use_bias else None)
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: in_features})

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "use_bias": self.use_bias,
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
        }


def add_on_trailing_axes(x, residual, axis, add_norm):
    """add_norm(x, residual, norm_shape) -> (y, h) over the axes `axis`, moved to the trailing
    dims and back as on_trailing_axes; residual in the dtype x + residual promotes to."""
    residual = ops.cast(residual, keras.backend.result_type(x.dtype, residual.dtype))
    ndim = len(x.shape)
    axes = sorted(a % ndim for a in axis)
    perm = [d for d in range(ndim) if d not in axes] + axes
    if perm == list(range(ndim)):
        return add_norm(x, residual, [x.shape[a] for a in axes])
    inverse = [perm.index(d) for d in range(ndim)]
    y, h = add_norm(ops.transpose(x, perm), ops.transpose(residual, perm),
                    [x.shape[a] for a in axes])
    return ops.transpose(y, inverse), ops.transpose(h, inverse)
