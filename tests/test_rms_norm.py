"""RMSNorm against the unfused layer in float64 (torch.nn.functional.rms_norm), on the CPU and
CUDA: forward and gradients at odd sizes and layouts, half precision with float32 weights,
zero-centred gain, gradcheck/opcheck, drop-in modules (torch and Keras), torch.compile, fuse(),
torch-TF parity and argument errors."""

import pytest
import torch
import torch.nn.functional as F

import fusedlayers as fl
from fusedlayers.torch import RMSNorm, fuse

from _helpers import ALL_DTYPES, DEVICES, assert_bitwise, grads, rel_err

# Relative error allowed against float64 (stats in float32; 16-bit outputs round once).
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(x, normalized_shape, weight, eps, zero_centered=False):
    """The unfused layer in float64."""
    w = None if weight is None else (weight.double() + 1 if zero_centered else weight.double())
    return F.rms_norm(x.double(), normalized_shape, w, eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape,normalized_shape", [((33, 1000), (1000,)), ((3, 5, 768), (768,)),
                                                    ((4, 6, 10), (6, 10)), ((7, 1), (1,)),
                                                    ((2, 4097), (4097,)), ((0, 16), (16,))])
@pytest.mark.parametrize("weight_kind", ["none", "same", "float32", "zero_centered"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_matches_float64(device, dtype, shape, normalized_shape, weight_kind, layout):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU only")
    if weight_kind == "float32" and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip("float32 weights are for half inputs")
    x = torch.randn(shape, device=device) * 3 + 0.5
    if layout == "transposed" and len(shape) > 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    x = x.to(dtype).requires_grad_()
    wdtype = torch.float32 if weight_kind == "float32" else dtype
    w = (None if weight_kind == "none" else
         (torch.randn(normalized_shape, device=device) * 0.5 + 1).to(wdtype).requires_grad_())
    zc = weight_kind == "zero_centered"
    eps = 1e-5
    y = fl.rms_norm(x, normalized_shape, w, eps, zero_centered=zc)
    assert y.dtype == dtype and y.shape == x.shape
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    y64 = reference(x64, normalized_shape, w64, eps, zc)
    assert rel_err(y, y64) <= TOL[dtype]
    if x.numel() == 0:
        return
    dy = torch.randn_like(y)
    leaves = [t for t in (x, w) if t is not None]
    ours = grads(y, leaves, dy)
    ref = grads(y64, [t for t in (x64, w64) if t is not None], dy.double())
    # The unfused layer's own error in this dtype bounds what is achievable where dx cancels
    # (rows of one element: dx = rstd * dy * eps / (x^2 + eps)).
    xn = x.detach().requires_grad_()
    wn = None if w is None else w.detach().to(dtype).requires_grad_()
    native = grads(F.rms_norm(xn, normalized_shape, None if wn is None else wn + zc, eps),
                   [t for t in (xn, wn) if t is not None], dy)
    tol = TOL[dtype] * (4 if dtype in (torch.float16, torch.bfloat16) else 50)
    # dx sums rstd * g and a term of the same size that cancels it: judged against their size.
    rstd = torch.rsqrt(x64.detach().pow(2).mean(tuple(range(-len(normalized_shape), 0)),
                                                keepdim=True) + eps)
    gain = 1 if w64 is None else (w64.detach() + zc).abs()
    scales = [dy.double().abs() * rstd * gain, None]
    for got, want, base, scale in zip(ours, ref, native, scales):
        assert rel_err(got, want, scale) <= max(tol, 2 * rel_err(base.to(dtype), want, scale))


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_dweight(device):
    x = torch.randn(4099, 768, device=device, requires_grad=True)
    w = torch.randn(768, device=device, requires_grad=True)
    dy = torch.randn(4099, 768, device=device)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs.append(grads(fl.rms_norm(x, 768, w, 1e-6), [x, w], dy))
    for a, b in zip(*runs):
        assert_bitwise(a, b)


def test_gradcheck_and_opcheck():
    x = torch.randn(5, 3, 17, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 17, dtype=torch.float64, requires_grad=True)
    for zc in (False, True):
        assert torch.autograd.gradcheck(lambda a, b: fl.rms_norm(a, (3, 17), b, 1e-5, zc), (x, w))
    torch.library.opcheck(torch.ops.fusedlayers.rms_norm.default, (x, [3, 17], w, 1e-5, False))
    torch.library.opcheck(torch.ops.fusedlayers.rms_norm.default, (x.float(), [17], None, 0.1))
    y, rstd = torch.ops.fusedlayers.rms_norm(x, [3, 17], w, 1e-5)
    torch.library.opcheck(torch.ops.fusedlayers.rms_norm_backward.default,
                          (torch.randn_like(y), x.detach(), rstd, [3, 17], w.detach(), True))


def test_module_is_drop_in():
    ref = torch.nn.RMSNorm((4, 9))
    torch.nn.init.normal_(ref.weight)
    ours = RMSNorm((4, 9))
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert torch.equal(ours.weight, torch.ones(4, 9))
    ours.load_state_dict(ref.state_dict())
    for dtype in (torch.float32, torch.float64):  # eps=None: finfo(dtype).eps, as torch's
        x = torch.randn(3, 4, 9, dtype=dtype) * 1e-4
        ours.to(dtype), ref.to(dtype)
        assert rel_err(ours(x), ref(x).double()) <= TOL[dtype] * 2
    assert RMSNorm(5, elementwise_affine=False).weight is None
    assert torch.equal(RMSNorm(5, zero_centered=True).weight, torch.zeros(5))


def test_compile_fullgraph():
    m = RMSNorm(64)
    x = torch.randn(8, 64, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    assert_bitwise(y, m(x))


class LlamaStyleRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm, written out (the eps attribute is variance_epsilon)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class GemmaStyleRMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def test_fuse_swaps_rms_norms():
    model = torch.nn.Sequential(torch.nn.RMSNorm(32), torch.nn.Linear(32, 32),
                                LlamaStyleRMSNorm(32), GemmaStyleRMSNorm(32),
                                torch.nn.LayerNorm(32, bias=False))
    for m in (model[2], model[3]):
        torch.nn.init.normal_(m.weight)
    x = torch.randn(6, 32)
    before = model(x)
    fuse(model)
    assert [type(m).__name__ for m in model] == ["RMSNorm", "Linear", "RMSNorm", "RMSNorm",
                                                 "LayerNorm"]
    assert model[3].zero_centered and not model[2].zero_centered
    assert rel_err(model(x), before) <= 1e-5
    assert not any("RMSNorm" in why for _, _, why in model.fusedlayers_report.left)


@pytest.mark.parametrize("args,error,match", [
    (((3, 7), 8, None), ValueError, r"rms_norm: the last 1 dimension\(s\) of input must equal "
                                    r"normalized_shape \[8\], got input of shape \[3, 7\]"),
    (((3, 7), 7, (6,)), ValueError, r"rms_norm: weight must have shape normalized_shape \[7\], "
                                    r"got \[6\]"),
    (((3, 7), 7, (7,), torch.float64), TypeError, r"weight must have input's dtype float32, "
                                                  r"got float64"),
])
def test_errors(args, error, match):
    shape, ns, wshape, *wdtype = args
    w = None if wshape is None else torch.ones(wshape, dtype=wdtype[0] if wdtype else None)
    with pytest.raises(error, match=match):
        fl.rms_norm(torch.randn(shape), ns, w)
    with pytest.raises(ValueError, match=r"rms_norm: eps must be finite and >= 0, got -1"):
        fl.rms_norm(torch.randn(3, 7), 7, None, -1.0)
    with pytest.raises(TypeError, match=r"rms_norm: eps must be a real number"):
        fl.rms_norm(torch.randn(3, 7), 7, None, "1e-5")


# ---------------------------------------------------------------- TensorFlow and Keras

@pytest.fixture
def tf():
    return pytest.importorskip("tensorflow")


@pytest.mark.parametrize("zero_centered", [False, True])
def test_tf_bitwise_with_torch(tf, zero_centered):
    x = torch.randn(65, 3, 100)
    w = torch.randn(3, 100)
    dy = torch.randn(65, 3, 100)
    xt, wt, dyt = (tf.constant(t.numpy()) for t in (x, w, dy))
    with tf.GradientTape() as tape:
        tape.watch([xt, wt])
        yt = fl.rms_norm(xt, (3, 100), wt, 1e-5, zero_centered)
    dxt, dwt = tape.gradient(yt, [xt, wt], output_gradients=dyt)
    x.requires_grad_(), w.requires_grad_()
    y = fl.rms_norm(x, (3, 100), w, 1e-5, zero_centered)
    dx, dw = grads(y, [x, w], dy)
    for a, b in ((yt, y), (dxt, dx), (dwt, dw)):
        assert_bitwise(torch.from_numpy(a.numpy()), b.detach())


def test_tf_gradients_match_autodiff(tf):
    x = tf.constant(torch.randn(9, 37, dtype=torch.float64).numpy())
    w = tf.constant(torch.randn(37, dtype=torch.float64).numpy())
    theo, num = tf.test.compute_gradient(lambda a, b: fl.rms_norm(a, 37, b, 1e-5), [x, w])
    for t, n in zip(theo, num):
        assert abs(t - n).max() <= 1e-7 * max(1.0, abs(n).max())


def test_keras_layer_is_drop_in(tf):
    import keras

    from fusedlayers.keras import RMSNorm as KerasRMSNorm

    x = tf.constant(torch.randn(4, 6, 10).numpy())
    for axis in (-1, [1, 2]):  # Keras' own layer cannot broadcast a non-trailing axis
        ref, ours = keras.layers.RMSNormalization(axis=axis), KerasRMSNorm(axis=axis)
        ref.build(x.shape), ours.build(x.shape)
        ref.scale.assign(torch.randn(tuple(ref.scale.shape)).numpy())
        ours.set_weights(ref.get_weights())
        assert [w.name for w in ours.weights] == [w.name for w in ref.weights]
        err = abs(ours(x).numpy() - ref(x).numpy()).max()
        assert err <= 1e-5, (axis, err)
    clone = KerasRMSNorm.from_config(ours.get_config())
    assert clone.get_config() == ours.get_config()
