"""One table entry per op (the idea of PyTorch's OpInfo): its sample inputs, its unfused
reference and its bad inputs. `test_ops.py` turns every entry into the op's torch tests (CPU and
CUDA), TensorFlow tests, torch<->TF parity, gradcheck / tf.test.compute_gradient, opcheck and
argument-error tests, so a new op adds an entry here and its own op-specific tests only.

A sample is a static description (the shapes and non-tensor arguments, which name the test);
its values are drawn from the test's seeded rng in float64 and rounded to the dtype under test
the same way for both frameworks. The reference is the unfused computation written with stock
torch ops (`fusedlayers.reference`, torch.nn.functional): in float64 it is the truth, in the
dtype under test it is the baseline whose error the fused op's error is calibrated against."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fusedlayers.torch import reference


@dataclass(frozen=True)
class Sample:
    id: str
    shapes: dict            # tensor argument -> shape, in call order (x first); None: absent
    kwargs: dict = field(default_factory=dict)  # the other arguments
    params_f32: bool = False  # parameters in float32 under half x (else in x's dtype)
    layout: str = "contiguous"  # x's layout in the torch tests (_helpers.as_layout)
    cuda_only: bool = False   # a size that exercises a CUDA path and is slow on the CPU
    # The op's inputs (not parameters): in the dtype under test, split by rows in the sharded
    # tests; the first takes the layout and names y's dtype.
    input_names: tuple = ("x",)
    nondiff: tuple = ()  # arguments the op does not differentiate (rope's cos and sin)

    def first(self) -> str:
        return self.input_names[0]

    def inputs(self) -> tuple:
        return self.input_names

    def numel(self) -> int:
        return math.prod(self.shapes[self.first()])


@dataclass(frozen=True)
class ErrorInput:
    id: str
    tensors: dict           # argument -> (shape, dtype name), in call order
    kwargs: dict
    type_error: bool        # torch raises TypeError (dtypes, types), else ValueError; TF
    match: str              # raises InvalidArgumentError; the regex must match both messages


@dataclass(frozen=True)
class OpInfo:
    name: str                # fusedlayers.<name>, called with keyword arguments
    samples: tuple
    draw: Callable           # (rng, sample) -> {argument: float64 ndarray or None}
    reference: Callable      # (**torch tensors, **kwargs) -> y, unfused, at any dtype
    errors: tuple = ()
    exact: bool = False      # the fused op rounds once, as the unfused one: results bitwise equal
    bitwise_parity: bool = True  # torch and TF run the same csrc kernels end to end
    # TF's op runs TF's own GEMMs, whose rounding is not torch's: the TF tests' baseline is
    # fusedlayers.tensorflow.<name>.reference, the unfused computation in TF's ops
    tf_baseline: bool = False
    ulps: float = 1.0        # rounding noise allowed on few-element results (assert_calibrated)
    # (tensors64, dy64, kwargs) -> {"d<arg>": magnitude of the terms summed into that gradient}
    grad_scales: Callable = lambda t, dy, kw: {}
    # (kwargs, x's dtype) -> the kwargs that give the float64 reference the same math (a
    # default that depends on the dtype, as rms_norm's eps=None, made explicit)
    reference_kwargs: Callable = lambda kw, dtype: kw
    keeps_layout: bool = False  # results in their input's layout (rope), not contiguous
    # sample -> the leading dims of its inputs that are rows (split across devices in JAX)
    rows: Callable = lambda s: min(len(s.shapes[s.first()]), 1)


# ---------------------------------------------------------------- relu_scale

def _relu_scale_samples():
    # alpha exactly a float32: TF takes it as a float32 op attribute
    out = [Sample(f"{list(s)}-alpha{a}", {"x": s}, {"alpha": a})
           for s, a in [((0,), 1.0), ((), -1.5), ((1,), 0.375), ((7,), -1.5), ((33, 1000), 0.375),
                        ((2, 3, 4097), 1.0), ((0, 5), 2.0), ((4, 9), 0.0)]]
    out += [Sample(f"[33, 1000]-{lay}", {"x": (33, 1000)}, {"alpha": 0.625}, layout=lay)
            for lay in ("transposed", "sliced", "expanded")]
    out.append(Sample("[1048621]", {"x": ((1 << 20) + 45,)}, {"alpha": 1.25}, cuda_only=True))
    return tuple(out)


def _relu_scale_draw(rng, s):
    return {"x": rng.normal(s.shapes["x"], scale=2.0)}


RELU_SCALE = OpInfo(
    "relu_scale", _relu_scale_samples(), _relu_scale_draw, reference.relu_scale, exact=True,
    errors=(
        *(ErrorInput(f"alpha-{a}", {"x": ((3, 7), "float32")}, {"alpha": a}, False,
                     rf"fusedlayers\.relu_scale: alpha must be finite, got {a}")
          for a in (math.nan, math.inf, -math.inf)),
        ErrorInput("int-x", {"x": ((3, 7), "int32")}, {"alpha": 2.0}, True,
                   r"fusedlayers\.relu_scale: (x|input) must be float32, float64, float16 or "
                   r"bfloat16, got (int32|Int)"),
    ))


# ---------------------------------------------------------------- linear_gelu

def _linear_gelu_samples():
    out = []
    for lead, k, n in [((0,), 7, 4), ((1,), 1, 7), ((33,), 7, 33), ((4, 33), 100, 77),
                       ((2, 5), 33, 1), ((), 9, 5), ((2, 4097), 9, 3)]:
        for approximate in ("none", "tanh"):
            for bias in (True, False):
                out.append(Sample(f"{list(lead)}x{k}->{n}-{approximate}-{'bias' if bias else 'nobias'}",
                                  {"x": (*lead, k), "weight": (n, k), "bias": (n,) if bias else None},
                                  {"approximate": approximate}))
    out += [Sample(f"[40, 33]x33->17-{lay}", {"x": (40, 33), "weight": (17, 33), "bias": (17,)},
                   {"approximate": "none"}, layout=lay) for lay in ("transposed", "sliced")]
    # cuBLASLt's bias+GELU epilogue (tanh, n % 8 == 0) and large GEMM tiles
    out += [Sample(f"[512]x1024->4096-{a}", {"x": (512, 1024), "weight": (4096, 1024),
                                            "bias": (4096,)}, {"approximate": a}, cuda_only=True)
            for a in ("none", "tanh")]
    return tuple(out)


def _linear_gelu_draw(rng, s):
    n, k = s.shapes["weight"]
    return {"x": rng.normal(s.shapes["x"]),
            "weight": rng.normal((n, k), scale=1.5 / math.sqrt(max(k, 1))),
            "bias": None if s.shapes["bias"] is None else rng.normal(n, scale=0.5)}


def _linear_gelu_scales(t, dy, kw):
    """|gelu'| < 1.13: the GEMMs of the backward sum terms of at most 1.13 |dy| |x| (|W|), and y
    is gelu of a sum of terms |x| |W| and |b|, which is what its rounding is relative to."""
    g = 1.13 * dy.abs().reshape(-1, dy.shape[-1]) if dy.dim() else 1.13 * dy.abs().reshape(1, 1)
    x = t["x"].abs().reshape(-1, t["weight"].shape[1])
    b = 0 if t.get("bias") is None else t["bias"].abs()
    y = 1.13 * (x @ t["weight"].abs().T + b)
    return {"y": y.reshape(*t["x"].shape[:-1], t["weight"].shape[0]),
            "dx": (g @ t["weight"].abs()).reshape(t["x"].shape), "dweight": g.T @ x,
            "dbias": g.sum(0)}


LINEAR_GELU = OpInfo(
    "linear_gelu", _linear_gelu_samples(), _linear_gelu_draw, reference.linear_gelu,
    bitwise_parity=False, tf_baseline=True, grad_scales=_linear_gelu_scales,
    rows=lambda s: len(s.shapes["x"]) - 1,
    # On the CPU the GEMM's output is rounded to x's dtype before the bias is added (the
    # framework's GEMM, then csrc's bias+GELU): where the bias cancels it, that is an ulp of
    # more than y, and dx, through GELU's slope at that pre-activation (kept in x's dtype for
    # the backward), inherits it undamped when out_features is 1 (one product per element).
    ulps=6.0,
    errors=(
        ErrorInput("in_features", {"x": ((3, 7), "float32"), "weight": ((5, 6), "float32")}, {},
                   False, r"linear_gelu: the last dimension of (input|x) must equal in_features "
                          r"= (weight\.shape\[1\] = )?6, got (input|x) of shape .3, 7."),
        ErrorInput("weight-1d", {"x": ((3, 7), "float32"), "weight": ((7,), "float32")}, {},
                   False, r"linear_gelu: weight must be 2-D"),
        ErrorInput("bias-shape", {"x": ((3, 7), "float32"), "weight": ((5, 7), "float32"),
                                  "bias": ((4,), "float32")}, {},
                   False, r"linear_gelu: bias must have shape \((out_features,\) = \()?5,\), "
                          r"got .4,?."),
        ErrorInput("weight-dtype", {"x": ((3, 7), "float32"), "weight": ((5, 7), "float64")}, {},
                   True, r"linear_gelu: weight must have (input|x)'s dtype float32, got float64"),
        ErrorInput("half-weight", {"x": ((3, 7), "float32"), "weight": ((5, 7), "bfloat16")}, {},
                   True, r"linear_gelu: weight must have (input|x)'s dtype float32, got bfloat16"),
        ErrorInput("bias-dtype", {"x": ((3, 7), "float32"), "weight": ((5, 7), "float32"),
                                  "bias": ((5,), "float64")}, {},
                   True, r"linear_gelu: bias must have (input|x)'s dtype float32, got float64"),
        *(ErrorInput(f"approximate-{a}", {"x": ((3, 7), "float32"),
                                          "weight": ((5, 7), "float32")}, {"approximate": a},
                     False, rf"linear_gelu: approximate must be 'none' or 'tanh', got '{a}'")
          for a in ("erf", "TANH", "")),
        ErrorInput("int-x", {"x": ((3, 7), "int32"), "weight": ((5, 7), "int32")}, {}, True,
                   r"linear_gelu: (x|input) must be float32, float64, float16 or bfloat16, "
                   r"got (int32|Int)"),
    ))


# ---------------------------------------------------------------- layer_norm and rms_norm

def _norm_shapes():
    """(x shape, normalized_shape): odd widths, 0/1/many rows, multi-dim normalized_shape."""
    return [((0, 7), (7,)), ((1, 1), (1,)), ((33, 7), (7,)), ((33, 1000), (1000,)),
            ((3, 5, 768), (768,)), ((3, 4097), (4097,)), ((2, 3, 5, 7), (5, 7)), ((7,), (7,))]


def _norm_samples(params, kwargs, layout_params):
    out = []
    for shape, ns in _norm_shapes():
        for pid, present in params:
            for f32 in (False, True):
                if f32 and not any(present.values()):
                    continue
                shapes = {"x": shape, **{k: ns if on else None for k, on in present.items()}}
                out.append(Sample(f"{list(shape)}/{list(ns)}-{pid}{'-f32' if f32 else ''}",
                                  shapes, {"normalized_shape": ns, **kwargs}, params_f32=f32))
    for lay in ("transposed", "sliced", "expanded"):
        out.append(Sample(f"[40, 33]/[33]-{lay}", {"x": (40, 33), **layout_params((33,))},
                          {"normalized_shape": (33,), **kwargs}, layout=lay))
    out.append(Sample("[4, 6, 10]/[6, 10]-transposed", {"x": (4, 6, 10), **layout_params((6, 10))},
                      {"normalized_shape": (6, 10), **kwargs}, layout="transposed"))
    # the CUDA kernel shapes: one warp a row, two warps, a block a row, beyond the block
    out += [Sample(f"[{r}, {c}]/[{c}]", {"x": (r, c), **layout_params((c,))},
                   {"normalized_shape": (c,), **kwargs}, cuda_only=True)
            for r, c in ((4099, 768), (1031, 2048), (257, 12288), (33, 65536))]
    return tuple(out)


def _norm_draw(rng, s):
    """Rows with a random offset and scale (the mean matters), parameters around 1 and 0."""
    x = rng.normal(s.shapes["x"], loc=rng.uniform(-2, 2), scale=rng.uniform(0.5, 2))
    out = {"x": x}
    for name, shape in s.shapes.items():
        if name != "x":
            out[name] = None if shape is None else rng.normal(
                shape, loc=1.0 if name == "weight" else 0.0, scale=0.5)
    return out


def _norm_rows(s):
    return len(s.shapes["x"]) - len(s.kwargs["normalized_shape"])


def _trailing(t, ns):
    return tuple(range(t.dim() - len(ns), t.dim())), tuple(range(t.dim() - len(ns)))


def _layer_norm_scales(t, dy, kw):
    """With gy = dy * gamma and xc = (x - mean) * rstd: dx = rstd (gy - mean(gy) - xc
    mean(gy xc)), dgamma = sum dy xc, dbeta = sum dy: each judged against the size of its terms
    where it cancels. xc is itself x rstd - mean rstd: a constant row's true dgamma is 0, and a
    float64 reference's is the rounding of those two terms."""
    axes, lead = _trailing(t["x"], kw["normalized_shape"])
    x = t["x"]
    mean = x.mean(axes, keepdim=True)
    rstd = 1 / ((x - mean).pow(2).mean(axes, keepdim=True) + kw["eps"]).sqrt()
    xc = ((x - mean) * rstd).abs()
    gy = dy.abs() * (1 if t.get("weight") is None else t["weight"].abs())
    dx = rstd * (gy + gy.mean(axes, keepdim=True) + xc * (gy * xc).mean(axes, keepdim=True))
    xs = (x.abs() + mean.abs()) * rstd
    return {"dx": dx, "dweight": (dy.abs() * xs).sum(lead), "dbias": dy.abs().sum(lead)}


