"""The TensorFlow cases of `python -m fusedlayers bench` on the CPU: each op of
fusedlayers.tensorflow against the unfused TensorFlow / Keras ops a Keras model would run instead
(tf.nn.relu times alpha, keras.ops.layer_normalization and rms_normalization, a Dense layer's
matmul + bias + tf.nn.gelu), on the torch cases' shapes. Both run inside tf.function, as Keras'
fit runs them; forward and forward + backward (a GradientTape over every input)."""

import numpy as np
import tensorflow as tf
from keras import ops as keras_ops

from . import tensorflow as fused


def _fwd_bwd(fn, inputs):
    """fn and its gradients with respect to every input, for a fixed random output gradient."""
    grad = tf.random.normal(fn(*inputs).shape, dtype=inputs[0].dtype)

    def run(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = fn(*args)
        return tape.gradient(y, args, output_gradients=grad)
    return run


def cases(shapes: dict, dtype_name: str):
    """(op, shape, work, element size, {impl: {pass: fn}}) for the ops of `shapes` (op -> list of
    shapes, as bench.shapes gives them); work is the bytes of x, or linear_gelu's GEMM flops."""
    dtype = getattr(tf, dtype_name)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return tf.constant(rng.standard_normal(shape, dtype=np.float32), dtype=dtype)

    def variants(fused_fn, unfused_fn, inputs):
        out = {}
        for impl, fn in (("tf-fused", fused_fn), ("tf-eager", unfused_fn)):
            # No Python control flow to convert: AutoGraph would only warn that it cannot
            # parse two lambdas on one line.
            fwd = tf.function(fn, autograph=False)
            fwd_bwd = tf.function(_fwd_bwd(fn, inputs), autograph=False)
            out[impl] = {"fwd": lambda f=fwd: f(*inputs), "fwd+bwd": lambda f=fwd_bwd: f(*inputs)}
        return out

    for rows, cols in shapes.get("relu_scale", []):
        x = rand(rows, cols)
        yield ("relu_scale", f"{rows}x{cols}", x.shape.num_elements() * x.dtype.size, x.dtype.size,
               variants(lambda x: fused.relu_scale(x, 0.5), lambda x: tf.nn.relu(x) * 0.5, [x]))
    for rows, cols in shapes.get("layer_norm", []):
        x, w, b = rand(rows, cols), rand(cols), rand(cols)
        yield ("layer_norm", f"{rows}x{cols}", x.shape.num_elements() * x.dtype.size, x.dtype.size,
               variants(lambda x, w, b: fused.layer_norm(x, cols, w, b),
                        lambda x, w, b: keras_ops.layer_normalization(x, w, b, epsilon=1e-5),
                        [x, w, b]))
    for rows, cols in shapes.get("rms_norm", []):
        x, w = rand(rows, cols), rand(cols)
        yield ("rms_norm", f"{rows}x{cols}", x.shape.num_elements() * x.dtype.size, x.dtype.size,
               variants(lambda x, w: fused.rms_norm(x, cols, w, 1e-6),
                        lambda x, w: keras_ops.rms_normalization(x, w, epsilon=1e-6), [x, w]))
    for m, k, n in shapes.get("linear_gelu", []):
        x, kernel, b = rand(m, k), rand(k, n), rand(n)  # Dense's (in, out) kernel
        yield ("linear_gelu", f"({m}x{k})x({k}x{n})", 2 * m * n * k, x.dtype.size,
               variants(lambda x, kernel, b: fused.dense_gelu(x, kernel, b),
                        lambda x, kernel, b: tf.nn.gelu(tf.matmul(x, kernel) + b,
                                                        approximate=False),
                        [x, kernel, b]))
