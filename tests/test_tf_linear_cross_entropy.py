"""fusedlayers.tensorflow.linear_cross_entropy against the float64 reference (torch's F.linear
and F.cross_entropy, as the torch and JAX tests use) over several chunks, for every reduction and
option set, gradients included, eagerly, in tf.function (a batch size unknown while tracing
included) and under XLA, on the CPU and on TensorFlow's GPU; against fusedlayers.torch (the same
csrc pass) on either device;
tf.test.compute_gradient; errors; and the Keras layer training with fit on every backend."""

import numpy as np
import pytest
import torch

from _helpers import LCE_OPTIONS, lce_problem, lce_torch_reference, rel_err, tf_device

tf = pytest.importorskip("tensorflow")

from fusedlayers.tensorflow import linear_cross_entropy  # noqa: E402

def _value_and_grads(fn, params, dy):
    with tf.GradientTape() as tape:
        tape.watch(params)
        loss = fn(*params)
    return loss, tape.gradient(loss, params, output_gradients=tf.constant(dy, loss.dtype))


@pytest.mark.parametrize("mode", ["eager", "function", "unknown_batch", "xla"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", LCE_OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(mode, reduction, options, bias, seed):
    x, w, b, t = lce_problem(4500, 13, 41, bias, options.get("ignore_index", -100), seed)
    params = [tf.constant(a) for a in (x, w) + ((b,) if bias else ())]
    dy = np.random.default_rng(seed).random(() if reduction != "none" else t.shape) + 0.5

    def run(target, *p):
        return _value_and_grads(
            lambda *p: linear_cross_entropy(p[0], p[1], target,
                                            linear_bias=p[2] if bias else None,
                                            reduction=reduction, **options), list(p), dy)
    if mode != "eager":
        rows = None if mode == "unknown_batch" else len(t)
        spec = [tf.TensorSpec([rows], tf.int64), tf.TensorSpec([rows, 13], tf.float64)] + \
            [tf.TensorSpec(p.shape, tf.float64) for p in params[1:]]
        run = tf.function(run, input_signature=spec, jit_compile=mode == "xla")
    loss, grads = run(tf.constant(t), *params)
    want, grads_want = lce_torch_reference(x, w, b, t, reduction, dy, options)
    assert loss.dtype == tf.float64 and tuple(loss.shape) == want.shape
    assert rel_err(torch.tensor(loss.numpy()), torch.tensor(want)) <= 1e-12
    for got, ref in zip(grads, grads_want):
        assert rel_err(torch.tensor(got.numpy()), torch.tensor(ref)) <= 1e-11


def test_compute_gradient():
    x, w, b, t = lce_problem(9, 5, 11, True)
    for reduction in ("mean", "none"):
        def fn(x, w, b, reduction=reduction):
            return linear_cross_entropy(x, w, tf.constant(t), linear_bias=b,
                                        reduction=reduction, label_smoothing=0.1, softcap=2.5,
                                        z_loss=1e-2)
        theoretical, numerical = tf.test.compute_gradient(
            fn, [tf.constant(a) for a in (x, w, b)], delta=1e-6)
        for a, n in zip(theoretical, numerical):
            np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-7)


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", LCE_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_gpu_float32_matches_float64_reference(mode, reduction, options, seed):
    """On TensorFlow's GPU (the csrc CUDA chunk pass around TF's matmuls; under XLA, its custom
    call around XLA's dots), float32 against the float64 reference of the same float32 values."""
    x, w, b, t = (a.astype(np.float32) if a.dtype == np.float64 else a for a in lce_problem(
        4500, 64, 1000, True, options.get("ignore_index", -100), seed))
    dy = np.random.default_rng(seed).random(() if reduction != "none" else t.shape) + 0.5
    with tf.device(tf_device("cuda")):
        params, target = [tf.constant(a) for a in (x, w, b)], tf.constant(t)

        def run(*p):
            return _value_and_grads(lambda *q: linear_cross_entropy(
                q[0], q[1], target, linear_bias=q[2], reduction=reduction, **options), list(p),
                dy.astype(np.float32))
        loss, grads = (tf.function(run, jit_compile=True) if mode == "xla" else run)(*params)
    assert all(v.device.endswith("GPU:0") for v in (loss, *grads))
    want, grads_want = lce_torch_reference(*(a.astype(np.float64) for a in (x, w, b)), t,
                                           reduction, dy, options)
    assert rel_err(torch.tensor(loss.numpy()), torch.tensor(want)) <= 1e-5
    for got, ref in zip(grads, grads_want):
        assert rel_err(torch.tensor(got.numpy()), torch.tensor(ref)) <= 1e-5


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_close_to_torch(dtype, device):
    x, w, b, t = lce_problem(300, 32, 200, True)
    tdt = getattr(torch, dtype)
    rounded = [torch.tensor(a).to(tdt) for a in (x, w, b)]
    with tf.device(tf_device(device)):
        params = [tf.constant(r.float().numpy(), getattr(tf, dtype)) for r in rounded]
        loss, grads = _value_and_grads(
            lambda x, w, b: linear_cross_entropy(x, w, tf.constant(t, tf.int32), linear_bias=b,
                                                 num_items_in_batch=400), params, 1.0)
    assert loss.device.endswith("GPU:0" if device == "cuda" else "CPU:0")
    tx, tw, tb = (r.to(device).requires_grad_() for r in rounded)
    from fusedlayers.torch import linear_cross_entropy as torch_lce
    tl = torch_lce(tx, tw, torch.tensor(t, device=device), linear_bias=tb, num_items_in_batch=400)
    tgrads = torch.autograd.grad(tl, (tx, tw, tb))
    tol = 1e-6 if dtype == "float32" else 2e-2  # TF's and ATen's GEMMs sum differently
    assert loss.dtype == getattr(tf, dtype)
    assert rel_err(torch.tensor(float(loss)), tl.double().detach().cpu()) <= tol
    for g, tg in zip(grads, tgrads):
        assert rel_err(torch.tensor(tf.cast(g, tf.float32).numpy()), tg.float().cpu()) <= tol * 10


def test_no_gradient_asked_runs_the_loss_alone():
    x, w, _, t = (tf.constant(a) if a is not None and i < 2 else a
                  for i, a in enumerate(lce_problem(50, 6, 9, False)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        watched = linear_cross_entropy(x, w, t)
    plain = linear_cross_entropy(x, w, t)
    assert float(watched) == float(plain)
    assert tape.gradient(watched, x) is not None


def test_errors():
    x, w, b, t = (tf.constant(a, tf.float32) if a is not None and i < 3 else a
                  for i, a in enumerate(lce_problem(6, 4, 7, True)))
    t = tf.constant(t)
    invalid = tf.errors.InvalidArgumentError
    with pytest.raises(invalid, match="reduction must be one of mean, sum, none"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(invalid, match=r"linear_weight must be \(vocab, 4\)"):
        linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(invalid, match="label_smoothing must be in"):
        linear_cross_entropy(x, w, t, label_smoothing=2.0)
    with pytest.raises(invalid, match="linear_weight must have input's dtype float32"):
        linear_cross_entropy(x, tf.cast(w, tf.bfloat16), t)
    with pytest.raises(invalid, match="target must be an integer tensor"):
        linear_cross_entropy(x, w, tf.cast(t, tf.float32))
    with pytest.raises(invalid, match="target must have input's leading shape"):
        linear_cross_entropy(x, w, t[:5])
    with pytest.raises(invalid, match=r"target must be in \[0, 7\)"):
        linear_cross_entropy(x, w, tf.constant([0, 1, 2, 3, 4, 70]))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_dtype_float32_is_the_float32_loss(reduction, seed):
    x, w, _, t = lce_problem(300, 32, 1000, False, seed=seed)
    xb, wb = tf.constant(x, tf.bfloat16), tf.constant(w, tf.bfloat16)
    got = linear_cross_entropy(xb, wb, t, reduction=reduction, loss_dtype=tf.float32)
    default = linear_cross_entropy(xb, wb, t, reduction=reduction)
    assert got.dtype == tf.float32 and default.dtype == tf.bfloat16
    assert np.array_equal(default.numpy(), tf.cast(got, tf.bfloat16).numpy())
    # the loss of the op's bfloat16 logits (TF's matmul) in float64
    logits = tf.matmul(xb, wb, transpose_b=True)
    want = torch.nn.functional.cross_entropy(
        torch.tensor(tf.cast(logits, tf.float64).numpy()), torch.tensor(t), reduction=reduction)
    assert rel_err(torch.tensor(got.numpy().astype(np.float64)), want) <= 1e-4
    with pytest.raises(TypeError, match="loss_dtype must be None or a floating dtype"):
        linear_cross_entropy(xb, wb, t, loss_dtype=tf.int32)
