"""pagedkv sets OMP_WAIT_POLICY=PASSIVE when it is imported before torch (idle OpenMP threads must not spin
against a busy machine: pagedkv/_threads.py), never overrides a user's choice, and counts usable CPUs."""
import os
import subprocess
import sys

import pytest

from pagedkv import _threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def policy_after(code, **env):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env={**clean, "PYTHONPATH": REPO, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1]


@pytest.mark.parametrize("code,env,want", [
    ("import pagedkv", {}, "PASSIVE"),
    ("import pagedkv.engine", {}, "PASSIVE"),
    ("import torch, pagedkv", {}, "None"),                 # too late: libgomp already read it
    ("import pagedkv", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
    ("import pagedkv", {"GOMP_SPINCOUNT": "1000"}, "None"),
    ("import pagedkv", {"PAGEDKV_KEEP_OMP_WAIT_POLICY": "1"}, "None"),
])
def test_wait_policy(code, env, want):
    assert policy_after(code, **env) == want


def test_available_cpus_follows_affinity():
    n = _threads.available_cpus()
    assert 1 <= n <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert n <= len(os.sched_getaffinity(0))
