"""The prefix cache's host tier from Python: offloads and loads the runner performs and confirms, failed
copies, events and cached blocks per medium, and bad input that changes nothing."""
import subprocess
import sys
from collections import Counter

import pytest
import torch

from pagedkv import BlockManager


def toks(n, start=0):
    return list(range(start, start + n))


def cache_prompt(bm, seq_id, prompt):
    bm.allocate(seq_id, prompt)
    bm.mark_computed(seq_id)
    bm.free(seq_id)


def offload_all(bm, ok=True):
    bm.plan_offloads(bm.num_blocks)
    mapping = bm.take_offloads()
    bm.complete_offloads(ok)
    return mapping


def test_the_tier_is_off_by_default_and_for_hybrid_groups():
    assert not BlockManager(8, 4).host_tier_enabled
    bm = BlockManager(8, 4, num_host_blocks=4, host_offload_min_priority=10)
    assert bm.host_tier_enabled and bm.num_host_blocks == 4 and bm.num_free_host_blocks == 4
    assert bm.host_offload_min_priority == 10
    assert not BlockManager(8, 4, num_host_blocks=4, group_windows=[None, 8]).host_tier_enabled
    assert not BlockManager(8, 4, num_host_blocks=4, enable_prefix_caching=False).host_tier_enabled
    with pytest.raises(ValueError, match="num_host_blocks"):
        BlockManager(8, 4, num_host_blocks=-1)
    with pytest.raises(ValueError, match="host_offload_min_priority"):
        BlockManager(8, 4, num_host_blocks=4, host_offload_min_priority=101)


def test_offload_then_host_hit_loads_into_fresh_device_blocks():
    bm = BlockManager(4, 4, num_host_blocks=8)
    prompt = toks(13)
    cache_prompt(bm, 1, prompt)
    assert bm.plan_offloads(2) == 2 and bm.plan_offloads(8) == 1
    offloads = bm.take_offloads()
    assert offloads.dtype == torch.int64 and offloads.shape == (3, 2)
    assert bm.num_free_blocks == 1  # blocks being copied are never handed out
    bm.complete_offloads(True)
    assert bm.stats()["cached_host_blocks"] == 3 and bm.num_free_blocks == 4
    slot_of = dict(offloads.tolist())
    cache_prompt(bm, 2, toks(16, 100))  # evicts the device copies
    assert bm.lookup(prompt) == (0, 3, 0)
    assert bm.allocate(3, prompt) == 12
    assert bm.num_loading_blocks(3) == 3
    loads = bm.take_loads()
    assert loads.shape == (3, 2)
    assert loads[:, 1].tolist() == bm.block_table(3)[:3]
    assert sorted(loads[:, 0].tolist()) == sorted(slot_of.values())
    with pytest.raises(ValueError, match="complete_loads"):
        bm.mark_computed(3)
    bm.complete_loads([True, True, True])
    assert bm.num_computed_tokens(3) == 12 and bm.num_loading_blocks(3) == 0
    assert bm.lookup(prompt) == (3, 0, 0)
    s = bm.stats()
    assert s["loaded_blocks"] == 3 and s["host_hit_blocks"] == 3 and s["offloaded_blocks"] == 3
    bm.check_invariants()


def test_a_failed_load_lowers_the_computed_tokens_to_the_prefix_before_it():
    bm = BlockManager(4, 4, num_host_blocks=8)
    prompt = toks(13)
    cache_prompt(bm, 1, prompt)
    offload_all(bm)
    cache_prompt(bm, 2, toks(16, 100))
    assert bm.allocate(3, prompt) == 12
    bm.take_loads()
    bm.complete_loads(torch.tensor([True, True, False]))
    assert bm.num_computed_tokens(3) == 8
    assert bm.stats()["load_failures"] == 1
    bm.check_invariants()
    bm.mark_computed(3)
    bm.check_invariants()


def test_a_failed_offload_leaves_no_host_entry():
    bm = BlockManager(4, 4, num_host_blocks=8)
    cache_prompt(bm, 1, toks(13))
    offload_all(bm, ok=False)
    assert bm.stats()["cached_host_blocks"] == 0 and bm.stats()["offload_failures"] == 3
    assert bm.cached_blocks("CPU") == []
    bm.check_invariants()


