"""Tensor-parallel workers start from their own entry point (`python -m pagedkv.engine.tp.worker`), never by
re-importing the caller's main module: tensor_parallel_size=2 works from a script without a main guard,
from `python -c` and from `python -` (stdin), with tp=1's greedy tokens; interpreter exit and a killed
rank 0 leave no worker behind; a worker that fails while starting or loading is reported with its
traceback."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine_fixtures import save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.tp import group
from pagedkv.engine.tp.collectives import TensorParallelError
from pagedkv.engine.tp.workers import PARENT_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # where pagedkv is importable
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_llama(path)
    prompts = shared_prefix_prompts(model.config.vocab_size)[:3]
    expected = [o.token_ids for o in LLM(str(path), block_size=8).generate(prompts, GREEDY)]
    return str(path), prompts, expected


def driver_code(path, prompts, then="") -> str:
    """A script with no main guard: rank 0 of a TP=2 engine that prints its pid, its workers' pids and
    its tokens, then runs `then` (and exits without closing the engine)."""
    return (f"import os, torch\n"
            f"from pagedkv.engine import LLM, SamplingParams\n"
            f"torch.set_num_threads(1)\n"
            f"llm = LLM({path!r}, tensor_parallel_size=2, block_size=8)\n"
            f"print('PIDS', os.getpid(), [p.pid for p in llm.tp.processes], flush=True)\n"
            f"out = llm.generate({prompts!r}, SamplingParams(max_tokens={MAX_TOKENS}, ignore_eos=True))\n"
            f"print('TOKENS', [o.token_ids for o in out], flush=True)\n"
            f"{then}\n")


def env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def workers_of(driver_pid: int) -> list[int]:
    """Live (not zombie) processes whose environment names `driver_pid` as their tensor-parallel rank 0."""
    found = []
    marker = f"{PARENT_ENV}={driver_pid}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker in environ and not zombie:
            found.append(int(entry))
    return found


def parse_pids(stdout: str) -> tuple[int, list[int]]:
    line = next(line for line in stdout.splitlines() if line.startswith("PIDS "))
    driver, workers = line.split(" ", 2)[1:]
    return int(driver), eval(workers)     # noqa: S307 (our own script's output: a list of ints)


def assert_gone(driver_pid: int, worker_pids: list[int], wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while workers_of(driver_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers_of(driver_pid), f"workers of rank 0 (pid {driver_pid}) are still running"
    assert len(worker_pids) == 1


@pytest.mark.parametrize("how", ["script", "-c", "stdin"])
def test_tp2_without_a_main_guard(tiny, tmp_path, how):
    path, prompts, expected = tiny
    code = driver_code(path, prompts)
    if how == "script":
        script = tmp_path / "no_main_guard.py"
        script.write_text(code)
        run = dict(args=[sys.executable, str(script)])
    elif how == "-c":
        run = dict(args=[sys.executable, "-c", code])
    else:
        run = dict(args=[sys.executable, "-"], input=code)
    done = subprocess.run(**run, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"TOKENS {expected!r}" in done.stdout
    assert_gone(*parse_pids(done.stdout))


def test_workers_exit_when_rank_0_is_killed(tiny, tmp_path):
    path, prompts, expected = tiny
    code = driver_code(path, prompts, then="import time; time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[1] == f"TOKENS {expected!r}\n", lines
        driver, workers = parse_pids(lines[0])
        assert workers_of(driver) == workers
    finally:
        proc.kill()
        proc.wait()
    assert_gone(driver, workers)


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_worker_that_fails_to_start_is_reported_with_its_traceback(tiny, monkeypatch, one_thread):
    path, _, _ = tiny
    real = group.worker_spec

    def bad_spec(*args):              # the workers, and only they, get a block size they refuse
        spec = real(*args)
        spec.config["block_size"] = 0
        return spec
    monkeypatch.setattr(group, "worker_spec", bad_spec)
    with pytest.raises(TensorParallelError, match="worker rank 1 failed to start: Traceback") as info:
        LLM(path, tensor_parallel_size=2, block_size=8)
    assert "ValueError: block_size must be >= 1, got 0" in str(info.value)
    assert not workers_of(os.getpid())


def test_worker_that_fails_to_load_its_shard_is_reported_with_its_traceback(tiny, monkeypatch, one_thread):
    path, _, _ = tiny
    real = group.worker_spec

    def moved_model(*args):
        spec = real(*args)
        spec.model_path += "-moved"
        return spec
    monkeypatch.setattr(group, "worker_spec", moved_model)
    with pytest.raises(TensorParallelError, match="worker rank 1 failed: FileNotFoundError: model_path") as info:
        LLM(path, tensor_parallel_size=2, block_size=8)
    assert "Traceback" in str(info.value) and "-moved" in str(info.value)
    assert not workers_of(os.getpid())
