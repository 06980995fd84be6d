"""The TensorFlow cases of `python -m fusedlayers bench` on the CPU: each op of
fusedlayers.tensorflow against the unfused TensorFlow / Keras ops a Keras model would run
instead, as each op's TensorFlow module builds them (`bench_case`), on the torch cases' shapes.
Both run inside tf.function, as Keras' fit runs them; forward and forward + backward (a
GradientTape over every input). Their floors are TensorFlow's own: for the memory-bound ops a
copy of x ("tf-copy", forward), for linear_gelu the bare tf.matmul ("tf-gemm")."""

import tensorflow as tf

from .. import ops


def _fwd_bwd(fn, inputs):
    """fn and its gradients with respect to every input, for a fixed random output gradient."""
    out = fn(*inputs)  # rope has two outputs: a gradient for each
    grad = tf.nest.map_structure(lambda y: tf.random.normal(y.shape, dtype=y.dtype), out)

    def run(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = fn(*args)
        return tape.gradient(y, args, output_gradients=grad)
    return run


def case(op: ops.Op, shape, dtype_name: str) -> tuple[dict, dict]:
    """(work by pass, {impl: {pass: fn}}) of op at shape: "tf-fused", "tf-eager", the case's
    variants ("tf-gemm") and, forward only, "tf-copy"."""
    c = ops.module(op, "tensorflow").bench_case(shape, getattr(tf, dtype_name))
    fwd_only = {}
    if op.bench_unit == "GB/s":  # TF names a graph's inputs after the arguments: no `*_`
        fwd_only["copy"] = lambda x, *params: tf.raw_ops.DeepCopy(x=x)
    impls = {}
    for impl, fn in (("fused", c.fused), ("eager", c.eager), *c.variants.items(),
                     *fwd_only.items()):
        # No Python control flow to convert: AutoGraph would only warn that it cannot parse
        # two lambdas on one line.
        fwd = tf.function(fn, autograph=False)
        impls["tf-" + impl] = {"fwd": lambda f=fwd: f(*c.inputs)}
        if impl not in fwd_only:
            fwd_bwd = tf.function(_fwd_bwd(fn, c.inputs), autograph=False)
            impls["tf-" + impl]["fwd+bwd"] = lambda f=fwd_bwd: f(*c.inputs)
    return c.work, impls
