"""Shared fixtures: a fresh random seed per test (reported when the test fails, and fixable with
FUSEDLAYERS_TEST_SEED=<seed> to reproduce), and thread-count restoration."""

import os
import random

import pytest
import torch


@pytest.fixture(autouse=True)
def seed(request):
    """Seeds torch's default RNG with a fresh seed, or with $FUSEDLAYERS_TEST_SEED if set."""
    fixed = os.environ.get("FUSEDLAYERS_TEST_SEED")
    s = int(fixed) if fixed else random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    request.node._fusedlayers_seed = s
    return s


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
