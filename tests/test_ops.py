"""Every op of `op_db.OP_DB`, generated from its table entry (sample inputs, reference, bad
inputs): forward and gradients in torch on the CPU and CUDA, in TensorFlow on its CPU and GPU
(there under XLA too) and in JAX against the float64 reference, calibrated against the unfused
computation in the dtype under test (bitwise equal to it where the op rounds once); torch<->TF
(on either device) and torch<->JAX parity (bitwise where they run the same csrc kernels);
gradcheck, tf.test.compute_gradient and jax.test_util.check_grads in float64 (TF's GPU kernels:
compute_gradient in float32); opcheck of every fusedlayers op a sample's forward and backward
reach; and the argument errors in every framework, eagerly and compiled (tf.function, jax.jit).
The op-specific behaviour (modules, options of one framework, special values, determinism) stays
in tests/test_<op>.py."""

import dataclasses
import importlib
import warnings

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlayers as fl
from _helpers import (as_layout, assert_bitwise, assert_calibrated, leaf_shape, np64, rel_err,
                      tf_device)
from op_db import OP_DB

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
HALF = ("float16", "bfloat16")
# Added to the calibrated bound: float64 results are compared with a float64 reference that
# sums in another order; half results round once more than the unfused layer's float math.
FLOOR = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-4, "bfloat16": 1e-4}
CUDA_MARKS = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cases(dtypes, devices=("cpu",), contiguous_only=False, small=False, nonempty=False):
    """pytest params (op, sample, dtype, device) over the table, without the combinations a sample
    does not apply to (float32 parameters under full-precision x, float64 on CUDA, CUDA-sized
    samples on the CPU); small: few enough elements for finite differences."""
    out = []
    for op in OP_DB:
        for s in op.samples:
            if (contiguous_only and s.layout != "contiguous") or (small and (
                    s.cuda_only or s.numel() > 300)) or (nonempty and s.numel() == 0):
                continue
            for dtype in dtypes:
                for device in devices:
                    if (s.params_f32 and dtype not in HALF) or (device == "cuda" and (
                            dtype == "float64")) or (device == "cpu" and s.cuda_only):
                        continue
                    out.append(pytest.param(op, s, dtype, device, id=f"{op.name}-{s.id}-{dtype}"
                                            f"{'-cuda' if device == 'cuda' else ''}",
                                            marks=CUDA_MARKS if device == "cuda" else ()))
    return out


def outputs(y) -> dict:
    """An op's results by name: "y", or "y0", "y1", ... for an op with several (rope)."""
    return {f"y{i}": o for i, o in enumerate(y)} if isinstance(y, (tuple, list)) else {"y": y}


def grad_outputs(rng, y, dtype):
    """A random gradient for each of y's results (one tensor, or a tuple), in `dtype`."""
    draw1 = lambda o: torch.from_numpy(np.asarray(rng.normal(tuple(o.shape)))).to(dtype)  # noqa: E731
    return tuple(map(draw1, y)) if isinstance(y, (tuple, list)) else draw1(y)


def _map(fn, dy):
    return tuple(map(fn, dy)) if isinstance(dy, tuple) else fn(dy)


def draw(op, s, rng):
    """float64 values for the sample's arguments, x as the storage of its layout's view."""
    x = s.first()
    shapes = {**s.shapes, x: leaf_shape(s.shapes[x], s.layout)}
    values = op.draw(rng, dataclasses.replace(s, shapes=shapes))
    return {n: None if v is None else np.asarray(v, np.float64) for n, v in values.items()}


def rounded(values, s, dtype):
    """The values as torch CPU tensors in the dtypes under test (parameters float32 if the sample
    says so): the inputs every framework and the float64 reference see."""
    pdt = torch.float32 if s.params_f32 else DTYPES[dtype]
    return {n: None if v is None else torch.from_numpy(v).to(
        DTYPES[dtype] if n in s.inputs() else pdt)
            for n, v in values.items()}


