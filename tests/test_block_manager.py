"""BlockManager behaviour by behaviour, through the Python API (DESIGN.md section 1)."""

import numpy as np
import pytest
import torch
import xxhash

import pagedkv
from pagedkv import AllocStatus, BlockManager


def toks(n, start=0):
    return list(range(start, start + n))


def seeds_hash(tokens, parent=None):
    """The seeds' formula, written with the Python xxhash package."""
    h = xxhash.xxh64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(np.array(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


# --- hashing -----------------------------------------------------------------------------------------

def test_xxh64_chain_is_bit_identical_to_seeds(rng):
    parent = None
    for _ in range(20):
        block = [rng.randrange(-(2**40), 2**40) for _ in range(rng.choice([1, 16, 64]))]
        h = pagedkv.hash_block_tokens(block, parent)
        assert h == seeds_hash(block, parent)
        parent = h


def test_hash_accepts_tensors_and_salts_change_block0_only():
    block = toks(16)
    assert pagedkv.hash_block_tokens(torch.tensor(block)) == seeds_hash(block)
    salted = pagedkv.hash_block_tokens(block, cache_salt=b"tenant-a")
    assert salted != seeds_hash(block)
    assert salted != pagedkv.hash_block_tokens(block, cache_salt="tenant-b")
    assert pagedkv.hash_block_tokens(block, 7, cache_salt="x") == seeds_hash(block, 7)


def test_salted_block0_hash_follows_the_documented_rule(rng):
    """docs/reference.md: a salt is block 0's parent, xxh64(b"\\xa5" + salt); a router can recompute it."""
    block = toks(16, start=rng.randrange(10**6))
    for salt in (b"tenant-a", "t\u00e9nant"):
        raw = salt.encode() if isinstance(salt, str) else salt
        parent = xxhash.xxh64_intdigest(b"\xa5" + raw)
        assert pagedkv.hash_block_tokens(block, cache_salt=salt) == seeds_hash(block, parent)


def _sha256_first8(data):
    import hashlib

    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


@pytest.mark.parametrize("num_bytes", [0, 8, 48, 56, 64, 72, 120, 128, 136, 1 << 20])
def test_sha256_of_token_blocks_matches_hashlib(num_bytes):
    """The built-in SHA-256 over whole blocks of int64 tokens: lengths around the 55/56 and 64-byte
    padding boundaries and a 1 MiB block."""
    block = [(i * 2654435761) % (1 << 40) - (1 << 39) for i in range(num_bytes // 8)]
    data = np.array(block, dtype=np.int64).tobytes()
    assert pagedkv.hash_block_tokens(block, algo="sha256") == _sha256_first8(data)
    parent = _sha256_first8(b"p")
    assert pagedkv.hash_block_tokens(block, parent, algo="sha256") == _sha256_first8(
        parent.to_bytes(8, "little") + data)


@pytest.mark.parametrize("num_bytes", [2, 3, 55, 56, 57, 63, 64, 65, 119, 120, 121, 1000, (1 << 20) + 1])
def test_sha256_of_any_length_matches_hashlib(num_bytes):
    """A salt of n-1 bytes makes block 0's parent sha256(b"\xa5" + salt): a message of any length n."""
    salt = bytes((i * 131 + 7) % 256 for i in range(num_bytes - 1))
    block = toks(4)
    parent = _sha256_first8(b"\xa5" + salt)
    expected = _sha256_first8(parent.to_bytes(8, "little") + np.array(block, dtype=np.int64).tobytes())
    assert pagedkv.hash_block_tokens(block, cache_salt=salt, algo="sha256") == expected


def test_sha256_and_weak8():
    import hashlib

    block = toks(4)
    digest = hashlib.sha256(np.array(block, dtype=np.int64).tobytes()).digest()
    assert pagedkv.hash_block_tokens(block, algo="sha256") == int.from_bytes(digest[:8], "little")
    assert pagedkv.hash_block_tokens(block, algo="weak8") == seeds_hash(block) & 0xFF
    with pytest.raises(ValueError, match="hash_algo"):
        BlockManager(4, 4, hash_algo="md5")


# --- allocation and prefix caching ---------------------------------------------------------------------

def test_all_blocks_usable_and_slot_mapping():
    bm = BlockManager(4, 4)
    assert bm.can_allocate(toks(16)) == AllocStatus.OK
    assert bm.allocate(1, toks(16)) == 0
    assert bm.num_free_blocks == 0
    table = bm.block_table(1)
    assert sorted(table) == [0, 1, 2, 3]
    expected = [table[p // 4] * 4 + p % 4 for p in range(16)]
    slots = bm.slot_mapping(1, 0, 16)
    assert slots.dtype == torch.int64 and slots.tolist() == expected
    assert bm.slot_mapping(1, 5, 9).tolist() == expected[5:9]
    bm.check_invariants()


def test_slot_mappings_batched_with_and_without_ends():
    bm = BlockManager(16, 4)
    bm.allocate(1, toks(10))
    bm.allocate(2, toks(7, start=100))
    whole = torch.cat([bm.slot_mapping(1, 3), bm.slot_mapping(2, 0)])
    assert bm.slot_mappings([1, 2], [3, 0]).tolist() == whole.tolist()
    chunks = torch.cat([bm.slot_mapping(1, 3, 8), bm.slot_mapping(2, 2, 4)])   # chunked prefill
    assert bm.slot_mappings([1, 2], [3, 2], [8, 4]).tolist() == chunks.tolist()
    assert bm.slot_mappings([1, 2], [10, 7], [10, 7]).numel() == 0
    for starts, ends in (([3, 5], [2, 7]), ([0, 0], [11, 7]), ([-1, 0], [4, 4])):
        with pytest.raises(ValueError, match="not inside"):
            bm.slot_mappings([1, 2], starts, ends)
    with pytest.raises(ValueError, match="ends differ in length"):
        bm.slot_mappings([1, 2], [0, 0], [4])


@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 17])
def test_slot_mappings_match_the_per_token_formula_on_random_ranges(block_size, rng):
    """Slots are written a block's run at a time: every start / end alignment against p // bs, p % bs."""
    bm = BlockManager(4096, block_size)
    lengths = {i: rng.randrange(1, 6 * block_size + 3) for i in range(12)}
    for i, n in lengths.items():
        bm.allocate(i, [rng.randrange(100) for _ in range(n)])
    bm.free(3)  # holes in the pool: tables are not runs of consecutive blocks
    bm.allocate(3, toks(lengths[3]))
    for _ in range(20):
        ids = rng.sample(sorted(lengths), rng.randrange(1, len(lengths) + 1))
        starts = [rng.randrange(lengths[i] + 1) for i in ids]
        ends = [rng.randrange(s, lengths[i] + 1) for s, i in zip(starts, ids)]
        expected = []
        for i, s, e in zip(ids, starts, ends):
            table = bm.block_table(i)
            expected += [table[p // block_size] * block_size + p % block_size for p in range(s, e)]
        assert bm.slot_mappings(ids, starts, ends).tolist() == expected
        i, s, e = ids[0], starts[0], ends[0]
        assert bm.slot_mapping(i, s, e).tolist() == expected[:e - s]
    whole = [t * block_size + k for t in bm.block_table(5) for k in range(block_size)][:lengths[5]]
    assert bm.slot_mappings([5], [0]).tolist() == whole

@pytest.mark.parametrize("window", [None, 5])
def test_attention_inputs_equal_the_separate_calls(window, rng):
    """attention_inputs = (slot_mappings, block_tables, ends or lengths, cumulative query lengths), on random
    batches (windowed group 1: ranges start past what its window released)."""
    block_size = rng.choice([1, 3, 4, 16])
    bm = BlockManager(4096, block_size, group_windows=[None, window])
    lengths = {i: rng.randrange(1, 5 * block_size + 9) for i in range(10)}
    for i, n in lengths.items():
        cached = bm.allocate(i, [rng.randrange(50) for _ in range(n)])  # a prompt can hit an earlier one
        bm.mark_computed(i, rng.randrange(cached, n + 1))
    for _ in range(20):
        ids = rng.sample(sorted(lengths), rng.randrange(0, len(lengths) + 1))
        group = rng.randrange(2)
        first = [bm.num_released_blocks(i, group=group) * block_size for i in ids]
        starts = [rng.randrange(f, lengths[i] + 1) for f, i in zip(first, ids)]
        ends = [rng.randrange(s, lengths[i] + 1) for s, i in zip(starts, ids)] if rng.random() < 0.5 else None
        pad = rng.randrange(-1, 3)
        slots, tables, lens, qsl = bm.attention_inputs(ids, starts, ends, pad=pad, group=group)
        assert slots.dtype == torch.int64 and tables.dtype == lens.dtype == qsl.dtype == torch.int32
        assert slots.tolist() == bm.slot_mappings(ids, starts, ends, group=group).tolist()
        assert tables.tolist() == bm.block_tables(ids, pad=pad, group=group).tolist()
        stop = ends if ends is not None else [lengths[i] for i in ids]
        assert lens.tolist() == stop
        assert qsl.tolist() == [0] + np.cumsum([e - s for s, e in zip(starts, stop)]).tolist()
    with pytest.raises(ValueError, match="differ in length"):
        bm.attention_inputs([0, 1], [0])
    with pytest.raises(KeyError):
        bm.attention_inputs([99], [0])
    with pytest.raises(ValueError, match="not inside"):
        bm.attention_inputs([0], [0], [lengths[0] + 1])


def test_hits_need_mark_computed_and_last_block_is_computed():
    bm = BlockManager(32, 4)
    prompt = toks(12)
    bm.allocate(1, prompt)
    assert bm.allocate(2, prompt) == 0, "not registered before its KV is written"
    bm.mark_computed(1, 8)  # two blocks written
    assert bm.allocate(3, prompt) == 8
    bm.mark_computed([1, 2, 3])
    # 12 tokens = 3 full blocks, but the last is always computed.
    assert bm.allocate(4, prompt) == 8
    assert bm.allocate(5, prompt + [99]) == 12
    # Latest registration wins (seq 2's blocks 0-1); block 2 was written by seq 3 after a parent held
    # by another physical block: equal prefixes are interchangeable.
    assert bm.block_table(5)[:3] == bm.block_table(2)[:2] + [bm.block_table(3)[2]]
    st = bm.stats()
    assert st["hits"] == 8 + 8 + 12 and st["queries"] == 12 * 4 + 13
    assert st["hit_rate"] == pytest.approx(st["hits"] / st["queries"])
    bm.check_invariants()


def test_hit_requires_whole_prefix_not_just_block():
    bm = BlockManager(32, 2)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.mark_computed(1)
    # Same second block, different first block: no hit anywhere.
    assert bm.allocate(2, [9, 9, 3, 4, 5]) == 0
    assert bm.allocate(3, [1, 2, 3, 4, 6]) == 4


def test_latest_registration_wins():
    bm = BlockManager(16, 4)
    bm.allocate(1, toks(5))
    bm.allocate(2, toks(5))
    bm.mark_computed(1)
    bm.mark_computed(2)
    bm.allocate(3, toks(5))
    assert bm.block_table(3)[0] == bm.block_table(2)[0]
    # Freeing the winner and reusing the loser's block leaves the winner's entry intact.
    first_loser = bm.block_table(1)[0]
    bm.free(1)
    bm.allocate(4, toks(4, 100))  # takes free blocks, possibly the loser's
    bm.allocate(5, toks(5))
    assert bm.block_table(5)[0] == bm.block_table(2)[0] != first_loser
    bm.check_invariants()


def test_cached_in_use_blocks_cost_no_free_block():
    bm = BlockManager(5, 4)
    bm.allocate(1, toks(13))  # 4 blocks
    bm.mark_computed(1)
    assert bm.num_free_blocks == 1
    # 13 tokens again: 3 hit blocks in use, 1 new block needed.
    assert bm.can_allocate(toks(13)) == AllocStatus.OK
    assert bm.allocate(2, toks(13)) == 12
    assert bm.can_allocate(toks(13)) == AllocStatus.LATER
    assert bm.can_allocate(toks(21)) == AllocStatus.NEVER


def test_watermark():
    bm = BlockManager(10, 4, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(toks(36)) == AllocStatus.NEVER
    assert bm.can_allocate(toks(32)) == AllocStatus.OK
    bm.allocate(1, toks(4, 100))
    assert bm.can_allocate(toks(32)) == AllocStatus.LATER


def test_salt_isolates_and_prefix_caching_can_be_disabled():
    bm = BlockManager(32, 4)
    bm.allocate(1, toks(9), cache_salt="a")
    bm.mark_computed(1)
    assert bm.allocate(2, toks(9), cache_salt=b"b") == 0
    assert bm.allocate(3, toks(9)) == 0
    assert bm.allocate(4, toks(9), cache_salt="a") == 8
    off = BlockManager(32, 4, enable_prefix_caching=False)
    off.allocate(1, toks(9))
    off.mark_computed(1)
    assert off.allocate(2, toks(9)) == 0
    assert off.stats()["cached_blocks"] == 0


def test_lru_eviction_tail_first():
    bm = BlockManager(6, 2)
    bm.allocate(1, toks(6))
    bm.mark_computed(1)
    table = bm.block_table(1)
    bm.free(1)
    assert bm.stats()["cached_free_blocks"] == 3
    bm.allocate(2, toks(2, 50))
    bm.allocate(3, toks(2, 60))
    bm.allocate(4, toks(2, 70))  # the 3 never-used blocks go first
    assert bm.stats()["evictions"] == 0
    bm.allocate(5, toks(2, 80))
    assert bm.block_table(5) == [table[2]]  # the tail block is evicted first
    assert bm.stats()["evictions"] == 1
    for i in (2, 3, 4):
        bm.free(i)
    assert bm.allocate(6, toks(6)) == 4  # the prefix blocks survived
    assert bm.block_table(6)[:2] == table[:2]
    bm.check_invariants()


def test_reset_prefix_cache():
    bm = BlockManager(8, 2)
    bm.allocate(1, toks(5))
    bm.mark_computed(1)
    bm.reset_prefix_cache()
    assert bm.stats()["cached_blocks"] == 0
    assert bm.allocate(2, toks(5)) == 0
    bm.mark_computed([1, 2])  # re-registers the computed blocks
    assert bm.allocate(3, toks(5)) == 4
    bm.check_invariants()


# --- decode, fork, copy-on-write ------------------------------------------------------------------------

def test_append_token_allocates_at_block_boundary():
    bm = BlockManager(4, 4)
    bm.allocate(1, toks(4))
    assert bm.num_free_blocks == 3
    assert bm.can_append([1])
    slot = bm.append_token(1, 4)
    assert bm.num_free_blocks == 2
    assert slot == bm.block_table(1)[1] * 4
    assert bm.num_tokens(1) == 5
    assert bm.token_ids(1) == toks(5)


def test_batched_append_and_block_tables():
    bm = BlockManager(64, 4)
    for i in range(5):
        bm.allocate(i, toks(3 + 3 * i))
    slots = bm.append_tokens([0, 1, 2, 3, 4], [7, 7, 7, 7, 7])
    assert slots.dtype == torch.int64
    for i in range(5):
        pos = bm.num_tokens(i) - 1
        assert slots[i] == bm.block_table(i)[pos // 4] * 4 + pos % 4
    bt = bm.block_tables([4, 0], max_blocks=6, pad=-1)
    assert bt.dtype == torch.int32 and bt.shape == (2, 6)
    assert bt[0, :4].tolist() == bm.block_table(4) and bt[1].tolist() == bm.block_table(0) + [-1] * 5
    assert bm.block_tables([0, 4]).shape == (2, 4)
    assert bm.num_tokens([0, 4]).tolist() == [4, 16] and bm.num_tokens([0, 4]).dtype == torch.int32
    with pytest.raises(ValueError, match="max_blocks"):
        bm.block_tables([4], max_blocks=2)


def test_fork_and_copy_on_write():
    bm = BlockManager(16, 4)
    bm.allocate(1, toks(6))
    bm.mark_computed(1)
    for child in (2, 3):
        bm.fork(1, child)
    shared = bm.block_table(1)[1]
    used = bm.stats()["used_blocks"]
    slots = bm.append_tokens([1, 2, 3], [10, 11, 12])
    copies = bm.take_copies().tolist()
    # Three sequences share the partial last block: two copies, the last writer keeps the original.
    assert len(copies) == 2 and all(src == shared for src, _ in copies)
    assert bm.stats()["used_blocks"] == used + 2
    assert len({s // 4 for s in slots.tolist()}) == 3
    assert bm.take_copies().tolist() == []
    assert bm.block_table(2)[0] == bm.block_table(1)[0]  # the full block stays shared
    bm.free(1)
    bm.free(2)
    bm.check_invariants()


def test_can_append_counts_cow_exactly():
    bm = BlockManager(3, 4)
    bm.allocate(1, toks(6))
    bm.fork(1, 2)
    assert bm.num_free_blocks == 1
    assert bm.can_append([1, 2])  # one copy, the other writes in place
    bm.fork(1, 3)
    assert not bm.can_append([1, 2, 3])
    with pytest.raises(RuntimeError, match="free blocks"):
        bm.append_tokens([1, 2, 3], [0, 0, 0])
    assert bm.num_tokens(1) == 6 and bm.take_copies().tolist() == []
    bm.check_invariants()


# --- swap ----------------------------------------------------------------------------------------------

def test_swap_out_and_in_roundtrip():
    bm = BlockManager(6, 4, num_cpu_blocks=4)
    bm.allocate(1, toks(10))
    bm.mark_computed(1)
    bm.fork(1, 2)
    gpu_table = bm.block_table(1)
    assert bm.can_swap_out([1, 2])
    out = bm.swap_out([1, 2]).tolist()
    assert [g for g, _ in out] == gpu_table and bm.is_swapped(1)
    assert bm.num_free_cpu_blocks == 1 and bm.num_free_blocks == 6
    # The freed GPU blocks keep their cached KV.
    assert bm.allocate(3, toks(10)) == 8
    bm.free(3)
    assert bm.can_swap_in([1, 2]) == AllocStatus.OK
    back = bm.swap_in([1, 2]).tolist()
    assert [c for c, _ in back] == [c for _, c in out]
    assert bm.block_table(1) == bm.block_table(2) == [g for _, g in back]
    assert bm.num_free_cpu_blocks == 4
    bm.append_token(1, 5)
    bm.mark_computed([1, 2])
    bm.check_invariants()


def test_swap_errors():
    bm = BlockManager(4, 4)
    bm.allocate(1, toks(4))
    with pytest.raises(ValueError, match="no CPU blocks"):
        bm.swap_out([1])
    assert not bm.can_swap_out([1])
    bm2 = BlockManager(4, 4, num_cpu_blocks=1)
    bm2.allocate(1, toks(8))
    assert not bm2.can_swap_out([1])
    with pytest.raises(RuntimeError, match="CPU blocks"):
        bm2.swap_out([1])
    with pytest.raises(ValueError, match="not swapped"):
        bm2.swap_in([1])
    bm3 = BlockManager(4, 4, num_cpu_blocks=4)
    bm3.allocate(1, toks(8))
    bm3.swap_out([1])
    with pytest.raises(ValueError, match="swapped out"):
        bm3.append_token(1, 0)
    with pytest.raises(ValueError, match="swapped out"):
        bm3.block_tables([1])
    bm3.free(1)  # a swapped sequence can be freed: its CPU blocks return
    assert bm3.num_free_cpu_blocks == 4
    bm3.check_invariants()


# --- bad input: a clear exception and no change of state -------------------------------------------------

def snapshot(bm, ids):
    return (bm.num_free_blocks, bm.num_free_cpu_blocks, bm.stats(),
            {i: (bm.block_table(i), bm.num_tokens(i), bm.num_computed_tokens(i)) for i in ids if i in bm})


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda bm: bm.allocate(1, toks(3)), ValueError, "already exists"),
        (lambda bm: bm.allocate(9, []), ValueError, "empty"),
        (lambda bm: bm.allocate(9, toks(100)), RuntimeError, "free blocks"),
        (lambda bm: bm.allocate(9, "abc"), TypeError, "token_ids"),
        (lambda bm: bm.allocate(9, [1.5, 2.0]), TypeError, "ints"),
        (lambda bm: bm.allocate(9, torch.ones(2, 2, dtype=torch.long)), ValueError, "1-D"),
        (lambda bm: bm.free(9), KeyError, "unknown sequence 9"),
        (lambda bm: bm.append_token(9, 1), KeyError, "unknown sequence 9"),
        (lambda bm: bm.append_tokens([1, 9], [1, 1]), KeyError, "unknown sequence 9"),
        (lambda bm: bm.append_tokens([1, 2], [1]), ValueError, "2 seq_ids but 1"),
        (lambda bm: bm.append_tokens([1, 1], [1, 1]), ValueError, "twice"),
        (lambda bm: bm.mark_computed([1, 9]), KeyError, "unknown sequence 9"),
        (lambda bm: bm.mark_computed([1, 2], [3]), ValueError, "num_tokens"),
        (lambda bm: bm.mark_computed(1, 99), ValueError, "num_tokens=99"),
        (lambda bm: bm.slot_mapping(1, 2, 99), ValueError, "start <= end"),
        (lambda bm: bm.slot_mapping(1, -1, 2), ValueError, "start"),
        (lambda bm: bm.fork(1, 2), ValueError, "already exists"),
        (lambda bm: bm.fork(9, 10), KeyError, "unknown"),
        (lambda bm: bm.swap_out([1]), ValueError, "no CPU blocks"),
        (lambda bm: bm.block_table(9), KeyError, "unknown"),
        (lambda bm: bm.block_tables([1, 9]), KeyError, "unknown"),
        (lambda bm: bm.can_append([1, 1]), ValueError, "twice"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, exc, match):
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(10))
    bm.allocate(2, toks(3, 50))
    bm.mark_computed(1, 4)
    before = snapshot(bm, [1, 2, 9, 10])
    with pytest.raises(exc, match=match):
        call(bm)
    assert snapshot(bm, [1, 2, 9, 10]) == before
    bm.check_invariants()


@pytest.mark.parametrize("kwargs", [dict(num_blocks=0, block_size=4), dict(num_blocks=4, block_size=0),
                                    dict(num_blocks=4, block_size=4, watermark=1.5),
                                    dict(num_blocks=4, block_size=4, num_cpu_blocks=-1)])
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


def test_double_free_is_key_error():
    bm = BlockManager(4, 4)
    bm.allocate(1, toks(3))
    bm.free(1)
    with pytest.raises(KeyError, match="already freed"):
        bm.free(1)
    assert bm.num_free_blocks == 4


# --- API shape: block mappings, one name per quantity, deprecations ------------------------------------

def test_block_mappings_are_int64_pair_tensors_the_ops_take():
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    bm.allocate(1, toks(6))
    bm.fork(1, 2)
    bm.append_tokens([1, 2], [7, 8])
    copies = bm.take_copies()
    assert copies.dtype == torch.int64 and copies.shape == (1, 2) and copies.device.type == "cpu"
    (key, value), = pagedkv.allocate_kv_cache(1, 8, 4, 1, 8, dtype=torch.float32)
    key.copy_(torch.arange(key.numel(), dtype=torch.float32).view_as(key))
    src, dst = copies[0].tolist()
    torch.ops.pagedkv.copy_blocks([key], [value], copies)
    assert torch.equal(key[dst], key[src])
    assert bm.take_copies().shape == (0, 2)
    torch.ops.pagedkv.copy_blocks([key], [value], bm.take_copies())  # nothing to copy is fine
    out = bm.swap_out([1, 2])
    assert out.dtype == torch.int64 and out.shape == (3, 2)
    (cpu_key, _), = pagedkv.allocate_kv_cache(1, 8, 4, 1, 8, dtype=torch.float32)
    torch.ops.pagedkv.swap_blocks(key, cpu_key, out)
    for g, c in out.tolist():
        assert torch.equal(cpu_key[c], key[g])
    back = bm.swap_in([1, 2])
    assert back.shape == (3, 2) and back[:, 0].tolist() == out[:, 1].tolist()
    bm.check_invariants()


def test_num_tokens_of_one_sequence_is_an_int_of_several_a_tensor():
    bm = BlockManager(16, 4)
    bm.allocate(1, toks(5))
    bm.allocate(2, toks(9))
    assert bm.num_tokens(1) == 5 and isinstance(bm.num_tokens(1), int)
    assert bm.num_tokens(np.int64(2)) == 9 and bm.num_tokens(torch.tensor(2)) == 9
    for ids in ([1, 2], (1, 2), np.array([1, 2]), torch.tensor([1, 2])):
        lens = bm.num_tokens(ids)
        assert lens.dtype == torch.int32 and lens.tolist() == [5, 9]
    assert bm.num_tokens([]).shape == (0,)
    with pytest.raises(KeyError):
        bm.num_tokens([1, 3])
    with pytest.raises(TypeError):
        bm.num_tokens(1.0)


def test_deprecated_seq_lens_and_seq_id_keyword_still_work():
    bm = BlockManager(16, 4)
    bm.allocate(1, toks(5))
    with pytest.warns(DeprecationWarning, match=r"seq_lens.*num_tokens\(seq_ids\)"):
        assert bm.seq_lens([1]).tolist() == [5]
    with pytest.warns(DeprecationWarning, match="num_tokens"):
        assert bm.num_tokens(seq_id=1) == 5
    assert bm.num_tokens(seq_ids=1) == 5
