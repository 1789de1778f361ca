"""reshape_and_cache and paged_attention on the caches other engines allocate: K and V views of one buffer
(vLLM's interleaved K|V cells, FlashInfer's [pages, 2, ...], the HND order, transformers' alternating pages)
against a plain PyTorch reference. Writes: every byte of the buffer compared (the bytes the op must not
write hold NaN); int32 and int64 slot mappings. Attention: every dtype (float8 with scales), decode and
both prefill kernels, every CPU ISA copy, NaN in every slot it must not read, and equal to the same call
on contiguous copies. The exact K/V aliasing check against a brute-force one; hostile arguments."""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedkv.ops as ops

import ops_reference as ref
from ops_reference import BF16, CPU_ISAS, DEVICES, F16, F32, assert_close, cpu_attention_isa

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["separate", "vllm_cells", "pages_two", "hnd", "transformers_pages", "mixed"]
SENTINEL = 0xFF  # NaN in every float format here, one byte or wider


def buffer_numel(layout: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    pages_per_block = 4 if layout == "transformers_pages" else 2
    return pages_per_block * num_blocks * block_size * num_kv_heads * head_dim


def cache_views(buffer: torch.Tensor, layout: str, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each a [num_blocks, block_size, num_kv_heads, head_dim] view of buffer (a
    flat tensor of buffer_numel(...) elements) in the layout's order."""
    n, bs, h, d = num_blocks, block_size, num_kv_heads, head_dim
    if layout == "separate":  # two contiguous halves
        x = buffer.view(2, n, bs, h, d)
        return x[0], x[1]
    if layout == "vllm_cells":  # one tensor per layer, K|V interleaved in each cell
        x = buffer.view(n, bs, h, 2 * d)
        return x[..., :d], x[..., d:]
    if layout == "pages_two":  # FlashInfer: [pages, 2, page, Hkv, D]
        x = buffer.view(n, 2, bs, h, d)
        return x[:, 0], x[:, 1]
    if layout == "hnd":  # [pages, 2, Hkv, page, D], each half seen as [pages, page, Hkv, D]
        x = buffer.view(n, 2, h, bs, d)
        return x[:, 0].transpose(1, 2), x[:, 1].transpose(1, 2)
    if layout == "mixed":  # K: a contiguous NHD half; V: the other half in HND order (different strides)
        x = buffer.view(2, n, h, bs, d)
        return x[0].view(n, bs, h, d), x[1].transpose(1, 2)
    if layout == "transformers_pages":  # a 2-layer group: pages K0 V0 K1 V1 per block; layer 1's views
        x = buffer.view(n, 2, 2, bs, h, d)[:, 1]
        return x[:, 0], x[:, 1]
    raise ValueError(layout)


def sentinel_buffer(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.full((numel * torch.tensor([], dtype=dtype).element_size(),), SENTINEL, dtype=torch.uint8,
                      device=device).view(dtype)


def random_slots(num_tokens: int, num_slots: int, slot_dtype: torch.dtype, device) -> torch.Tensor:
    slots = torch.randperm(num_slots)[:num_tokens]
    pad = torch.randperm(num_tokens)[:max(1, num_tokens // 5)]
    slots[pad] = torch.tensor([-1, -7, torch.iinfo(slot_dtype).min])[torch.arange(len(pad)) % 3]
    return slots.to(slot_dtype).to(device)


def reference_write(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[slot // bs, slot % bs] = row for every non-negative slot, through the view (in place)."""
    keep = slots >= 0
    s = slots[keep].long()
    if cache.element_size() == 1:  # float8: move the bytes
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache[s // cache.shape[1], s % cache.shape[1]] = rows[keep]


def quantise(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    x = x.float() if scale is None else x.float() / (scale.view(1, -1, 1) if scale.dim() else scale)
    return x.clamp(-limit, limit).to(dtype)


CASES = [(F32, F32, "none"), (F16, F16, "none"), (BF16, BF16, "none"),
         (BF16, torch.float8_e4m3fn, "head"), (F16, torch.float8_e4m3fn, "tensor"), (F32, torch.float8_e5m2, "none"),
         (BF16, torch.float8_e5m2, "head")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("in_dtype,cache_dtype,scales", CASES,
                         ids=[f"{str(i)[6:]}-{str(c)[6:]}-{s}" for i, c, s in CASES])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 2, 64), (5, 1, 40), (16, 4, 128)])
def test_reshape_and_cache_into_cache_views(device, layout, in_dtype, cache_dtype, scales, slot_dtype, block_size,
                                            num_kv_heads, head_dim):
    num_blocks, num_tokens = max(3, 48 // block_size), 29
    dims = (num_blocks, block_size, num_kv_heads, head_dim)
    buffer = sentinel_buffer(buffer_numel(layout, *dims), cache_dtype, device)
    key_cache, value_cache = cache_views(buffer, layout, *dims)
    assert key_cache.shape == value_cache.shape == dims and key_cache.stride(3) == 1
    assert layout in ("separate", "mixed") or not key_cache.is_contiguous()
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=device).to(in_dtype)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]  # a fused projection's slices
    k_scale = v_scale = None
    if scales == "tensor":
        k_scale, v_scale = torch.tensor(0.02, device=device), torch.tensor(3.0, device=device)
    elif scales == "head":
        k_scale = torch.rand(num_kv_heads, device=device) + 0.01
        v_scale = torch.rand(num_kv_heads, device=device) * 4 + 0.25
    slots = random_slots(num_tokens, num_blocks * block_size, slot_dtype, device)

    want = buffer.clone()
    want_k, want_v = cache_views(want, layout, *dims)
    if cache_dtype in FP8:
        reference_write(want_k, quantise(key, k_scale, cache_dtype), slots)
        reference_write(want_v, quantise(value, v_scale, cache_dtype), slots)
    else:
        reference_write(want_k, key, slots)
        reference_write(want_v, value, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    got_bytes, want_bytes = buffer.view(torch.uint8), want.view(torch.uint8)
    untouched = want_bytes == SENTINEL
    assert torch.equal(got_bytes[untouched], want_bytes[untouched]), "a byte outside the written rows changed"
    assert torch.equal(got_bytes, want_bytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int32_and_int64_slots_write_the_same(device, layout):
    dims = (6, 8, 2, 32)
    key, value = torch.randn(20, 2, 32, device=device), torch.randn(20, 2, 32, device=device)
    slots = random_slots(20, 48, torch.int32, device)  # int32 padding values: the same in both types
    buffers = []
    for slot_dtype in (torch.int32, torch.int64):
        buffer = sentinel_buffer(buffer_numel(layout, *dims), F32, device)
        ops.reshape_and_cache(key, value, *cache_views(buffer, layout, *dims), slots.to(slot_dtype))
        buffers.append(buffer.view(torch.uint8))
    assert torch.equal(*buffers)


# --------------------------------------------------------------------------------------------------
# The aliasing check: K and V views of one buffer are accepted exactly when they share no element.

def element_ids(view: torch.Tensor, buffer_numel: int) -> set[int]:
    """The buffer indices of a view's elements (the same as_strided on an arange)."""
    ids = torch.arange(buffer_numel).as_strided(view.shape, view.stride(), view.storage_offset())
    return set(ids.flatten().tolist())


def has_internal_overlap(view: torch.Tensor) -> bool:
    return len(element_ids(view, view.untyped_storage().nbytes() // view.element_size())) != view.numel()


def random_view_strides(rng: random.Random, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a [blocks, bs, H, D] view with a contiguous head_dim: the block, token and head
    dimensions nested in a random order, each with a random gap (so views of one buffer can interleave)."""
    n, bs, h, d = sizes
    order = rng.sample([0, 1, 2], 3)  # innermost first
    strides = [0, 0, 0, 1]
    extent = d + rng.choice([0, 0, d, 1, 3])
    for dim in order:
        strides[dim] = extent
        extent = extent * sizes[dim] + rng.choice([0, 0, d, 2, 5])
    return tuple(strides)


@pytest.mark.parametrize("trial", range(6))
def test_overlap_check_matches_brute_force(trial, rng):
    """Random strided K and V views of one buffer (same or different strides, offsets near each other):
    the op never accepts a pair that shares an element, and accepts every disjoint pair with equal strides."""
    accepted = refused = undecided = 0
    for _ in range(150):
        sizes = (rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 3), rng.choice([1, 2, 4]))
        k_strides = random_view_strides(rng, sizes)
        v_strides = k_strides if rng.random() < 0.6 else random_view_strides(rng, sizes)
        k_span = sum((s - 1) * st for s, st in zip(sizes, k_strides)) + 1
        v_span = sum((s - 1) * st for s, st in zip(sizes, v_strides)) + 1
        k_offset = rng.randint(0, 8)
        v_offset = rng.choice([k_offset + rng.randint(0, k_span + 1), rng.randint(0, 8 + k_span)])
        numel = max(k_offset + k_span, v_offset + v_span) + 3
        buffer = torch.randn(numel)
        key_cache = buffer.as_strided(sizes, k_strides, k_offset)
        value_cache = buffer.as_strided(sizes, v_strides, v_offset)
        if has_internal_overlap(key_cache) or has_internal_overlap(value_cache):
            continue
        shared = bool(element_ids(key_cache, numel) & element_ids(value_cache, numel))
        key = torch.randn(1, sizes[2], sizes[3])
        slots = torch.tensor([rng.randrange(sizes[0] * sizes[1])])
        before = buffer.clone()
        try:
            ops.reshape_and_cache(key, key.clone(), key_cache, value_cache, slots)
        except RuntimeError as e:
            assert "share memory" in str(e) or "same tensor" in str(e), str(e)
            assert torch.equal(buffer, before)
            assert shared or k_strides != v_strides, f"disjoint views with strides {k_strides} refused: {e}"
            if shared:
                refused += 1
            else:
                undecided += 1
            continue
        assert not shared, f"accepted K {k_strides} @{k_offset} and V {v_strides} @{v_offset}, which share elements"
        accepted += 1
    assert accepted > 20 and refused > 20, (accepted, refused, undecided)


def _aliasing_calls():
    n, bs, h, d = 4, 8, 2, 16
    cells = torch.randn(n, bs, h, 2 * d)  # vLLM's layout
    pages = torch.randn(n, 2, bs, h, d)   # FlashInfer's
    flat = pages.view(-1)
    key = torch.randn(3, h, d)
    slots = torch.tensor([0, 9, 17], dtype=torch.int32)
    page = bs * h * d
    return [cells, pages], {
        "K is V": ((key, key, cells[..., :d], cells[..., :d], slots), "same tensor"),
        "cells shifted by one element": ((key, key, cells[..., :d], cells[..., d - 1:2 * d - 1], slots),
                                         "share memory"),
        "cells, V inside K's cell": ((key, key, cells[..., 1:d + 1], cells[..., :d], slots), "share memory"),
        "pages, V one token early": ((key, key, pages[:, 0],
                                      flat.as_strided((n, bs, h, d), (2 * page, h * d, d, 1), page - h * d),
                                      slots), "share memory"),
        "hnd transpose of K's own page": ((key, key, pages[:, 0], pages[:, 0].view(n, h, bs, d).transpose(1, 2),
                                           slots), "share memory"),
        "key reads from key_cache": ((cells[0, :3, :, :d], key, cells[..., :d], cells[..., d:], slots),
                                     "share memory"),
        "value reads from value_cache": ((key, cells[1, :3, :, d:], cells[..., :d], cells[..., d:], slots),
                                         "share memory"),
    }


@pytest.mark.parametrize("case", list(_aliasing_calls()[1]))
def test_overlapping_cache_views_are_refused_and_nothing_changes(case):
    buffers, calls = _aliasing_calls()
    before = [b.clone() for b in buffers]
    args, message = calls[case]
    with pytest.raises(RuntimeError, match=message):
        ops.reshape_and_cache(*args)
    for b, b0 in zip(buffers, before):
        assert torch.equal(b, b0)


def test_key_read_from_the_other_half_of_the_cells_is_accepted():
    # key lives in the V half of the buffer while only K is written: no element is both read and written.
    cells = torch.randn(4, 8, 2, 32)
    key_cache, value_store = cells[..., :16], cells[..., 16:]
    key = value_store[0, :3]
    value_cache = torch.zeros(4, 8, 2, 16)
    want = key.clone()
    ops.reshape_and_cache(key, key.clone(), key_cache, value_cache, torch.tensor([5, 6, 7]))
    assert torch.equal(key_cache[0, 5:8], want)


# --------------------------------------------------------------------------------------------------
# Hostile arguments: a clear error, nothing written

def _hostile_calls(buffer: torch.Tensor):
    n, bs, h, d = 4, 8, 2, 16
    key_cache, value_cache = cache_views(buffer, "vllm_cells", n, bs, h, d)
    key = torch.randn(3, h, d)
    ok = torch.tensor([0, 9, 17])
    big = torch.iinfo(torch.int32).max
    return {
        r"slot_mapping must be int32 or int64, got Float": (key, key, key_cache, value_cache, ok.float()),
        r"slot_mapping must be int32 or int64, got Bool": (key, key, key_cache, value_cache, ok.bool()),
        r"slot_mapping must be int32 or int64, got Short": (key, key, key_cache, value_cache, ok.short()),
        r"slot_mapping\[1\] = 2147483647 is out of range": (key, key, key_cache, value_cache,
                                                             torch.tensor([0, big, 1], dtype=torch.int32)),
        r"slot_mapping\[2\] = 4294967297 is out of range": (key, key, key_cache, value_cache,
                                                             torch.tensor([0, 1, 2**32 + 1])),
        r"slot_mapping\[0\] and slot_mapping\[2\] are both slot 9": (key, key, key_cache, value_cache,
                                                                      torch.tensor([9, -1, 9], dtype=torch.int32)),
        r"key_cache must have a contiguous head_dim": (key[..., :8], key[..., :8], key_cache[..., ::2],
                                                       value_cache[..., ::2], ok),
        r"value_cache has elements that share memory": (key, key, key_cache, value_cache[:1].expand(n, bs, h, d),
                                                        ok),
        r"value_cache shape": (key, key, key_cache, value_cache[:, :4], ok),
    }


@pytest.mark.parametrize("case", list(_hostile_calls(torch.zeros(2 * 4 * 8 * 2 * 16))))
def test_hostile_arguments_raise_and_change_nothing(case):
    buffer = torch.randn(2 * 4 * 8 * 2 * 16)
    before = buffer.clone()
    with pytest.raises(RuntimeError, match=case):
        ops.reshape_and_cache(*_hostile_calls(buffer)[case])
    assert torch.equal(buffer, before)


def test_int32_min_and_negative_slots_are_padding():
    buffer = sentinel_buffer(2 * 2 * 4 * 1 * 8, F32, "cpu")
    key_cache, value_cache = cache_views(buffer, "vllm_cells", 2, 4, 1, 8)
    key = torch.randn(3, 1, 8)
    ops.reshape_and_cache(key, key, key_cache, value_cache,
                          torch.tensor([torch.iinfo(torch.int32).min, -1, 5], dtype=torch.int32))
    written = buffer.view(torch.uint8) != SENTINEL
    assert int(written.sum()) == 2 * 8 * 4  # one K row and one V row of 8 floats
    assert torch.equal(key_cache[1, 1], key[2]) and torch.equal(value_cache[1, 1], key[2])


@pytest.mark.parametrize("op", ["copy_blocks", "swap_blocks"])
def test_block_copies_still_refuse_strided_caches(op):
    cells = torch.randn(4, 8, 2, 128)
    key_cache, value_cache = cells[..., :64], cells[..., 64:]
    before = cells.clone()
    with pytest.raises(RuntimeError, match="must be contiguous"):
        if op == "copy_blocks":
            ops.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 1]]))
        else:
            ops.swap_blocks(key_cache, torch.randn(4, 8, 2, 64), torch.tensor([[0, 1]]))
    assert torch.equal(cells, before)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_on_interleaved_cells_with_int32_slots(device):
    cells = torch.randn(4, 8, 2, 128, device=device)
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([3, -1, 17], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.pagedkv.reshape_and_cache.default,
                          (key, torch.randn_like(key), cells[..., :64], cells[..., 64:], slots))


def test_views_too_irregular_to_decide_are_refused():
    # K every 4th element, V every 6th from 1: disjoint (even vs odd), but with different strides the check
    # must try ~N/3 coefficients; small N is decided (accepted), large N exceeds its budget (refused).
    for num_blocks, accepted in ((200, True), (200_000, False)):
        buffer = torch.zeros(6 * num_blocks + 8)
        key_cache = buffer.as_strided((num_blocks, 1, 1, 1), (4, 1, 1, 1), 0)
        value_cache = buffer.as_strided((num_blocks, 1, 1, 1), (6, 1, 1, 1), 1)
        key = torch.ones(1, 1, 1)
        if accepted:
            ops.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([7]))
            assert buffer[28] == 1 and buffer[43] == 1 and buffer.sum() == 2
        else:
            with pytest.raises(RuntimeError, match="may share memory"):
                ops.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([7]))
            assert not buffer.any()


# --------------------------------------------------------------------------------------------------
# paged_attention reads the same views: K and V with equal strides (every layout but "mixed")

ATTENTION_LAYOUTS = [layout for layout in LAYOUTS if layout != "mixed"]
ATTENTION_CASES = [(F32, F32, "none"), (F16, F16, "none"), (BF16, BF16, "none"),
                   (BF16, torch.float8_e4m3fn, "head"), (F16, torch.float8_e4m3fn, "tensor"),
                   (F32, torch.float8_e5m2, "head")]
# (kernel, prefixes, q_lens, group): decode (one query per sequence), prefill with few rows (the per-row
# kernel) and with many (the micro-GEMM kernel; AMX tiles for bf16), GQA throughout.
ATTENTION_SHAPES = {
    "decode": ([0, 16, 39, 300], [1, 1, 1, 1], 4),
    "prefill_rows": ([0, 21], [3, 2], 2),
    "prefill_gemm": ([35, 0], [40, 17], 2),
}


class ViewBatch:
    """A random paged batch whose caches are K/V views of one NaN-filled buffer in `layout`: only the
    slots of each sequence's positions hold numbers; unused blocks, the tail of each last block and the
    other parts of the buffer stay NaN, and block tables are padded with out-of-range ids."""

    def __init__(self, layout, prefixes, q_lens, group, dtype, cache_dtype, scales, device, *, block_size=16,
                 num_kv_heads=2, head_dim=64):
        self.seq_lens_list = [p + q for p, q in zip(prefixes, q_lens)]
        blocks_per_seq = [-(-n // block_size) for n in self.seq_lens_list]
        num_blocks = sum(blocks_per_seq) + 3
        dims = (num_blocks, block_size, num_kv_heads, head_dim)
        self.buffer = sentinel_buffer(buffer_numel(layout, *dims), cache_dtype, device)
        self.key_cache, self.value_cache = cache_views(self.buffer, layout, *dims)
        perm = torch.randperm(num_blocks)
        tables = torch.randint(num_blocks, num_blocks + 1000, (len(q_lens), max(blocks_per_seq) + 2))
        used = 0
        for b, n in enumerate(blocks_per_seq):
            tables[b, :n] = perm[used:used + n]
            used += n
        self.k_scale = self.v_scale = None
        if scales == "tensor":
            self.k_scale, self.v_scale = torch.tensor(0.05, device=device), torch.tensor(0.3, device=device)
        elif scales == "head":
            self.k_scale = torch.rand(num_kv_heads, device=device) * 0.2 + 0.01
            self.v_scale = torch.rand(num_kv_heads, device=device) + 0.05
        for b, seq_len in enumerate(self.seq_lens_list):
            pos = torch.arange(seq_len)
            slots = (tables[b, pos // block_size].long() * block_size + pos % block_size).to(device)
            for cache, scale in ((self.key_cache, self.k_scale), (self.value_cache, self.v_scale)):
                rows = torch.randn(seq_len, num_kv_heads, head_dim, device=device)
                if cache_dtype in FP8:
                    reference_write(cache, quantise(rows * (1 if scale is None else scale.view(-1, 1)),
                                                    scale, cache_dtype), slots)
                else:
                    reference_write(cache, rows.to(cache_dtype), slots)
        self.block_tables = tables.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32,
                                            device=device)
        self.query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, device=device).to(dtype)
        self.scale = head_dim ** -0.5

    def run(self, key_cache, value_cache):
        return ops.paged_attention_with_lse(self.query, key_cache, value_cache, self.block_tables, self.seq_lens,
                                            self.query_start_loc, self.scale, k_scale=self.k_scale,
                                            v_scale=self.v_scale)

    def reference(self):
        """float64 (out, lse) from the caches' values times their scales."""
        def values(cache, scale):
            x = cache.float()
            return x if scale is None else x * scale.view(-1, 1).float()
        return ref.paged_attention(self.query, values(self.key_cache, self.k_scale),
                                   values(self.value_cache, self.v_scale), self.block_tables, self.seq_lens,
                                   self.query_start_loc, self.scale)


def _check_attention_on_views(batch: ViewBatch, dtype, what: str) -> None:
    assert not batch.key_cache.is_contiguous() or batch.key_cache.data_ptr() == batch.buffer.data_ptr()
    before = batch.buffer.view(torch.uint8).clone()
    out, lse = batch.run(batch.key_cache, batch.value_cache)
    expected, expected_lse = batch.reference()
    assert_close(out, expected, dtype, what)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)
    # The same arithmetic as on contiguous caches (the kernels only address rows differently).
    out_c, lse_c = batch.run(batch.key_cache.contiguous(), batch.value_cache.contiguous())
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c), f"{what}: differs from the contiguous call"
    assert torch.equal(batch.buffer.view(torch.uint8), before), "paged_attention wrote into its caches"


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("dtype,cache_dtype,scales", ATTENTION_CASES,
                         ids=[f"{str(d)[6:]}-{str(c)[6:]}-{s}" for d, c, s in ATTENTION_CASES])
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_paged_attention_cpu_on_cache_views(isa, layout, dtype, cache_dtype, scales, shape):
    prefixes, q_lens, group = ATTENTION_SHAPES[shape]
    batch = ViewBatch(layout, prefixes, q_lens, group, dtype, cache_dtype, scales, "cpu")
    with cpu_attention_isa(isa):
        _check_attention_on_views(batch, dtype, f"{isa} {layout} {shape}")


@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("block_size,head_dim", [(5, 40), (1, 24), (32, 128)])
def test_paged_attention_on_cache_views_odd_shapes(layout, block_size, head_dim):
    """Blocks that do not hold whole 16-key tiles, head dims that are not multiples of 16 (other kernels)."""
    for kernel, (prefixes, q_lens, group) in ATTENTION_SHAPES.items():
        batch = ViewBatch(layout, prefixes, q_lens, group, F32, F32, "none", "cpu", block_size=block_size,
                          head_dim=head_dim)
        _check_attention_on_views(batch, F32, f"{layout} {kernel} bs={block_size} D={head_dim}")


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("layout,num_kv_heads", [("vllm_cells", 8), ("separate", 16), ("separate", 8)])
def test_bf16_decode_with_slots_4k_apart(isa, layout, num_kv_heads):
    """bf16 rows whose slots are 4 KiB apart (cells of 8 KV heads x 128 dims, contiguous 16 x 128) are
    staged out of the cache by the AVX-512 decode kernel: the same results as rows read in place."""
    prefixes, q_lens, group = ATTENTION_SHAPES["decode"]
    batch = ViewBatch(layout, prefixes, q_lens, group, BF16, BF16, "none", "cpu", num_kv_heads=num_kv_heads,
                      head_dim=128)
    with cpu_attention_isa(isa):
        _check_attention_on_views(batch, BF16, f"{isa} {layout} Hkv={num_kv_heads}")


@pytest.mark.skipif(not ref.HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ATTENTION_LAYOUTS)
@pytest.mark.parametrize("dtype,cache_dtype,scales", ATTENTION_CASES,
                         ids=[f"{str(d)[6:]}-{str(c)[6:]}-{s}" for d, c, s in ATTENTION_CASES])
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_paged_attention_cuda_on_cache_views(layout, dtype, cache_dtype, scales, shape):
    prefixes, q_lens, group = ATTENTION_SHAPES[shape]
    batch = ViewBatch(layout, prefixes, q_lens, group, dtype, cache_dtype, scales, "cuda")
    _check_attention_on_views(batch, dtype, f"cuda {layout} {shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_paged_attention_on_interleaved_cells(device):
    batch = ViewBatch("vllm_cells", [5, 0], [1, 3], 2, F32, F32, "none", device)
    cells = batch.buffer.view(*batch.key_cache.shape[:3], -1).nan_to_num()  # opcheck compares outputs
    args = (batch.query, cells[..., :64], cells[..., 64:], batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.scale)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, args)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_with_lse.default, args)


def test_paged_attention_on_cache_views_compiles():
    batch = ViewBatch("hnd", [9, 0], [1, 5], 2, F32, F32, "none", "cpu")
    fn = torch.compile(lambda q, k, v: ops.paged_attention(q, k, v, batch.block_tables, batch.seq_lens,
                                                           batch.query_start_loc, batch.scale), fullgraph=True)
    out = fn(batch.query, batch.key_cache, batch.value_cache)
    assert_close(out, batch.reference()[0], F32, "compiled")


def _hostile_attention_views():
    n, bs, h, d = 4, 8, 2, 16
    cells = torch.randn(n, bs, h, 2 * d)  # vLLM's layout
    pages = torch.randn(n, 2, bs, h, d)   # FlashInfer's
    hnd = torch.randn(n, h, bs, d)
    return {
        r"key_cache strides \[512, 64, 32, 1\] and value_cache strides \[256, 16, 128, 1\] must be equal":
            (cells[..., :d], hnd.transpose(1, 2)),
        r"key_cache strides \[512, 32, 16, 1\] and value_cache strides \[512, 16, 128, 1\] must be equal":
            (pages[:, 0], pages[:, 1].as_strided((n, bs, h, d), (512, 16, 128, 1))),  # K NHD, V HND
        r"key_cache must have a contiguous head_dim": (cells[..., ::2], cells[..., 1::2]),
        r"value_cache has elements that share memory .*each cache element holds one value":
            (pages[:, 0], pages[:1, 1].expand(n, bs, h, d)),
        r"key_cache has elements that share memory":
            (cells.as_strided((n, bs, h, d), (0, 2 * h * d, 2 * d, 1)), cells[..., d:]),
    }


@pytest.mark.parametrize("case", list(_hostile_attention_views()))
def test_hostile_attention_cache_views_raise(case):
    """Checked before anything is read; each call runs in a child process too, so a missing check that
    crashes the kernel fails the test instead of the run."""
    key_cache, value_cache = _hostile_attention_views()[case]
    query = torch.randn(2, 4, key_cache.shape[-1])
    tables = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 12], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=case):
        ops.paged_attention(query, key_cache, value_cache, tables, seq_lens, qsl, 0.25)


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_paged_attention_on_overlapping_page_views(isa):
    """transformers' page views: each layer's K pages and, one page later, its V pages as two contiguous
    [pages, page, Hkv, D] views of the whole buffer (they overlap; only reads). Block b of layer 1 of a
    2-layer group is page 4 b of both views: the same output as the [blocks, ...] strided views."""
    batch = ViewBatch("transformers_pages", *ATTENTION_SHAPES["prefill_rows"], F32, F32, "none", "cpu")
    pages = batch.buffer.view(-1, *batch.key_cache.shape[1:])  # K0 V0 K1 V1 per block
    key_pages, value_pages = pages[2:-1], pages[3:]            # layer 1's K and V page views
    assert key_pages.is_contiguous() and value_pages.is_contiguous()
    tables = batch.block_tables.clone()
    real = tables < batch.key_cache.shape[0]
    tables[real] *= 4
    with cpu_attention_isa(isa):
        out, lse = ops.paged_attention_with_lse(batch.query, key_pages, value_pages, tables, batch.seq_lens,
                                                batch.query_start_loc, batch.scale)
        want, want_lse = batch.run(batch.key_cache, batch.value_cache)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert_close(out, batch.reference()[0], F32, "overlapping page views")


def test_hostile_attention_cache_views_do_not_crash_a_process():
    code = textwrap.dedent("""
        import re, torch, pagedkv.ops as ops
        from test_cache_layouts import _hostile_attention_views
        for case, (k, v) in _hostile_attention_views().items():
            q = torch.randn(2, 4, k.shape[-1])
            try:
                ops.paged_attention(q, k, v, torch.tensor([[0, 3], [1, 2]], dtype=torch.int32),
                                    torch.tensor([9, 12], dtype=torch.int32),
                                    torch.tensor([0, 1, 2], dtype=torch.int32), 0.25)
            except RuntimeError as e:
                assert re.search(case, str(e)), (case, str(e))
            else:
                raise AssertionError("accepted: " + case)
        print("all refused")
    """)
    import os
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests_dir), tests_dir]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "all refused" in done.stdout, done.stderr[-2000:]