def _f32(v):
    """eps as a float32 value: TF takes it as a float32 op attribute."""
    return float(np.float32(v))


LAYER_NORM = OpInfo(
    "layer_norm",
    _norm_samples([("affine", {"weight": True, "bias": True}),
                   ("weight", {"weight": True, "bias": False}),
                   ("bias", {"weight": False, "bias": True}),
                   ("none", {"weight": False, "bias": False})],
                  {"eps": _f32(1e-5)}, lambda ns: {"weight": ns, "bias": ns}),
    _norm_draw, reference.layer_norm, grad_scales=_layer_norm_scales, rows=_norm_rows,
    errors=(
        ErrorInput("trailing", {"x": ((3, 7), "float32")}, {"normalized_shape": 8}, False,
                   r"layer_norm: the last 1 dimension\(s\) of (input|x) must equal "
                   r"normalized_shape \[8\], got (input|x) of shape .3, 7."),
        ErrorInput("trailing-2", {"x": ((3, 7), "float32")}, {"normalized_shape": (3, 8)},
                   False, r"layer_norm: the last 2 dimension\(s\) of (input|x) must equal "
                          r"normalized_shape \[3, 8\]"),
        *(ErrorInput(f"{arg}-shape", {"x": ((3, 7), "float32"), arg: ((6,), "float32")},
                     {"normalized_shape": 7}, False,
                     rf"layer_norm: {arg} must have shape normalized_shape \[7\], got \[6\]")
          for arg in ("weight", "bias")),
        *(ErrorInput(f"{arg}-dtype", {"x": ((3, 7), "float32"), arg: ((7,), "float64")},
                     {"normalized_shape": 7}, True,
                     rf"layer_norm: {arg} must have x's dtype float32, got float64")
          for arg in ("weight", "bias")),
        ErrorInput("half-x-float64-weight", {"x": ((3, 7), "bfloat16"),
                                             "weight": ((7,), "float64")},
                   {"normalized_shape": 7}, True,
                   r"layer_norm: weight must have x's dtype bfloat16 or float32, got float64"),
        *(ErrorInput(f"eps-{e}", {"x": ((3, 7), "float32")}, {"normalized_shape": 7, "eps": e},
                     False, r"layer_norm: eps must be finite and >= 0")
          for e in (math.nan, math.inf, -1e-5)),
        ErrorInput("int-x", {"x": ((3, 7), "int64")}, {"normalized_shape": 7}, True,
                   r"layer_norm: (x|input) must be float32, float64, float16 or bfloat16, "
                   r"got (int64|Long)"),
    ))


