"""Keras 3 layers for the fused ops, drop-in for the layers they replace: same constructor
arguments, defaults, weight names and shapes, config and serialisation. The same layer runs on
the TensorFlow op library under the TensorFlow backend and on the torch extension under
KERAS_BACKEND=torch: the layers call the public functions of the fusedlayers package of Keras'
backend."""

import importlib

import keras
from keras import constraints, initializers, ops, regularizers

from fusedlayers import _args

_FRAMEWORKS = {"tensorflow": "fusedlayers.tensorflow", "torch": "fusedlayers.torch"}


def framework(layer: str):
    """The fusedlayers package (fusedlayers.tensorflow or fusedlayers.torch) of Keras' backend;
    TypeError naming `layer` on another backend."""
    backend = keras.backend.backend()
    if backend not in _FRAMEWORKS:
        raise TypeError(f"fusedlayers.keras.{layer}: Keras' {backend!r} backend has no fusedlayers "
                        f"kernels; use KERAS_BACKEND=tensorflow or torch")
    return importlib.import_module(_FRAMEWORKS[backend])


def on_trailing_axes(inputs, axis, norm):
    """norm(x, norm_shape, param_dtype) over the axes `axis` of inputs, which the kernels take as
    x's trailing dims: other axes are moved there and back. param_dtype: float32 for half inputs
    (the kernels compute in float32 either way), else x's dtype."""
    ndim = len(inputs.shape)
    axes = sorted(a % ndim for a in axis)
    perm = [d for d in range(ndim) if d not in axes] + axes
    trailing = perm == list(range(ndim))
    x = inputs if trailing else ops.transpose(inputs, perm)
    half = keras.backend.standardize_dtype(x.dtype) in ("float16", "bfloat16")
    y = norm(x, [inputs.shape[a] for a in axes], "float32" if half else x.dtype)
    return y if trailing else ops.transpose(y, [perm.index(d) for d in range(ndim)])


class _FusedLayer(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # The ops have no XLA kernels; Keras' jit_compile='auto' must not pick XLA.
        self.supports_jit = False


@keras.saving.register_keras_serializable(package="fusedlayers")
class FusedReLUScale(_FusedLayer):
    """y = max(x, 0) * alpha in one pass; replaces `Activation('relu')` followed by a scale.

    Input: any shape, floating; output: same shape, the layer's compute dtype.
    """

    def __init__(self, alpha: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.alpha = _args.real("FusedReLUScale", "alpha", alpha)

    def call(self, inputs):
        return framework("FusedReLUScale").relu_scale(inputs, self.alpha)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "alpha": self.alpha}


@keras.saving.register_keras_serializable(package="fusedlayers")
class FusedLinearGELU(_FusedLayer):
    """gelu(x @ kernel + bias); replaces `Dense(units, activation='gelu')` (approximate=False,
    erf GELU) or its tanh form (approximate=True), with Dense's `kernel` (in, units) and `bias`.

    Input (..., in_features) -> output (..., units). Under a mixed policy the kernel stays in
    the variable dtype and computes in the compute dtype, as Dense does.
    """

    def __init__(self, units: int, use_bias: bool = True, approximate: bool = False,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        if not isinstance(units, int) or units <= 0:
            raise ValueError(f"FusedLinearGELU: units must be a positive integer, got {units!r}")
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units, self.use_bias, self.approximate = units, use_bias, bool(approximate)
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

    def call(self, inputs):
        kernel = ops.cast(self.kernel, self.compute_dtype)
        bias = ops.cast(self.bias, self.compute_dtype) if self.bias is not None else None
        return framework("FusedLinearGELU").dense_gelu(
            inputs, kernel, bias, "tanh" if self.approximate else "none")

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "use_bias": self.use_bias,
            "approximate": self.approximate,
            "kernel_initializer": initializers.serialize(self.kernel_initializer),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
        }


@keras.saving.register_keras_serializable(package="fusedlayers")
class LayerNorm(_FusedLayer):
    """Layer normalization over `axis`; replaces `keras.layers.LayerNormalization` with the same
    arguments, `gamma`/`beta` weights (autocast off) and outputs, for trailing and non-trailing
    axes. Computes in float32 at least and returns the compute dtype, as Keras does.
    rms_scaling=True reproduces Keras' (deprecated) variant: x * rsqrt(var(x) + epsilon) * gamma.
    Ba et al. 2016, arXiv:1607.06450.
    """

    def __init__(self, axis=-1, epsilon: float = 1e-3, center: bool = True, scale: bool = True,
                 rms_scaling: bool = False, beta_initializer="zeros", gamma_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, **kwargs):
        super().__init__(**kwargs)
        if isinstance(axis, (list, tuple)):
            self.axis = list(axis)
        elif isinstance(axis, int):
            self.axis = axis
        else:
            raise TypeError(f"LayerNorm: axis must be an int or a list/tuple of ints, "
                            f"got {axis!r}")
        self.epsilon, self.center, self.scale = epsilon, center, scale
        self.rms_scaling = rms_scaling
        self.beta_initializer = initializers.get(beta_initializer)
        self.gamma_initializer = initializers.get(gamma_initializer)
        self.beta_regularizer = regularizers.get(beta_regularizer)
        self.gamma_regularizer = regularizers.get(gamma_regularizer)
        self.beta_constraint = constraints.get(beta_constraint)
        self.gamma_constraint = constraints.get(gamma_constraint)
        self.supports_masking = True
        self.autocast = False

    def build(self, input_shape):
        self.axis = sorted(self.axis) if isinstance(self.axis, list) else [self.axis]
        shape = tuple(input_shape[dim] for dim in self.axis)
        self.gamma = (self.add_weight(
            name="gamma", shape=shape, initializer=self.gamma_initializer,
            regularizer=self.gamma_regularizer, constraint=self.gamma_constraint,
            autocast=False) if self.scale or self.rms_scaling else None)
        self.beta = (self.add_weight(
            name="beta", shape=shape, initializer=self.beta_initializer,
            regularizer=self.beta_regularizer, constraint=self.beta_constraint,
            autocast=False) if self.center and not self.rms_scaling else None)

    def call(self, inputs):
        def norm(x, norm_shape, param_dtype):
            gamma = ops.cast(self.gamma, param_dtype) if self.gamma is not None else None
            beta = ops.cast(self.beta, param_dtype) if self.beta is not None else None
            # gamma/beta dims follow self.axis as Keras sorted it (negatives first, e.g.
            # [-1, 1]); Keras reshapes (not transposes) them onto the normalized dims: so do we.
            gamma = ops.reshape(gamma, norm_shape) if gamma is not None else None
            beta = ops.reshape(beta, norm_shape) if beta is not None else None
            return framework("LayerNorm").layer_norm_trailing(
                x, len(norm_shape), gamma, beta, self.epsilon, rms_scaling=self.rms_scaling)

        return ops.cast(on_trailing_axes(inputs, self.axis, norm), self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "axis": self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "rms_scaling": self.rms_scaling,
            "beta_initializer": initializers.serialize(self.beta_initializer),
            "gamma_initializer": initializers.serialize(self.gamma_initializer),
            "beta_regularizer": regularizers.serialize(self.beta_regularizer),
            "gamma_regularizer": regularizers.serialize(self.gamma_regularizer),
            "beta_constraint": constraints.serialize(self.beta_constraint),
            "gamma_constraint": constraints.serialize(self.gamma_constraint),
        }