def run_torch(fn, s, leaves, dy, device="cpu", dtype=None, kwargs=None):
    """fn(**arguments, **kwargs (default: s.kwargs)) on the sample's view of x, and its gradients
    wrt the present tensors for grad_out dy: {"y": y, "d<arg>": ...}. dtype: convert the leaves
    first."""
    t = {n: None if v is None else v.detach().to(device, dtype).requires_grad_(n not in s.nondiff)
         for n, v in leaves.items()}
    x = s.first()
    args = {**t, x: as_layout(t[x], s.shapes[x], s.layout)}
    with warnings.catch_warnings():  # F.rms_norm warns that mixed dtypes take its slow path
        warnings.simplefilter("ignore", UserWarning)
        y = fn(**args, **(s.kwargs if kwargs is None else kwargs))
        present = [n for n, v in args.items() if v is not None and n not in s.nondiff]
        ys = y if isinstance(y, tuple) else (y,)
        dys = dy if isinstance(dy, tuple) else (dy,)
        gs = torch.autograd.grad(ys, [args[n] for n in present],
                                 [d.to(device, o.dtype) for d, o in zip(dys, ys)])
    return {**{n: o.detach() for n, o in outputs(y).items()},
            **{f"d{n}": g for n, g in zip(present, gs)}}


def reference64(op, s, leaves, rng):
    """The float64 reference's results on the rounded inputs, the grad_out drawn for it (in x's
    dtype) and the magnitudes that judge its cancelling gradients."""
    x = s.first()
    kwargs = op.reference_kwargs(s.kwargs, leaves[x].dtype)
    t64 = {n: None if v is None else v.double() for n, v in leaves.items()}
    t64[x] = as_layout(t64[x], s.shapes[x], s.layout)
    with torch.no_grad():
        dy = grad_outputs(rng, op.reference(**t64, **kwargs), leaves[x].dtype)
    dy64 = _map(lambda d: d.double(), dy)
    ref = run_torch(op.reference, s, leaves, dy64, dtype=torch.float64, kwargs=kwargs)
    return ref, dy, op.grad_scales(t64, dy64, kwargs)


def baseline(op, s, leaves, dy, device="cpu"):
    """The unfused computation in the dtypes under test. torch's own layer_norm backward rejects
    a float32 bias without a weight under half x: there, its parameters in x's dtype."""
    try:
        return run_torch(op.reference, s, leaves, dy, device)
    except RuntimeError as e:
        if "expected scalar type" not in str(e) or not s.params_f32:
            raise
        x_dtype = leaves[s.first()].dtype
        return run_torch(op.reference, s, {n: None if v is None else v.to(x_dtype)
                                           for n, v in leaves.items()}, dy, device)


def check(op, s, dtype, leaves, ours, ref, base, scales, rng, what):
    """ours within the calibrated bound of the reference (bitwise equal to base for exact ops),
    each result in the dtype of the argument it is the gradient of (y: x's)."""
    assert set(ours) == set(ref), (what, sorted(ours), sorted(ref))
    for name, want in ref.items():
        got = ours[name]
        expected = leaves[s.first() if name.startswith("y") else name[1:]].dtype
        assert got.dtype == expected, (what, name, got.dtype, expected)
        got = got.cpu()
        assert tuple(got.shape) == tuple(want.shape), (what, name, got.shape, want.shape)
        if op.exact:
            assert_bitwise(got, base[name].cpu())
            continue
        scale = scales.get(name)
        assert_calibrated(rel_err(got, want, scale), rel_err(base[name].cpu(), want, scale),
                          f"{what} {name}", dtype=dtype, numel=want.numel(), floor=FLOOR[dtype],
                          ulps=op.ulps, rng=rng)


# ---------------------------------------------------------------- torch, CPU and CUDA