def test_events_of_each_medium_replay_to_its_cached_blocks():
    bm = BlockManager(4, 2, num_host_blocks=6, enable_events=True, hash_algo="weak8")
    replay = {"GPU": Counter(), "CPU": Counter()}

    def check():
        for e in bm.take_events():
            if e["kind"] == "cleared":
                for r in replay.values():
                    r.clear()
            for h in e["block_hashes"]:
                replay[e["medium"]][h] += 1 if e["kind"] == "stored" else -1
        for medium, r in replay.items():
            assert +r == Counter(h for h, _ in bm.cached_blocks(medium)), medium

    prompts = [[(j * 7 + k) % 3 for k in range(3 + j % 3)] for j in range(3)]
    for i in range(60):
        if i % 4 == 3:  # new tokens over the whole free list: device copies go, host copies stay
            bm.allocate(1000 + i, [7] * (2 * bm.num_free_blocks))
            bm.free(1000 + i)
        prompt = prompts[i % len(prompts)]
        bm.allocate(i, prompt)
        bm.take_loads()
        bm.complete_loads(i % 5 != 0)
        bm.mark_computed(i)
        bm.free(i)
        bm.plan_offloads(2)
        bm.take_offloads()
        bm.complete_offloads(i % 4 != 0)
        check()
        bm.check_invariants()
    assert bm.stats()["offloaded_blocks"] > 0 and bm.stats()["loaded_blocks"] > 0


def test_events_stay_gpu_only_without_the_tier():
    bm = BlockManager(4, 2, enable_events=True)
    for i in range(6):
        cache_prompt(bm, i, toks(5, 10 * i))
    assert {e["medium"] for e in bm.take_events()} == {"GPU"}
    assert bm.cached_blocks("CPU") == []


def test_bad_input_is_a_clear_error_and_changes_nothing():
    bm = BlockManager(4, 4, num_host_blocks=8)
    cache_prompt(bm, 1, toks(13))
    bm.plan_offloads(8)
    with pytest.raises(ValueError, match="max_blocks"):
        bm.plan_offloads(-1)
    with pytest.raises(ValueError, match="3 offloads taken"):
        bm.take_offloads() is not None and bm.complete_offloads([True])
    with pytest.raises(ValueError, match="medium"):
        bm.cached_blocks("disk")
    with pytest.raises(TypeError):
        bm.complete_offloads(3)
    with pytest.raises(ValueError, match="0 loads taken"):
        bm.complete_loads([True])
    bm.check_invariants()
    bm.complete_offloads([True, False, True])
    assert bm.stats()["cached_host_blocks"] == 2
    bm.check_invariants()


def test_loading_sequences_refuse_what_would_need_their_kv():
    bm = BlockManager(8, 4, num_host_blocks=8)
    prompt = toks(13)
    cache_prompt(bm, 1, prompt)
    offload_all(bm)
    cache_prompt(bm, 2, toks(32, 100))
    bm.allocate(3, prompt)
    for call in (lambda: bm.append_token(3, 1), lambda: bm.truncate(3, 2), lambda: bm.fork(3, 4),
                 lambda: bm.pin(3), lambda: bm.mark_computed(3)):
        with pytest.raises(ValueError, match="complete_loads"):
            call()
    bm.check_invariants()
    bm.free(3)  # allowed: the loads keep their blocks until confirmed
    bm.take_loads()
    bm.complete_loads(True)
    bm.check_invariants()


def test_hostile_outcomes_do_not_crash_the_process():
    code = (
        "from pagedkv import BlockManager\n"
        "bm = BlockManager(4, 4, num_host_blocks=2)\n"
        "bm.allocate(1, list(range(13))); bm.mark_computed(1); bm.free(1)\n"
        "bm.plan_offloads(2**31 - 1); bm.take_offloads()\n"
        "for bad in (None, 'x', [object()], [True] * 10**6):\n"
        "    try: bm.complete_offloads(bad)\n"
        "    except (TypeError, ValueError): pass\n"
        "bm.check_invariants(); bm.complete_offloads(True); bm.check_invariants(); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
