"""Keras' rms_scaling LayerNorm (`layer_norm_trailing(..., rms_scaling=True)`, a mode of the
layer_norm kernels that no public op exposes) through the torch extension and the TensorFlow op
library: the same csrc kernels, so forward and backward bit-identical. The public ops' parity is
generated from their tables (tests/op_db.py, test_ops.py::test_parity)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from fusedlayers.tensorflow import layer_norm_trailing as tf_trailing  # noqa: E402
from fusedlayers.torch import layer_norm_trailing as torch_trailing  # noqa: E402

from _helpers import tf_grads  # noqa: E402

TORCH_DT = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
            "bfloat16": torch.bfloat16}


def to_both(a, dtype, requires_grad=True):
    """numpy (float64) -> (torch tensor, tf tensor), both rounded to dtype the same way."""
    t = torch.from_numpy(np.asarray(a, np.float64)).to(TORCH_DT[dtype])
    tt = tf.cast(tf.constant(np.asarray(a, np.float64)), dtype)
    # rounding float64 -> half in torch and TF must agree, or the comparison is meaningless
    assert np.array_equal(t.float().numpy(), tf.cast(tt, tf.float32).numpy(), equal_nan=True)
    return t.detach().requires_grad_(requires_grad), tt


def same(a_torch, b_tf, what, rng):
    a = a_torch.detach().float().numpy() if a_torch.dtype != torch.float64 else \
        a_torch.detach().numpy()
    b = tf.cast(b_tf, tf.float64 if b_tf.dtype == tf.float64 else tf.float32).numpy()
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if np.array_equal(a, b, equal_nan=True):
        return
    diff = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    assert False, (
        f"{what}: torch and TF differ at {int(diff.sum())} of {a.size} elements, e.g. "
        f"{a[diff][:3]} vs {b[diff][:3]} ({rng})")


def torch_grads(fn, inputs, dy):
    """As tf_grads: y and the gradients wrt the non-None inputs, None for None."""
    live = [t for t in inputs if t is not None]
    y = fn(*inputs)
    gs = iter(torch.autograd.grad(y, live, dy))
    return y, [None if t is None else next(gs) for t in inputs]


@pytest.mark.parametrize("shape,k", [((40, 33), 1), ((3, 4, 1000), 2)], ids=str)
def test_layer_norm_rms_bitwise(rng, shape, k):
    x, dy = rng.normal(shape, loc=0.5), rng.normal(shape)
    g = rng.normal(shape[-k:], loc=1.0)
    xt, xf = to_both(x, "float32")
    gt, gf = to_both(g, "float32")
    dyt, dyf = to_both(dy, "float32", requires_grad=False)
    yt, gts = torch_grads(lambda a, c: torch_trailing(a, k, c, None, 1e-3, rms_scaling=True),
                          [xt, gt], dyt)
    yf, gfs = tf_grads(lambda a, c: tf_trailing(a, k, c, None, 1e-3, rms_scaling=True),
                       [xf, gf], dyf)
    same(yt, yf, "rms y", rng)
    for name, a, c in zip(("dx", "dgamma"), gts, gfs):
        same(a, c, f"rms {name}", rng)


