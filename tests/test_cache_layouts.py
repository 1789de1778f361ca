"""reshape_and_cache into the caches other engines allocate: K and V views of one buffer (vLLM's interleaved
K|V cells, FlashInfer's [pages, 2, ...], the HND order, transformers' alternating pages) against a plain
PyTorch reference, every byte of the buffer compared (the bytes the op must not write hold NaN); int32
and int64 slot mappings; the exact K/V aliasing check against a brute-force one; hostile arguments."""
from __future__ import annotations

import random

import pytest
import torch

import pagedkv.ops as ops

from ops_reference import BF16, DEVICES, F16, F32

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


@pytest.mark.parametrize("op", ["paged_attention", "copy_blocks", "swap_blocks"])
def test_other_ops_still_refuse_strided_caches(op):
    cells = torch.randn(4, 8, 2, 128)
    key_cache, value_cache = cells[..., :64], cells[..., 64:]
    before = cells.clone()
    with pytest.raises(RuntimeError, match="must be contiguous"):
        if op == "paged_attention":
            ops.paged_attention(torch.randn(1, 2, 64), key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.125)
        elif op == "copy_blocks":
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
