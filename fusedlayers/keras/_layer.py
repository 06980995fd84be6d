"""What the Keras layers share (one module per op, fusedlayers/keras/<op>.py): their base class,
the fusedlayers package of Keras' backend, and normalization over any axes. The same layer runs
on the TensorFlow op library under the TensorFlow backend and on the torch extension under
KERAS_BACKEND=torch: the layers call the public functions of the fusedlayers package of Keras'
backend."""

import importlib

import keras
from keras import ops

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