def _rms_norm_scales(t, dy, kw):
    """dx = rstd (gy - xs mean(gy xs)), xs = x rstd; dweight = sum dy xs."""
    axes, lead = _trailing(t["x"], kw["normalized_shape"])
    x = t["x"]
    rstd = 1 / (x.pow(2).mean(axes, keepdim=True) + kw["eps"]).sqrt()
    xs = (x * rstd).abs()
    w = t.get("weight")
    gy = dy.abs() * (1 if w is None else (w + kw["zero_centered"]).abs())
    return {"dx": rstd * (gy + xs * (gy * xs).mean(axes, keepdim=True)),
            "dweight": (dy.abs() * xs).sum(lead)}


RMS_NORM = OpInfo(
    "rms_norm",
    _norm_samples([("weight", {"weight": True}), ("none", {"weight": False})],
                  {"eps": _f32(1e-5), "zero_centered": False}, lambda ns: {"weight": ns})
    + tuple(Sample(f"[9, 37]/[37]-{pid}", {"x": (9, 37), "weight": (37,)},
                   {"normalized_shape": (37,), **kw}, params_f32=f32)
            for pid, kw, f32 in [("zero-centered", {"eps": _f32(1e-5), "zero_centered": True}, 0),
                                 ("zero-centered-f32", {"eps": _f32(1e-5),
                                                        "zero_centered": True}, 1),
                                 ("eps-none", {"eps": None, "zero_centered": False}, 0)]),
    _norm_draw, reference.rms_norm, grad_scales=_rms_norm_scales, rows=_norm_rows,
    reference_kwargs=lambda kw, dtype: {**kw, "eps": torch.finfo(dtype).eps
                                        if kw["eps"] is None else kw["eps"]},
    errors=(
        ErrorInput("trailing", {"x": ((3, 7), "float32")}, {"normalized_shape": 8}, False,
                   r"rms_norm: the last 1 dimension\(s\) of (input|x) must equal "
                   r"normalized_shape \[8\], got (input|x) of shape .3, 7."),
        ErrorInput("weight-shape", {"x": ((3, 7), "float32"), "weight": ((6,), "float32")},
                   {"normalized_shape": 7}, False,
                   r"rms_norm: weight must have shape normalized_shape \[7\], got \[6\]"),
        ErrorInput("weight-dtype", {"x": ((3, 7), "float32"), "weight": ((7,), "float64")},
                   {"normalized_shape": 7}, True,
                   r"rms_norm: weight must have x's dtype float32, got float64"),
        ErrorInput("half-x-float64-weight", {"x": ((3, 7), "bfloat16"),
                                             "weight": ((7,), "float64")},
                   {"normalized_shape": 7}, True,
                   r"rms_norm: weight must have x's dtype bfloat16 or float32, got float64"),
        *(ErrorInput(f"eps-{e}", {"x": ((3, 7), "float32")}, {"normalized_shape": 7, "eps": e},
                     False, r"rms_norm: eps must be finite and >= 0")
          for e in (math.nan, -math.inf, -1.0)),
        ErrorInput("int-x", {"x": ((3, 7), "int32")}, {"normalized_shape": 7}, True,
                   r"rms_norm: (x|input) must be float32, float64, float16 or bfloat16, "
                   r"got (int32|Int)"),
    ))


