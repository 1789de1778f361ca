"""Sliding windows and hybrid groups of layers in the BlockManager: construction, the release rule (checked
against the attention kernel's window), prefix hits that need only the window, per-group tables and
prefix-cache namespaces, fork / copy-on-write, swap, truncate, admission counting only held blocks."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import pagedkv
from pagedkv import AllocStatus, BlockManager


def toks(n, start=0):
    return list(range(start, start + n))


def first_held_block(num_computed, window, bs):
    """Independent of the manager's formula: the first block any future query (position >= num_computed,
    reading positions (q - window, q]) can read."""
    if window is None:
        return 0
    first_read = max(0, num_computed - window + 1)  # the smallest position read by the query at num_computed
    return first_read // bs


# --- construction ------------------------------------------------------------------------------------

def test_windows_and_groups_are_properties():
    bm = BlockManager(8, 4)
    assert (bm.num_groups, bm.group_windows) == (1, [None])
    bm = BlockManager(8, 4, group_windows=[100])
    assert (bm.num_groups, bm.group_windows) == (1, [100])
    bm = BlockManager(8, 4, group_windows=[None, 4096, None])
    assert (bm.num_groups, bm.group_windows) == (3, [None, 4096, None])


def test_sliding_window_argument_and_property_are_deprecated():
    with pytest.warns(DeprecationWarning, match=r"group_windows=\[w\]"):
        bm = BlockManager(8, 4, sliding_window=100)
    assert bm.group_windows == [100]
    with pytest.warns(DeprecationWarning, match="use group_windows"):
        assert bm.sliding_window == 100
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="group_windows"):
        BlockManager(8, 4, group_windows=[None, 8]).sliding_window  # ambiguous on a hybrid manager


@pytest.mark.filterwarnings("ignore:BlockManager\\(sliding_window=w\\) is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kwargs, error", [
    (dict(sliding_window=4, group_windows=[None]), ValueError),
    (dict(sliding_window=0), ValueError),
    (dict(sliding_window=-3), ValueError),
    (dict(sliding_window=2.5), TypeError),
    (dict(sliding_window=True), TypeError),
    (dict(group_windows=[]), ValueError),
    (dict(group_windows=[None, 0]), ValueError),
    (dict(group_windows=[None] * 65), ValueError),
    (dict(group_windows="ab"), TypeError),
])
def test_bad_windows_raise(kwargs, error):
    with pytest.raises(error):
        BlockManager(8, 4, **kwargs)


def test_group_argument_is_checked():
    bm = BlockManager(8, 4, group_windows=[None, 8])
    bm.allocate(0, toks(5))
    for call in (lambda: bm.block_table(0, group=2), lambda: bm.block_tables([0], group=-1),
                 lambda: bm.slot_mapping(0, 0, 1, group=2), lambda: bm.slot_mappings([0], [0], group=5),
                 lambda: bm.num_released_blocks(0, group=2), lambda: bm.attention_inputs([0], [0], group=3)):
        with pytest.raises(ValueError, match="group"):
            call()


# --- the release rule --------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(bs=st.sampled_from([1, 2, 4, 16]), window=st.integers(1, 40), prompt=st.integers(1, 50),
       steps=st.lists(st.integers(1, 7), max_size=12))
def test_release_follows_the_window(bs, window, prompt, steps):
    """After every mark_computed, exactly the blocks wholly before the first position a future query reads
    are released (pads), the rest held; held blocks stay within the window's blocks + the one written."""
    bm = BlockManager(256, bs, group_windows=[window])
    bm.allocate(0, toks(prompt))
    n = prompt
    bm.mark_computed(0)
    for k in steps:
        bm.append_tokens([0], toks(k), counts=[k])
        n += k
        bm.mark_computed(0)
        released = first_held_block(n, window, bs)
        table = bm.block_table(0)
        assert bm.num_released_blocks(0) == released
        assert table[:released] == [0] * released  # the pad
        assert len(table) == -(-n // bs)
        assert bm.blocks_held(n, n) == len(table) - released
        assert len(table) - released <= -(-(window - 1) // bs) + 1
        assert bm.num_free_blocks == 256 - (len(table) - released)
        bm.check_invariants()


def test_memory_is_o_window_not_o_context():
    bs, window = 16, 64
    bm = BlockManager(12, bs, group_windows=[window])  # 12 blocks = 192 tokens of pool
    bm.allocate(0, toks(100))
    bm.mark_computed(0)
    for t in range(2000):  # 2100 tokens: eleven times the pool
        assert bm.can_append([0])
        bm.append_token(0, t)
        bm.mark_computed(0)
    assert bm.num_tokens(0) == 2100
    assert 12 - bm.num_free_blocks <= window // bs + 1
    assert len(bm.block_table(0)) == -(-2100 // bs)
    bm.check_invariants()
    full = BlockManager(12, bs)
    full.allocate(0, toks(100))
    with pytest.raises(RuntimeError):
        for t in range(2000):
            full.append_token(0, t)


def test_block_tables_and_slot_mapping_around_released_entries():
    bm = BlockManager(32, 4, group_windows=[6])
    bm.allocate(0, toks(19))
    bm.mark_computed(0)  # first position read: 14 -> blocks 0..2 released
    table = bm.block_table(0)
    assert bm.num_released_blocks(0) == 3 and table[:3] == [0, 0, 0]
    rows = bm.block_tables([0], pad=-7, max_blocks=8)
    assert rows[0].tolist() == [-7, -7, -7] + table[3:] + [-7] * 3
    assert bm.slot_mapping(0, 12, 19).tolist() == [table[p // 4] * 4 + p % 4 for p in range(12, 19)]
    with pytest.raises(ValueError, match="released"):
        bm.slot_mapping(0, 11, 19)
    with pytest.raises(ValueError, match="released"):
        bm.slot_mappings([0], [3], [5])
    assert bm.slot_mapping(0, 5, 5).tolist() == []  # an empty range reads nothing


def test_windowed_block_tables_may_be_longer_than_the_pool():
    bm = BlockManager(4, 2, group_windows=[2])
    bm.allocate(0, toks(3))
    bm.mark_computed(0)
    for t in range(20):
        bm.append_token(0, t)
        bm.mark_computed(0)
    assert bm.block_tables([0]).shape == (1, 12)
    assert bm.block_tables([0], max_blocks=40).shape == (1, 40)


# --- against the kernel ------------------------------------------------------------------------------

def kv_of(tokens, p, heads, dim):
    """Deterministic K/V of the token at position p given its prefix (so a prefix hit holds valid KV)."""
    g = torch.Generator().manual_seed(hash(tuple(tokens[: p + 1])) & 0xFFFFFFFF)
    return torch.randn(2, heads, dim, generator=g)


@pytest.mark.parametrize("windows", [[5], [None, 7], [3, None, 9]])
def test_kernels_read_only_held_blocks(windows, rng):
    """A tiny serving loop: prompts (some sharing prefixes), chunked prefill, decode, freeing. Each group's
    cache gets K/V through its slot mapping; attention through its block tables (released entries point
    at a NaN-filled pad block) equals a dense reference over the window: released blocks are never read,
    and every held block (hits included) holds the right KV."""
    bs, heads, dim, num_blocks = 4, 2, 8, 64
    bm = BlockManager(num_blocks, bs, group_windows=windows)
    pad = num_blocks  # an extra block full of NaN
    caches = [torch.zeros(2, num_blocks + 1, bs, heads, dim) for _ in windows]
    for c in caches:
        c[:, pad] = float("nan")
    base = [rng.randrange(50) for _ in range(30)]
    for sid in range(12):
        prompt = base[: rng.randrange(1, 30)] + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
        if bm.can_allocate(prompt) != AllocStatus.OK:
            break
        start = bm.allocate(sid, prompt)
        tokens = list(prompt)
        while start < len(tokens) or len(tokens) < len(prompt) + 6:
            if start == len(tokens):  # decode one token, if the pool has a block for it
                if not bm.can_append([sid]):
                    break
                tokens.append(rng.randrange(50))
                bm.append_token(sid, tokens[-1])
            end = min(len(tokens), start + rng.randrange(1, 9))
            q = torch.randn(end - start, heads, dim)
            for g, w in enumerate(windows):
                slots = bm.slot_mapping(sid, start, end, group=g)
                kv = torch.stack([kv_of(tokens, p, heads, dim) for p in range(start, end)], 1)
                pagedkv.ops.reshape_and_cache(kv[0], kv[1], caches[g][0], caches[g][1], slots)
                out = pagedkv.ops.paged_attention(
                    q, caches[g][0], caches[g][1], bm.block_tables([sid], pad=pad, group=g),
                    torch.tensor([end], dtype=torch.int32), torch.tensor([0, end - start], dtype=torch.int32),
                    dim ** -0.5, sliding_window=w or -1)
                for j, p in enumerate(range(start, end)):
                    lo = 0 if w is None else max(0, p - w + 1)
                    ref_kv = torch.stack([kv_of(tokens, x, heads, dim) for x in range(lo, p + 1)], 1)
                    att = torch.softmax(torch.einsum("hd,khd->hk", q[j], ref_kv[0]) * dim ** -0.5, -1)
                    ref = torch.einsum("hk,khd->hd", att, ref_kv[1])
                    torch.testing.assert_close(out[j], ref, atol=1e-5, rtol=1e-5)
            bm.mark_computed(sid, end)
            start = end
            bm.check_invariants()
        if rng.random() < 0.5:
            bm.free(sid)
        bm.check_invariants()


# --- prefix caching with a window --------------------------------------------------------------------

def test_a_windowed_hit_needs_only_the_blocks_the_window_reads():
    """The blocks a window released are evicted; the prompt still hits in full, because the blocks the
    window reads at the first token to compute are still held."""
    bm = BlockManager(12, 4, group_windows=[8])
    prompt = toks(33)
    bm.allocate(0, prompt)
    bm.mark_computed(0)  # first read position 26: blocks 0..5 released (cached, free)
    assert bm.num_released_blocks(0) == 6 and bm.num_free_blocks == 9
    bm.allocate(1, toks(36, 1000))  # takes every free block: the six released ones are evicted
    assert bm.stats()["evictions"] == 6
    bm.free(1)
    assert bm.allocate(2, prompt) == 32  # ceil(33/4) - 1 = 8 blocks hit; only blocks 6, 7 are needed
    assert bm.block_table(2)[6:8] == bm.block_table(0)[6:8]
    assert bm.num_released_blocks(2) == 6
    bm.check_invariants()


def test_window_hit_holds_only_the_window_and_its_kv_is_the_prompts(rng):
    bm = BlockManager(64, 4, group_windows=[10], enable_events=True)
    prompt = [rng.randrange(100) for _ in range(41)]
    bm.allocate(0, prompt)
    table0 = bm.block_table(0)  # before the window releases anything
    bm.mark_computed(0)
    assert bm.allocate(1, prompt) == 40
    released = first_held_block(40, 10, 4)
    t1 = bm.block_table(1)
    assert bm.num_released_blocks(1) == released and t1[:released] == [0] * released
    # the held hits are the blocks seq 0 computed: still held, or released to the cache and revived
    assert t1[released:10] == table0[released:10]
    assert bm.num_computed_tokens(1) == 40
    bm.check_invariants()


def test_hybrid_hit_is_the_longest_prefix_every_group_serves():
    """The windowed group's released blocks 0..3 are evicted while the full group keeps every block: a
    prompt whose window would need them does not hit at all (the full group alone would serve 4 blocks),
    one whose window needs only block 4 hits in full. Groups never share a block."""
    bm = BlockManager(40, 2, group_windows=[None, 3])
    prompt = toks(13)
    bm.allocate(0, prompt)
    g0, g1 = bm.block_table(0, group=0), bm.block_table(0, group=1)
    bm.mark_computed(0)  # group 1 (window 3): first read position 11 -> blocks 0..4 released
    assert bm.num_released_blocks(0, group=1) == 5 and bm.num_released_blocks(0, group=0) == 0
    assert not set(g0) & set(g1[5:])
    assert bm.num_free_blocks == 40 - 7 - 2
    bm.allocate(1, toks(30, 1000))  # 2 x 15 blocks: the 26 untouched ones, then group 1's blocks 0..3
    assert bm.stats()["evictions"] == 4
    bm.free(1)
    assert bm.allocate(2, prompt[:9]) == 0
    assert bm.allocate(3, prompt[:11]) == 10
    assert bm.block_table(3, group=0)[:5] == g0[:5]
    assert bm.num_released_blocks(3, group=1) == 4 and bm.block_table(3, group=1)[4] == g1[4]
    bm.check_invariants()


def test_each_group_hashes_in_its_own_namespace():
    bm = BlockManager(40, 2, group_windows=[None, None], enable_events=True)
    bm.allocate(0, toks(9))
    bm.mark_computed(0)
    assert bm.stats()["cached_blocks"] == 8  # 4 full blocks per group
    events = bm.take_events()  # group 0's cache only
    assert sum(len(e["block_hashes"]) for e in events if e["kind"] == "stored") == 4
    assert len(bm.cached_blocks()) == 4
    bm.allocate(1, toks(9))
    for g in range(2):
        assert bm.block_table(1, group=g)[:4] == bm.block_table(0, group=g)[:4]


# --- admission counts only held blocks ---------------------------------------------------------------

def test_blocks_held_and_can_allocate():
    bm = BlockManager(10, 4, group_windows=[None, 8])
    assert bm.blocks_held(17) == 10 and bm.blocks_held(17, 17) == 5 + 5 - (17 - 8 + 1) // 4
    assert bm.blocks_held(0) == 0
    with pytest.raises(ValueError):
        bm.blocks_held(5, 6)
    assert bm.can_allocate(toks(20)) == AllocStatus.OK  # 5 blocks x 2 groups = the pool
    assert bm.can_allocate(toks(21)) == AllocStatus.NEVER
    bm.allocate(0, toks(20))
    assert bm.num_free_blocks == 0
    bm.mark_computed(0)  # the windowed group gives back 3 blocks
    assert bm.num_free_blocks == (20 - 8 + 1) // 4
    assert bm.can_allocate(toks(6, 100)) == AllocStatus.LATER


def test_can_append_and_swap_count_every_group():
    bm = BlockManager(8, 2, num_cpu_blocks=8, group_windows=[None, 2])
    bm.allocate(0, toks(4))
    bm.mark_computed(0)
    held = 8 - bm.num_free_blocks
    assert held == 2 + 2 - (4 - 2 + 1) // 2
    assert bm.can_append([0]) and bm.can_append([0], num_lookahead_slots=2)
    assert not bm.can_append([0], num_lookahead_slots=6)
    mapping = bm.swap_out([0])
    assert len(mapping) == held  # only held blocks move
    assert bm.num_free_cpu_blocks == 8 - held
    assert bm.block_table(0, group=1)[0] == 0 and bm.num_released_blocks(0, group=1) == 1
    assert bm.can_swap_in([0]) == AllocStatus.OK
    back = bm.swap_in([0])
    assert len(back) == held and bm.num_free_cpu_blocks == 8
    bm.check_invariants()
    bm.append_token(0, 7)
    bm.mark_computed(0)
    bm.check_invariants()


# --- fork, copy-on-write, truncate ---------------------------------------------------------------------

def test_fork_and_copy_on_write_across_released_entries():
    bm = BlockManager(32, 4, group_windows=[5])
    bm.allocate(0, toks(18))
    bm.mark_computed(0)
    r = bm.num_released_blocks(0)
    assert r == 3
    bm.fork(0, 1)
    assert bm.block_table(1) == bm.block_table(0) and bm.num_released_blocks(1) == r
    free = bm.num_free_blocks
    bm.append_tokens([0, 1], [5, 6])  # the shared partial block is copied for one of them
    copies = bm.take_copies()
    assert len(copies) == 1 and bm.num_free_blocks == free - 1
    assert bm.block_table(0)[:r] == bm.block_table(1)[:r] == [0] * r
    bm.mark_computed([0, 1])
    bm.check_invariants()
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 32
    bm.check_invariants()


def test_truncate_refuses_to_roll_back_into_released_blocks():
    bm = BlockManager(32, 4, group_windows=[4])
    bm.allocate(0, toks(10))
    bm.mark_computed(0)  # first read 7: blocks 0 released
    bm.append_tokens([0], toks(5, 50), counts=[5])  # drafts, not computed
    bm.truncate([0], [11])  # the computed tokens keep their window
    with pytest.raises(ValueError, match="released"):
        bm.truncate([0], [6])  # the query at 6 would read position 3
    assert bm.num_tokens(0) == 11
    bm.mark_computed(0)
    bm.check_invariants()


def test_preemption_by_recompute_frees_everything_held():
    bm = BlockManager(16, 4, group_windows=[None, 6])
    bm.allocate(0, toks(30))
    bm.mark_computed(0)
    for t in range(6):
        bm.append_token(0, t)
        bm.mark_computed(0)
    tokens = bm.token_ids(0)
    bm.free(0)
    assert bm.num_free_blocks == 16
    assert bm.allocate(0, tokens) > 0  # recompute: the prefix cache serves both groups
    bm.check_invariants()


# --- chunked prefill ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("windows", [[16], [16, 32], [None, 16]])
def test_prompt_longer_than_the_pool_is_prefilled_in_chunks(windows, rng):
    """allocate(num_new_tokens=) + reserve(): a windowed prompt of several times the pool is admitted and
    prefilled chunk by chunk, each chunk's blocks reserved after the previous chunk released its window's
    oldest blocks; a full-attention group still needs its whole prompt."""
    bs, num_blocks, chunk = 4, 40, rng.choice([4, 7, 16])
    # Longer than the pool (160 tokens) for every draw: a whole prompt never fits even one group's table.
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(num_blocks * bs + 1, 300))]
    bm = BlockManager(num_blocks, bs, group_windows=windows)
    full = None in windows
    assert bm.can_allocate(prompt) == AllocStatus.NEVER
    status = bm.can_allocate(prompt, num_new_tokens=chunk)
    assert status == (AllocStatus.NEVER if full else AllocStatus.OK)
    if full:
        return
    assert bm.allocate(0, prompt, num_new_tokens=chunk) == 0
    with pytest.raises(ValueError, match="reserve"):
        bm.append_token(0, 1)
    with pytest.raises(ValueError, match="reserve"):
        bm.mark_computed(0)
    done, peak = 0, 0
    while done < len(prompt):
        end = min(len(prompt), done + chunk)
        if bm.num_allocated_tokens(0) < end:
            assert bm.can_reserve(0, end)
            bm.reserve(0, end)
        with pytest.raises(ValueError):
            bm.slot_mapping(0, done, bm.num_allocated_tokens(0) + 1)
        for g in range(len(windows)):
            bm.slot_mapping(0, done, end, group=g)
        bm.mark_computed(0, end)
        done = end
        peak = max(peak, num_blocks - bm.num_free_blocks)
        bm.check_invariants()
    assert peak <= bm.blocks_held(0) + sum(-(-(w + bs - 2) // bs) + 1 + -(-chunk // bs) for w in windows)
    bm.append_token(0, 3)
    bm.mark_computed(0)
    bm.check_invariants()
    bad = [(lambda: bm.reserve(0, len(prompt) + 2)), (lambda: bm.allocate(1, prompt, num_new_tokens=0))]
    for call in bad:
        with pytest.raises(ValueError):
            call()


# --- layers to groups ------------------------------------------------------------------------------------

def test_kv_cache_groups_from_layer_windows(rng):
    w = rng.randrange(1, 5000)
    assert pagedkv.kv_cache_groups([None] * 3) == ([None], [(0, 0), (0, 1), (0, 2)])
    assert pagedkv.kv_cache_groups([w] * 2) == ([w], [(0, 0), (0, 1)])
    gemma = [w if i % 2 == 0 else None for i in range(6)]  # Gemma 2: sliding, full, sliding, ...
    windows, placement = pagedkv.kv_cache_groups(gemma)
    assert windows == [None, w]                            # full attention first
    assert placement == [(1 - i % 2, i // 2) for i in range(6)]
    assert pagedkv.kv_cache_groups([w + 1, w, None, w])[0] == [None, w, w + 1]   # then windows, smallest first
    for layer, (g, _) in enumerate(placement):
        assert windows[g] == gemma[layer]
    BlockManager(8, 4, group_windows=windows)  # the manager takes them as they are
    for bad, error in (([], ValueError), ([4, 0], ValueError), ([2.5], TypeError), ([True], TypeError)):
        with pytest.raises(error):
            pagedkv.kv_cache_groups(bad)


def test_distinct_blocks_counts_what_a_swap_moves():
    bm = BlockManager(16, 2, num_cpu_blocks=16, group_windows=[None, 2])
    bm.allocate(0, toks(7))
    bm.mark_computed(0)
    bm.fork(0, 1)                      # shares every held block of 0
    bm.allocate(2, toks(3, 50))
    held = bm.distinct_blocks([0])
    assert held == 16 - bm.num_free_blocks - bm.distinct_blocks([2])       # released entries excepted
    assert bm.distinct_blocks([0, 1]) == held and bm.distinct_blocks(1) == held
    assert bm.distinct_blocks([]) == 0
    assert len(bm.swap_out([0, 1])) == held
    assert bm.distinct_blocks([0, 1]) == held == 16 - bm.num_free_cpu_blocks   # swapped: its CPU blocks
    for bad, error in (([0, 2], ValueError), ([2, 0], ValueError), ([0, 0], ValueError), ([9], KeyError),
                       (["a"], TypeError)):
        with pytest.raises(error):
            bm.distinct_blocks(bad)
    assert len(bm.swap_in([0, 1])) == held
    bm.check_invariants()
