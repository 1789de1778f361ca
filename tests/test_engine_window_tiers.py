"""The prefix cache's host and disk tiers with windowed models: a Mistral whose every layer is windowed and a
Gemma 2 (windowed and full-attention layers: two KV groups) give token for token the single-tier engine's
output (fp32 greedy) under a device pool so small that prefixes go down to the host tier or the disk and
come back many times; a windowed hit loads only its window's blocks; a failed copy or disk transfer costs a
recompute (a sequence without a safe point goes back to admission), never a wrong token, a held slot or a
leaked block."""
import os

import pytest
import torch

import pagedkv.disk_store as disk_store
import pagedkv.engine.execution.model_runner as model_runner
from engine_fixtures import save_tiny_model
from pagedkv.engine import LLM
from test_engine_host_tier import GREEDY, conversations, run

HOST_BYTES = 64 << 20
HOST_BLOCKS = 12  # with the disk tier: a host tier so small that prefixes go down to disk


# Device blocks: a sequence of Mistral holds its window's few blocks, one of Gemma 2 its whole prefix too.
POOL = {"mistral": 10, "gemma2": 24}


@pytest.fixture(scope="module", params=["mistral", "gemma2"])
def windowed(request, tmp_path_factory):
    """(checkpoint dir, vocab size, bytes of one KV block, the engines' settings) of a tiny model with a
    window of 8 tokens; the settings' pool is so small that prefixes leave the device between visits."""
    path = tmp_path_factory.mktemp(f"tiers_{request.param}")
    model = save_tiny_model(path, request.param)
    per_block = model_runner.kv_cache_block_bytes(LLM(str(path), block_size=8, num_blocks=8).model, 8,
                                                  torch.float32)
    settings = dict(block_size=8, num_blocks=POOL[request.param], max_num_batched_tokens=32)
    return str(path), model.config.vocab_size, per_block, settings


def check_nothing_held(llm):
    assert llm.stats()["used_blocks"] == 0
    llm.close()  # waits for the disk transfers in flight and confirms them
    assert llm.bm.num_free_host_blocks == llm.bm.num_host_blocks, "no host slot is left held"
    llm.bm.check_invariants()