# ---------------------------------------------------------------- add_rms_norm, add_layer_norm

def _add_norm_samples(params, kwargs):
    """x and residual: fewer widths than the norms' (the kernels are theirs), the add's own
    paths: 16-byte vectors and not, rows in registers and streamed."""
    out = []
    for shape, ns in [((0, 7), (7,)), ((33, 7), (7,)), ((33, 1000), (1000,)),
                      ((3, 4097), (4097,)), ((2, 3, 5, 7), (5, 7)), ((7,), (7,))]:
        for pid, present in params:
            for f32 in (False, True) if any(present.values()) else (False,):
                out.append(Sample(
                    f"{list(shape)}/{list(ns)}-{pid}{'-f32' if f32 else ''}",
                    {"x": shape, "residual": shape,
                     **{k: ns if on else None for k, on in present.items()}},
                    {"normalized_shape": ns, **kwargs}, params_f32=f32,
                    input_names=("x", "residual")))
    full = {k: (33,) for k in params[0][1]}
    out += [Sample(f"[40, 33]/[33]-{lay}", {"x": (40, 33), "residual": (40, 33), **full},
                   {"normalized_shape": (33,), **kwargs}, layout=lay,
                   input_names=("x", "residual")) for lay in ("transposed", "sliced")]
    out += [Sample(f"[{r}, {c}]/[{c}]", {"x": (r, c), "residual": (r, c),
                                         **{k: (c,) for k in full}},
                   {"normalized_shape": (c,), **kwargs}, cuda_only=True,
                   input_names=("x", "residual"))
            for r, c in ((1031, 2048), (257, 4096), (33, 65536))]
    return tuple(out)


