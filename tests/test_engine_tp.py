"""Tensor parallelism (gloo, CPU processes): greedy output of LLM(tensor_parallel_size=N) equals the
single-process engine and transformers token for token, through prefix caching, preemption by swap and
by recompute, n > 1 and chunked prefill, with KV heads split or replicated; a worker that raises or dies
makes generate() raise its error; close, garbage collection and Ctrl-C leave no process behind."""
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine_fixtures import hf_greedy, save_tiny_llama, shared_prefix_prompts
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.execution.model_runner import kv_cache_block_bytes
from pagedkv.engine.tp.collectives import TensorParallelError
from pagedkv.engine.tp.shard import Shard
from pagedkv.engine.tp.step_message import StepMessage

MAX_TOKENS = 12
# Six query heads and one KV head (replicated over 2 or 3 ranks), an MLP and a vocabulary that no rank
# count divides (uneven MLP shards, a padded last vocabulary shard), biases (row-parallel ones added by
# rank 0 only) and tied embeddings.
ODD = dict(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=1, vocab_size=383,
           attention_bias=True, mlp_bias=True, tie_word_embeddings=True)


def spawned_workers() -> list[int]:
    """Live tensor-parallel worker processes below this one."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if b"pagedkv.engine.tp.worker" in cmdline and not zombie:
            found.append(pid)
    return found


@pytest.fixture(autouse=True)
def no_orphans():
    before = set(spawned_workers())
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while set(spawned_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(spawned_workers()) - before, "a test left tensor-parallel workers running"


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)       # workers take the driver's thread count: one per rank on 2 cores
    yield
    torch.set_num_threads(previous)


def _model(tmp_path_factory, name, **overrides):
    path = tmp_path_factory.mktemp(name)
    model = save_tiny_llama(path, **overrides)
    prompts = shared_prefix_prompts(model.config.vocab_size)
    return str(path), prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _model(tmp_path_factory, "tiny_llama")


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return _model(tmp_path_factory, "odd_llama", **ODD)


def greedy(n=1):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)


def outputs(llm, prompts, n):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy(n))]


# ---- sharding geometry (no processes) ---------------------------------------------------------------
@pytest.mark.parametrize("heads,kv_heads,size", [(4, 2, 2), (8, 2, 4), (6, 1, 3), (6, 1, 2), (8, 8, 8), (16, 4, 8)])
def test_shards_cover_the_model_once(heads, kv_heads, size):
    cfg = ModelConfig(vocab_size=1001, hidden_size=16 * heads, intermediate_size=101, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=16)
    shards = [Shard(r, size) for r in range(size)]
    assert sorted(h for s in shards for h in s.q_heads(cfg)) == list(range(heads))
    assert sorted(i for s in shards for i in s.intermediate(cfg)) == list(range(101))
    assert sorted(v for s in shards for v in s.vocab(cfg)) == list(range(1001))
    group = heads // kv_heads
    for s in shards:
        local = s.local_config(cfg)
        assert local.num_heads * size == heads and local.vocab_size == cfg.vocab_size
        assert local.num_kv_heads == max(1, kv_heads // size)
        assert {q // group for q in s.q_heads(cfg)} <= set(s.kv_heads(cfg)), "GQA groups stay on one rank"
    assert {h for s in shards for h in s.kv_heads(cfg)} == set(range(kv_heads))


def test_incompatible_head_counts_raise_before_spawning(tiny):
    path, _, _ = tiny
    with pytest.raises(ValueError, match="must divide num_attention_heads=4"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(path, tensor_parallel_size=0)
    with pytest.raises(TypeError, match="tensor_parallel_size must be an int"):
        LLM(path, tensor_parallel_size=2.0)
    with pytest.raises(ValueError, match="distributed_backend"):
        LLM(path, tensor_parallel_size=2, distributed_backend="mpi")
    with pytest.raises(ValueError, match="needs device='cuda'"):
        LLM(path, tensor_parallel_size=2, distributed_backend="nccl")


# ---- output equality ---------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [
    dict(enable_prefix_caching=True, num_cpu_blocks=64, max_num_batched_tokens=20, num_blocks=24, n=2),
    dict(enable_prefix_caching=False, num_cpu_blocks=0, max_num_batched_tokens=4096, num_blocks=12, n=1),
], ids=["prefix-swap-chunked-n2", "noprefix-recompute"])
def test_tp2_matches_single_process_and_transformers(tiny, setting):
    path, prompts, expected = tiny
    setting = dict(setting)
    n = setting.pop("n")
    kwargs = dict(block_size=8, **setting)
    single = LLM(path, **kwargs)
    want = [[e] * n for e in expected]
    assert outputs(single, prompts, n) == want
    with LLM(path, tensor_parallel_size=2, **kwargs) as llm:
        assert llm.runner.kv_caches[0][0].shape[2] == 1, "each rank caches one of the two KV heads"
        assert kv_cache_block_bytes(llm.model, 8, torch.float32) * 2 == \
            kv_cache_block_bytes(single.model, 8, torch.float32)
        assert outputs(llm, prompts, n) == want
        assert outputs(llm, prompts[::-1], n) == want[::-1]      # a second round over a warm cache
        stats = llm.stats()
        preempted = "preempted_swap" if setting["num_cpu_blocks"] else "preempted_recompute"
        assert stats[preempted] > 0 and stats["used_blocks"] == 0
        if setting["enable_prefix_caching"]:
            assert stats["cached_prompt_tokens"] > 0
        if n > 1:
            assert stats["cow_copies"] > 0
        llm.bm.check_invariants()
    assert llm.tp.processes and not any(p.is_alive() for p in llm.tp.processes), "close() stopped the workers"


def test_tp2_with_speculative_decoding(tiny):
    """Speculative verification keeps several rows per sequence: every rank must keep the same rows."""
    path, prompts, expected = tiny
    repeated = [p + p[-6:] + p[-6:] for p in prompts]        # repeats, so n-gram drafts exist
    single = LLM(path, block_size=8, num_blocks=40)
    want = outputs(single, repeated, 1)
    with LLM(path, tensor_parallel_size=2, block_size=8, num_blocks=40, speculative="ngram",
             num_speculative_tokens=3) as llm:
        assert outputs(llm, repeated, 1) == want
        assert llm.stats()["spec_draft_tokens"] > 0


@pytest.mark.parametrize("size", [2, 3])
def test_replicated_kv_heads_uneven_shards_biases_tied_embeddings(odd, size):
    path, prompts, expected = odd
    llm = LLM(path, tensor_parallel_size=size, block_size=8, num_blocks=30, max_num_batched_tokens=24)
    assert llm.model.config.num_kv_heads == 1 and llm.model.config.num_heads == 6 // size
    assert outputs(llm, prompts, 2) == [[e, e] for e in expected]
    assert llm.stats()["preempted_recompute"] > 0
    workers = list(llm.tp.processes)
    del llm                          # garbage collection stops the workers
    gc.collect()
    assert len(workers) == size - 1 and not any(p.is_alive() for p in workers), "workers outlived their LLM"


# ---- failures ----------------------------------------------------------------------------------------
def test_worker_that_raises_mid_run_fails_generate_with_its_error(tiny, monkeypatch):
    path, prompts, expected = tiny
    llm = LLM(path, tensor_parallel_size=2, block_size=8)
    assert outputs(llm, prompts[:2], 1) == [[e] for e in expected[:2]]
    real = StepMessage.pack
    sent = []

    def corrupt(self):               # the 4th step hands the worker a slot outside its cache
        sent.append(1)
        if len(sent) == 4:
            self = dataclasses.replace(self, slot_mappings=[s.clone() for s in self.slot_mappings])
            self.slot_mappings[0][0] = 10 ** 9
        return real(self)
    monkeypatch.setattr(StepMessage, "pack", corrupt)
    start = time.monotonic()
    error = r"worker rank 1 failed: RuntimeError: (.*, )?slot_mapping\[0\] = 1000000000 is out of range"
    with pytest.raises(TensorParallelError, match=error) as info:
        llm.generate(prompts, greedy())
    assert time.monotonic() - start < 30
    assert "Traceback" in str(info.value)
    assert not llm.has_unfinished()
    assert not any(p.is_alive() for p in llm.tp.processes)
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate(prompts[:1], greedy())


def test_worker_killed_between_calls(tiny):
    path, prompts, expected = tiny
    llm = LLM(path, tensor_parallel_size=2, block_size=8)
    assert outputs(llm, prompts[:1], 1) == [expected[:1]]
    os.kill(llm.tp.processes[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker rank 1 failed: .pid [0-9]+. died with exit code -9"):
        llm.generate(prompts[:2], greedy())
    assert time.monotonic() - start < 30


def test_errors_on_rank_0(tiny):
    """Before a step is sent the ranks stay in step: the step rolls back and the engine goes on. Ctrl-C
    once the step is sent (here in rank 0's forward) leaves them out of step: the workers are stopped."""
    path, prompts, expected = tiny
    llm = LLM(path, tensor_parallel_size=2, block_size=8)
    prepare = llm.runner._prepare

    def failing(*args):
        llm.runner._prepare = prepare
        raise RuntimeError("injected before the broadcast")
    llm.runner._prepare = failing
    with pytest.raises(RuntimeError, match="injected before the broadcast"):
        llm.generate(prompts[:2], greedy())
    assert outputs(llm, prompts[:2], 1) == [[e] for e in expected[:2]]
    assert llm.stats()["failed_steps"] == 1
    calls = []
    real = llm.model.forward

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)
    llm.model.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy())
    assert not llm.has_unfinished() and not any(p.is_alive() for p in llm.tp.processes)
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate(prompts[:1], greedy())


def test_under_torchrun(tiny, tmp_path):
    """torchrun starts both ranks: rank 1's LLM() serves rank 0 and exits its process when rank 0 closes."""
    path, prompts, expected = tiny
    script = tmp_path / "tp_script.py"
    script.write_text(
        "import os, sys, torch\n"
        "from pagedkv.engine import LLM, SamplingParams\n"
        "torch.set_num_threads(1)\n"
        "llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=8)\n"
        "assert os.environ['RANK'] == '0', 'only rank 0 gets past LLM()'\n"
        f"out = llm.generate({prompts[:2]!r}, SamplingParams(max_tokens={MAX_TOKENS}, ignore_eos=True))\n"
        "print('TOKENS', [o.token_ids for o in out])\n"
        "llm.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # where pagedkv is importable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), path], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"TOKENS {expected[:2]!r}" in result.stdout


def test_bad_checkpoint_raises_and_stops_the_workers(tmp_path):
    """Every rank checks the full shape of each tensor it reads a piece of; rank 0 raises, naming it."""
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' has shape .*128.*, the model expects .*96"):
        LLM(str(tmp_path), tensor_parallel_size=2)
