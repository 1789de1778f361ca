"""The engine's CPU thread choice: the tuner runs with the CPUs other processes leave free and follows a
change of load; the thread count respects the CPUs the process may use; cpu_threads= fixes it."""
import os

import pytest
import torch

from pagedkv import _threads as threads_module
from pagedkv._threads import ThreadTuner, available_cpus


def write_stat(path, running):
    path.write_text(f"cpu  1 2 3 4\nprocs_running {running}\nprocs_blocked 0\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_tuner_leaves_the_cpus_other_processes_use(tmp_path, monkeypatch):
    """Runs with every thread on a quiet machine, one when another process holds a core, and back."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads_module, "_own_running_threads", lambda: 1)
    stat = tmp_path / "stat"
    write_stat(stat, 1)
    tuner = ThreadTuner(2, stat_path=str(stat))
    assert [tuner.threads for _ in range(5)] == [2] * 5
    write_stat(stat, 2)                                # one other runnable thread: one CPU left
    assert [tuner.threads for _ in range(5)][-3:] == [1, 1, 1]
    write_stat(stat, 1)
    assert [tuner.threads for _ in range(8)][-3:] == [2, 2, 2]
    write_stat(stat, 7)                                # more than the machine: still one thread
    assert [tuner.threads for _ in range(5)][-1] == 1


def test_tuner_without_proc_stat_keeps_its_threads(tmp_path):
    tuner = ThreadTuner(2, stat_path=str(tmp_path / "missing"))
    assert [tuner.threads for _ in range(3)] == [2, 2, 2]
    assert ThreadTuner(1).threads == 1


def test_own_running_threads_counts_the_caller():
    assert threads_module._own_running_threads() >= 1


def test_available_cpus_follows_affinity():
    n = available_cpus()
    assert 1 <= n <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert n <= len(os.sched_getaffinity(0))


def test_cpu_threads_argument(tmp_path):
    from pagedkv.demo import build_tiny_llama
    from pagedkv.engine import LLM

    build_tiny_llama(str(tmp_path), hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tmp_path), cpu_threads=1)
        assert llm.thread_tuner is None and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        tuned = LLM(str(tmp_path))
        assert tuned.thread_tuner is not None and tuned.thread_tuner.max_threads == min(2, available_cpus())
        with pytest.raises(ValueError, match="cpu_threads"):
            LLM(str(tmp_path), cpu_threads=0)
        with pytest.raises(TypeError, match="cpu_threads"):
            LLM(str(tmp_path), cpu_threads="x")
    finally:
        torch.set_num_threads(before)