def _add_norm_draw(rng, s):
    """x and residual of different offsets and scales (their sum's mean matters), parameters
    as the norms'."""
    out = _norm_draw(rng, s)
    out["residual"] = rng.normal(s.shapes["residual"], loc=rng.uniform(-2, 2),
                                 scale=rng.uniform(0.5, 2))
    return out


def _add_norm_scales(norm_scales):
    """The norm's scales at h = x + residual; the residual's gradient (dx's too) adds |dh|,
    and h's rounding is relative to |x| + |residual|."""
    def scales(t, dy, kw):
        x, r = t["x"], t["residual"]
        s = norm_scales({**t, "x": x + r}, dy[0], kw)
        d = s.pop("dx") + dy[1].abs()
        return {**s, "dx": d, "dresidual": d, "y1": x.abs() + r.abs()}
    return scales


def _add_norm_errors(op, kwargs):
    two = {"x": ((3, 7), "float32"), "residual": ((3, 7), "float32")}
    return (
        ErrorInput("residual-shape", {**two, "residual": ((3, 8), "float32")},
                   {"normalized_shape": 7, **kwargs}, False,
                   rf"{op}: residual must have x's shape \[3, 7\], got \[3, 8\]"),
        ErrorInput("residual-dtype", {**two, "residual": ((3, 7), "float64")},
                   {"normalized_shape": 7, **kwargs}, True,
                   rf"{op}: residual must have x's dtype float32, got float64"),
        ErrorInput("half-x-float64-residual", {"x": ((3, 7), "bfloat16"),
                                               "residual": ((3, 7), "float64")},
                   {"normalized_shape": 7, **kwargs}, True,
                   rf"{op}: residual must have x's dtype bfloat16 or float32, got float64"),
        ErrorInput("trailing", two, {"normalized_shape": 8, **kwargs}, False,
                   rf"{op}: the last 1 dimension\(s\) of x must equal normalized_shape \[8\]"),
        ErrorInput("weight-dtype", {**two, "weight": ((7,), "float64")},
                   {"normalized_shape": 7, **kwargs}, True,
                   rf"{op}: weight must have x's dtype float32, got float64"),
        *(ErrorInput(f"eps-{e}", two, {"normalized_shape": 7, **kwargs, "eps": e}, False,
                     rf"{op}: eps must be finite and >= 0") for e in (math.nan, -1.0)),
        ErrorInput("int-residual", {**two, "residual": ((3, 7), "int32")},
                   {"normalized_shape": 7, **kwargs}, True,
                   rf"{op}: residual must be float32, float64, float16 or bfloat16, "
                   r"got (int32|Int)"),
    )


