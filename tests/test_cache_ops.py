"""reshape_and_cache, copy_blocks, swap_blocks and cache sizing against plain references on fresh random
inputs; CUDA variants are skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from pagedkv.cache import allocate_kv_cache, block_bytes, num_blocks_for
import pagedkv.ops as ops

from ops_reference import BF16, DEVICES, F16, F32, HAS_CUDA, PagedBatch, assert_close
import ops_reference as ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 2, 64), (8, 1, 80), (16, 4, 128), (32, 2, 96),
                                                               (256, 1, 256)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_reshape_and_cache(device, dtype, block_size, num_kv_heads, head_dim, layout):
    num_blocks = max(4, 64 // block_size)
    num_tokens = 37
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    if layout == "contiguous":
        key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    else:  # a fused qkv projection's slices and a transposed tensor
        qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=device)
        key = qkv[:, num_kv_heads:2 * num_kv_heads]
        value = torch.randn(num_tokens, head_dim, num_kv_heads, dtype=dtype, device=device).transpose(1, 2)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:5]] = -1  # padding
    slots = slots.to(device)
    expected_k, expected_v = ref.reshape_and_cache(key, value, key_cache, value_cache, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_step_write_then_attend(device, dtype):
    # The engine's decode step: write this token's K/V, then attend over the cache; compare with SDPA
    # on the same KV stored contiguously.
    block_size, num_kv_heads, group, head_dim = 16, 2, 4, 64
    lengths = [1, 20, 33]
    batch = PagedBatch([n - 1 for n in lengths], [1] * len(lengths), block_size=block_size,
                       num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype, device=device)
    key = torch.randn(len(lengths), num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    tables = batch.block_tables.long().cpu()
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for b, n in enumerate(lengths)], device=device)
    ops.reshape_and_cache(key, value, batch.key_cache, batch.value_cache, slots)
    out = ops.paged_attention(*batch.args())
    for b, n in enumerate(lengths):
        k = ref.gather_sequence_kv(batch.key_cache, batch.block_tables[b], n)
        v = ref.gather_sequence_kv(batch.value_cache, batch.block_tables[b], n)
        assert torch.equal(k[-1], key[b]) and torch.equal(v[-1], value[b])
        k = k.double().repeat_interleave(group, 1).transpose(0, 1)
        v = v.double().repeat_interleave(group, 1).transpose(0, 1)
        q = batch.query[b:b + 1].double().transpose(0, 1)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=batch.scale).transpose(0, 1)
        assert_close(out[b:b + 1], sdpa, dtype, f"sequence {b}")


# --------------------------------------------------------------------------------------------------
# copy_blocks / swap_blocks

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 1, 64), (16, 2, 80), (256, 1, 128)])
def test_copy_blocks(device, dtype, block_size, num_kv_heads, head_dim):
    num_layers, num_blocks = 3, 24
    caches = [(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device),
               torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device))
              for _ in range(num_layers)]
    perm = torch.randperm(num_blocks)
    mapping = torch.stack([perm[:6], perm[6:12]], dim=1)  # distinct destinations, never sources
    keys, values = [k for k, _ in caches], [v for _, v in caches]
    expected_k, expected_v = ref.copy_blocks(keys, values, mapping)
    ops.copy_blocks(keys, values, mapping.to(device))
    for got, want in zip(keys + values, expected_k + expected_v):
        assert torch.equal(got, want)


SWAP_DIRECTIONS = [
    ("cpu", "cpu"),
    pytest.param("cuda", "cpu", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
    pytest.param("cpu", "cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
    pytest.param("cuda", "cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("src_device,dst_device", SWAP_DIRECTIONS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_swap_blocks(src_device, dst_device, dtype):
    src = torch.randn(10, 16, 2, 64, dtype=dtype, device=src_device)
    dst = torch.randn(7, 16, 2, 64, dtype=dtype, device=dst_device)
    if dst_device == "cpu" and src_device == "cuda":
        dst = dst.pin_memory()
    mapping = torch.stack([torch.randperm(10)[:5], torch.randperm(7)[:5]], dim=1)
    expected = ref.swap_blocks(src, dst, mapping)
    ops.swap_blocks(src, dst, mapping)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert torch.equal(dst, expected)


# --------------------------------------------------------------------------------------------------
# pagedkv.cache

def test_allocate_kv_cache_and_num_blocks_for():
    caches = allocate_kv_cache(3, 10, 16, 2, 64, dtype=BF16, device="cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (10, 16, 2, 64) and k.dtype == BF16 and k.is_contiguous()
        assert k.data_ptr() != v.data_ptr()
    per_block = block_bytes(num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=BF16)
    assert per_block == 2 * 3 * 16 * 2 * 64 * 2
    assert num_blocks_for(10 * per_block + per_block - 1, num_layers=3, block_size=16, num_kv_heads=2,
                          head_dim=64, dtype=BF16) == 10
    assert num_blocks_for(0, num_layers=1, block_size=16, num_kv_heads=1, head_dim=64, dtype=F32) == 0
    with pytest.raises(ValueError):
        allocate_kv_cache(0, 10, 16, 2, 64)
