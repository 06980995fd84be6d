"""The tests' one helper module (pytest puts tests/ on sys.path): error measures and tolerances
calibrated against the framework's own unfused computation, for torch tensors and for TF tensors
or numpy arrays alike; bitwise comparison; strided views of fresh tensors (layouts: "contiguous",
"transposed", "sliced" (last-dim stride 2), "expanded" (stride-0 rows)); float64 references for
the TF tests; subprocess runners for cases that could crash the interpreter.

Nothing here imports TensorFlow at module level, so a test module can `pytest.importorskip` it
first."""

import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

# Device parameter for tests that run on the CPU and, on a CUDA machine, on the GPU too.
DEVICES = ("cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]))
HALF = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# The same by name, for the TF tests; machine epsilon (spacing at 1.0) of each.
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")
HALF_NAMES = ("float16", "bfloat16")
EPS = {"float64": float(np.finfo(np.float64).eps), "float32": float(np.finfo(np.float32).eps),
       "float16": float(np.finfo(np.float16).eps), "bfloat16": 2.0 ** -7}


def rel_err(a, ref, scale=None) -> float:
    """||a - ref|| / ||ref|| in float64 (||a - ref|| when ref is all zeros; 0 for empty), of torch
    tensors, or of TF tensors / variables / numpy arrays.

    scale: the magnitude of the terms that sum to ref (e.g. sum |dy| for a bias gradient), used
    elementwise in place of |ref| where it is larger, so a result that cancels to nearly zero is
    judged against the size of what was summed, not against its own rounding noise."""
    assert tuple(a.shape) == tuple(ref.shape), (a.shape, ref.shape)
    if math.prod(ref.shape) == 0:
        return 0.0
    if isinstance(a, torch.Tensor) and isinstance(ref, torch.Tensor):
        a, ref = a.detach().double(), ref.detach().double()
        den_t = ref.abs() if scale is None else torch.maximum(ref.abs(), scale.detach().double())
        num, den = (a - ref).norm().item(), den_t.norm().item()
    else:
        a, ref = np64(a), np64(ref)
        den_t = np.abs(ref) if scale is None else np.maximum(np.abs(ref), np64(scale))
        num, den = float(np.linalg.norm((a - ref).ravel())), float(np.linalg.norm(den_t.ravel()))
    return num / den if den > 0 else num


def np64(t) -> np.ndarray:
    """A torch or TF tensor, TF variable or numpy array as a float64 numpy array."""
    if isinstance(t, torch.Tensor):
        return t.detach().double().cpu().numpy()
    if hasattr(t, "numpy"):
        # Widened by NumPy (ml_dtypes for bfloat16), not tf.cast: TF's threads flush subnormals
        return np.asarray(t.numpy()).astype(np.float64)
    return np.asarray(t, dtype=np.float64)


def assert_bitwise(a: torch.Tensor, ref: torch.Tensor) -> None:
    """Same dtype, shape and values bit for bit (NaN equal to NaN; +0 equal to -0)."""
    torch.testing.assert_close(a, ref, rtol=0, atol=0, equal_nan=True)


def assert_calibrated(ours: float, baseline: float, what: str, *, dtype, numel: int,
                      factor: float = 2.0, floor: float = 0.0, ulps: float = 1.0,
                      rng=None) -> None:
    """Ours (our relative error against a float64 reference) must be at most `factor` times the
    framework's own unfused error against the same reference (`baseline`), plus a small `floor`,
    plus one ulp of `dtype` (a torch dtype or a name) / sqrt(numel): a tolerance that follows
    the dtype instead of being guessed. The last term covers the rounding noise of few-element
    results (a single output is either exact or an ulp off, whoever computes it); it fades as
    the errors of many elements average out; `ulps` widens it for an op that rounds an
    intermediate the unfused one does not."""
    name = str(dtype).removeprefix("torch.")
    allowed = factor * baseline + floor + ulps * EPS[name] / max(numel, 1) ** 0.5
    assert ours <= allowed, (
        f"{what} [{name}]: relative error {ours:.3e} vs the unfused computation's "
        f"{baseline:.3e} (allowed {factor} x unfused + {floor:.1e} + {ulps} ulp/sqrt({numel}) = "
        f"{allowed:.3e})" + (f" ({rng})" if rng is not None else ""))


def leaf_shape(shape, layout):
    """The shape of the storage tensor from which `as_layout` cuts a view of `shape`."""
    shape = tuple(shape)
    if layout == "contiguous":
        return shape
    if layout == "transposed":
        return (*shape[:-2], shape[-1], shape[-2])
    if layout in ("sliced", "half"):  # every other column; the first half of each row
        return (*shape[:-1], 2 * shape[-1])
    if layout == "heads-seq":  # (b, h, s, d) as Llama's transposed view of (b, s, h, d)
        return (shape[0], shape[2], shape[1], *shape[3:])
    if layout == "expanded":  # every row the same storage: leading strides 0
        return (*(1 for _ in shape[:-1]), shape[-1])
    raise ValueError(layout)


def as_layout(leaf: torch.Tensor, shape, layout) -> torch.Tensor:
    """A view of `leaf` with `shape` and the given (non-contiguous unless 'contiguous') layout."""
    if layout == "contiguous":
        v = leaf
    elif layout == "transposed":
        v = leaf.transpose(-1, -2)
    elif layout == "sliced":
        v = leaf[..., ::2]
    elif layout == "heads-seq":
        v = leaf.transpose(1, 2)
    elif layout == "half":  # rows twice as far apart as they are long: a chunk(2, -1) half
        v = leaf[..., :shape[-1]]
    elif layout == "expanded":
        v = leaf.expand(*shape)
    else:
        raise ValueError(layout)
    assert v.shape == tuple(shape)
    return v


def f64(t: torch.Tensor | None, requires_grad: bool | None = None):
    """A float64 leaf copy of t (None stays None); keeps t's requires_grad unless told."""
    if t is None:
        return None
    rg = t.requires_grad if requires_grad is None else requires_grad
    return t.detach().double().requires_grad_(rg)


def grads(out: torch.Tensor, inputs, grad_out: torch.Tensor):
    """d<out, grad_out>/d inputs (None for inputs that are None)."""
    live = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, live, grad_out.to(out.dtype)))
    return [None if t is None else next(got) for t in inputs]