@pytest.mark.parametrize("op,s,dtype,device", cases(DTYPES, ("cpu", "cuda")))
def test_torch(op, s, dtype, device, rng):
    leaves = rounded(draw(op, s, rng), s, dtype)
    ref, dy, scales = reference64(op, s, leaves, rng)
    ours = run_torch(getattr(fl, op.name), s, leaves, dy, device)
    if not op.keeps_layout:
        assert all(ours[n].is_contiguous() for n in ours if n.startswith("y"))
    base = baseline(op, s, leaves, dy, device)
    check(op, s, dtype, leaves, ours, ref, base, scales, rng, f"torch {op.name} {s.id} on {device}")


@pytest.mark.parametrize("op,s,dtype,device", cases(["float64"], small=True, nonempty=True))
def test_gradcheck(op, s, dtype, device, rng):
    leaves = {n: None if v is None else torch.from_numpy(v)
              for n, v in draw(op, s, rng).items()}
    names = [n for n, v in leaves.items() if v is not None and n not in s.nondiff]

    def fn(*ts):
        args = {**leaves, **dict(zip(names, ts))}
        x = s.first()
        args[x] = as_layout(args[x], s.shapes[x], s.layout)
        return getattr(fl, op.name)(**args, **s.kwargs)

    assert torch.autograd.gradcheck(fn, [leaves[n].requires_grad_() for n in names])


def _copy(a, requires_grad=False):
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().clone().requires_grad_(requires_grad and a.is_floating_point())


class _PublicOps(TorchFunctionMode):
    """Records the fusedlayers ops called from Python (the ops fl.<op> calls), with arguments
    that require grad as the caller's did: their autograd kernels are checked too."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "fusedlayers":
            self.calls[func] = ([_copy(a, getattr(a, "requires_grad", False)) for a in args],
                                {k: _copy(v) for k, v in (kwargs or {}).items()})
        return func(*args, **(kwargs or {}))


class _InnerOps(TorchDispatchMode):
    """Records the fusedlayers ops run below autograd (forward kernels and backward ops), with
    arguments that do not require grad, unless already recorded from Python."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedlayers" and func not in self.calls:
            self.calls[func] = ([_copy(a) for a in args],
                                {k: _copy(v) for k, v in (kwargs or {}).items()})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op,s,dtype,device", cases(["float32", "bfloat16"], ("cpu", "cuda"),
                                                     small=True))
def test_opcheck(op, s, dtype, device, rng):
    leaves = rounded(draw(op, s, rng), s, dtype)
    with torch.no_grad():
        x = as_layout(leaves[s.first()], s.shapes[s.first()], s.layout)
        dy = _map(lambda o: torch.randn(o.shape),
                  getattr(fl, op.name)(**{**leaves, s.first(): x}, **s.kwargs))
    calls = {}
    with _PublicOps(calls), _InnerOps(calls):
        run_torch(getattr(fl, op.name), s, leaves, dy, device)
    public = [f for f in calls if f.name().removeprefix("fusedlayers::") == op.name]
    assert public, f"fl.{op.name} did not call fusedlayers::{op.name} ({list(calls)})"
    for func, (args, kwargs) in calls.items():
        torch.library.opcheck(func, args, kwargs)


def _torch_error_input(e):
    return {n: torch.ones(shape, dtype=DTYPES.get(dt) or getattr(torch, dt))
            for n, (shape, dt) in e.tensors.items()}


@pytest.mark.parametrize("op,e", [pytest.param(op, e, id=f"{op.name}-{e.id}")
                                  for op in OP_DB for e in op.errors])
def test_torch_errors(op, e):
    with pytest.raises(TypeError if e.type_error else ValueError, match=e.match):
        getattr(fl, op.name)(**_torch_error_input(e), **e.kwargs)


# ---------------------------------------------------------------- TensorFlow

@pytest.fixture
def tf():
    return pytest.importorskip("tensorflow")


