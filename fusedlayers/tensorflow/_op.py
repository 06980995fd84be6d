"""What the TensorFlow op modules share: the op library, loaded once when fusedlayers.tensorflow
is first imported (without it, importing still works and the first call raises
fusedlayers.NotBuiltError), argument conversion, the error type and gradient registration.

The ops have no XLA kernels: calling one while XLA compiles the graph (jit_compile=True) raises a
clear error. Gradients are registered for the forward ops and call the backward ops, so they work
eagerly, in tf.function, under tf.GradientTape and in a reloaded SavedModel (importing the op's
module, which a reload needs anyway to load the op library, registers them).
"""

import numpy as np
import tensorflow as tf

from .._sources import NotBuiltError
from . import _library

try:
    lib = _library.load()
    LOAD_ERROR = None
except NotBuiltError as e:  # importing must not fail; the first call does
    lib, LOAD_ERROR = None, str(e)

FLOATS = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def invalid(message: str) -> tf.errors.InvalidArgumentError:
    return tf.errors.InvalidArgumentError(None, None, message)


def prepare(op: str, **tensors) -> list[tf.Tensor]:
    """Checks the op can run here and converts each argument to a floating tensor."""
    if lib is None:
        raise NotBuiltError(LOAD_ERROR)
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "_xla_compile", False) or _in_xla_context(graph):
        raise invalid(f"fusedlayers.{op} has no XLA kernel and cannot run under "
                      f"jit_compile=True; compile this function or model with "
                      f"jit_compile=False (fusedlayers' Keras layers set supports_jit=False).")
    out = []
    for name, value in tensors.items():
        t = tf.convert_to_tensor(value)
        if t.dtype not in FLOATS:
            raise invalid(f"fusedlayers.{op}: {name} must be float32, float64, float16 or "
                          f"bfloat16, got {t.dtype.name}")
        out.append(t)
    return out


def _in_xla_context(graph) -> bool:
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def register_gradient(op_type: str):
    """tf.RegisterGradient(op_type), tolerating a second registration (a module reloaded)."""
    def register(fn):
        try:
            tf.RegisterGradient(op_type)(fn)
        except KeyError:  # already registered in this process
            pass
        return fn
    return register
