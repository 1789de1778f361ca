"""Retention priorities, durations and pins through the Python bindings: the arguments they take, the
behaviour they buy (a priority prefix outlives a flood of default-priority prompts; a pinned one
outlives everything until unpinned), and bad input that raises a clear exception and changes nothing."""
import math

import pytest

from pagedkv import AllocStatus, BlockManager

BS = 4


def cache(bm, sid, tokens, **kw):
    """Admits, computes and frees a prompt: its full blocks stay cached in the free list."""
    bm.allocate(sid, tokens, **kw)
    bm.mark_computed(sid)
    table = bm.block_table(sid)
    bm.free(sid)
    return table


def flood(bm, first_id, n, length=4 * BS + 1):
    """n distinct prompts, each admitted, computed and freed: default priority, overflowing the pool."""
    for i in range(n):
        cache(bm, first_id + i, [10_000 * (first_id + i) + t for t in range(length)])


def snapshot(bm, ids=()):
    return (bm.num_free_blocks, bm.num_pinned_blocks, bm.stats(), bm.now,
            [bm.block_priority(b) for b in range(bm.num_blocks)],
            {i: (bm.block_table(i), bm.num_tokens(i)) for i in ids if i in bm})


@pytest.mark.parametrize("priority, survives", [(None, False), (90, True)])
def test_priority_prefix_outlives_a_flood_of_default_prompts(priority, survives):
    bm = BlockManager(16, BS)
    system = list(range(4 * BS))  # 4 full blocks
    retention = None if priority is None else [(0, len(system), priority)]
    cache(bm, 1, system + [7], retention=retention)
    flood(bm, 100, 10)  # 50 blocks through a 16-block pool
    assert bm.allocate(2, system + [8]) == (4 * BS if survives else 0)
    bm.check_invariants()


def test_ranges_overlap_highest_wins_and_end_none_covers_decode_tokens():
    bm = BlockManager(16, BS, decode_priority=5)
    bm.allocate(1, list(range(2 * BS)), retention=[(0, 1, 60), (0, BS + 1, 80, None), (BS + 1, None, 20)])
    bm.allocate(2, list(range(100, 100 + BS)))
    t1 = bm.block_table(1)
    assert [bm.block_priority(b) for b in t1] == [80, 80]
    bm.append_tokens([1, 2], [1, 1])
    assert bm.block_priority(bm.block_table(1)[2]) == 20  # the open-ended range reaches decode tokens
    assert bm.block_priority(bm.block_table(2)[1]) == 5   # decode_priority
    assert bm.block_priority(bm.block_table(2)[0]) == bm.default_priority == 35
    bm.check_invariants()


def test_duration_counts_from_the_free_on_the_managers_clock():
    bm = BlockManager(8, BS)
    table = cache(bm, 1, list(range(2 * BS + 1)), retention=[(0, None, 90, 2.5)])
    assert bm.now == 0.0
    bm.set_time(2.4)
    assert bm.block_priority(table[0]) == 90
    bm.set_time(2.5)
    assert bm.block_priority(table[0]) == 35
    with pytest.raises(ValueError, match="only moves forward"):
        bm.set_time(1.0)
    with pytest.raises(ValueError):
        bm.set_time(math.nan)
    assert bm.now == 2.5
    bm.check_invariants()


def test_allocate_batch_takes_one_retention_per_prompt():
    bm = BlockManager(16, BS)
    prompts = [list(range(BS + 1)), list(range(50, 50 + BS + 1))]
    assert bm.allocate_batch([1, 2], prompts, retentions=[[(0, None, 70)], None]) == [0, 0]
    assert bm.block_priority(bm.block_table(1)[0]) == 70
    assert bm.block_priority(bm.block_table(2)[0]) == 35
    with pytest.raises(ValueError, match="one entry"):
        bm.allocate_batch([3, 4], prompts, retentions=[None])
    assert 3 not in bm and 4 not in bm


