"""Linear + cross-entropy on TensorFlow tensors without the logits: a chunk loop
(tf.while_loop) whose steps are TF's matmuls and the op FusedlayersLinearCrossEntropyChunk
(backends/tensorflow/linear_cross_entropy.cc: csrc's row pass), under tf.custom_gradient. Same
contract as fusedlayers.torch.linear_cross_entropy; csrc/loss/linear_cross_entropy.h has the math,
the chunk rule and the checks. Runs eagerly, in tf.function (a batch size unknown while tracing
included) and under XLA (jit_compile=True: the chunk op's XLA kernel is JAX's custom call)."""

import numpy as np
import tensorflow as tf

from .. import _args, _csrc_check
from . import _op

__all__ = ["linear_cross_entropy"]

_OP = "linear_cross_entropy"


@tf.autograph.experimental.do_not_convert
def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, softcap: float | None = None,
                         z_loss: float = 0.0, num_items_in_batch=None,
                         loss_dtype=None) -> tf.Tensor:
    """cross_entropy(softcap(input @ linear_weight^T + linear_bias), target) without the
    (..., V) logits, as fusedlayers.torch.linear_cross_entropy (PyTorch's
    F.linear_cross_entropy arguments, plus softcap, z_loss and num_items_in_batch).

    input (..., H), linear_weight (V, H), linear_bias (V,) of one float dtype, H and V static;
    target integer (...). Returns a scalar, or target's shape for reduction 'none', in input's
    dtype or in `loss_dtype` (a floating dtype: the float32 loss, float64 for float64 input,
    cast to it, never rounded through input's dtype; Keras' LinearCrossEntropy asks for
    float32). Rows run in chunks (csrc's rule: equal chunks of at most 4096 rows whose logits
    take at most twice input's size plus half the weight's, or 2^24 logits); each chunk's logits are
    TF's matmul in input's dtype, then csrc's pass. With 'mean' or
    'sum' the gradients are formed in the forward pass and scaled by the backward; with 'none'
    the backward recomputes the logits. Raises InvalidArgumentError for a bad argument (csrc's
    message where csrc checks it); a target outside [0, V) other than ignore_index fails the op
    on the CPU and gives its row a NaN loss on CUDA."""
    x, w = _op.prepare(_OP, input=input, linear_weight=linear_weight)
    out_dtype = x.dtype if loss_dtype is None else tf.as_dtype(loss_dtype)
    if not out_dtype.is_floating:
        raise TypeError(f"fusedlayers.{_OP}: loss_dtype must be None or a floating dtype, got "
                        f"{loss_dtype!r}")
    b = None if linear_bias is None else _op.prepare(_OP, linear_bias=linear_bias)[0]
    target = tf.convert_to_tensor(target)
    if not target.dtype.is_integer:
        raise _op.invalid(f"fusedlayers.{_OP}: target must be an integer tensor, got "
                          f"{target.dtype.name}")
    if x.shape.rank is None or target.shape.rank is None:
        raise _op.invalid(f"fusedlayers.{_OP}: input and target must have known ranks, got "
                          f"{x.shape} and {target.shape}")
    leading = x.shape[:-1]  # sizes unknown while tracing match any
    try:
        _args.linear_cross_entropy(reduction, num_items_in_batch, softcap, x.shape.as_list(),
                                   (leading if leading.is_compatible_with(target.shape)
                                    else target.shape).as_list())
    except ValueError as e:
        raise _op.invalid(str(e)) from None
    options = (int(ignore_index), _args.real(_OP, "label_smoothing", label_smoothing),
               _args.real(_OP, "softcap", softcap or 0.0), _args.real(_OP, "z_loss", z_loss))
    h, v = x.shape[-1], w.shape[0] if w.shape.rank else None
    if h is None or v is None:
        raise _op.invalid(f"fusedlayers.{_OP}: input's last dimension and linear_weight's first "
                          f"must be static, got {x.shape} and {w.shape}")
    n = x.shape[:-1].num_elements()  # None while tracing an unknown batch size
    _op.check(_OP, tf.TensorSpec((n or 0, h), x.dtype), w, b, n or 0,
              *map(np.float64, options[1:]))
    x2 = tf.reshape(x, [-1, h])
    t = tf.cast(tf.reshape(target, [-1]), tf.int64)
    items = None if num_items_in_batch is None else tf.convert_to_tensor(num_items_in_batch)
    loss = _lce(x2, w, b, t, items, n, reduction, options, out_dtype)
    return tf.reshape(loss, tf.shape(target)) if reduction == "none" else loss


def _loss_dtype(x):
    return tf.float64 if x.dtype == tf.float64 else tf.float32