ADD_RMS_NORM = OpInfo(
    "add_rms_norm",
    _add_norm_samples([("weight", {"weight": True}), ("none", {"weight": False})],
                      {"eps": _f32(1e-5), "zero_centered": False})
    + (Sample("[9, 37]/[37]-zero-centered", {"x": (9, 37), "residual": (9, 37),
                                             "weight": (37,)},
              {"normalized_shape": (37,), "eps": _f32(1e-5), "zero_centered": True},
              input_names=("x", "residual")),
       Sample("[9, 37]/[37]-eps-none", {"x": (9, 37), "residual": (9, 37), "weight": (37,)},
              {"normalized_shape": (37,), "eps": None, "zero_centered": False},
              input_names=("x", "residual"))),
    _add_norm_draw, reference.add_rms_norm, grad_scales=_add_norm_scales(_rms_norm_scales),
    rows=_norm_rows,
    reference_kwargs=lambda kw, dtype: {**kw, "eps": torch.finfo(dtype).eps
                                        if kw["eps"] is None else kw["eps"]},
    errors=_add_norm_errors("add_rms_norm", {}))

ADD_LAYER_NORM = OpInfo(
    "add_layer_norm",
    _add_norm_samples([("affine", {"weight": True, "bias": True}),
                       ("bias", {"weight": False, "bias": True}),
                       ("none", {"weight": False, "bias": False})], {"eps": _f32(1e-5)}),
    _add_norm_draw, reference.add_layer_norm, grad_scales=_add_norm_scales(_layer_norm_scales),
    rows=_norm_rows, errors=_add_norm_errors("add_layer_norm", {}))


# ---------------------------------------------------------------- swiglu and geglu

def _gated_samples(kwargs_list):
    out = []
    for kw in kwargs_list:
        tag = "".join(f"-{v}" for v in kw.values())
        for s in ((0,), (), (1,), (7,), (33, 1000), (2, 3, 4097), (0, 5), (5, 3, 8)):
            out.append(Sample(f"{list(s)}{tag}", {"gate": s, "up": s}, kw,
                              input_names=("gate", "up")))
        out += [Sample(f"[33, 1000]-{lay}{tag}", {"gate": (33, 1000), "up": (33, 1000)}, kw,
                       layout=lay, input_names=("gate", "up"))
                for lay in ("transposed", "sliced", "expanded", "half")]
        # the CUDA paths: 16-byte vectors, flat and by rows (a chunk(2, -1) half), and one by one
        out += [Sample(f"[{r}, {c}]-{lay}{tag}", {"gate": (r, c), "up": (r, c)}, kw, layout=lay,
                       cuda_only=True, input_names=("gate", "up"))
                for r, c, lay in ((257, 5632, "contiguous"), (257, 4096, "half"),
                                  (1031, 1001, "contiguous"))]
    return tuple(out)


def _gated_draw(rng, s):
    """gate over the activation's whole shape (its tails and its dip near -1.3), up around 0."""
    return {"gate": rng.normal(s.shapes["gate"], scale=3.0), "up": rng.normal(s.shapes["up"])}


def _gated_errors(op, kwargs):
    return (
        ErrorInput("shape", {"gate": ((3, 7), "float32"), "up": ((3, 8), "float32")}, kwargs,
                   False, rf"fusedlayers\.{op}: up must have gate's shape \[3, 7\], got \[3, 8\]"),
        ErrorInput("up-dtype", {"gate": ((3, 7), "float32"), "up": ((3, 7), "float64")}, kwargs,
                   True, rf"fusedlayers\.{op}: up must have gate's dtype float32, got float64"),
        ErrorInput("int-gate", {"gate": ((3, 7), "int32"), "up": ((3, 7), "int32")}, kwargs, True,
                   rf"fusedlayers\.{op}: gate must be float32, float64, float16 or bfloat16, "
                   r"got (int32|Int)"),
    )


