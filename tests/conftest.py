"""Shared fixtures: a fresh random seed per test (reported when the test fails, and fixable with
FUSEDLAYERS_TEST_SEED=<seed> to reproduce), seeding torch and, as `rng`, a numpy Generator;
torch's threads shared among pytest-xdist's workers; thread-count restoration; the long tests
collected first; TensorFlow's device (its CPU unless a test is marked cuda); and the one guard
on the optional frameworks: TensorFlow's and Keras' tests skip where those are not installed, so
where they are installed but do not import, the session fails instead of turning half the suite
into skips."""

import importlib
import importlib.util
import os
import random
import sys

import numpy as np
import pytest
import torch

import fusedlayers

# TensorFlow's C++ start-up logs off in the test run, as in our own processes (unless set).
fusedlayers.quiet_tensorflow_logs()
# TensorFlow takes a GPU's memory as it needs it, not all of it at start: torch and JAX share the
# device within a test process and among pytest-xdist's workers.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
# pytest-xdist's workers share the machine's cores: each worker's torch takes its share of them
# (at least one thread). With more threads than cores, OpenMP's threads wait for descheduled
# peers at every parallel region's barrier, and small CPU ops run many times slower. Tests of
# the kernels' threading set their own thread counts (restore_threads).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_cores or 1) // _workers))
# Two CPU devices for JAX's sharding tests: XLA reads this when JAX first starts its CPU client.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip()


def pytest_collection_modifyitems(config, items):
    """The tests marked `long` first (in their order): under pytest-xdist each long group then
    starts on a worker of its own beside the short tests, instead of one worker running it alone
    once the rest is done."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_sessionstart(session):
    for name in ("tensorflow", "keras", "jax"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # whatever the import raises, the tests would only be skipped
            pytest.exit(f"{name} is installed but does not import ({type(e).__name__}: {e}); "
                        f"its tests would all be skipped", returncode=1)
    if "tensorflow" in sys.modules:
        # float32 matmuls in float32, not TF32 (TensorFlow's GPU default): the float32 references
        # and tolerances assume it, as for torch (whose default it is).
        sys.modules["tensorflow"].config.experimental.enable_tensor_float_32_execution(False)


@pytest.fixture(autouse=True)
def tensorflow_device(request):
    """TensorFlow places an op on its GPU when it sees one: the tests not marked cuda run on its
    CPU, as torch's tensors default to the CPU (their bitwise comparisons with torch's CPU results
    hold there); those marked cuda place their TensorFlow ops themselves."""
    tf = sys.modules.get("tensorflow")
    if tf is None or request.node.get_closest_marker("cuda") or not tf.config.list_physical_devices(
            "GPU"):
        yield
        return
    with tf.device("/CPU:0"):
        yield


@pytest.fixture(autouse=True)
def seed(request):
    """Seeds torch's default RNG with a fresh seed, or with $FUSEDLAYERS_TEST_SEED if set."""
    fixed = os.environ.get("FUSEDLAYERS_TEST_SEED")
    s = int(fixed) if fixed else random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    request.node._fusedlayers_seed = s
    return s


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
def rng(seed) -> Rng:
    """numpy's Generator on this test's seed (the TF tests draw from it)."""
    return Rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    s = getattr(item, "_fusedlayers_seed", None)
    if report.failed and s is not None:
        report.sections.append(("fusedlayers seed", f"torch.manual_seed({s}); reproduce with "
                                                    f"FUSEDLAYERS_TEST_SEED={s}"))


@pytest.fixture
def restore_threads():
    """Restores torch's intra-op thread count after a test that changes it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def pytest_terminal_summary(terminalreporter):
    """One line counting the skips by reason, so a log shows at a glance why each was skipped."""
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_line("skips by reason: " + "; ".join(
            f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
