"""CPU threads that stay fast on a shared machine.

torch's CPU ops (its own kernels, MKL, oneDNN and pagedkv's at::parallel_for) run on GNU OpenMP, whose
idle threads spin before they sleep. When another process holds a core, a spinning thread takes turns
with the working one on the cores left, and every parallel region waits for a thread that is not
running: on a 2-core machine with one busy process beside it, the engine at 2 threads fell from ~550 to
~40-100 tok/s (benchmarks/bench_engine.py --contention). With OMP_WAIT_POLICY=PASSIVE idle threads
sleep at once and the same run keeps its speed. libgomp reads the variable when it is loaded (by
`import torch`), so pagedkv sets it, unless the user did, when it is imported before torch.
"""
import os
import sys

WAIT_POLICY_SET_BY_PAGEDKV = False


def prefer_passive_openmp() -> None:
    """Sets OMP_WAIT_POLICY=PASSIVE for this process (and its children) when torch is not loaded yet and
    neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set; PAGEDKV_KEEP_OMP_WAIT_POLICY=1 opts out."""
    global WAIT_POLICY_SET_BY_PAGEDKV
    if "torch" in sys.modules or os.environ.get("PAGEDKV_KEEP_OMP_WAIT_POLICY") == "1":
        return
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        WAIT_POLICY_SET_BY_PAGEDKV = True


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return count