def _gated_scales(t, dy, kw):
    """Each result judged against the size of the terms the unfused layer sums: act(g) up,
    |dy| act(g), and |dy| |up| times those of act'(g) (SiLU: s + g s (1 - s); GELU: 1 + erf,
    or 1 + tanh, and g times the pdf, or the tanh form's (1 - tanh^2) dz). act' crosses zero
    (GELU's near g = -0.75), and GELU's 1 + erf and 1 + tanh cancel in its negative tail, so
    the float64 reference itself is only that accurate there."""
    g, u, d = t["gate"], t["up"].abs(), dy.abs()
    if "approximate" not in kw:
        s = torch.sigmoid(g)
        terms = s + (g * s * (1 - s)).abs()
    elif kw["approximate"] == "tanh":
        terms = 1 + g.abs() * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * g ** 2)
    else:
        terms = 1 + g.abs() * torch.exp(-g * g / 2) / math.sqrt(2 * math.pi)
    return {"y": g.abs() * u, "dgate": d * u * terms, "dup": d * g.abs()}


_GATED_ROWS = lambda s: min(len(s.shapes["gate"]), max(len(s.shapes["gate"]) - 1, 1))  # noqa: E731

SWIGLU = OpInfo("swiglu", _gated_samples([{}]), _gated_draw, reference.swiglu,
                errors=_gated_errors("swiglu", {}), rows=_GATED_ROWS, grad_scales=_gated_scales)

GEGLU = OpInfo(
    "geglu", _gated_samples([{"approximate": "none"}, {"approximate": "tanh"}]), _gated_draw,
    reference.geglu, rows=_GATED_ROWS, grad_scales=_gated_scales,
    errors=_gated_errors("geglu", {"approximate": "tanh"}) + tuple(
        ErrorInput(f"approximate-{a}", {"gate": ((3, 7), "float32"), "up": ((3, 7), "float32")},
                   {"approximate": a}, False,
                   rf"geglu: approximate must be 'none' or 'tanh', got '{a}'")
        for a in ("erf", "TANH", "")))


# ---------------------------------------------------------------- rope

def _rope_samples():
    out = []
    # (batch, q heads, k heads, seq, head_dim, rotary_dim, cos batch)
    geometries = [(1, 1, 1, 1, 2, 2, 1), (2, 4, 2, 7, 16, 16, 2), (3, 3, 1, 5, 8, 8, 1),
                  (2, 2, 2, 3, 12, 8, 2), (1, 5, 5, 9, 6, 4, 1), (2, 4, 1, 0, 8, 8, 2),
                  (0, 2, 2, 3, 8, 8, 1)]
    for b, hq, hk, sq, d, r, bc in geometries:
        for unsq in (1, 2):
            for inter in (False, True):
                def shape(h, b=b, sq=sq, d=d, unsq=unsq):
                    return (b, h, sq, d) if unsq == 1 else (b, sq, h, d)
                out.append(Sample(
                    f"b{b}-h{hq}/{hk}-s{sq}-d{d}-r{r}-cos{bc}-u{unsq}{'-inter' if inter else ''}",
                    {"q": shape(hq), "k": shape(hk), "cos": (bc, sq, r), "sin": (bc, sq, r)},
                    {"unsqueeze_dim": unsq, "interleaved": inter},
                    input_names=("q", "k", "cos", "sin"), nondiff=("cos", "sin")))
    # q and k as Llama makes them: transposed views of (batch, seq, heads, head_dim)
    out.append(Sample("b2-h4/2-s5-d8-transposed", {"q": (2, 4, 5, 8), "k": (2, 2, 5, 8),
                                                   "cos": (2, 5, 8), "sin": (2, 5, 8)},
                      {"unsqueeze_dim": 1, "interleaved": False}, layout="heads-seq",
                      input_names=("q", "k", "cos", "sin"), nondiff=("cos", "sin")))
    # the CUDA kernel's 16-byte vectors (head_dim 64, 128) and partial rotary
    out += [Sample(f"b2-h8/2-s33-d{d}-r{r}-cuda", {"q": (2, 8, 33, d), "k": (2, 2, 33, d),
                                                  "cos": (1, 33, r), "sin": (1, 33, r)},
                   {"unsqueeze_dim": 1, "interleaved": inter}, cuda_only=True,
                   input_names=("q", "k", "cos", "sin"), nondiff=("cos", "sin"))
            for d, r, inter in ((64, 64, False), (128, 128, True), (128, 64, False))]
    return tuple(out)


def _rope_draw(rng, s):
    """q and k around 0; cos and sin of real angles (any angle: the math does not assume it)."""
    angles = rng.uniform(-10, 10, s.shapes["cos"])
    return {"q": rng.normal(s.shapes["q"]), "k": rng.normal(s.shapes["k"]),
            "cos": np.cos(angles), "sin": np.sin(angles)}