def run_tf(tf, op, s, leaves, dy, device="cpu", jit=False, fn=None):
    """As run_torch, through the TF op (or `fn`) on `device` (jit: under
    tf.function(jit_compile=True), the op's XLA kernel): {"y": ..., "d<arg>": ...} as TF tensors.
    On cuda every result must have been computed on the GPU (a dtype without a GPU kernel would
    fall back to the CPU's)."""
    fn = getattr(fl, op.name) if fn is None else fn
    with tf.device(tf_device(device)):
        t = {n: None if v is None else tf.cast(tf.constant(v.double().numpy()), str(v.dtype)[6:])
             for n, v in leaves.items()}
        present = [n for n, v in t.items() if v is not None and n not in s.nondiff]
        dys = [tf.cast(tf.constant(d.double().numpy()), t[s.first()].dtype)
               for d in (dy if isinstance(dy, tuple) else (dy,))]

        def forward_and_grads(*args):
            with tf.GradientTape() as tape:
                tape.watch(args)
                y = fn(**{**t, **dict(zip(present, args))}, **s.kwargs)
            ys = list(y) if isinstance(y, tuple) else [y]
            return y, tape.gradient(ys, list(args), output_gradients=dys)

        if jit:
            forward_and_grads = tf.function(forward_and_grads, jit_compile=True)
        y, gs = forward_and_grads(*[t[n] for n in present])
    results = {**outputs(y), **{f"d{n}": g for n, g in zip(present, gs)}}
    if device == "cuda":
        elsewhere = {n: v.device for n, v in results.items() if not v.device.endswith("GPU:0")}
        assert not elsewhere, f"{op.name} {s.id}: results not computed on the GPU: {elsewhere}"
    return results


def tf_baseline(tf, op, s, leaves, dy, device, jit=False):
    """The unfused computation the TF op is judged against: TF's own (op.tf_baseline), else
    torch's on the CPU."""
    if not op.tf_baseline:
        return baseline(op, s, leaves, dy)
    fn = importlib.import_module(f"fusedlayers.tensorflow.{op.name}").reference
    return tf_results_as_torch(run_tf(tf, op, s, leaves, dy, device, jit, fn))


def tf_results_as_torch(results) -> dict:
    return {n: torch.from_numpy(np64(v)).to(DTYPES[v.dtype.name])  # exact: v is in that dtype
            for n, v in results.items()}


@pytest.mark.parametrize("op,s,dtype,device", cases(DTYPES, ("cpu", "cuda"), contiguous_only=True))
def test_tf(op, s, dtype, device, rng, tf):
    leaves = rounded(draw(op, s, rng), s, dtype)
    ref, dy, scales = reference64(op, s, leaves, rng)
    ours = tf_results_as_torch(run_tf(tf, op, s, leaves, dy, device))
    base = tf_baseline(tf, op, s, leaves, dy, device)
    check(op, s, dtype, leaves, ours, ref, base, scales, rng, f"TF {op.name} {s.id} {device}")


@pytest.mark.parametrize("op,s,dtype,device", [
    c for c in cases(["float64"], contiguous_only=True, nonempty=True) if c.values[0].tf_baseline])
