"""The prefix cache's host and disk tiers from Python: offloads and loads, disk writes and prefetch reads the
runner performs and confirms, failed transfers, events and cached blocks per medium, and bad input that
changes nothing."""
import subprocess
import sys
from collections import Counter

import pytest
import torch

from pagedkv import BlockManager


def toks(n, start=0):
    return list(range(start, start + n))


def cache_prompt(bm, seq_id, prompt, cache_salt=None):
    bm.allocate(seq_id, prompt, cache_salt=cache_salt)
    bm.mark_computed(seq_id)
    bm.free(seq_id)


def offload_all(bm, ok=True):
    bm.plan_offloads(bm.num_blocks)
    mapping = bm.take_offloads()
    bm.complete_offloads(ok)
    return mapping


def test_the_tier_is_off_by_default_and_on_for_windows_and_hybrid_groups():
    assert not BlockManager(8, 4).host_tier_enabled
    bm = BlockManager(8, 4, num_host_blocks=4, host_offload_min_priority=10)
    assert bm.host_tier_enabled and bm.num_host_blocks == 4 and bm.num_free_host_blocks == 4
    assert bm.host_offload_min_priority == 10
    assert BlockManager(8, 4, num_host_blocks=4, group_windows=[None, 8]).host_tier_enabled
    assert BlockManager(8, 4, num_host_blocks=4, group_windows=[8]).host_tier_enabled
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


# ---------------------------------------------------------------------------------------------------
# Windows and groups


def test_a_windowed_hit_loads_its_window_and_a_failed_load_sends_the_sequence_back():
    bm = BlockManager(6, 4, num_host_blocks=8, group_windows=[8])
    prompt = toks(21)  # 5 full blocks; the window at position 20 reads blocks 3 and 4
    cache_prompt(bm, 1, prompt)
    assert len(offload_all(bm)) == 5, "the blocks the window released are cached and offloaded too"
    cache_prompt(bm, 2, toks(24, 100))
    assert bm.lookup(prompt) == (3, 2, 0)
    assert bm.allocate(3, prompt) == 20
    offload_all(bm)  # the write-backs allocate queued
    loads = bm.take_loads().tolist()
    assert [b for _, b in loads] == bm.block_table(3)[3:5]
    with pytest.raises(ValueError, match="complete_loads"):
        bm.mark_computed(3)
    assert bm.complete_loads([True, False]) == [3]
    assert bm.must_readmit(3) and bm.num_computed_tokens(3) == 0
    for call in (lambda: bm.append_token(3, 1), lambda: bm.truncate(3, 2), lambda: bm.fork(3, 4),
                 lambda: bm.pin(3), lambda: bm.mark_computed(3), lambda: bm.reserve(3, 21)):
        with pytest.raises(ValueError, match="re-admitted"):
            call()
    bm.check_invariants()
    bm.free(3)
    with pytest.raises(KeyError):
        bm.must_readmit(3)
    assert sum(bm.lookup(prompt)[:2]) < 5, "the failed host entry was dropped"
    bm.allocate(3, prompt)
    bm.take_loads()
    assert bm.complete_loads(True) == []
    assert not bm.must_readmit(3)
    bm.mark_computed(3)
    bm.check_invariants()


def test_a_hybrid_hit_is_the_longest_every_group_serves_and_events_stay_group_zeros():
    bm = BlockManager(12, 4, num_host_blocks=16, group_windows=[None, 32], enable_events=True)
    prompt = toks(21)
    cache_prompt(bm, 1, prompt)
    assert len(offload_all(bm)) == 10, "both groups' blocks"
    cache_prompt(bm, 2, toks(24, 100))
    assert bm.lookup(prompt) == (0, 5, 0)
    assert bm.allocate(3, prompt) == 20
    assert len(bm.take_loads()) == 10
    assert bm.complete_loads([True] * 2 + [False] + [True] * 7) == [], "a wide window recomputes in place"
    assert bm.num_computed_tokens(3) == 8
    bm.mark_computed(3)
    bm.check_invariants()
    replayed = {m: Counter() for m in ("GPU", "CPU")}
    for e in bm.take_events():
        if e["medium"] in replayed:
            sign = 1 if e["kind"] == "stored" else -1
            for h in e["block_hashes"]:
                replayed[e["medium"]][h] += sign
    for medium, counts in replayed.items():
        assert +counts == Counter(h for h, _ in bm.cached_blocks(medium)), medium
    assert bm.stats()["cached_host_blocks"] == 10 and len(bm.cached_blocks("CPU")) == 5, "group 0's listed"


