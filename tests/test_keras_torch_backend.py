"""fusedlayers.keras layers under KERAS_BACKEND=torch: the same layer classes run on the torch
extension. In a fresh interpreter (the Keras backend is fixed at import), the three layers are
built on torch-backed inputs and compared with keras.layers.LayerNormalization /
Dense(gelu) / relu * alpha with copied weights, forward and backward (torch autograd); spies on
fusedlayers.torch.ops prove the torch ops ran. The child reports errors against a float64
reference; this process judges them (ours within 2x Keras' own error + 2 ulps)."""

import json

import pytest

# The child needs keras and torch (not TensorFlow); skip where either is absent.
keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")

from _tf_utils import EPS, assert_calibrated, rng, run_python  # noqa: E402,F401

CHILD = r"""
import json, math, os, sys, warnings
import numpy as np
import torch
import keras

assert keras.backend.backend() == "torch", keras.backend.backend()
warnings.filterwarnings("ignore", message=".*rms_scaling.*")

import fusedlayers.torch.ops as tops
from fusedlayers.keras import FusedLinearGELU, FusedReLUScale, LayerNorm

calls = {"layer_norm_trailing": 0, "dense_gelu": 0, "relu_scale": 0}
for name in calls:
    orig = getattr(tops, name)
    def spy(*a, _orig=orig, _name=name, **k):
        calls[_name] += 1
        return _orig(*a, **k)
    setattr(tops, name, spy)

rng = np.random.default_rng(int(sys.argv[1]))
out = {"cases": [], "types": set()}


def rel_err(a, ref):
    a = np.asarray(a, np.float64); ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((a - ref).ravel())
    return float(num / den if den > 0 else num)


def to_np(t):
    return t.detach().to(torch.float64).cpu().numpy()


def run(layer, x, dy):
    # output and gradients of sum(layer(x) * dy) wrt x and the trainable weights, by name
    xt = x.detach().clone().requires_grad_(True)
    y = layer(xt)
    out["types"].add(type(y).__module__ + "." + type(y).__qualname__)
    ws = layer.trainable_weights
    gs = torch.autograd.grad((y.to(torch.float64) * dy.to(torch.float64)).sum(),
                             [xt] + [w.value for w in ws])
    return to_np(y), {"x": to_np(gs[0]), **{w.name: to_np(g) for w, g in zip(ws, gs[1:])}}


def copy_weights(src, *dsts):
    for w in src.weights:
        for d in dsts:
            t = next(v for v in d.weights if v.name == w.name)
            t.assign(keras.ops.cast(w.value, t.dtype))


def run_ref(fn, layer, x, dy):
    # the float64 reference fn(x64, weights64) -> y64 (hand-written in torch: on the torch
    # backend, Keras' own float64 LayerNormalization computes its variance in float32 --
    # keras.ops.var returns float32 for a float64 torch tensor -- so it is no reference)
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    ws = {w.name: w.value.detach().to(torch.float64).requires_grad_(True)
          for w in layer.trainable_weights}
    y = fn(x64, ws)
    gs = torch.autograd.grad((y * dy.to(torch.float64)).sum(), [x64, *ws.values()])
    return to_np(y), {"x": to_np(gs[0]), **{n: to_np(g) for n, g in zip(ws, gs[1:])}}


def compare(what, ours, theirs, ref_fn, x, dy):
    y, g = run(ours, x, dy)
    yk, gk = run(theirs, x, dy)
    yr, gr = run_ref(ref_fn, ours, x, dy)
    assert sorted(g) == sorted(gr) == sorted(gk), (sorted(g), sorted(gr))
    case = {"what": what, "y": [rel_err(y, yr), rel_err(yk, yr), int(y.size)]}
    for name in gr:
        case["d" + name] = [rel_err(g[name], gr[name]), rel_err(gk[name], gr[name]),
                            int(gr[name].size)]
    out["cases"].append(case)


def ln_ref(axis, eps, rms):
    def fn(x, ws):
        axes = sorted(a % x.dim() for a in ([axis] if isinstance(axis, int) else axis))
        bshape = [x.shape[d] if d in axes else 1 for d in range(x.dim())]
        mean = x.mean(dim=axes, keepdim=True)
        inv = torch.rsqrt(((x - mean) ** 2).mean(dim=axes, keepdim=True) + eps)
        y = x * inv if rms else (x - mean) * inv
        if "gamma" in ws:
            y = y * ws["gamma"].reshape(bshape)
        if "beta" in ws:
            y = y + ws["beta"].reshape(bshape)
        return y
    return fn


def dense_ref(approximate):
    def fn(x, ws):
        h = x @ ws["kernel"] + (ws["bias"] if "bias" in ws else 0.0)
        return torch.nn.functional.gelu(h, approximate="tanh" if approximate else "none")
    return fn


shape = (3, 4, 5, 6)
x = torch.tensor(rng.normal(0.5, 1.0, shape), dtype=torch.float32)
x_keras = keras.ops.convert_to_tensor(rng.normal(0.5, 1.0, shape).astype("float32"))
assert isinstance(x_keras, torch.Tensor)
dy = torch.tensor(rng.normal(size=shape), dtype=torch.float32)

# LayerNorm vs LayerNormalization. (Keras' own layer fails on the torch backend for contiguous
# non-trailing axes such as 1 or [1, 2]: it passes them to F.layer_norm, which normalizes
# trailing dims only. Those axes are checked against F.layer_norm on a permuted input below.)
for axis in (-1, [-1, -2], [1, 3], [2, 3]):
    for center, scale, rms in ((True, True, False), (False, True, False), (True, False, False),
                               (False, False, False), (True, True, True)):
        kw = dict(axis=axis, epsilon=1e-4, center=center, scale=scale, rms_scaling=rms)
        ours, theirs = LayerNorm(**kw), keras.layers.LayerNormalization(**kw)
        xin = x
        if rms:  # near-centered rows (rms dx conditioning: see test_tf_ops)
            red = tuple(a % 4 for a in ([axis] if isinstance(axis, int) else axis))
            xin = x - x.mean(dim=red, keepdim=True)
        ours(xin); theirs(xin)
        assert [(w.name, tuple(w.shape)) for w in ours.weights] == \
               [(w.name, tuple(w.shape)) for w in theirs.weights]
        for w in ours.weights:
            w.assign(rng.normal(1.0 if w.name == "gamma" else 0.0, 0.5, tuple(w.shape)))
        copy_weights(ours, theirs)
        compare(f"LayerNorm({kw})", ours, theirs, ln_ref(axis, 1e-4, rms), xin, dy)
        # also on a tensor made by keras.ops (torch-backed keras input)
        y2 = ours(x_keras)
        assert isinstance(y2, torch.Tensor)
        np.testing.assert_allclose(to_np(y2), to_np(theirs(x_keras)), rtol=1e-4, atol=1e-4)

# contiguous non-trailing axes: against torch's layer_norm of the permuted input, in float64
for axis in (1, [1, 2]):
    axes = [axis] if isinstance(axis, int) else axis
    perm = [d for d in range(4) if d not in axes] + axes
    inv = [perm.index(d) for d in range(4)]
    ours = LayerNorm(axis=axis, epsilon=1e-4)
    ours(x)
    for w in ours.weights:
        w.assign(rng.normal(1.0 if w.name == "gamma" else 0.0, 0.5, tuple(w.shape)))
    x64 = x.to(torch.float64).requires_grad_(True)
    g64 = torch.tensor(to_np(ours.gamma.value))
    b64 = torch.tensor(to_np(ours.beta.value))
    yr = torch.nn.functional.layer_norm(x64.permute(perm), tuple(g64.shape), g64, b64,
                                        1e-4).permute(inv)
    (dxr,) = torch.autograd.grad((yr * dy.to(torch.float64)).sum(), [x64])
    y, g = run(ours, x, dy)
    case = {"what": f"LayerNorm(axis={axis}) vs permuted F.layer_norm (float64)",
            "max_abs_y": float(np.abs(y - to_np(yr)).max()),
            "max_abs_dx": float(np.abs(g["x"] - to_np(dxr)).max()),
            "scale_dx": float(np.abs(to_np(dxr)).max())}
    out.setdefault("permuted", []).append(case)

# FusedLinearGELU vs Dense(gelu)
xl = torch.tensor(rng.normal(size=(2, 7, 6)), dtype=torch.float32)
dyl = torch.tensor(rng.normal(size=(2, 7, 11)), dtype=torch.float32)
for approximate in (False, True):
    for use_bias in (True, False):
        act = (lambda t: keras.activations.gelu(t, approximate=True)) if approximate else "gelu"
        ours = FusedLinearGELU(11, use_bias=use_bias, approximate=approximate)
        theirs = keras.layers.Dense(11, activation=act, use_bias=use_bias)
        ours(xl); theirs(xl)
        assert [(w.name, tuple(w.shape)) for w in ours.weights] == \
               [(w.name, tuple(w.shape)) for w in theirs.weights]
        for w in ours.weights:
            w.assign(rng.normal(0.0, 0.6, tuple(w.shape)))
        copy_weights(ours, theirs)
        compare(f"FusedLinearGELU(11, use_bias={use_bias}, approximate={approximate})",
                ours, theirs, dense_ref(approximate), xl, dyl)
        assert isinstance(ours(x_keras[..., :6]), torch.Tensor)

# FusedReLUScale: bit-identical to relu(x) * alpha, forward and backward
alpha = float(rng.uniform(-2, 2))
layer = FusedReLUScale(alpha)
xr = x.detach().clone().requires_grad_(True)
y = layer(xr)
assert isinstance(y, torch.Tensor)
(dx,) = torch.autograd.grad((y * dy).sum(), [xr])
xr2 = x.detach().clone().requires_grad_(True)
y2 = keras.activations.relu(xr2) * alpha
(dx2,) = torch.autograd.grad((y2 * dy).sum(), [xr2])
out["relu_equal"] = bool(torch.equal(y, y2)) and bool(torch.equal(dx, dx2))

# a small model trains on the torch backend
model = keras.Sequential([keras.Input((6,)), FusedLinearGELU(8), LayerNorm(),
                          FusedReLUScale(0.5), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
xs = rng.normal(size=(64, 6)).astype("float32")
hist = model.fit(xs, np.tanh(xs.sum(1, keepdims=True)), epochs=2, verbose=0)
out["losses"] = [float(v) for v in hist.history["loss"]]

out["calls"] = calls
out["types"] = sorted(out["types"])
print("RESULT" + json.dumps(out))
"""