def _rope_partner(t, interleaved):
    """t's values at each element's partner in the rotation (rope.h)."""
    if interleaved:
        return t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.roll(t, t.shape[-1] // 2, -1)


def _rope_scales(t, dy, kw):
    """Each result sums |x| |cos| and |x at the partner| |sin| (the backward: |dy| and the sine
    at the partner): bounded by |x| |cos| + |x'| (|sin| + |sin'|), ' the partner's."""
    inter = kw["interleaved"]
    c = t["cos"].abs().unsqueeze(kw["unsqueeze_dim"])
    s = t["sin"].abs().unsqueeze(kw["unsqueeze_dim"])
    r = c.shape[-1]
    s2 = s + _rope_partner(s, inter)
    out = {}
    for key, v in (("y0", t["q"]), ("y1", t["k"]), ("dq", dy[0]), ("dk", dy[1])):
        a = v.abs()
        rot = a[..., :r] * c + _rope_partner(a[..., :r], inter) * s2
        out[key] = torch.cat((rot, a[..., r:]), -1)
    return out


_ROPE_ERROR_ARGS = {"q": ((2, 4, 5, 8), "float32"), "k": ((2, 2, 5, 8), "float32"),
                    "cos": ((2, 5, 8), "float32"), "sin": ((2, 5, 8), "float32")}


def _rope_error(id_, changes, kwargs, type_error, match):
    return ErrorInput(id_, {**_ROPE_ERROR_ARGS, **changes}, kwargs, type_error,
                      r"fusedlayers\.rope: " + match)


ROPE = OpInfo(
    "rope", _rope_samples(), _rope_draw, reference.rope, grad_scales=_rope_scales,
    keeps_layout=True,
    rows=lambda s: s.kwargs["unsqueeze_dim"],
    errors=(
        _rope_error("k-heads-dim", {"k": ((2, 2, 5, 6), "float32")}, {}, False,
                    r"k must match q's batch, seq and head_dim \(2, 5, 8\), got shape "
                    r"\[2, 2, 5, 6\]"),
        _rope_error("q-3d", {"q": ((2, 5, 8), "float32")}, {}, False,
                    r"q must be 4-D, got shape \[2, 5, 8\]"),
        _rope_error("cos-seq", {"cos": ((2, 4, 8), "float32"), "sin": ((2, 4, 8), "float32")},
                    {}, False, r"cos must have shape \(batch or 1, seq, rotary_dim\) = "
                               r"\(2 or 1, 5, rotary_dim\), got \[2, 4, 8\]"),
        _rope_error("sin-shape", {"sin": ((2, 5, 6), "float32")}, {}, False,
                    r"sin must have cos's shape \[2, 5, 8\], got \[2, 5, 6\]"),
        _rope_error("rotary-odd", {"cos": ((2, 5, 7), "float32"), "sin": ((2, 5, 7), "float32")},
                    {}, False, r"rotary_dim \(cos.shape\[-1\]\) must be even, positive and "
                               r"at most head_dim 8, got 7"),
        _rope_error("rotary-wide", {"cos": ((2, 5, 10), "float32"),
                                    "sin": ((2, 5, 10), "float32")}, {}, False,
                    r"rotary_dim \(cos.shape\[-1\]\) must be even, positive and at most "
                    r"head_dim 8, got 10"),
        _rope_error("unsqueeze-3", {}, {"unsqueeze_dim": 3}, False,
                    r"unsqueeze_dim must be 1 \(q, k as \(batch, heads, seq, head_dim\)\) or 2"),
        _rope_error("k-dtype", {"k": ((2, 2, 5, 8), "float64")}, {}, True,
                    r"k must have q's dtype float32, got float64"),
        _rope_error("cos-dtype", {"q": ((2, 4, 5, 8), "bfloat16"), "k": ((2, 2, 5, 8), "bfloat16"),
                                  "cos": ((2, 5, 8), "float64"), "sin": ((2, 5, 8), "float64")},
                    {}, True, r"cos must be float32 or q's dtype bfloat16, got float64"),
        _rope_error("sin-dtype", {"sin": ((2, 5, 8), "float64")}, {}, True,
                    r"sin must have cos's dtype float32, got float64"),
        _rope_error("int-q", {"q": ((2, 4, 5, 8), "int32")}, {}, True,
                    r"q must be float32, float64, float16 or bfloat16, got (int32|Int)"),
    ))

OP_DB = (RELU_SCALE, LINEAR_GELU, LAYER_NORM, RMS_NORM, ADD_RMS_NORM, ADD_LAYER_NORM,
         SWIGLU, GEGLU, ROPE)