# ---------------------------------------------------------------------------------------------------
# The disk tier


def write_all(bm, ok=True):
    bm.plan_disk_writes(bm.num_host_blocks)
    mapping = bm.take_disk_writes()
    bm.complete_disk_writes(ok)
    return mapping


def demote_to_disk(bm, prompt, other):
    """prompt's blocks end up only on disk: offloaded, written, then pushed out of the upper tiers by other."""
    cache_prompt(bm, 1, prompt)
    offload_all(bm)
    write_all(bm)
    cache_prompt(bm, 2, other)
    offload_all(bm)
    write_all(bm)


def test_the_disk_tier_needs_the_host_tier():
    bm = BlockManager(8, 4, num_host_blocks=4)
    assert not bm.disk_tier_enabled and bm.num_disk_blocks == 0 and bm.num_free_disk_blocks == 0
    bm = BlockManager(8, 4, num_host_blocks=4, num_disk_blocks=16)
    assert bm.disk_tier_enabled and bm.num_disk_blocks == 16 and bm.num_free_disk_blocks == 16
    assert bm.num_pending_disk_reads == 0
    with pytest.raises(ValueError, match="num_host_blocks"):
        BlockManager(8, 4, num_disk_blocks=4)
    with pytest.raises(ValueError, match="num_disk_blocks"):
        BlockManager(8, 4, num_host_blocks=4, num_disk_blocks=-1)
    hybrid = BlockManager(8, 4, num_host_blocks=4, num_disk_blocks=4, group_windows=[None, 8])
    assert hybrid.disk_tier_enabled and hybrid.prefetch(toks(9)) == 0 and hybrid.plan_disk_writes(4) == 0
    stats = bm.stats()
    assert stats["num_disk_blocks"] == 16 and stats["free_disk_blocks"] == 16 and stats["cached_disk_blocks"] == 0


def test_write_back_then_prefetch_then_load_round_trip():
    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8, enable_events=True)
    prompt = toks(13)
    cache_prompt(bm, 1, prompt)
    offload_all(bm)
    assert bm.plan_disk_writes(8) == 3
    writes = bm.take_disk_writes()
    assert writes.dtype == torch.int64 and writes.shape == (3, 2)
    assert bm.num_free_host_blocks == 1  # slots being written are never reused
    # Each record's identity is what the events say about its block.
    stored = {h: (e["parent_block_hash"] if i == 0 else e["block_hashes"][i - 1], e["token_ids"][4 * i:4 * i + 4])
              for e in bm.take_events() if e["kind"] == "stored" and e["medium"] == "GPU"
              for i, h in enumerate(e["block_hashes"])}
    for _, record in writes.tolist():
        block_hash, parent, tokens = bm.disk_record_identity(record)
        assert stored[block_hash] == (parent, tokens)
    bm.complete_disk_writes(True)
    disk_events = [e for e in bm.take_events() if e["medium"] == "DISK"]
    assert sum(len(e["block_hashes"]) for e in disk_events if e["kind"] == "stored") == 3
    assert sorted(bm.cached_blocks("DISK")) == sorted(bm.cached_blocks("CPU"))
    assert bm.stats()["disk_writes"] == 3

    cache_prompt(bm, 2, toks(16, 100))  # pushes the prompt out of the device and host tiers
    offload_all(bm)
    write_all(bm)
    assert bm.lookup(prompt) == (0, 0, 3)
    assert bm.prefetch(prompt) == 3 and bm.num_pending_disk_reads == 3
    reads = bm.take_disk_reads()
    assert reads.shape == (3, 2)
    assert bm.allocate(3, prompt) == 0, "a block being read is a miss"
    bm.free(3)
    bm.complete_disk_reads([True, True, True])
    assert bm.num_pending_disk_reads == 0 and bm.stats()["disk_reads"] == 3
    assert bm.stats()["disk_hit_blocks"] == 3
    assert bm.lookup(prompt) == (0, 3, 0)
    assert bm.allocate(4, prompt) == 12
    loads = bm.take_loads()
    assert loads[:, 0].tolist() == reads[:, 1].tolist()  # the loads read the slots the reads filled
    bm.complete_loads(True)
    bm.check_invariants()


