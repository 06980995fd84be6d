"""Utilities shared by the TensorFlow / Keras tests (test_tf_*.py, test_keras_*.py,
test_parity.py): a fresh random generator per test, float64 conversions, error measures and
tolerances calibrated against the framework's own unfused computation.

Nothing here imports TensorFlow at module level, so a module can `pytest.importorskip` it first.
The torch tests' conftest.py is separate; this module is imported explicitly
(`from _tf_utils import rng, ...`), pytest puts tests/ on sys.path.
"""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

# Machine epsilon (spacing at 1.0) of each floating dtype, by name.
EPS = {
    "float64": float(np.finfo(np.float64).eps),
    "float32": float(np.finfo(np.float32).eps),
    "float16": float(np.finfo(np.float16).eps),
    "bfloat16": 2.0 ** -7,
}
DTYPES = ("float32", "float64", "float16", "bfloat16")
HALF = ("float16", "bfloat16")


class Rng:
    """numpy's Generator with its seed, for assertion messages and reproduction."""

    def __init__(self, seed: int):
        self.seed = seed
        self.gen = np.random.default_rng(seed)

    def normal(self, shape, scale=1.0, loc=0.0) -> np.ndarray:
        return self.gen.normal(loc, scale, size=shape)

    def uniform(self, low, high, shape=None):
        return self.gen.uniform(low, high, size=shape)

    def away_from_zero(self, shape, gap=0.1) -> np.ndarray:
        """Normal values with |v| >= gap: finite differences do not straddle relu's kink."""
        v = self.gen.normal(size=shape)
        return np.sign(v) * (gap + np.abs(v))

    def __str__(self):
        return f"seed {self.seed}; reproduce with FUSEDLAYERS_TEST_SEED={self.seed}"


@pytest.fixture
def rng(request) -> Rng:
    """A fresh seed per test (from SystemRandom), or $FUSEDLAYERS_TEST_SEED to reproduce one.
    The seed is also attached to the test item, which tests/conftest.py reports on failure."""
    fixed = os.environ.get("FUSEDLAYERS_TEST_SEED")
    seed = int(fixed) if fixed else random.SystemRandom().randrange(2 ** 32)
    request.node._fusedlayers_seed = seed
    return Rng(seed)


def f64(t) -> np.ndarray:
    """A tf tensor / variable / numpy array as a float64 numpy array."""
    if hasattr(t, "numpy"):
        import tensorflow as tf
        return tf.cast(t, tf.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def rel_err(a, ref, scale=None) -> float:
    """||a - ref|| / ||ref|| in float64 (||a - ref|| when ref is all zeros, 0 when empty).

    scale: magnitudes of the terms summed into ref (e.g. sum |dy| for a bias gradient), used
    elementwise in place of |ref| where larger, so a cancelling sum is judged against what was
    summed."""
    a, ref = f64(a), f64(ref)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    if ref.size == 0:
        return 0.0
    den_t = np.abs(ref) if scale is None else np.maximum(np.abs(ref), f64(scale))
    num = float(np.linalg.norm((a - ref).ravel()))
    den = float(np.linalg.norm(den_t.ravel()))
    return num / den if den > 0 else num


def assert_calibrated(ours: float, baseline: float, what: str, *, dtype: str, numel: int,
                      rng=None, factor: float = 2.0, floor: float = 0.0) -> None:
    """ours (our relative error against a float64 reference) must be at most `factor` times the
    framework's own unfused error against the same reference (`baseline`), plus `floor`, plus
    one ulp of dtype / sqrt(numel) (few-element results are exact or an ulp off, whoever
    computes them; the term fades as many elements average out)."""
    allowed = factor * baseline + floor + EPS[dtype] / max(numel, 1) ** 0.5
    assert ours <= allowed, (
        f"{what} [{dtype}]: relative error {ours:.3e} vs the unfused computation's "
        f"{baseline:.3e} (allowed {factor} x unfused + {floor:.1e} + ulp/sqrt({numel}) = "
        f"{allowed:.3e}) ({rng})")


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


def run_python(code: str, env_extra: dict | None = None, timeout: float = 240) -> str:
    """Runs `code` in a fresh interpreter (cwd: the repository root) and returns its stdout;
    fails the test with both streams if it exits non-zero."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env_extra or {})}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=root, timeout=timeout)
    assert proc.returncode == 0, (
        f"subprocess failed (rc {proc.returncode})\n--- stdout ---\n{proc.stdout[-6000:]}\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc.stdout
