"""The engine with the prefix cache's disk tier (LLM(disk_cache_dir=..., disk_cache_bytes=...)): token for
token the output of the single-tier engine (fp32 greedy) under a device pool and a host tier so small that
prefixes go down to disk and come back many times; the disk reads are on the path (records that read as
garbage change the tokens); a failed write or read costs a recompute, never a wrong token or a held slot."""
import os

import pytest
import torch

import pagedkv.disk_store as disk_store
import pagedkv.engine.execution.model_runner as model_runner
from engine_fixtures import save_tiny_llama
from pagedkv.engine import LLM
from test_engine_host_tier import GREEDY, conversations, run

HOST_BLOCKS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("disk_tier_llama")
    model = save_tiny_llama(path)
    per_block = model_runner.kv_cache_block_bytes(LLM(str(path), block_size=8, num_blocks=4).model, 8, torch.float32)
    return str(path), model.config.vocab_size, per_block


def engines(path, per_block, directory, **kwargs):
    common = dict(block_size=8, num_blocks=20, max_num_batched_tokens=32, **kwargs)
    return LLM(path, **common), LLM(path, host_cache_bytes=HOST_BLOCKS * per_block, disk_cache_dir=directory,
                                    disk_cache_bytes=256 * (per_block + 8192), **common)


def check_nothing_held(llm):
    stats = llm.stats()
    assert stats["used_blocks"] == 0
    llm.close()                        # waits for the transfers in flight and confirms them
    assert llm.bm.num_free_host_blocks == llm.bm.num_host_blocks, "no host slot is left held"
    assert llm.bm.num_pending_disk_reads == 0
    llm.bm.check_invariants()


def test_tokens_equal_the_single_tier_engine_and_prefixes_come_back_from_disk(tiny, tmp_path):
    path, vocab, per_block = tiny
    rounds = conversations(vocab, turns=4)
    single, tiered = engines(path, per_block, tmp_path)
    want = run(single, rounds)
    assert run(tiered, rounds) == want
    assert os.listdir(tmp_path) == [], "the records' file has no name"
    t = tiered.stats()
    assert t["disk_writes"] > 0 and t["disk_reads"] > 0 and t["disk_hit_blocks"] > 0, t
    assert t["disk_read_failures"] == 0 and t["disk_write_failures"] == 0
    three_tier_hits = t["cached_prompt_tokens"]
    host_only = LLM(path, block_size=8, num_blocks=20, max_num_batched_tokens=32,
                    host_cache_bytes=HOST_BLOCKS * per_block)
    assert run(host_only, rounds) == want
    assert three_tier_hits > host_only.stats()["cached_prompt_tokens"], "the disk adds hits the host tier lost"
    check_nothing_held(tiered)
    with pytest.raises(ValueError, match="closed"):
        tiered.disk_tier.store.fileno()


def test_the_disk_reads_are_on_the_path(tiny, tmp_path, monkeypatch):
    """Records that 'read' without filling the host slot leave other KV there, and the tokens change."""
    path, vocab, per_block = tiny
    rounds = conversations(vocab, seed=1, turns=4)
    single, tiered = engines(path, per_block, tmp_path)
    want = run(single, rounds)
    monkeypatch.setattr(disk_store.DiskStore, "read", lambda self, record, out, identity: True)
    assert run(tiered, rounds) != want


@pytest.mark.parametrize("fail", ["write", "read"])
def test_a_failed_disk_transfer_costs_a_recompute_not_a_wrong_token(tiny, tmp_path, monkeypatch, fail):
    path, vocab, per_block = tiny
    rounds = conversations(vocab, seed=2, turns=4)
    single, tiered = engines(path, per_block, tmp_path)
    want = run(single, rounds)
    real = getattr(disk_store.DiskStore, fail)
    calls = {"n": 0}

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            if fail == "write":
                raise OSError(28, "injected: no space left on device")
            return False          # a record that reads as stale or foreign
        return real(self, *args)

    monkeypatch.setattr(disk_store.DiskStore, fail, flaky)
    assert run(tiered, rounds) == want
    assert calls["n"] >= 3
    assert tiered.stats()[f"disk_{fail}_failures"] > 0
    check_nothing_held(tiered)