def test_a_failed_read_drops_the_disk_entry():
    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8, enable_events=True)
    prompt = toks(13)
    demote_to_disk(bm, prompt, toks(16, 100))
    bm.take_events()
    assert bm.prefetch(prompt) == 3
    reads = bm.take_disk_reads()
    bm.complete_disk_reads(torch.tensor([True, False, True]))
    events = bm.take_events()
    assert [e["kind"] for e in events if e["medium"] == "DISK"] == ["removed"]
    with pytest.raises(KeyError, match="holds nothing"):
        bm.disk_record_identity(int(reads[1, 0]))
    assert bm.lookup(prompt)[1] == 1
    assert bm.stats()["disk_read_failures"] == 1
    bm.check_invariants()


def test_a_failed_write_leaves_no_disk_entry():
    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8)
    cache_prompt(bm, 1, toks(13))
    offload_all(bm)
    write_all(bm, ok=[False, True, False])
    assert bm.stats()["cached_disk_blocks"] == 1 and bm.stats()["disk_write_failures"] == 2
    assert len(bm.cached_blocks("DISK")) == 1
    assert write_all(bm).shape == (2, 2)  # the failed ones are still dirty
    bm.check_invariants()


def test_salted_disk_entries_hit_only_their_salt():
    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8)
    prompt = toks(9)
    cache_prompt(bm, 1, prompt, cache_salt=b"a")
    offload_all(bm)
    write_all(bm)
    cache_prompt(bm, 2, toks(16, 100))
    offload_all(bm)
    write_all(bm)
    assert bm.lookup(prompt, cache_salt="a") == (0, 0, 2)
    assert bm.lookup(prompt, cache_salt="b") == (0, 0, 0) and bm.lookup(prompt) == (0, 0, 0)
    assert bm.prefetch(prompt, cache_salt="b") == 0
    assert bm.prefetch(prompt, cache_salt="a") == 2


def test_disk_bad_input_is_a_clear_error_and_changes_nothing():
    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8)
    cache_prompt(bm, 1, toks(13))
    offload_all(bm)
    bm.plan_disk_writes(8)
    with pytest.raises(ValueError, match="max_slots"):
        bm.plan_disk_writes(-1)
    with pytest.raises(ValueError, match="3 disk writes taken"):
        bm.take_disk_writes() is not None and bm.complete_disk_writes([True])
    with pytest.raises(ValueError, match="0 disk reads taken"):
        bm.complete_disk_reads([True])
    with pytest.raises(ValueError, match="no disk record"):
        bm.disk_record_identity(8)
    with pytest.raises(ValueError, match="no disk record"):
        bm.disk_record_identity(-1)
    with pytest.raises(KeyError):
        bm.disk_record_identity(7)  # free, nothing pending
    with pytest.raises(ValueError, match="empty"):
        bm.prefetch([])
    with pytest.raises(TypeError):
        bm.complete_disk_writes(3)
    bm.check_invariants()
    bm.complete_disk_writes([True, True, True])
    with pytest.raises(ValueError, match="0 disk writes taken"):
        bm.complete_disk_writes([True, True, True])  # a double complete (one bool for none is a no-op)
    assert bm.stats()["cached_disk_blocks"] == 3
    bm.check_invariants()


def test_reset_forgets_disk_entries():
    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8, enable_events=True)
    prompt = toks(13)
    demote_to_disk(bm, prompt, toks(16, 100))
    bm.prefetch(prompt)
    bm.take_disk_reads()
    bm.reset_prefix_cache()
    assert bm.cached_blocks("DISK") == [] and bm.lookup(prompt) == (0, 0, 0)
    bm.complete_disk_reads(True)  # in flight across the reset: enters nothing
    assert bm.cached_blocks("CPU") == [] and bm.num_free_disk_blocks == 8 and bm.num_free_host_blocks == 4
    bm.check_invariants()