def test_tf_baseline_is_the_unfused_math(op, s, dtype, device, rng, tf):
    """The TF baseline that widens test_tf's bounds computes the op: in float64 it equals the
    float64 reference, forward and backward, to 1e-6 (TF's float64 GELU is off by up to ~1e-7
    relative; erf- and tanh-GELU differ by 1e-3)."""
    leaves = rounded(draw(op, s, rng), s, dtype)
    ref, dy, _ = reference64(op, s, leaves, rng)
    base = tf_baseline(tf, op, s, leaves, dy, device)
    assert set(base) == set(ref)
    for name, want in ref.items():
        torch.testing.assert_close(base[name], want, rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{name}: {m} ({rng})")


@pytest.mark.parametrize("op,s,dtype,device", cases(DTYPES, ("cuda",), contiguous_only=True))
def test_tf_xla_gpu(op, s, dtype, device, rng, tf):
    """The ops' XLA kernels on the GPU (tf.function(jit_compile=True)): their custom calls run the
    csrc CUDA kernels inside TensorFlow's XLA, forward and backward."""
    leaves = rounded(draw(op, s, rng), s, dtype)
    ref, dy, scales = reference64(op, s, leaves, rng)
    ours = tf_results_as_torch(run_tf(tf, op, s, leaves, dy, device, jit=True))
    base = tf_baseline(tf, op, s, leaves, dy, device, jit=True)
    check(op, s, dtype, leaves, ours, ref, base, scales, rng, f"TF XLA {op.name} {s.id} GPU")


def check_parity(op, s, dtype, rng, framework: str, run_other, device="cpu"):
    """The same rounded inputs through torch's fused op on `device` and `framework`'s (run_other(
    leaves, dy): results by name, like run_torch's). Ops of csrc kernels alone agree bit for bit;
    linear_gelu's GEMMs are each framework's own (other summation orders), so its float32 results
    agree to the GEMM's rounding and its other dtypes are not compared."""
    if not op.bitwise_parity and dtype != "float32":
        pytest.skip("the frameworks' own GEMMs differ beyond float32 rounding in other dtypes")
    leaves = rounded(draw(op, s, rng), s, dtype)
    dy = grad_outputs(rng, getattr(fl, op.name)(**leaves, **s.kwargs), leaves[s.first()].dtype)
    a = run_torch(getattr(fl, op.name), s, leaves, dy, device)
    b = run_other(leaves, dy)
    assert set(a) == set(b)
    for name in a:
        x, y = np64(a[name]), np64(b[name])
        assert x.shape == y.shape, (name, x.shape, y.shape)
        if op.bitwise_parity:
            diff = ~((x == y) | (np.isnan(x) & np.isnan(y)))
            assert not diff.any(), (f"{op.name} {s.id} {name}: torch and {framework} differ at "
                                    f"{int(diff.sum())} of {x.size} elements ({rng})")
        else:  # GEMM rounding grows ~sqrt(in_features)
            k = s.shapes[s.first()][-1] if s.shapes[s.first()] else 1
            tol = 1e-6 * max(1.0, np.sqrt(k / 64))
            err = rel_err(x, y, op.grad_scales(
                {n: None if v is None else v.double() for n, v in leaves.items()},
                _map(lambda d: d.double(), dy), s.kwargs).get(name))
            assert err <= tol, f"{op.name} {s.id} {name}: {err:.2e} > {tol:.1e} ({rng})"


@pytest.mark.parametrize("op,s,dtype,device", cases(DTYPES, ("cpu", "cuda"), contiguous_only=True))
def test_parity(op, s, dtype, device, rng, tf):
    """torch's op and TF's on the same device: on cuda, the same csrc CUDA kernels."""
    check_parity(op, s, dtype, rng, "TF",
                 lambda leaves, dy: run_tf(tf, op, s, leaves, dy, device), device)


@pytest.mark.parametrize("op,s,dtype,device", cases(["float64"], contiguous_only=True,
                                                     small=True, nonempty=True))
def test_tf_compute_gradient(op, s, dtype, device, rng, tf):
    values = draw(op, s, rng)
    names = [n for n, v in values.items() if v is not None and n not in s.nondiff]

    def fn(*ts):  # several results: compared as one vector
        y = getattr(fl, op.name)(**{**values, **dict(zip(names, ts))}, **s.kwargs)
        return tf.concat([tf.reshape(o, [-1]) for o in y], 0) if isinstance(y, tuple) else y

    theo, num = tf.test.compute_gradient(fn, [tf.constant(values[n]) for n in names],
                                         delta=1e-6)
    for n, t, m in zip(names, theo, num):
        np.testing.assert_allclose(t, m, rtol=1e-6, atol=1e-6, err_msg=f"d{n} ({rng})")


@pytest.mark.parametrize("op,s,dtype,device", cases(["float32"], ("cuda",), contiguous_only=True,
                                                     small=True, nonempty=True))
def test_tf_compute_gradient_gpu(op, s, dtype, device, rng, tf):
    """tf.test.compute_gradient of the GPU kernels, in float32 (they take no float64): central
    differences with step 1e-3 carry float32 rounding of ~1e-4 of the Jacobian's scale."""
    values = {n: None if v is None else v.astype(np.float32) for n, v in draw(op, s, rng).items()}
    names = [n for n, v in values.items() if v is not None and n not in s.nondiff]
    with tf.device(tf_device(device)):
        consts = {n: None if v is None else tf.constant(v) for n, v in values.items()}

        def fn(*ts):
            y = getattr(fl, op.name)(**{**consts, **dict(zip(names, ts))}, **s.kwargs)
            return tf.concat([tf.reshape(o, [-1]) for o in y], 0) if isinstance(y, tuple) else y

        assert fn(*[consts[n] for n in names]).device.endswith("GPU:0")
        theo, num = tf.test.compute_gradient(fn, [consts[n] for n in names], delta=1e-3)
    for n, t, m in zip(names, theo, num):
        np.testing.assert_allclose(t, m, rtol=2e-3, atol=2e-3 * max(1.0, np.abs(m).max()),
                                   err_msg=f"d{n} ({rng})")


@pytest.mark.parametrize("op,e", [pytest.param(op, e, id=f"{op.name}-{e.id}")
                                  for op in OP_DB for e in op.errors])
@pytest.mark.parametrize("mode", ["eager", "tf.function"])
def test_tf_errors(op, e, mode, tf):
    tensors = {n: tf.ones(shape, dt) for n, (shape, dt) in e.tensors.items()}

    def call():
        return getattr(fl, op.name)(**tensors, **e.kwargs)

    with pytest.raises(tf.errors.InvalidArgumentError, match=e.match):
        (call if mode == "eager" else tf.function(call))()


# ---------------------------------------------------------------- JAX (XLA custom calls)

@pytest.fixture
def jax(request):
    """jax with float64 arrays enabled for the test (restored after it); a float64 test runs on
    JAX's CPU device (the CUDA kernels take no float64), the others on its default device."""
    jax = pytest.importorskip("jax")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    float64 = "float64" in request.node.name
    with jax.default_device(jax.devices("cpu")[0] if float64 else None):
        yield jax
    jax.config.update("jax_enable_x64", previous)


def _jax_array(jax, v: torch.Tensor):
    """A torch CPU tensor as a jax.Array of the same dtype (exact: its values are in it)."""
    return jax.numpy.asarray(v.double().numpy()).astype(str(v.dtype).removeprefix("torch."))


def run_jax(jax, op, s, leaves, dy, compiled=True):
    """As run_torch, through the JAX op (under jax.jit when compiled), back as torch tensors."""
    present = [n for n, v in leaves.items() if v is not None and n not in s.nondiff]
    consts = {n: _jax_array(jax, leaves[n]) for n in s.nondiff if leaves.get(n) is not None}

    def fn(*ts):
        return getattr(fl, op.name)(**{**leaves, **consts, **dict(zip(present, ts))}, **s.kwargs)

    def forward_and_grads(*ts):
        y, vjp = jax.vjp(fn, *ts)
        return y, vjp(jax.tree.map(lambda d, o: d.astype(o.dtype),
                                   _map(lambda d: _jax_array(jax, d), dy), y))

    run = jax.jit(forward_and_grads) if compiled else forward_and_grads
    y, gs = run(*[_jax_array(jax, leaves[n]) for n in present])
    back = lambda a: torch.from_numpy(np.asarray(a).astype(np.float64)).to(  # noqa: E731
        DTYPES[str(a.dtype)])
    return {**{n: back(o) for n, o in outputs(y).items()},
            **{f"d{n}": back(g) for n, g in zip(present, gs)}}


@pytest.mark.parametrize("op,s,dtype,device", cases(DTYPES, contiguous_only=True))
def test_jax(op, s, dtype, device, rng, jax):
    leaves = rounded(draw(op, s, rng), s, dtype)
    ref, dy, scales = reference64(op, s, leaves, rng)
    ours = run_jax(jax, op, s, leaves, dy)
    base = baseline(op, s, leaves, dy)
    check(op, s, dtype, leaves, ours, ref, base, scales, rng, f"JAX {op.name} {s.id}")


def _sharded_samples():
    """Each op's samples with rows (nonempty, contiguous), the first dim of its inputs (x; gate
    and up) doubled so that it splits over two devices."""
    out = []
    for op in OP_DB:
        for s in op.samples:
            rows = op.rows(s)
            if s.layout != "contiguous" or s.cuda_only or rows < 1 or s.numel() == 0 or len(
                    {s.shapes[n][0] for n in s.inputs()}) > 1:
                continue
            s2 = dataclasses.replace(s, id=f"{s.id}-rows-split", shapes={
                **s.shapes, **{n: (2 * s.shapes[n][0], *s.shapes[n][1:]) for n in s.inputs()}})
            out.append(pytest.param(op, s2, rows, id=f"{op.name}-{s2.id}"))
    return out


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("op,s,rows", _sharded_samples())
def test_jax_sharded_rows(op, s, rows, platform, rng, jax):
    """Under jit with x (and dy) split over two devices by their first dim, the op runs on each
    device's rows: its results are the unsplit call's (bitwise for y and dx, which each row
    computes alone, where the op is csrc's alone; XLA's dots of linear_gelu and parameter
    gradients summed across devices within float32 rounding), with
    no all-gather in the compiled program, except where relu_scale's mask would split a word."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    try:
        devices = jax.devices(platform)
    except RuntimeError:  # no such backend
        devices = []
    if len(devices) < 2:
        pytest.skip(f"needs two JAX {platform.upper()} devices (on the CPU conftest sets "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts)")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("rows",))
    leaves = rounded(draw(op, s, rng), s, "float32")
    _, dy, scales = reference64(op, s, leaves, rng)
    present = [n for n, v in leaves.items() if v is not None and n not in s.nondiff]
    consts = [n for n in s.nondiff if leaves.get(n) is not None]

    def forward_and_grads(dy, const, *ts):
        y, vjp = jax.vjp(lambda *ts: getattr(fl, op.name)(
            **{**leaves, **dict(zip(consts, const)), **dict(zip(present, ts))}, **s.kwargs), *ts)
        return y, vjp(jax.tree.map(lambda d, o: d.astype(o.dtype), dy, y))

    split, whole = NamedSharding(mesh, P("rows")), NamedSharding(mesh, P())
    dy_arrays = _map(lambda d: _jax_array(jax, d), dy)
    const_arrays = [_jax_array(jax, leaves[n]) for n in consts]
    args = [_jax_array(jax, leaves[n]) for n in present]
    placed = [jax.device_put(dy_arrays, split),
              [jax.device_put(a, split if n in s.inputs() else whole)
               for n, a in zip(consts, const_arrays)],
              *[jax.device_put(a, split if n in s.inputs() else whole)
                for n, a in zip(present, args)]]
    fn = jax.jit(forward_and_grads)
    with jax.default_device(devices[0]):
        y, grads = fn(dy_arrays, const_arrays, *args)
    ys, grads_s = fn(*placed)
    hlo = fn.lower(*placed).compile().as_text()
    got = {**outputs(ys), **{f"d{n}": g for n, g in zip(present, grads_s)}}
    want = {**outputs(y), **{f"d{n}": g for n, g in zip(present, grads)}}
    exact = [n for n in got if n.startswith("y")] + [f"d{n}" for n in s.inputs() if n in present]
    for name in exact if op.bitwise_parity else ():
        assert np.asarray(got[name]).tobytes() == np.asarray(want[name]).tobytes(), (
            f"{name} differs when x's rows are split ({rng})")
    for name in got:
        err = rel_err(torch.from_numpy(np.asarray(got[name], np.float64)),
                      torch.from_numpy(np.asarray(want[name], np.float64)), scales.get(name))
        assert err <= 1e-6, f"{name}: {err:.2e} ({rng})"
    per_row = int(np.prod(s.shapes[s.first()][rows:]))
    if op.name == "relu_scale" and per_row % 32:
        return  # the mask's words would straddle the devices: x is gathered, as documented
    assert "all-gather" not in hlo, f"x was gathered:\n{hlo[:4000]}"
    first = ys[0] if isinstance(ys, tuple) else ys
    assert first.sharding.spec[:1] == P("rows")[:1], first.sharding


@pytest.mark.parametrize("op,s,dtype,device", cases(["float32", "bfloat16"], contiguous_only=True))
def test_jax_parity(op, s, dtype, device, rng, jax):
    """JAX eagerly, on its CPU device: torch ran on the CPU, so both call the same kernels."""
    def run_other(leaves, dy):
        with jax.default_device(jax.devices("cpu")[0]):
            return run_jax(jax, op, s, leaves, dy, compiled=False)
    check_parity(op, s, dtype, rng, "JAX", run_other)


@pytest.mark.parametrize("op,s,dtype,device", cases(["float64"], contiguous_only=True,
                                                     small=True, nonempty=True))
def test_jax_check_grads(op, s, dtype, device, rng, jax):
    from jax.test_util import check_grads
    values = {n: None if v is None else jax.numpy.asarray(v) for n, v in draw(op, s, rng).items()}
    names = [n for n, v in values.items() if v is not None and n not in s.nondiff]

    def fn(*ts):  # check_grads' finite differences pass NumPy arrays
        ts = [jax.numpy.asarray(t) for t in ts]
        return getattr(fl, op.name)(**{**values, **dict(zip(names, ts))}, **s.kwargs)

    check_grads(fn, [values[n] for n in names], order=1, modes=("rev",), atol=1e-6, rtol=1e-6,
                eps=1e-6)


@pytest.mark.parametrize("op,e", [pytest.param(op, e, id=f"{op.name}-{e.id}")
                                  for op in OP_DB for e in op.errors])
@pytest.mark.parametrize("mode", ["eager", "jit", "make_jaxpr", "grad", "vmap"])
def test_jax_errors(op, e, mode, jax):
    """Every argument error is raised while tracing (shapes and dtypes are static in JAX), as
    TypeError (dtypes) or ValueError with csrc's message, eagerly and under jit, grad and vmap:
    jax.make_jaxpr only traces, so an error that waited for XLA would not be raised there."""
    jnp = jax.numpy
    tensors = {n: jnp.ones(shape, dt) for n, (shape, dt) in e.tensors.items()}

    def call(**ts):
        return getattr(fl, op.name)(**ts, **e.kwargs)

    run = {"eager": lambda: call(**tensors),
           "jit": lambda: jax.jit(call)(**tensors),
           "make_jaxpr": lambda: jax.make_jaxpr(call)(**tensors),
           "grad": lambda: jax.grad(lambda ts: sum(
               jnp.sum(o).astype(jnp.float32) for o in jax.tree.leaves(call(**ts))),
               allow_int=True)(tensors),
           # every argument gains a leading mapped axis: the op sees the shapes above
           "vmap": lambda: jax.vmap(lambda ts: call(**ts))(
               {n: jnp.stack([t, t]) for n, t in tensors.items()})}[mode]
    with pytest.raises(TypeError if e.type_error else ValueError, match=e.match):
        run()
