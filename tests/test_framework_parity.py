"""One function, two frameworks: the same numpy inputs through torch and TensorFlow.

relu_scale and layer_norm run the very same csrc code in both, so float32 outputs and gradients
must agree bit for bit; linear_gelu agrees to float32 rounding only, because its GEMMs are each
framework's own (ATen's addmm vs TF's matmul) and sum in different orders."""

import numpy as np
import pytest
import torch

tf = pytest.importorskip("tensorflow")
import fusedlayers as fl  # noqa: E402


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


def grads_torch(fn, arrays, dy):
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), [t.grad.numpy() for t in ts]


def grads_tf(fn, arrays, dy):
    vs = [tf.Variable(a) for a in arrays]
    with tf.GradientTape() as tape:
        y = fn(*vs)
    return y.numpy(), [g.numpy() for g in tape.gradient(y, vs, output_gradients=tf.constant(dy))]


@pytest.mark.parametrize("cols", [1, 7, 1000, 4097])
def test_layer_norm_bitwise(rng, cols):
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((33, cols), (cols,), (cols,)))
    dy = rng.standard_normal((33, cols)).astype(np.float32)
    fn = lambda x, w, b: fl.layer_norm(x, cols, w, b)
    yt, gt = grads_torch(fn, (x, w, b), dy)
    yf, gf = grads_tf(fn, (x, w, b), dy)
    assert np.array_equal(yt, yf)
    for a, c in zip(gt, gf):
        assert np.array_equal(a, c)


def test_relu_scale_bitwise(rng):
    x = rng.standard_normal((64, 257)).astype(np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    dy = rng.standard_normal(x.shape).astype(np.float32)
    yt, (gt,) = grads_torch(lambda x: fl.relu_scale(x, 0.75), (x,), dy)
    yf, (gf,) = grads_tf(lambda x: fl.relu_scale(x, 0.75), (x,), dy)
    assert np.array_equal(yt, yf, equal_nan=True) and np.array_equal(gt, gf, equal_nan=True)


def test_linear_gelu_agrees(rng):
    x = rng.standard_normal((33, 100)).astype(np.float32)
    w = (rng.standard_normal((70, 100)) / 10).astype(np.float32)
    b = rng.standard_normal(70).astype(np.float32)
    dy = rng.standard_normal((33, 70)).astype(np.float32)
    fn = lambda x, w, b: fl.linear_gelu(x, w, b)
    yt, gt = grads_torch(fn, (x, w, b), dy)
    yf, gf = grads_tf(fn, (x, w, b), dy)
    np.testing.assert_allclose(yt, yf, rtol=1e-5, atol=1e-5)
    for a, c in zip(gt, gf):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)
