"""Non-finite keys and values at masked positions (after a query, outside its sliding window, past a
sequence's length, in other sequences' blocks) must not reach that query's output: on every CPU
attention path (single-query decode, per-row, micro-GEMM prefill, split-K, each ISA copy) and dtype."""
from __future__ import annotations

import pytest
import torch

import pagedkv.ops as ops

from ops_reference import BF16, CPU_ISAS, F16, F32, PagedBatch, assert_close, cpu_attention_isa

POISONS = [float("inf"), float("-inf"), float("nan")]


def slot_of(batch, b, pos):
    bs = batch.key_cache.shape[1]
    return int(batch.block_tables[b, pos // bs]) * bs + pos % bs


def visible_positions(batch, b, j, sliding_window):
    """Key positions query j of sequence b sees (causal, bottom-right aligned, optional window)."""
    q_len = int(batch.query_start_loc[b + 1] - batch.query_start_loc[b])
    pos = int(batch.seq_lens[b]) - q_len + j
    begin = max(0, pos + 1 - sliding_window) if sliding_window > 0 else 0
    return range(begin, pos + 1)


def masked_slots(batch, sliding_window):
    """Slots a query cannot see but the kernel might touch: each sequence's last key (masked for all
    but its last query), keys just before a window, the tail of each last block, a block no table uses."""
    bs, num_blocks = batch.key_cache.shape[1], batch.key_cache.shape[0]
    slots = set()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = int(batch.query_start_loc[b + 1] - batch.query_start_loc[b])
        if q_len > 1:
            slots.add(slot_of(batch, b, seq_len - 1))
            slots.add(slot_of(batch, b, seq_len - 2))
        if sliding_window > 0 and seq_len - q_len + 1 - sliding_window > 0:
            first = seq_len - q_len + 1 - sliding_window   # first key the first query sees
            for pos in range(max(0, first - 3), first):
                slots.add(slot_of(batch, b, pos))
        for pos in range(seq_len, -(-seq_len // bs) * bs):  # past the length, same block
            slots.add(slot_of(batch, b, pos))
    used = {int(x) for b, n in enumerate(batch.seq_lens.tolist()) for x in batch.block_tables[b, :-(-n // bs)]}
    free = [blk for blk in range(num_blocks) if blk not in used]
    slots.update(free[0] * bs + o for o in range(bs))
    return sorted(slots)


def check_masked_poison(batch, *, sliding_window=-1, softcap=0.0, where=("key", "value"), num_threads=None):
    """Plants inf / -inf / NaN at masked slots; every row that sees none of them must match the
    reference on the clean cache (and be finite); the planted slots must really be masked for some row."""
    expected, expected_lse = batch.reference(sliding_window=sliding_window, softcap=softcap)
    poisoned = masked_slots(batch, sliding_window)
    poison_set = set(poisoned)
    bs = batch.key_cache.shape[1]
    values = torch.tensor(POISONS, dtype=batch.key_cache.dtype)[torch.randint(0, 3, (len(poisoned),))]
    for name in where:
        cache = getattr(batch, f"{name}_cache").view(-1, *batch.key_cache.shape[2:])
        cache[torch.tensor(poisoned)] = values.view(-1, 1, 1).expand(-1, *cache.shape[1:])
    threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        out, lse = ops.paged_attention_with_lse(*batch.args(), sliding_window=sliding_window, softcap=softcap)
    finally:
        torch.set_num_threads(threads)
    clean_rows = []
    for b in range(batch.seq_lens.shape[0]):
        q0, q1 = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        for j in range(q1 - q0):
            seen = {slot_of(batch, b, p) for p in visible_positions(batch, b, j, sliding_window)}
            if not seen & poison_set:
                clean_rows.append(q0 + j)
    assert len(clean_rows) > 0
    rows = torch.tensor(clean_rows)
    assert torch.isfinite(out[rows].float()).all(), f"non-finite output in rows {clean_rows}"
    assert_close(out[rows], expected[rows], batch.query.dtype, f"bs={bs} poisoned={len(poisoned)}")
    torch.testing.assert_close(lse[rows].double(), expected_lse[rows], atol=1e-4, rtol=1e-4)
    return len(clean_rows)


# (prefixes, q_lens, block_size, num_kv_heads, group, head_dim): the kernel path each shape takes.
PATH_SHAPES = {
    "decode": ([19, 40, 3], [1, 1, 1], 16, 2, 4, 64),
    "decode-per-row": ([19, 40, 3], [1, 1, 1], 8, 2, 2, 36),            # head_dim % 8 != 0
    "prefill-per-row": ([0, 11, 30], [5, 7, 3], 8, 2, 2, 64),             # q_len * group < 16
    "prefill-gemm": ([0, 7, 60], [20, 33, 70], 16, 2, 4, 64),             # q_len * group >= 16
    "prefill-gemm-odd": ([0, 130], [20, 90], 5, 1, 3, 72),                # padded rows and head_dim
    # one query per 64-row block: the block's last key pair reaches past its odd number of keys
    "prefill-gemm-mqa": ([40], [3], 16, 1, 64, 32),
    "mixed": ([36, 0, 50, 300, 4, 17], [1, 20, 13, 1, 1, 40], 16, 2, 2, 80),
}


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("path", list(PATH_SHAPES))
@pytest.mark.parametrize("sliding_window", [-1, 6, 40])
@pytest.mark.parametrize("where", [("value",), ("key",), ("key", "value")])
def test_masked_nonfinite_does_not_leak(dtype, path, sliding_window, where):
    prefixes, q_lens, bs, hkv, group, d = PATH_SHAPES[path]
    batch = PagedBatch(prefixes, q_lens, block_size=bs, num_kv_heads=hkv, group=group, head_dim=d, dtype=dtype,
                       device="cpu")
    check_masked_poison(batch, sliding_window=sliding_window, where=where)


def test_issue_repro_inf_at_last_position_of_a_prompt():
    # A 20-token prompt with value_cache inf at position 19: rows 0-18 never see it.
    batch = PagedBatch([0], [20], block_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=F16, device="cpu")
    expected, _ = batch.reference()
    batch.value_cache.view(-1, 2, 64)[slot_of(batch, 0, 19)] = float("inf")
    out = ops.paged_attention(*batch.args())
    assert torch.isfinite(out[:19]).all()
    assert_close(out[:19], expected[:19], F16, "rows 0-18")


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("q_len", [1, 3, 40])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_masked_nonfinite_split_k(dtype, q_len, softcap):
    # Few items over a long context and many threads: the keys are split into partitions merged by lse.
    seq_len = 1500 + int(torch.randint(0, 300, ()))
    for window in (-1, 700):
        batch = PagedBatch([seq_len - q_len], [q_len], block_size=16, num_kv_heads=1, group=4, head_dim=64,
                           dtype=dtype, device="cpu")
        check_masked_poison(batch, sliding_window=window, softcap=softcap, num_threads=8)


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_masked_nonfinite_each_isa(isa):
    with cpu_attention_isa(isa):
        for path, (prefixes, q_lens, bs, hkv, group, d) in PATH_SHAPES.items():
            for dtype in (F32, F16, BF16):
                for window in (-1, 6):
                    batch = PagedBatch(prefixes, q_lens, block_size=bs, num_kv_heads=hkv, group=group, head_dim=d,
                                       dtype=dtype, device="cpu")
                    check_masked_poison(batch, sliding_window=window)
