"""KV events, cached_blocks() and step statistics of the prefix cache."""
from collections import Counter

import pytest

from pagedkv import BlockManager, hash_block_tokens


def toks(n, start=0):
    return list(range(start, start + n))


def chain(tokens, bs, salt=None, algo="xxh64"):
    hashes, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block_tokens(tokens[i * bs:(i + 1) * bs], parent, algo=algo, cache_salt=salt if i == 0 else None)
        hashes.append(parent)
    return hashes


def test_events_are_off_by_default():
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="enable_events"):
        bm.take_events()


def test_stored_events_carry_what_a_router_needs_to_recompute_the_hashes():
    bm = BlockManager(16, 4, enable_events=True)
    prompt = toks(13, 5)
    bm.allocate(1, prompt, cache_salt=b"tenant")
    bm.mark_computed(1)
    [e] = bm.take_events()
    assert e["kind"] == "stored" and e["seq"] == 0 and e["medium"] == "GPU" and e["block_size"] == 4
    assert e["block_hashes"] == chain(prompt, 4, salt=b"tenant")  # three full blocks, one event
    assert e["parent_block_hash"] is None and e["cache_salt"] == b"tenant" and e["token_ids"] == prompt[:12]
    assert sorted(bm.cached_blocks()) == sorted(zip(e["block_hashes"], [None] + e["block_hashes"][:-1]))
    # salted blocks never share hashes with unsalted ones
    assert not set(e["block_hashes"]) & set(chain(prompt, 4))


def test_partial_registration_continues_the_chain_with_its_parent():
    bm = BlockManager(16, 4, enable_events=True)
    prompt = toks(12)
    bm.allocate(1, prompt)
    bm.mark_computed(1, 4)
    bm.mark_computed(1, 12)
    first, second = bm.take_events()
    assert first["block_hashes"] == chain(prompt, 4)[:1] and second["parent_block_hash"] == first["block_hashes"][0]
    assert second["block_hashes"] == chain(prompt, 4)[1:] and second["cache_salt"] is None


def test_removed_on_eviction_and_cleared_on_reset():
    bm = BlockManager(2, 4, enable_events=True)
    bm.allocate(1, toks(5))
    bm.mark_computed(1)
    bm.free(1)
    bm.allocate(2, toks(8, 100))  # takes both blocks: the cached one is evicted
    events = bm.take_events()
    assert [e["kind"] for e in events] == ["stored", "removed"]
    assert events[1]["block_hashes"] == events[0]["block_hashes"] and events[1]["token_ids"] is None
    bm.mark_computed(2)
    bm.reset_prefix_cache()
    assert [e["kind"] for e in bm.take_events()] == ["stored", "cleared"]
    assert bm.cached_blocks() == []


def test_a_full_buffer_drops_the_oldest_events_and_counts_them():
    bm = BlockManager(64, 1, enable_events=True, max_pending_events=3)
    for i in range(5):  # five separate stored events
        bm.allocate(i, [100 + i, 7])
        bm.mark_computed(i)
    events = bm.take_events()
    assert [e["seq"] for e in events] == [2, 3, 4]
    assert bm.stats()["events_dropped"] == 2
    with pytest.raises(ValueError):
        BlockManager(8, 4, enable_events=True, max_pending_events=0)


def test_replay_equals_cached_blocks_through_cow_swap_and_reuse():
    bm = BlockManager(7, 2, num_cpu_blocks=6, enable_events=True, hash_algo="weak8")
    replay = Counter()

    def check():
        for e in bm.take_events():
            if e["kind"] == "stored":
                replay.update(e["block_hashes"])
            elif e["kind"] == "removed":
                replay.subtract(e["block_hashes"])
            else:
                replay.clear()
        assert +replay == Counter(h for h, _ in bm.cached_blocks())

    bm.allocate(1, toks(5))
    bm.mark_computed(1)
    check()
    bm.fork(1, 2)
    bm.append_tokens([1, 2], [9, 8])
    bm.take_copies()
    bm.mark_computed([1, 2])
    check()
    bm.swap_out([2])
    bm.allocate(3, toks(7, 50))
    bm.mark_computed(3)
    check()
    bm.free(1)
    bm.free(3)
    bm.swap_in([2])
    bm.mark_computed(2)
    check()


def test_step_stats_count_since_the_last_call():
    bm = BlockManager(16, 4)
    bm.allocate(1, toks(9))
    bm.mark_computed(1)
    first = bm.take_step_stats()
    assert (first["queries"], first["hits"], first["query_blocks"], first["hit_blocks"]) == (9, 0, 3, 0)
    bm.allocate(2, toks(9))          # hits the two full blocks that 1 still holds
    bm.free(1)
    bm.free(2)
    bm.allocate(3, toks(10))         # hits them again, now from the free list
    step = bm.take_step_stats()
    assert (step["queries"], step["hits"], step["query_blocks"], step["hit_blocks"]) == (19, 16, 6, 4)
    assert (step["hit_blocks_in_use"], step["hit_blocks_revived"]) == (2, 2)
    assert step["used_blocks"] == 3 and step["hit_rate"] == pytest.approx(16 / 19)
    assert bm.stats()["queries"] == 28
    assert bm.take_step_stats()["queries"] == 0



@pytest.mark.parametrize("algo", ["xxh64", "sha256", "weak8"])
def test_cached_block_hashes_are_the_chains_of_the_registered_prompts(algo, rng):
    """Block hashes are computed by the prefix cache only when asked for (events, cached_blocks): they
    must still be each registered block's chained hash with the manager's algorithm."""
    bs = rng.randrange(2, 6)
    bm = BlockManager(256, bs, hash_algo=algo, enable_events=rng.random() < 0.5)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(bs, 4 * bs))] for _ in range(3)]
    expected, registered = Counter(), set()  # one node per distinct (salt, prefix content)
    for seq_id in range(12):
        salt = rng.choice([None, b"a", b"b"])
        prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * bs))]
        bm.allocate(seq_id, prompt, cache_salt=salt)
        computed = rng.randrange(bm.num_computed_tokens(seq_id), len(prompt) + 1)
        bm.mark_computed(seq_id, computed)
        parent = None
        for i, h in enumerate(chain(prompt[:computed], bs, salt, algo)):
            if (salt, tuple(prompt[:(i + 1) * bs])) not in registered:
                registered.add((salt, tuple(prompt[:(i + 1) * bs])))
                expected[(h, parent)] += 1
            parent = h
    assert Counter(bm.cached_blocks()) == expected
    bm.check_invariants()