def test_hostile_disk_calls_do_not_crash_the_process():
    code = (
        "import numpy as np\n"
        "from pagedkv import BlockManager\n"
        "bm = BlockManager(4, 4, num_host_blocks=2, num_disk_blocks=2)\n"
        "bm.allocate(1, list(range(13))); bm.mark_computed(1); bm.free(1)\n"
        "bm.plan_offloads(2**31 - 1); bm.take_offloads(); bm.complete_offloads(True)\n"
        "bm.plan_disk_writes(2**31 - 1); bm.take_disk_writes()\n"
        "calls = [lambda: bm.plan_disk_writes(2**40), lambda: bm.disk_record_identity(2**40),\n"
        "         lambda: bm.disk_record_identity(np.int64(-5)), lambda: bm.disk_record_identity(None),\n"
        "         lambda: bm.prefetch([float('nan')]), lambda: bm.prefetch(np.array([1, 2], dtype=np.float32)),\n"
        "         lambda: bm.prefetch(list(range(13)), cache_salt=3), lambda: bm.complete_disk_reads([True] * 10**6)]\n"
        "calls += [lambda bad=bad: bm.complete_disk_writes(bad) for bad in (None, 'x', [object()], [True] * 10**6)]\n"
        "for call in calls:\n"
        "    try: call()\n"
        "    except (TypeError, ValueError, KeyError, OverflowError): pass\n"
        "bm.check_invariants(); bm.complete_disk_writes(True); bm.check_invariants()\n"
        "print(bm.prefetch(np.arange(13)), 'ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def disk_records(bm):
    """{record: (block hash, parent hash, tokens, salt)} of every disk entry, as a runner writes them."""
    return {r: (*bm.disk_record_identity(r), bm.disk_record_salt(r)) for r in range(bm.num_disk_blocks)
            if _holds(bm, r)}


def _holds(bm, record):
    try:
        bm.disk_record_identity(record)
        return True
    except KeyError:
        return False


def restore_all(bm, records):
    """Restores records (parents first) into bm; returns {record: result}."""
    by_hash = {h: r for r, (h, _, _, _) in records.items()}
    done, results = set(), {}
    while len(results) < len(records):
        for r, (h, parent, tokens, salt) in records.items():
            if r in results or (parent is not None and by_hash.get(parent) not in done):
                continue
            results[r] = bm.restore_disk_record(r, h, None if parent is None else by_hash[parent], tokens,
                                                cache_salt=salt or None)
            done.add(r)
    return results


def test_records_of_an_earlier_manager_are_restored_and_hit_on_disk():
    earlier = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8)
    prompt = toks(13)
    cache_prompt(earlier, 1, prompt, cache_salt=b"tenant")
    offload_all(earlier)
    write_all(earlier)
    records = disk_records(earlier)
    assert len(records) == 3 and sum(salt == b"tenant" for *_, salt in records.values()) == 1

    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8, enable_events=True)
    assert all(restore_all(bm, records).values())
    assert bm.lookup(prompt, cache_salt=b"tenant") == (0, 0, 3)
    assert bm.lookup(prompt) == (0, 0, 0), "the salt is restored with block 0"
    assert sorted(bm.cached_blocks("DISK")) == sorted(earlier.cached_blocks("DISK"))
    assert sum(len(e["block_hashes"]) for e in bm.take_events() if e["medium"] == "DISK") == 3
    assert {r: (*bm.disk_record_identity(r), bm.disk_record_salt(r)) for r in records} == records
    bm.check_invariants()
    # The restored entries are ordinary disk entries: read into the host tier, then loaded.
    assert bm.prefetch(prompt, cache_salt=b"tenant") == 3
    reads = bm.take_disk_reads()
    assert sorted(reads[:, 0].tolist()) == sorted(records)
    bm.complete_disk_reads(True)
    assert bm.allocate(2, prompt, cache_salt=b"tenant") == 12
    bm.complete_loads(True)
    bm.check_invariants()


