"""Linear + cross-entropy on JAX arrays without the logits, under jax.custom_vjp. On CUDA (in a
CUDA build) one custom call, fusedlayers_linear_cross_entropy_gemm, runs csrc's whole chunk loop
on cuBLASLt (backends/xla/linear_cross_entropy_cublaslt_ffi.cc), as the torch extension runs it on
ATen's GEMMs; elsewhere a chunk loop (jax.lax.scan) whose steps are XLA's dots and the custom
call fusedlayers_linear_cross_entropy_chunk (backends/xla/linear_cross_entropy_ffi.cc: csrc's row
pass). Same contract as fusedlayers.torch.linear_cross_entropy; csrc/loss/linear_cross_entropy.h has
the math, the chunk rule and the checks."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _args, _csrc_check
from . import _op

__all__ = ["linear_cross_entropy"]

_OP = "linear_cross_entropy"


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, softcap: float | None = None,
                         z_loss: float = 0.0, num_items_in_batch=None,
                         loss_dtype=None) -> jax.Array:
    """cross_entropy(softcap(input @ linear_weight^T + linear_bias), target) without the
    (..., V) logits, as fusedlayers.torch.linear_cross_entropy (PyTorch's
    F.linear_cross_entropy arguments, plus softcap, z_loss and num_items_in_batch).

    input (..., H), linear_weight (V, H), linear_bias (V,) of one float dtype; target integer
    (...). Returns a scalar, or target's shape for reduction 'none', in input's dtype or in
    `loss_dtype` (a floating dtype: the float32 loss, float64 for float64 input, cast to it,
    never rounded through input's dtype; Flax's LinearCrossEntropy asks for float32). Rows run in
    chunks (csrc's rule: equal chunks of at most 4096 rows whose logits take at most twice
    input's size plus half the weight's, or 2^24 logits); each chunk's logits are
    the GEMM's (cuBLASLt's on CUDA, XLA's dot elsewhere) rounded to input's dtype, then csrc's
    pass. With 'mean' or 'sum' the gradients are
    formed in the forward pass of jax.grad / jax.vjp and scaled in the backward; with 'none' the
    backward recomputes the logits. While tracing, raises ValueError for a bad reduction, shapes
    or options and TypeError for dtypes (csrc's checks); a target outside [0, V) other than
    ignore_index gives its row an error on the CPU and a NaN loss on CUDA."""
    x, w, b = _op.prepare(_OP, input=input, linear_weight=linear_weight, linear_bias=linear_bias)
    out_dtype = x.dtype if loss_dtype is None else jnp.dtype(loss_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"fusedlayers.{_OP}: loss_dtype must be None or a floating dtype, got "
                        f"{loss_dtype!r}")
    target = jnp.asarray(target)
    if not jnp.issubdtype(target.dtype, jnp.integer):
        raise TypeError(f"fusedlayers.{_OP}: target must be an integer array, got {target.dtype}")
    _args.linear_cross_entropy(reduction, num_items_in_batch, softcap, x.shape, target.shape)
    x2 = x.reshape(-1, x.shape[-1])
    t = target.reshape(-1)
    if t.dtype not in (jnp.int32, jnp.int64):
        t = t.astype(jnp.int32)
    options = (int(ignore_index), float(label_smoothing), float(softcap or 0.0), float(z_loss))
    _op.check(_OP, x2, w, b, t.shape[0], *map(np.float64, options[1:]))
    items = None if num_items_in_batch is None else jnp.asarray(num_items_in_batch)
    loss = _lce(x2, w, b, t, items, reduction, options, out_dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _loss_dtype(x):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _scale(t, items, reduction, ignore_index, x):
    """The reduction's factor: 1 for 'sum', 1 / count for 'mean', as a (1,) array."""
    if reduction == "sum":
        return jnp.ones((1,), _loss_dtype(x))
    count = (t != ignore_index).sum() if items is None else items
    return (1 / count.astype(_loss_dtype(x))).reshape(1)


def _cublaslt():
    """Whether this build has the cuBLASLt handler (CUDA builds)."""
    return hasattr(_op.lib, "fusedlayers_xla_linear_cross_entropy_gemm_workspace_size")


def _loop(x, w, b, t, scale, options):
    """(loss of each row, dx, dw, db) of sum_i scale_i loss_i; the gradients None when scale is
    None: csrc's loop on cuBLASLt on CUDA (not float64, which cuBLASLt's path does not take),
    else the scan of XLA's dots."""
    def scan():
        return _scan(x, w, b, t, scale, options)
    if not _cublaslt() or x.dtype == jnp.float64:
        return scan()
    return _op.platform_dependent(x, default=scan,
                                  cuda=lambda: _cublaslt_loop(x, w, b, t, scale, options))


def _cublaslt_loop(x, w, b, t, scale, options):
    """_loop as one custom call: csrc's chunks of consecutive rows, dW accumulated in W's dtype
    by each chunk's GEMM (csrc's rule, as in torch)."""
    ignore_index, label_smoothing, softcap, z_loss = options
    n, h = x.shape
    v = w.shape[0]
    grads = scale is not None
    per_row = grads and scale.shape[0] > 1
    with_db = grads and b is not None
    results = (jax.ShapeDtypeStruct((n,), _loss_dtype(x)),
               jax.ShapeDtypeStruct((n, h) if grads else (0,), x.dtype),
               jax.ShapeDtypeStruct((v, h) if grads else (0,), w.dtype),
               jax.ShapeDtypeStruct((v,) if with_db else (0,), x.dtype))
    roles = "xppr" + ("r" if per_row else "p") + "->r" + ("xs" if grads else "pp") + \
        ("s" if with_db else "p")

    def workspace(x):  # the call's rows (this device's, when they are sharded)
        return _op.lib.fusedlayers_xla_linear_cross_entropy_gemm_workspace_size(
            x.shape[0], h, v, _op.csrc_dtype(x.dtype), b is not None, grads)
    loss, dx, dw, db = _op.call(
        "linear_cross_entropy_gemm", results, x, w, _op.absent(x.dtype) if b is None else b, t,
        scale if grads else jnp.zeros((0,), _loss_dtype(x)), roles=roles, rows=1,
        workspace=workspace, ignore_index=np.int64(ignore_index),
        label_smoothing=np.float64(label_smoothing), softcap=np.float64(softcap),
        z_loss=np.float64(z_loss))
    return loss, dx if grads else None, dw if grads else None, db if with_db else None


def _scan(x, w, b, t, scale, options):
    """_loop as a scan of XLA's dots around csrc's row pass. Chunks of csrc's rows run in order
    (dw and db summed in that order)."""
    ignore_index, label_smoothing, softcap, z_loss = options
    n, h = x.shape
    v = w.shape[0]
    c = _csrc_check.chunk_rows(_op.lib, n, h, v) if n else 1
    k = max(-(-n // c), 1)
    pad = k * c - n
    acc = _loss_dtype(x)
    grads = scale is not None
    per_row = grads and scale.shape[0] > 1
    # Chunk j takes rows i * k + j (i < c): rows split across devices (the leading ones on
    # the first) stay split within every chunk, so each device runs its share of each chunk.
    def chunked(a, fill=0):
        a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1), constant_values=fill)
        return jnp.swapaxes(a.reshape(c, k, *a.shape[1:]), 0, 1)
    xs = (chunked(x), chunked(t, ignore_index),
          chunked(scale) if per_row else jnp.zeros((k, 0), acc))
    bias = b if b is not None else jnp.zeros((0,), x.dtype)
    whole_scale = scale if grads and not per_row else jnp.zeros((0,), acc)
    with_db = grads and b is not None
    results = (jax.ShapeDtypeStruct((c,), acc),
               jax.ShapeDtypeStruct((c, v) if grads else (0,), x.dtype),
               jax.ShapeDtypeStruct((v,) if with_db else (0,), acc))
    roles = "xpr" + ("r" if per_row else "p") + "->r" + ("x" if grads else "p") + \
        ("s" if with_db else "p")

    # float32 products as float32 (no TF32 on GPUs), accumulated in the loss dtype; the logits
    # and dx leave their GEMMs in x's dtype (rounded once from that accumulator, with no pass
    # of their own over the chunk); each chunk's dW in the loss dtype, added to the running sum
    # and rounded to W's dtype (csrc's rule)
    dot = partial(jnp.dot, preferred_element_type=acc, precision=jax.lax.Precision.HIGHEST)
    dot_x = partial(dot, preferred_element_type=x.dtype)

    def step(carry, chunk):
        x_c, t_c, s_c = chunk
        logits = dot_x(x_c, w.T)
        loss_c, du, db_c = _op.call(
            "linear_cross_entropy_chunk", results, logits, bias, t_c,
            s_c if per_row else whole_scale, roles=roles, rows=1,
            ignore_index=np.int64(ignore_index), label_smoothing=np.float64(label_smoothing),
            softcap=np.float64(softcap), z_loss=np.float64(z_loss))
        if not grads:
            return carry, (loss_c, jnp.zeros((c, 0), x.dtype))
        dw, db = carry
        dx_c = dot_x(du, w)
        dw = (dw + dot(du.T, x_c)).astype(w.dtype)
        return (dw, db + db_c if with_db else db), (loss_c, dx_c)

    init = (jnp.zeros_like(w), jnp.zeros((v,), acc)) if grads else (jnp.zeros(()), jnp.zeros(()))
    (dw, db), (loss, dx) = jax.lax.scan(step, init, xs)
    loss = jnp.swapaxes(loss, 0, 1).reshape(-1)[:n]
    if not grads:
        return loss, None, None, None
    return (loss, jnp.swapaxes(dx, 0, 1).reshape(-1, h)[:n], dw,
            db.astype(b.dtype) if with_db else None)


def _reduce(rows, reduction, scale, dtype):
    return (rows if reduction == "none" else rows.sum() * scale[0]).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _lce(x, w, b, t, items, reduction, options, out_dtype):
    rows = _loop(x, w, b, t, None, options)[0]
    if reduction == "none":
        return rows.astype(out_dtype)
    return _reduce(rows, reduction, _scale(t, items, reduction, options[0], x), out_dtype)


def _lce_fwd(x, w, b, t, items, reduction, options, out_dtype):
    if reduction == "none":  # per-row weights come with the backward: recomputed there
        rows = _loop(x, w, b, t, None, options)[0]
        return rows.astype(out_dtype), (x, w, b, t, None)
    scale = _scale(t, items, reduction, options[0], x)
    rows, dx, dw, db = _loop(x, w, b, t, scale, options)
    return _reduce(rows, reduction, scale, out_dtype), (dx, dw, db, t, items)


def _lce_bwd(reduction, options, out_dtype, saved, g):
    zero_t = np.zeros(saved[3].shape, jax.dtypes.float0)
    if reduction == "none":
        x, w, b, t, _ = saved
        _, dx, dw, db = _loop(x, w, b, t, g.astype(_loss_dtype(x)), options)
        return dx, dw, db, zero_t, None
    dx, dw, db, t, items = saved
    return (dx * g.astype(dx.dtype), dw * g.astype(dw.dtype),
            None if db is None else db * g.astype(db.dtype), zero_t,
            None if items is None else jnp.zeros_like(items))


_lce.defvjp(_lce_fwd, _lce_bwd)


def bench_case(shape, dtype):
    """Against XLA's dot (float32 logits, as flax's LM heads compute them for the loss) then
    optax's softmax_cross_entropy_with_integer_labels formula (the logsumexp less the target's
    logit), mean over kept rows, at (tokens, hidden, vocab), targets fixed (1 in 7 ignored);
    "gemm": the logits' dot alone (with the backward: the three GEMMs, the floor)."""
    from ..bench.case import Case
    n, h, v = shape
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (n, h), dtype)
    w = (jax.random.normal(keys[1], (v, h), jnp.float32) / h ** 0.5).astype(dtype)
    t = np.random.default_rng(2).integers(0, v, n)
    t[::7] = -100
    t = jnp.asarray(t, jnp.int32)
    dot = partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)

    def unfused(x, w):
        z = dot(x, w.T, preferred_element_type=jnp.float32)
        kept = t != -100
        picked = jnp.take_along_axis(z, jnp.where(kept, t, 0)[:, None], 1)[:, 0]
        rows = jax.nn.logsumexp(z, -1) - picked
        return (jnp.where(kept, rows, 0).sum() / kept.sum()).astype(x.dtype)
    flops = 2 * n * h * v
    return Case(lambda x, w: linear_cross_entropy(x, w, t), unfused, [x, w],
                {"fwd": flops, "fwd+bwd": 3 * flops}, variants={"gemm": lambda x, w: dot(x, w.T)})