def assert_survives_subprocess(module: str, call: str, names, env_extra=None) -> None:
    """Runs `module.<call>(name)` for each name in a fresh interpreter (for cases that could
    crash it): fails with the case that was running if the interpreter exits early or fails."""
    code = (f"import {module} as t\n"
            f"for name in {list(names)!r}:\n"
            "    print(name, flush=True)\n"
            f"    t.{call}(name)\n"
            "print('done', flush=True)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, **(env_extra or {}), "PYTHONPATH": os.pathsep.join(
        [tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)
    last = proc.stdout.strip().splitlines()[-1:] or ["(nothing)"]
    assert proc.returncode == 0 and last == ["done"], (
        f"rc {proc.returncode} during {last[0]}\n{proc.stderr[-4000:]}")


def concurrent_mismatches(run, cases, same, repeats: int = 20) -> list:
    """One thread per case (args, want) calling run(*args) `repeats` times at once; the args of
    every result that is not same(result, want)."""
    failures = []

    def work(args, want):
        for _ in range(repeats):
            if not same(run(*args), want):
                failures.append(args)

    threads = [threading.Thread(target=work, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def tf_device(device: str) -> str:
    """TensorFlow's name for a test's device ("cpu", "cuda"); a cuda test skips where TensorFlow
    sees no GPU."""
    import tensorflow as tf
    if device == "cuda" and not tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees no GPU")
    return "/GPU:0" if device == "cuda" else "/CPU:0"


def tf_grads(fn, inputs, dy):
    """y = fn(*inputs) and the gradients of sum(y * dy), summed in float64, wrt the non-None
    inputs (None stays None)."""
    import tensorflow as tf
    live = [t for t in inputs if t is not None]
    with tf.GradientTape() as tape:
        tape.watch(live)
        y = fn(*inputs)
        loss = tf.reduce_sum(tf.cast(y, tf.float64) * tf.cast(dy, tf.float64))
    gs = iter(tape.gradient(loss, live))
    return y, [None if t is None else next(gs) for t in inputs]


def gelu64(u, approximate):
    """GELU of a float64 tf tensor through erfc (approximate 'none') or a logistic ('tanh'),
    without the cancellation of 1 + erf(u) / 1 + tanh(z) that costs tf.nn.gelu ~1e-6 relative
    accuracy in float64 for negative u. Differentiable (GradientTape)."""
    import tensorflow as tf
    if approximate in ("tanh", True):
        z = np.sqrt(2 / np.pi) * (u + 0.044715 * u * u * u)
        return u / (1 + tf.exp(-2 * z))
    return 0.5 * u * tf.math.erfc(-u * np.sqrt(0.5))


def ln_grad_scales(x64, g64, dy64, k, eps, rms_scaling=False):
    """Magnitudes of the terms summed into dx, dgamma, dbeta of a layer norm over the trailing
    k dims (float64): the denominators of their relative errors, so a gradient that cancels to
    ~0 is judged against what was summed. With gy = dy * gamma, xc = (x - mean) * rstd:
      standard: dx = rstd (gy - mean(gy) - xc mean(gy xc)),  dgamma = sum dy xc, dbeta = sum dy
      rms (rms_scaling=True): dx = rstd (gy - xc mean(gy x rstd)), dgamma = sum dy x rstd."""
    axes = tuple(range(x64.ndim - k, x64.ndim))
    lead = tuple(range(x64.ndim - k))
    mean = x64.mean(axes, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mean) ** 2).mean(axes, keepdims=True) + eps)
    xc = np.abs((x64 - mean) * rstd)
    xs = xc if not rms_scaling else np.abs(x64 * rstd)  # what multiplies dy in y
    gy = np.abs(dy64 * (g64 if g64 is not None else 1.0))
    dx = rstd * (gy + (gy.mean(axes, keepdims=True) if not rms_scaling else 0.0)
                 + xc * (gy * xs).mean(axes, keepdims=True))
    return dx, np.sum(np.abs(dy64) * xs, axis=lead), np.sum(np.abs(dy64), axis=lead)


def bits_equal(a, b) -> bool:
    """Same dtype, shape and bit pattern (so -0.0 != +0.0; NaN equal to the same NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.tobytes() == b.tobytes()


def run_python(code: str, env_extra: dict | None = None, timeout: float = 600,
               cwd: str | None = None) -> str:
    """Runs `code` in a fresh interpreter (cwd: the repository root unless given; without the
    FUSEDLAYERS_* variables of this process) and returns its stdout; fails the test with both
    streams if it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDLAYERS_")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", **(env_extra or {})})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=cwd or root, timeout=timeout)
    assert proc.returncode == 0, (
        f"subprocess failed (rc {proc.returncode})\n--- stdout ---\n{proc.stdout[-6000:]}\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc.stdout


def keras_hub_rotary(xp, x, max_wavelength=10000, scaling_factor=1.0):
    """KerasHub's RotaryEmbedding formula for x (batch, seq, ..., dim) in array module xp (numpy
    or jax.numpy, to differentiate it), positions 0..seq-1: the unfused reference."""
    dim, seq = x.shape[-1], x.shape[1]
    inverse_freq = 1.0 / max_wavelength ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    positions = np.arange(seq, dtype=np.float32) / scaling_factor
    freq = np.einsum("i,j->ij", positions, inverse_freq)
    emb = np.concatenate([freq, freq], -1).reshape(1, seq, *([1] * (x.ndim - 3)), dim)
    x1, x2 = xp.split(x, 2, axis=-1)
    rotated = xp.concatenate([-x2, x1], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


# linear_cross_entropy's tests in TensorFlow and JAX: a float64 problem and torch's reference.
LCE_OPTIONS = [dict(), dict(label_smoothing=0.1, softcap=2.0, z_loss=1e-2, ignore_index=5)]


def lce_problem(n, h, v, bias, ignore_index=-100, seed=0):
    """(x, w, b or None, t) in float64 NumPy: logits of a few units, 1 in 5 targets ignored."""
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, h))
    w = g.normal(size=(v, h)) / h ** 0.5 * 3
    b = g.normal(size=v) if bias else None
    t = g.integers(0, v, n)
    t[g.random(n) < 0.2] = ignore_index
    return x, w, b, t


def lce_torch_reference(x, w, b, t, reduction, dy, options):
    """(loss, [dx, dw, db]) of the unfused float64 computation for the cotangent dy."""
    from fusedlayers.torch.linear_cross_entropy import reference
    tx, tw = (torch.tensor(a, requires_grad=True) for a in (x, w))
    tb = None if b is None else torch.tensor(b, requires_grad=True)
    loss = reference(tx, tw, torch.tensor(t), linear_bias=tb, reduction=reduction, **options)
    grads = torch.autograd.grad(loss, [a for a in (tx, tw, tb) if a is not None],
                                torch.tensor(dy))
    return loss.detach().numpy(), [g.numpy() for g in grads]