def test_bad_settings_are_refused(tiny, tmp_path):
    path, _, per_block = tiny
    host = HOST_BLOCKS * per_block
    with pytest.raises(ValueError, match="both disk_cache_dir and disk_cache_bytes"):
        LLM(path, host_cache_bytes=host, disk_cache_dir=tmp_path)
    with pytest.raises(ValueError, match="both disk_cache_dir and disk_cache_bytes"):
        LLM(path, host_cache_bytes=host, disk_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="needs host_cache_bytes"):
        LLM(path, disk_cache_dir=tmp_path, disk_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="not an existing directory"):
        LLM(path, host_cache_bytes=host, disk_cache_dir=tmp_path / "missing", disk_cache_bytes=1 << 20)
    with pytest.raises(TypeError, match="disk_cache_dir"):
        LLM(path, host_cache_bytes=host, disk_cache_dir=3, disk_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(path, host_cache_bytes=host, disk_cache_dir=tmp_path, disk_cache_bytes=100)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, host_cache_bytes=host, disk_cache_dir=tmp_path, disk_cache_bytes=1 << 20, tensor_parallel_size=2)
    assert os.listdir(tmp_path) == []


def test_disk_tier_is_sized_from_disk_cache_bytes(tiny, tmp_path):
    path, _, per_block = tiny
    with LLM(path, block_size=8, num_blocks=20, host_cache_bytes=HOST_BLOCKS * per_block, disk_cache_dir=tmp_path,
             disk_cache_bytes=10 << 20) as llm:
        stride = disk_store.DiskStore.record_stride(per_block, 8)
        assert llm.bm.num_disk_blocks == (10 << 20) // stride
        assert llm.disk_tier.store.record_bytes == per_block


def test_a_persistent_disk_cache_survives_the_engine(tiny, tmp_path):
    """disk_cache_persist=True: a new engine restores the records the last one wrote and hits them on disk
    from its first prompt, token for token the single-tier engine's output."""
    path, vocab, per_block = tiny
    rounds = conversations(vocab, seed=3, turns=3)
    common = dict(block_size=8, num_blocks=20, max_num_batched_tokens=32, host_cache_bytes=HOST_BLOCKS * per_block,
                  disk_cache_dir=str(tmp_path), disk_cache_bytes=256 * (per_block + 8192), disk_cache_persist=True)
    want = run(LLM(path, block_size=8, num_blocks=20, max_num_batched_tokens=32), rounds)
    first = LLM(path, **common)
    assert first.disk_restored == 0 and first.disk_tier.store.persistent
    assert run(first, rounds[:2]) == want[:2 * len(rounds[0])]
    first.close()
    assert set(first.bm.cached_blocks("CPU")) <= set(first.bm.cached_blocks("DISK")), "close wrote the host tier"
    # What a restart can bring back: the disk entries whose whole chain is on disk (a block whose parent
    # was only on the device or the host tier can no longer be reached from a prompt's first block).
    parents = {}
    for record in range(first.bm.num_disk_blocks):
        try:
            block_hash, parent, _ = first.bm.disk_record_identity(record)
        except KeyError:
            continue
        parents[block_hash] = parent

    def whole(h):
        return h is None or (h in parents and whole(parents[h]))

    kept = sum(whole(h) for h in parents)
    assert 0 < kept <= first.bm.stats()["cached_disk_blocks"] and len(os.listdir(tmp_path)) == 1

    second = LLM(path, **common)
    assert second.disk_restored == kept
    assert second.stats()["used_blocks"] == 0
    assert run(second, rounds[:1]) == want[:len(rounds[0])]
    assert second.stats()["disk_hit_blocks"] > 0, "the first prompts hit the restored records"
    assert run(second, rounds[1:]) == want[len(rounds[0]):]
    check_nothing_held(second)

    other = save_tiny_llama(tmp_path / "other", seed=7)
    foreign = LLM(str(tmp_path / "other"), **common)
    assert foreign.disk_restored == 0, "another model's records are another file"
    foreign.close()
    del other


def test_disk_cache_persist_is_checked(tiny, tmp_path):
    path, _, per_block = tiny
    with pytest.raises(ValueError, match="disk_cache_persist"):
        LLM(path, block_size=8, num_blocks=20, disk_cache_persist=True)
    with pytest.raises(TypeError, match="disk_cache_persist"):
        LLM(path, block_size=8, num_blocks=20, host_cache_bytes=HOST_BLOCKS * per_block, disk_cache_dir=str(tmp_path),
            disk_cache_bytes=64 * (per_block + 8192), disk_cache_persist="yes")
