"""pytest configuration: every test runs under one seed for `random`, numpy and torch (derived from the
test's name, so a run is reproducible; $PAGEDKV_TEST_SEED=N fixes it, =random draws a fresh one per test),
and a failing test's report says how to replay it; the run ends with one line that
says why CUDA tests were skipped, if they were. Shared helpers live in tests/ops_reference.py (ops) and
tests/bm_model.py (block manager); pytest puts tests/ on sys.path."""
import os
import random
import zlib

import numpy as np
import pytest
import torch

SEED_VARIABLE = "PAGEDKV_TEST_SEED"


def _draw_seed(nodeid: str) -> int:
    fixed = os.environ.get(SEED_VARIABLE)
    if fixed == "random":
        return random.SystemRandom().randrange(2**32)
    if fixed:
        try:
            return int(fixed, 0)
        except ValueError:
            raise pytest.UsageError(f"{SEED_VARIABLE} must be an integer or 'random', got {fixed!r}") from None
    return zlib.crc32(nodeid.encode())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Seeds before any fixture of the test is set up, so module fixtures that draw are replayable too."""
    seed = _draw_seed(item.nodeid)
    item.pagedkv_seed = seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture
def seed(request) -> int:
    """This test's seed (already applied to `random`, numpy and torch)."""
    return request.node.pagedkv_seed


@pytest.fixture
def rng(seed) -> random.Random:
    """A random.Random of its own, seeded with this test's seed."""
    return random.Random(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "pagedkv_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"replay with: {SEED_VARIABLE}={seed} pytest '{item.nodeid}'"))
    return report


def pytest_terminal_summary(terminalreporter):
    if torch.cuda.is_available() or not terminalreporter.stats.get("skipped"):
        return
    why = "this torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
    terminalreporter.write_line(f"pagedkv: the CUDA variants were skipped ({why}); the CUDA kernels run on the "
                                "CPU emulator in the C++ tests instead")
