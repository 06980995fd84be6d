"""What the TensorFlow op modules share: the op library, loaded once when fusedlayers.tensorflow
is first imported (without it, importing still works and the first call raises
fusedlayers.NotBuiltError), argument conversion, the error type and gradient registration.

Every op has an XLA kernel (backends/tensorflow/xla_kernel.h): under jit_compile=True it compiles to a
custom call of the same kernels. Gradients are registered for the forward ops and call the backward ops, so they work
eagerly, in tf.function, under tf.GradientTape and in a reloaded SavedModel (importing the op's
module, which a reload needs anyway to load the op library, registers them).
"""

import ctypes

import numpy as np
import tensorflow as tf

from .. import _csrc_check
from ..errors import NotBuiltError
from . import _library

try:
    lib, _path = _library.load()
    # The same library through ctypes: its C symbols (csrc's checks and rules for static shapes)
    clib = ctypes.CDLL(str(_path))
    LOAD_ERROR = None
except NotBuiltError as e:  # importing must not fail; the first call does
    lib, clib, LOAD_ERROR = None, None, str(e)

FLOATS = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def invalid(message: str) -> tf.errors.InvalidArgumentError:
    return tf.errors.InvalidArgumentError(None, None, message)


def prepare(op: str, **tensors) -> list[tf.Tensor]:
    """Checks the op can run here and converts each argument to a floating tensor."""
    if lib is None:
        raise NotBuiltError(LOAD_ERROR)
    out = []
    for name, value in tensors.items():
        t = tf.convert_to_tensor(value)
        if t.dtype not in FLOATS:
            raise invalid(f"fusedlayers.{op}: {name} must be float32, float64, float16 or "
                          f"bfloat16, got {t.dtype.name}")
        out.append(t)
    return out


def float32_attr(op: str, name: str, value: float) -> float:
    """value for a float32 op attribute: TF would round a finite value past float32's range to
    inf, so csrc would not see what the caller passed; the rest is csrc's to check."""
    if not (0 <= value <= FLOAT32_MAX):  # NaN fails too
        raise invalid(f"fusedlayers.{op}: {name} must be finite and >= 0 as a float32 (the op "
                      f"attribute's type), got {value}")
    return value


def check(op: str, *arguments) -> None:
    """csrc's argument checks of op for static shapes, dtypes and attributes (the library's
    fusedlayers_xla_<op>_check, as JAX's ops call it), for ops whose TF matmuls would otherwise
    meet a bad argument first; raises InvalidArgumentError with csrc's message. Sizes unknown
    while tracing are checked by the op when it runs."""
    if not _csrc_check.static(*arguments):
        return
    kind, message = _csrc_check.run(clib, op, lambda d: FLOATS.index(d), *arguments)
    if kind:
        raise invalid(message)


def stat_dtype(x: tf.Tensor) -> tf.DType:
    """The norms' statistics dtype for x (csrc/norm/norm.h), the ops' attribute U."""
    return tf.float64 if x.dtype == tf.float64 else tf.float32


def trailing_shape(op: str, x: tf.Tensor, k: int) -> list:
    """The static sizes of x's last k dims, as normalized_shape (Keras layers know them)."""
    dims = x.shape[x.shape.rank - k:] if x.shape.rank is not None and x.shape.rank >= k else None
    if dims is None or any(d is None for d in dims):
        raise invalid(f"fusedlayers.{op}: the last {k} dimension(s) of x must have static sizes, "
                      f"got x of shape {x.shape}")
    return [int(d) for d in dims]


def random(shape, dtype: tf.DType, seed: int = 0, scale: float = 1.0) -> tf.Tensor:
    """Normal random values of `shape` and standard deviation `scale`, rounded to dtype (the
    bench's inputs)."""
    values = scale * np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return tf.constant(values, dtype=dtype)


def register_gradient(op_type: str):
    """tf.RegisterGradient(op_type), tolerating a second registration (a module reloaded)."""
    def register(fn):
        try:
            tf.RegisterGradient(op_type)(fn)
        except KeyError:  # already registered in this process
            pass
        return fn
    return register


def or_zeros(grad, like):
    """An output's gradient as TF hands it to a gradient function: None where the output was
    not used, zeros of its shape here."""
    return tf.zeros_like(like) if grad is None else grad


def or_absent(grad, like):
    """dh for the add+norm gradient ops: an empty stand-in (has_dh False) where h was unused."""
    return tf.zeros([0], like.dtype) if grad is None else grad


def dresidual(dx, dresidual, h):
    """The residual's gradient from the add+norm gradient ops: dx where h has dx's dtype (the
    op's dresidual output is then empty), else that output."""
    return dx if h.dtype == dx.dtype else dresidual


def add_norm_work(x) -> dict:
    """The fewest bytes an add+norm moves (as fusedlayers.torch._op.add_norm_work)."""
    n = x.shape.num_elements() * x.dtype.size
    return {"fwd": 4 * n, "fwd+bwd": 8 * n}