def test_restore_refuses_what_it_cannot_link_and_changes_nothing():
    earlier = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8)
    cache_prompt(earlier, 1, toks(13))
    offload_all(earlier)
    write_all(earlier)
    records = disk_records(earlier)
    by_parent = {p: (r, h, t) for r, (h, p, t, _) in records.items()}
    root, root_hash, root_tokens = by_parent[None]
    child, child_hash, child_tokens = by_parent[root_hash]

    bm = BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=8)
    before = bm.stats()
    assert not bm.restore_disk_record(child, child_hash, root, child_tokens), "the parent record holds nothing"
    assert not bm.restore_disk_record(root, root_hash ^ 1, None, root_tokens), "another block's hash"
    assert not bm.restore_disk_record(root, root_hash, None, root_tokens, cache_salt=b"s"), "the salt is hashed"
    assert bm.stats() == before and bm.lookup(toks(13)) == (0, 0, 0)
    assert bm.restore_disk_record(root, root_hash, None, root_tokens)
    assert not bm.restore_disk_record(root, root_hash, None, root_tokens), "the record holds it already"
    assert not bm.restore_disk_record(5, root_hash, None, root_tokens), "the block has a disk copy"
    assert not bm.restore_disk_record(child, child_hash, root, toks(4, 50)), "other tokens, another hash"
    assert bm.restore_disk_record(child, child_hash, root, child_tokens)
    bm.check_invariants()
    bad = [((8, 1, None, toks(4)), ValueError, "no disk record"), ((-1, 1, None, toks(4)), ValueError, "no disk record"),
           ((0, 1, 9, toks(4)), ValueError, "parent_record"), ((0, 1, None, toks(3)), ValueError, "one block"),
           ((0, 1, root, toks(4)), None, None), ((0, -1, None, toks(4)), TypeError, None),
           ((0, 1, None, [1.5] * 4), TypeError, None)]
    for args, exc, match in bad:
        if exc is None:
            with pytest.raises(ValueError, match="salt"):
                bm.restore_disk_record(*args, cache_salt=b"x")
            continue
        with pytest.raises(exc, match=match):
            bm.restore_disk_record(*args)
    with pytest.raises(ValueError, match="disk tier is off"):
        BlockManager(4, 4, num_host_blocks=4).restore_disk_record(0, 1, None, toks(4))
    with pytest.raises(ValueError, match="weak8"):
        BlockManager(4, 4, num_host_blocks=4, num_disk_blocks=4, hash_algo="weak8").restore_disk_record(
            0, 1, None, toks(4))
    bm.check_invariants()


def test_each_groups_records_are_restored_into_their_group():
    earlier = BlockManager(12, 4, num_host_blocks=16, num_disk_blocks=16, group_windows=[None, 64])
    prompt = toks(13)
    cache_prompt(earlier, 1, prompt)
    offload_all(earlier)
    write_all(earlier)
    records = disk_records(earlier)
    assert len(records) == 6, "3 blocks in each group, each group's under its own record hashes"
    bm = BlockManager(12, 4, num_host_blocks=16, num_disk_blocks=16, group_windows=[None, 64])
    by_hash = {h: r for r, (h, _, _, _) in records.items()}
    group_of = {}
    for r, (h, parent, tokens, salt) in sorted(records.items(), key=lambda kv: kv[1][2][0]):   # parents first
        parent_record = None if parent is None else by_hash[parent]
        tried = (0, 1) if parent is None else (group_of[parent_record],)
        groups = [g for g in tried if bm.restore_disk_record(r, h, parent_record, tokens, group=g)]
        assert len(groups) == 1, "a record restores into exactly one group"
        group_of[r] = groups[0]
        if parent is not None:
            assert not bm.restore_disk_record(r, h, parent_record, tokens, group=1 - groups[0])
    assert sorted(group_of.values()) == [0, 0, 0, 1, 1, 1]
    assert bm.lookup(prompt) == (0, 0, 3), "a hybrid hit needs both groups' blocks"
    with pytest.raises(ValueError, match="no group"):
        bm.restore_disk_record(0, 1, None, toks(4), group=2)
    bm.check_invariants()
