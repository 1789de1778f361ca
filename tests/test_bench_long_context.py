"""The long-context benchmark's driver: a contender that fails, hangs or is unknown is reported, never a
crash of the whole run; vLLM's KV figure counts shared prompt blocks once."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import bench_long_context as blc  # noqa: E402

JOB = dict(model="unused.gguf", gguf={}, hf_folder="unused", prompts=[[1, 2, 3]], max_tokens=4, threads=1,
           kv_token_elems=8, vllm_block_size=32)


def test_a_failing_worker_raises_with_its_last_lines(tmp_path):
    # The main venv has no llama_cpp: the worker dies on the import, and the reason names it.
    pythons = dict(llama=sys.executable, vllm=None)
    with pytest.raises(RuntimeError, match="worker exited with 1: .*llama_cpp"):
        blc.run_worker(dict(JOB, engine="llama-q4_1-fa"), str(tmp_path), pythons, timeout=120)


def test_a_worker_past_its_timeout_is_stopped(tmp_path):
    pythons = dict(llama=sys.executable, vllm=None)
    with pytest.raises(RuntimeError, match="no result within --worker-timeout"):
        blc.run_worker(dict(JOB, engine="llama-q4_1-fa"), str(tmp_path), pythons, timeout=0.01)


def test_unknown_engines_are_refused_by_name():
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "benchmarks", "bench_long_context.py"),
                          "--engines", "pagedkv-fp32,vllm-fp64"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
    assert out.returncode == 2 and "vllm-fp64" in out.stderr


def test_vllm_kv_bytes_count_each_shared_prompt_block_once(monkeypatch):
    monkeypatch.setattr(blc, "vllm_runner", lambda *a, **k: (lambda: "ran"))
    doc = list(range(64))                          # two full blocks of 32, shared by both prompts
    prompts = [doc + [100, 101], doc + [200]]      # own tails of 2 and 1 tokens
    job = dict(JOB, engine="vllm-bf16", prompts=prompts, max_tokens=40)
    out, kv = blc.run_vllm(job)()
    # Full blocks: the 2 shared; own: ceil((2 + 40) / 32) = 2 and ceil((1 + 40) / 32) = 2.
    assert out == "ran" and kv == (2 + 4) * 32 * job["kv_token_elems"] * 2