def test_pin_keeps_blocks_cached_after_free_until_unpin():
    bm = BlockManager(16, BS, max_pinned_fraction=0.25)
    assert bm.max_pinned_blocks == 4
    system = list(range(3 * BS + 1))
    bm.allocate(1, system)
    bm.mark_computed(1)
    assert bm.pin(1) == 3
    pinned = bm.pinned_blocks(1)
    bm.free(1)
    assert bm.is_pinned(1) and 1 not in bm
    assert bm.stats()["pinned_blocks"] == bm.num_pinned_blocks == 3
    flood(bm, 100, 10)
    assert bm.num_free_blocks == 13
    assert bm.allocate(2, system) == 3 * BS
    assert bm.block_table(2)[:3] == pinned
    bm.free(2)
    # Prompts too big to fit beside the pins are NEVER (not LATER for ever); the pinned prefix's own blocks
    # still count for a prompt that hits them.
    assert bm.can_allocate(list(range(1000, 1000 + 14 * BS))) == AllocStatus.NEVER
    assert bm.can_allocate(system[:-1] + list(range(1000, 1000 + 13 * BS))) == AllocStatus.OK
    bm.unpin(1)
    assert not bm.is_pinned(1) and bm.num_free_blocks == 16
    assert bm.can_allocate(list(range(1000, 1000 + 14 * BS))) == AllocStatus.OK
    bm.check_invariants()


def test_pin_cap_and_unknown_pins_are_clear_errors_that_change_nothing():
    bm = BlockManager(16, BS, max_pinned_fraction=0.25)
    for sid in (1, 2):
        bm.allocate(sid, list(range(100 * sid, 100 * sid + 3 * BS + 1)))
    bm.mark_computed([1, 2])
    bm.pin(1)
    before = snapshot(bm, [1, 2])
    with pytest.raises(RuntimeError, match="cap of 4"):
        bm.pin(2)
    with pytest.raises(KeyError):
        bm.pin(7)
    with pytest.raises(KeyError):
        bm.unpin(2)
    with pytest.raises(KeyError):
        bm.pinned_blocks(2)
    assert snapshot(bm, [1, 2]) == before
    assert not bm.is_pinned(2)
    bm.check_invariants()


@pytest.mark.parametrize("retention, exc, match", [
    ([(0, 4, 101)], ValueError, "priority 101"),
    ([(0, 4, -1)], ValueError, "priority -1"),
    ([(0, 4, 2 ** 40)], ValueError, "priority"),
    ([(5, 4, 50)], ValueError, "start <= end"),
    ([(-1, 4, 50)], ValueError, "start <= end"),
    ([(0, 4, 50, -1.0)], ValueError, "duration"),
    ([(0, 4, 50, math.nan)], ValueError, "duration"),
    ([(0, 4)], ValueError, "items"),
    ([(0, 4, 50, 1.0, 2)], ValueError, "items"),
    ([(0, 4, 50.5)], TypeError, "priority"),
    ([(0, 4, 50, "1s")], TypeError, "duration"),
    ([(0, 4, True)], TypeError, "priority"),
    ([7], TypeError, "tuple"),
    ("0-4", TypeError, "list or tuple"),
])
def test_bad_retention_is_a_clear_exception_and_changes_nothing(retention, exc, match):
    bm = BlockManager(16, BS)
    bm.allocate(1, list(range(9)))
    before = snapshot(bm, [1, 2])
    with pytest.raises(exc, match=match):
        bm.allocate(2, list(range(9)), retention=retention)
    with pytest.raises(exc, match=match):
        bm.allocate_batch([3, 2], [[1], list(range(9))], retentions=[None, retention])
    assert snapshot(bm, [1, 2, 3]) == before
    assert 2 not in bm and 3 not in bm


@pytest.mark.parametrize("kwargs, match", [
    ({"default_priority": 101}, "default_priority"),
    ({"decode_priority": -1}, "decode_priority"),
    ({"max_pinned_fraction": 1.0}, "max_pinned_fraction"),
    ({"max_pinned_fraction": -0.1}, "max_pinned_fraction"),
])
def test_bad_constructor_retention_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(16, BS, **kwargs)


def test_reset_forgets_priorities_and_lets_pins_go():
    bm = BlockManager(16, BS, enable_events=True)
    bm.allocate(1, list(range(2 * BS + 1)), retention=[(0, None, 90, 5.0)])
    bm.mark_computed(1)
    bm.pin(1)
    table = bm.block_table(1)
    bm.free(1)
    bm.reset_prefix_cache()
    assert not bm.is_pinned(1) and bm.num_pinned_blocks == 0
    assert [bm.block_priority(b) for b in table] == [35] * 3
    assert [e["kind"] for e in bm.take_events()][-1] == "cleared"
    bm.set_time(10.0)
    bm.check_invariants()