def test_keras_layers_on_torch_backend(rng):
    code = f"import sys; sys.argv = ['child', '{rng.seed}']\n" + CHILD
    stdout = run_python(code, env_extra={"KERAS_BACKEND": "torch"}, timeout=300)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT"))
    got = json.loads(line[len("RESULT"):])

    assert got["types"] == ["torch.Tensor"], got["types"]
    for op, n in got["calls"].items():
        assert n > 0, f"fusedlayers.torch.ops.{op} was never called: {got['calls']}"
    assert got["relu_equal"], "FusedReLUScale != relu(x) * alpha on the torch backend"
    assert all(v == v and abs(v) < 1e30 for v in got["losses"]), got["losses"]
    assert len(got["cases"]) == 4 * 5 + 4
    assert len(got["permuted"]) == 2
    for case in got["permuted"]:  # outputs ~1: float32 rounding is ~1e-6
        assert case["max_abs_y"] < 2e-5, (case, str(rng))
        assert case["max_abs_dx"] < 2e-5 * max(1.0, case["scale_dx"]), (case, str(rng))
    for case in got["cases"]:
        for key, errs in case.items():
            if key == "what":
                continue
            ours, theirs, numel = errs
            assert_calibrated(ours, theirs, f"{case['what']} {key}", dtype="float32",
                              numel=numel, rng=rng, floor=2 * EPS["float32"])