def flaky(monkeypatch, owner, name, every=3):
    """Makes owner.name raise on every `every`-th call; returns the call counter."""
    real = getattr(owner, name)
    calls = {"n": 0, "failed": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % every == 0:
            calls["failed"] += 1
            raise RuntimeError(f"injected {name} failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def run_retrying(llm, rounds):
    """run(), each prompt generated again after a step that raised an injected failure."""
    out = []
    for prompts in rounds:
        for p in prompts:
            while True:
                try:
                    out.append(llm.generate([p], GREEDY)[0].token_ids)
                    break
                except RuntimeError as e:
                    assert "injected" in str(e)
    return out


def test_host_tier_tokens_equal_the_single_tier_engine(windowed):
    path, vocab, _, common = windowed
    rounds = conversations(vocab)
    want = run(LLM(path, **common), rounds)
    tiered = LLM(path, host_cache_bytes=HOST_BYTES, **common)
    assert tiered.bm.host_tier_enabled
    assert run(tiered, rounds) == want
    t = tiered.stats()
    assert t["offloaded_blocks"] > 0 and t["loaded_blocks"] > 0 and t["host_hit_blocks"] > 0, t
    if tiered.model_config.group_windows == [8]:
        # A windowed hit loads the blocks its window reads, at most two of 8 tokens per hit.
        assert t["loaded_blocks"] < t["cached_prompt_tokens"] // 8
    check_nothing_held(tiered)


def test_the_loaded_blocks_are_read(windowed, monkeypatch):
    path, vocab, _, common = windowed
    rounds = conversations(vocab, seed=1)
    want = run(LLM(path, **common), rounds)
    monkeypatch.setattr(model_runner, "load_blocks", lambda *args, **kwargs: None)
    assert run(LLM(path, host_cache_bytes=HOST_BYTES, **common), rounds) != want


@pytest.mark.parametrize("fail", ["offload_blocks", "load_blocks"])
def test_a_failed_copy_costs_a_recompute_not_a_wrong_token(windowed, monkeypatch, fail):
    path, vocab, _, common = windowed
    rounds = conversations(vocab, seed=2)
    want = run(LLM(path, **common), rounds)
    tiered = LLM(path, host_cache_bytes=HOST_BYTES, **common)
    calls = flaky(monkeypatch, model_runner, fail)
    assert run_retrying(tiered, rounds) == want
    assert calls["failed"] > 0
    check_nothing_held(tiered)


def test_disk_tier_tokens_equal_the_single_tier_engine(windowed, tmp_path):
    path, vocab, per_block, common = windowed
    rounds = conversations(vocab, turns=4)
    want = run(LLM(path, **common), rounds)
    tiered = LLM(path, host_cache_bytes=HOST_BLOCKS * per_block, disk_cache_dir=tmp_path,
                 disk_cache_bytes=256 * (per_block + 8192), **common)
    assert tiered.bm.disk_tier_enabled
    assert run(tiered, rounds) == want
    t = tiered.stats()
    assert t["disk_writes"] > 0 and t["disk_reads"] > 0 and t["loaded_blocks"] > 0, t
    assert os.listdir(tmp_path) == []
    check_nothing_held(tiered)


def test_a_persistent_disk_cache_restores_every_group(windowed, tmp_path):
    """disk_cache_persist=True: a new engine restores each group's records (block 0 in the group whose record
    hash it carries, a child in its parent's) and hits them from its first prompt, token-exact."""
    path, vocab, per_block, common = windowed
    rounds = conversations(vocab, seed=5, turns=3)
    want = run(LLM(path, **common), rounds)
    tiers = dict(host_cache_bytes=HOST_BLOCKS * per_block, disk_cache_dir=tmp_path,
                 disk_cache_bytes=256 * (per_block + 8192), disk_cache_persist=True, **common)
    first = LLM(path, **tiers)
    assert run(first, rounds[:2]) == want[:2 * len(rounds[0])]
    first.close()
    second = LLM(path, **tiers)
    assert second.disk_restored > 0
    assert run(second, rounds[:1]) == want[:len(rounds[0])]
    assert second.stats()["disk_hit_blocks"] > 0, "the first prompts hit the restored records"
    assert run(second, rounds[1:]) == want[len(rounds[0]):]
    check_nothing_held(second)


@pytest.mark.parametrize("fail", ["write", "read"])
def test_a_failed_disk_transfer_costs_a_recompute_not_a_wrong_token(windowed, tmp_path, monkeypatch, fail):
    path, vocab, per_block, common = windowed
    rounds = conversations(vocab, seed=3, turns=4)
    want = run(LLM(path, **common), rounds)
    tiered = LLM(path, host_cache_bytes=HOST_BLOCKS * per_block, disk_cache_dir=tmp_path,
                 disk_cache_bytes=256 * (per_block + 8192), **common)
    real = getattr(disk_store.DiskStore, fail)
    calls = {"n": 0}

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            if fail == "write":
                raise OSError(28, "injected: no space left on device")
            return False  # a record that reads as stale or foreign
        return real(self, *args)

    monkeypatch.setattr(disk_store.DiskStore, fail, failing)
    assert run(tiered, rounds) == want
    assert tiered.stats()[f"disk_{fail}_failures"] > 0, tiered.stats()
    check_nothing_held(tiered)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_loads_on_a_side_stream_give_the_same_tokens(windowed):
    """On a GPU every group's loads run on the side stream, layer by layer: the tokens equal the
    single-tier engine's on the same device."""
    path, vocab, _, common = windowed
    rounds = conversations(vocab, seed=5)
    settings = dict(common, device="cuda", dtype=torch.float32)
    want = run(LLM(path, **settings), rounds)
    tiered = LLM(path, host_cache_bytes=HOST_BYTES, **settings)
    assert run(tiered, rounds) == want
    assert tiered.stats()["loaded_blocks"] > 0
    check_nothing_held(tiered)
