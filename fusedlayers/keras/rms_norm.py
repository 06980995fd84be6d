"""RMSNorm for Keras 3, drop-in for `keras.layers.RMSNormalization`: same arguments, defaults,
weight (`scale`, ones, of the normalized dims), config; on the TensorFlow or the torch backend."""

import keras
from keras import ops

import fusedlayers
from fusedlayers import _args


@keras.saving.register_keras_serializable(package="fusedlayers")
class RMSNorm(keras.layers.Layer):
    """y = x / sqrt(mean(x^2) + epsilon) * scale over `axis` (an int or a list of ints);
    zero_centered=True (not in Keras) applies the gain as 1 + scale, initialised to zeros, as
    Gemma's. Input: any shape with the axes known; output: same shape, the compute dtype."""

    def __init__(self, axis=-1, epsilon: float = 1e-6, zero_centered: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.axis = axis
        self.epsilon = _args.real("RMSNorm", "epsilon", epsilon)
        self.zero_centered = bool(zero_centered)
        self.supports_jit = False  # no XLA kernel: Keras' jit_compile='auto' must not pick XLA

    def build(self, input_shape):
        if isinstance(self.axis, (list, tuple)):
            self.axis = sorted(self.axis)
        else:
            self.axis = [self.axis]
        shape = tuple(input_shape[a] for a in self.axis)
        self.scale = self.add_weight(name="scale", shape=shape,
                                     initializer="zeros" if self.zero_centered else "ones")

    def call(self, inputs):
        ndim = len(inputs.shape)
        axes = sorted(a % ndim for a in self.axis)
        # The kernel normalizes trailing dims: move the other axes there and back.
        perm = [d for d in range(ndim) if d not in axes] + axes
        trailing = perm == list(range(ndim))
        x = inputs if trailing else ops.transpose(inputs, perm)
        half = keras.backend.standardize_dtype(x.dtype) in ("float16", "bfloat16")
        norm_shape = [inputs.shape[a] for a in axes]
        scale = ops.reshape(ops.cast(self.scale, "float32" if half else x.dtype), norm_shape)
        y = fusedlayers.rms_norm(x, norm_shape, scale, self.epsilon,
                                 zero_centered=self.zero_centered)
        if not trailing:
            y = ops.transpose(y, [perm.index(d) for d in range(ndim)])
        return ops.cast(y, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "axis": self.axis, "epsilon": self.epsilon,
                "zero_centered": self.zero_centered}
