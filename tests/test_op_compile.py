"""Every op under opcheck, a decode step under torch.compile(fullgraph=True), and (CUDA) captured in a
CUDA graph."""
from __future__ import annotations

import pytest
import torch

import pagedkv.ops as ops

from ops_reference import BF16, DEVICES, F32, HAS_CUDA, PagedBatch, assert_close
import ops_reference as ref


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_all_ops(device):
    batch = ref.small_batch(device)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, batch.args(),
                          {"sliding_window": 5, "softcap": 2.0})
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_with_lse.default, batch.args())
    sinks = torch.randn(batch.query.shape[1], device=device)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, batch.args(), {"sinks": sinks})
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_with_lse.default, batch.args(),
                          {"sinks": sinks, "sliding_window": 3})
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([3, -1, 17], device=device)
    torch.library.opcheck(torch.ops.pagedkv.reshape_and_cache.default,
                          (key, torch.randn_like(key), batch.key_cache, batch.value_cache, slots))
    mapping = torch.tensor([[0, 5], [2, 7]], device=device)
    torch.library.opcheck(torch.ops.pagedkv.copy_blocks.default,
                          ([batch.key_cache, batch.key_cache.clone()], [batch.value_cache, batch.value_cache.clone()],
                           mapping))
    torch.library.opcheck(torch.ops.pagedkv.swap_blocks.default,
                          (batch.key_cache, torch.randn(4, 8, 2, 64, device=device), torch.tensor([[1, 3]])))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_under_torch_compile(device):
    torch._dynamo.reset()
    batch = PagedBatch([9, 30], [1, 1], block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=F32,
                       device=device)
    key = torch.randn(2, 2, 64, device=device)
    value = torch.randn_like(key)
    slots = torch.tensor([int(batch.block_tables[0, 1]) * 8 + 1, int(batch.block_tables[1, 3]) * 8 + 6],
                         device=device)

    def decode_step(query, key, value, key_cache, value_cache, slots, block_tables, seq_lens, qsl):
        ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
        out, lse = ops.paged_attention_with_lse(query, key_cache, value_cache, block_tables, seq_lens, qsl, 0.125)
        return out * 2.0, lse

    compiled = torch.compile(decode_step, fullgraph=True, backend="inductor")
    eager_caches = (batch.key_cache.clone(), batch.value_cache.clone())
    rest = (slots, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    eager = decode_step(batch.query, key, value, *eager_caches, *rest)
    got = compiled(batch.query, key, value, batch.key_cache, batch.value_cache, *rest)
    torch.testing.assert_close(got, eager, atol=0, rtol=0)
    assert torch.equal(batch.key_cache, eager_caches[0]) and torch.equal(batch.value_cache, eager_caches[1])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq_len", [40, 3000])  # one partition / split-K with the merge kernel
def test_cuda_decode_step_graph_capture(seq_len):
    # A decode step must capture into a CUDA graph (no host syncs) and replay on new inputs.
    batch = PagedBatch([seq_len - 1, 10], [1, 1], block_size=16, num_kv_heads=2, group=4, head_dim=128,
                       dtype=BF16, device="cuda")
    key = torch.randn(2, 2, 128, dtype=BF16, device="cuda")
    value = torch.randn_like(key)
    tables = batch.block_tables.long().cpu()
    slots = torch.tensor([int(tables[0, (seq_len - 1) // 16]) * 16 + (seq_len - 1) % 16,
                          int(tables[1, 0]) * 16 + 10], device="cuda")

    def step():
        ops.reshape_and_cache(key, value, batch.key_cache, batch.value_cache, slots)
        return ops.paged_attention(*batch.args(), max_seq_len=seq_len)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        batch.query.copy_(torch.randn_like(batch.query))
        key.copy_(torch.randn_like(key))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, batch.reference()[0], BF16, "graph replay")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_mla_ops(device):
    from mla_reference import LatentBatch
    batch = LatentBatch([9, 0], [1, 3], block_size=4, num_heads=3, kv_lora_rank=32, rope_dim=16, dtype=F32,
                        device=device)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_mla.default, batch.args())
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_mla_with_lse.default, batch.args())
    # float8: every check but test_schema, which multiplies the float8 cache (torch does not implement it)
    fp8 = batch.kv_cache.to(torch.float8_e4m3fn)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_mla.default, (batch.query, fp8, *batch.args()[2:]),
                          {"kv_scale": torch.tensor(0.5, device=device)}, test_utils=utils)
    kv_c, k_pe = torch.randn(3, 32, device=device), torch.randn(3, 1, 16, device=device).squeeze(1)
    slots = torch.tensor([3, -1, 17], device=device)
    torch.library.opcheck(torch.ops.pagedkv.concat_and_cache_mla.default, (kv_c, k_pe, batch.kv_cache, slots))
    torch.library.opcheck(torch.ops.pagedkv.concat_and_cache_mla.default,
                          (kv_c, k_pe, fp8, slots.int(), "fp8", torch.tensor([2.0], device=device)), test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_decode_step_under_torch_compile(device):
    from mla_reference import LatentBatch
    torch._dynamo.reset()
    batch = LatentBatch([9, 30], [1, 1], block_size=8, num_heads=4, kv_lora_rank=64, rope_dim=32, dtype=F32,
                        device=device)
    kv_c, k_pe = torch.randn(2, 64, device=device), torch.randn(2, 32, device=device)
    tables = batch.block_tables.long().cpu()
    slots = torch.tensor([int(tables[0, 1]) * 8 + 1, int(tables[1, 3]) * 8 + 6], device=device)

    def decode_step(query, kv_c, k_pe, kv_cache, slots, block_tables, seq_lens, qsl):
        ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slots)
        out, lse = ops.paged_attention_mla_with_lse(query, kv_cache, block_tables, seq_lens, qsl, 0.1, 64)
        return out * 2.0, lse

    compiled = torch.compile(decode_step, fullgraph=True, backend="inductor")
    eager_cache = batch.kv_cache.clone()
    rest = (slots, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    eager = decode_step(batch.query, kv_c, k_pe, eager_cache, *rest)
    got = compiled(batch.query, kv_c, k_pe, batch.kv_cache, *rest)
    torch.testing.assert_close(got, eager, atol=0, rtol=0)
    assert torch.equal(batch.kv_cache.view(torch.uint8), eager_cache.view(torch.uint8))