def _loop(x, w, b, t, scale, n, options):
    """(loss of each row, dx, dw, db) of sum_i scale_i loss_i; the gradients None when scale is
    None. Chunks of csrc's rows (chunk j: rows j*c to j*c+c) run in order, dw and db summed in
    that order."""
    ignore_index, label_smoothing, softcap, z_loss = options
    h, v = x.shape[1], w.shape[0]
    if n is not None:  # static: the loop's sizes as Python ints
        rows = n
        c = _csrc_check.chunk_rows(_op.clib, n, h, v) if n else 1
    else:
        rows = tf.shape(x, out_type=tf.int64)[0]
        c = _op.lib.fusedlayers_linear_cross_entropy_chunk_rows(rows, hidden=h, vocab=v)
    k = (rows + c - 1) // c
    pad = k * c - rows
    acc = _loss_dtype(x)
    grads = scale is not None
    per_row = grads and scale.shape[0] != 1

    def chunked(a, fill=0):
        a = tf.pad(a, [[0, pad]] + [[0, 0]] * (a.shape.rank - 1), constant_values=fill)
        return tf.reshape(a, tf.concat([tf.cast([k, c], tf.int64),
                                        tf.shape(a, out_type=tf.int64)[1:]], 0))
    xs, ts = chunked(x), chunked(t, ignore_index)
    ss = chunked(scale) if per_row else None
    bias = b if b is not None else tf.zeros([0], x.dtype)
    whole_scale = scale if grads and not per_row else tf.zeros([0], acc)
    with_db = grads and b is not None
    consts = [tf.constant(o, tf.float64) for o in (label_smoothing, softcap, z_loss)]

    def body(i, dw, db, losses, dxs):
        x_c = xs[i]
        logits = tf.matmul(x_c, w, transpose_b=True)
        loss_c, du, db_c = _op.lib.fusedlayers_linear_cross_entropy_chunk(
            logits, bias, ts[i], ss[i] if per_row else whole_scale, *consts,
            ignore_index=ignore_index)
        losses = losses.write(tf.cast(i, tf.int32), loss_c)
        if grads:  # their shapes, where a per-row scale of unknown size hid them
            du.set_shape(logits.shape)
            db_c.set_shape([v] if with_db else [0])
            dxs = dxs.write(tf.cast(i, tf.int32), tf.matmul(du, w))
            dw = dw + tf.matmul(du, x_c, transpose_a=True)
            if with_db:
                db = db + db_c
        return i + 1, dw, db, losses, dxs

    size = tf.cast(k, tf.int32)
    losses = tf.TensorArray(acc, size=size, element_shape=[None])
    dxs = tf.TensorArray(x.dtype, size=size if grads else 0, element_shape=[None, h])
    init = (tf.constant(0, tf.int64), tf.zeros_like(w) if grads else tf.zeros([0], w.dtype),
            tf.zeros([v] if with_db else [0], acc), losses, dxs)
    _, dw, db, losses, dxs = tf.while_loop(lambda i, *_: i < k, body, init,
                                           parallel_iterations=1)
    loss = losses.concat()[:rows]
    if not grads:
        return loss, None, None, None
    return (loss, dxs.concat()[:rows], dw, tf.cast(db, b.dtype) if with_db else None)


def _scale(t, items, reduction, ignore_index, x):
    """The reduction's factor: 1 for 'sum', 1 / count for 'mean', as a (1,) tensor."""
    acc = _loss_dtype(x)
    if reduction == "sum":
        return tf.ones([1], acc)
    count = tf.math.count_nonzero(t != ignore_index) if items is None else items
    return tf.reshape(1 / tf.cast(count, acc), [1])


try:  # whether a tape records the op's inputs (requires_grad, in torch's words)
    from tensorflow.python.eager.record import should_record_backprop as _recorded
except ImportError:  # another TF layout: form the gradients as if recorded
    def _recorded(tensors):
        return True


def _lce(x, w, b, t, items, n, reduction, options, out_dtype):
    params = [x, w] + ([b] if b is not None else [])
    acc = _loss_dtype(x)
    if reduction != "none" and not _recorded(params):  # no backward: one GEMM per chunk
        rows = _loop(x, w, b, t, None, n, options)[0]
        return tf.cast(tf.reduce_sum(rows) * _scale(t, items, reduction, options[0], x)[0],
                       out_dtype)

    @tf.custom_gradient
    def run(*params):
        x, w = params[:2]
        b = params[2] if len(params) > 2 else None
        if reduction == "none":  # per-row weights come with the backward: recomputed there
            rows = _loop(x, w, b, t, None, n, options)[0]

            def recompute(dy):
                _, dx, dw, db = _loop(x, w, b, t, tf.reshape(tf.cast(dy, acc), [-1]), n,
                                      options)
                return [dx, dw] + ([db] if b is not None else [])
            return tf.cast(rows, out_dtype), recompute
        scale = _scale(t, items, reduction, options[0], x)
        rows, dx, dw, db = _loop(x, w, b, t, scale, n, options)

        def scaled(dy):
            return [g * tf.cast(dy, g.dtype) for g in (dx, dw, db) if g is not None]
        return tf.cast(tf.reduce_sum(rows) * scale[0], out_dtype), scaled

    return run(*params)


def bench_case(shape, dtype: tf.DType):
    """Against tf.matmul then tf.nn.sparse_softmax_cross_entropy_with_logits on float32 logits
    (what a Keras LM head and loss run), at (tokens, hidden, vocab), targets fixed (1 in 7
    ignored); "gemm": the logits' matmul alone (with the backward: the three GEMMs, the floor)."""
    from ..bench.case import Case
    n, h, v = shape
    x = _op.random((n, h), dtype, seed=0)
    w = _op.random((v, h), dtype, seed=1, scale=h ** -0.5)
    t = np.random.default_rng(2).integers(0, v, n)
    t[::7] = -100
    t = tf.constant(t)

    def unfused(x, w):
        logits = tf.cast(tf.matmul(x, w, transpose_b=True), tf.float32)
        kept = t != -100
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.where(kept, t, 0), logits)
        return tf.reduce_sum(tf.where(kept, losses, 0.0)) / tf.reduce_sum(tf.cast(kept, tf.float32))
    flops = 2 * n * h * v
    return Case(lambda x, w: linear_cross_entropy(x, w, t), unfused, [x, w],
                {"fwd": flops, "fwd+bwd": 3 * flops},
                variants={"gemm": lambda x, w: tf.matmul(x, w, transpose_b=True)})
