"""The MLA ops against float64 references: concat_and_cache_mla (strided inputs, int32 / int64 slots,
padding, float8 with a scale, cache views) and paged_attention_mla(_with_lse) (decode and prefill over a
cached prefix, block sizes 1 to 64, DeepSeek's 512 + 64 and small latents, 1 to 16 heads, float8), with NaN
in every cache byte the kernels must not read; hostile inputs raise and change nothing."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pagedkv.ops as ops

from mla_reference import LatentBatch, concat_and_cache_mla as ref_concat, stored_latent
from ops_reference import BF16, DEVICES, F16, F32, TOLERANCE, assert_close

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(512, 64), (32, 16)]  # (kv_lora_rank, rope_dim): DeepSeek V2/V3 and Kimi K2, and a small one


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN compares equal to itself."""
    return t.contiguous().view(torch.uint8)


def nan_cache(num_blocks, block_size, width, dtype, device):
    return torch.full((num_blocks, block_size, width), math.nan, device=device).to(dtype)


# --------------------------------------------------------------------------------------------------
# concat_and_cache_mla

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("rank,rope", SHAPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_concat_and_cache_mla_writes_rows(device, dtype, rank, rope, block_size, slot_dtype):
    num_blocks, T = 12, 9
    # kv_c and k_pe as the slices of one fused projection output, k_pe squeezed from [T, 1, rope]
    fused = torch.randn(T, rank + 2 * rope, dtype=dtype, device=device)
    kv_c, k_pe = fused[:, :rank], fused[:, rank:rank + rope].unsqueeze(1).squeeze(1)
    slots = torch.randperm(num_blocks * block_size)[:T].to(slot_dtype)
    slots[[2, 5]] = -1  # padding
    cache = nan_cache(num_blocks, block_size, rank + rope, dtype, device)
    expected = ref_concat(kv_c.cpu(), k_pe.cpu(), cache.cpu(), slots)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots.to(device))
    assert torch.equal(bits(cache.cpu()), bits(expected))


@pytest.mark.parametrize("device", DEVICES)
def test_concat_and_cache_mla_into_a_cache_view(device):
    # a latent cache that is a view: every other row of a larger buffer, and its blocks spaced apart
    buf = torch.full((6, 8, 2, 48), math.nan, device=device)
    cache = buf[:, :, 1]
    kv_c, k_pe = torch.randn(4, 32, device=device), torch.randn(4, 16, device=device)
    slots = torch.tensor([0, 9, 47, -1], device=device)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    expected = ref_concat(kv_c.cpu(), k_pe.cpu(), cache.cpu(), slots.cpu())
    assert torch.equal(bits(cache.cpu()), bits(expected))
    assert torch.isnan(buf[:, :, 0]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("scale_shape", [None, (), (1,)])
def test_concat_and_cache_mla_float8(device, fp8, dtype, scale_shape):
    T, rank, rope = 6, 32, 16
    kv_c = torch.randn(T, rank, dtype=dtype, device=device) * 40
    k_pe = torch.randn(T, rope, dtype=dtype, device=device) * 40
    kv_c[0, 0], kv_c[1, 1] = 1e30, -1e30  # saturate
    scale = None if scale_shape is None else torch.full(scale_shape, 0.37, device=device)
    slots = torch.tensor([3, 0, -1, 7, 12, 15], device=device)
    cache = nan_cache(4, 4, rank + rope, fp8, device)
    expected = ref_concat(kv_c.cpu(), k_pe.cpu(), cache.cpu(), slots.cpu(),
                          None if scale is None else scale.cpu())
    name = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}[fp8]
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, name, scale)
    assert torch.equal(bits(cache.cpu()), bits(expected))


def test_concat_and_cache_mla_vllm_call_shape():
    # vLLM's call: positional kv_cache_dtype and scale; "fp8" names e4m3; a scale on a bf16 cache is ignored
    kv_c, k_pe = torch.randn(2, 32, dtype=BF16), torch.randn(2, 16, dtype=BF16)
    cache = torch.zeros(2, 4, 48, dtype=BF16)
    torch.ops.pagedkv.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([1, 6]), "auto", torch.tensor(2.0))
    assert torch.equal(cache.view(-1, 48)[[1, 6]], torch.cat([kv_c, k_pe], 1))
    fp8 = torch.zeros(2, 4, 48, dtype=torch.float8_e4m3fn)
    torch.ops.pagedkv.concat_and_cache_mla(kv_c, k_pe, fp8, torch.tensor([1, 6]), "fp8", torch.tensor(2.0))
    assert torch.equal(bits(fp8.view(-1, 48)[[1, 6]]), bits(stored_latent(kv_c, k_pe, fp8.dtype, torch.tensor(2.0))))


def _concat_args():
    return dict(kv_c=torch.randn(3, 32), k_pe=torch.randn(3, 16), kv_cache=torch.zeros(4, 4, 48),
                slot_mapping=torch.tensor([0, 5, -1]), kv_cache_dtype="auto", scale=None)


CONCAT_ERRORS = {
    "slot out of range": (dict(slot_mapping=torch.tensor([0, 16, 1])), "out of range"),
    "slot twice": (dict(slot_mapping=torch.tensor([3, 3, 1])), "both slot 3"),
    "slot dtype": (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "int32 or int64"),
    "slot count": (dict(slot_mapping=torch.tensor([0, 1])), "slot_mapping has 2 entries"),
    "kv_c dtype": (dict(kv_c=torch.randn(3, 32, dtype=F16)), "kv_c dtype"),
    "k_pe dtype": (dict(k_pe=torch.randn(3, 16, dtype=torch.float64)), "k_pe dtype"),
    "widths": (dict(k_pe=torch.randn(3, 8)), "row width 48"),
    "tokens": (dict(k_pe=torch.randn(2, 16)), "k_pe has 2 tokens"),
    "k_pe 3-d": (dict(k_pe=torch.randn(3, 1, 16)), "squeeze"),
    "cache 4-d": (dict(kv_cache=torch.zeros(4, 4, 1, 48)), "kv_cache must be"),
    "cache dtype string": (dict(kv_cache_dtype="fp8"), "needs a Float8_e4m3fn"),
    "unknown dtype string": (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be"),
    "uint8 cache": (dict(kv_cache=torch.zeros(4, 4, 48, dtype=torch.uint8), kv_cache_dtype="fp8"), "uint8"),
    "scale shape": (dict(kv_cache=torch.zeros(4, 4, 48, dtype=torch.float8_e4m3fn), scale=torch.ones(2)),
                    "scale must have shape"),
    "scale value": (dict(kv_cache=torch.zeros(4, 4, 48, dtype=torch.float8_e4m3fn), scale=torch.tensor(0.0)),
                    "finite numbers > 0"),
    "meta cache": (dict(kv_cache=torch.zeros(4, 4, 48, device="meta")), "meta"),
    "rows not contiguous": (dict(kv_cache=torch.zeros(4, 4, 96)[..., ::2]), "contiguous rows"),
}


@pytest.mark.parametrize("case", sorted(CONCAT_ERRORS))
def test_concat_and_cache_mla_refuses_and_writes_nothing(case):
    change, message = CONCAT_ERRORS[case]
    args = {**_concat_args(), **change}
    before = args["kv_cache"].clone() if args["kv_cache"].device.type != "meta" else None
    with pytest.raises(RuntimeError, match=message):
        ops.concat_and_cache_mla(**args)
    if before is not None:
        assert torch.equal(bits(args["kv_cache"]), bits(before))


def test_concat_and_cache_mla_refuses_aliasing_and_foreign_inputs():
    cache = torch.zeros(4, 4, 48)
    with pytest.raises(RuntimeError, match="share memory|same tensor"):
        ops.concat_and_cache_mla(cache.view(-1, 48)[:2, :32], torch.randn(2, 16), cache, torch.tensor([5, 6]))
    with pytest.raises((TypeError, RuntimeError)):
        ops.concat_and_cache_mla(np.zeros((2, 32), np.float32), torch.randn(2, 16), cache, torch.tensor([5, 6]))
    assert not cache.any()


# --------------------------------------------------------------------------------------------------
# paged_attention_mla

ATTENTION_CASES = [  # (prefixes, q_lens): decode, prefill over a cached prefix, and both in one batch
    ([0], [1]),
    ([37], [1]),
    ([0], [19]),
    ([5, 70, 0, 16], [1, 1, 7, 3]),
    ([130, 3], [1, 40]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank,rope", SHAPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [1, 5, 16])
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_attention_mla_float32(device, rank, rope, block_size, num_heads, case):
    prefixes, q_lens = ATTENTION_CASES[case]
    batch = LatentBatch(prefixes, q_lens, block_size=block_size, num_heads=num_heads, kv_lora_rank=rank,
                        rope_dim=rope, dtype=F32, device=device)
    out, lse = ops.paged_attention_mla_with_lse(*batch.args())
    ref_out, ref_lse = batch.reference()
    assert out.shape == (sum(q_lens), num_heads, rank) and out.dtype == F32 and out.is_contiguous()
    assert_close(out, ref_out, F32, "out")
    assert_close(lse, ref_lse, F32, "lse")
    assert torch.equal(ops.paged_attention_mla(*batch.args()), out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("num_heads", [2, 16])
def test_paged_attention_mla_half_precision(device, dtype, num_heads):
    batch = LatentBatch([40, 0, 9], [1, 12, 2], block_size=16, num_heads=num_heads, kv_lora_rank=512, rope_dim=64,
                        dtype=dtype, device=device)
    out, lse = ops.paged_attention_mla_with_lse(*batch.args())
    ref_out, ref_lse = batch.reference()
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_scale", [False, True])
def test_paged_attention_mla_float8(device, fp8, dtype, with_scale):
    kv_scale = torch.tensor([0.02], device=device) if with_scale else None
    batch = LatentBatch([33, 0], [1, 6], block_size=16, num_heads=4, kv_lora_rank=64, rope_dim=32, dtype=dtype,
                        cache_dtype=fp8, kv_scale=kv_scale, device=device)
    out, lse = ops.paged_attention_mla_with_lse(*batch.args(), kv_scale=kv_scale)
    ref_out, ref_lse = batch.reference()  # over the stored bytes times the scale
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_mla_strided_query_and_cache_view(device):
    batch = LatentBatch([20, 3], [1, 4], block_size=8, num_heads=3, kv_lora_rank=32, rope_dim=16, dtype=F32,
                        device=device)
    ref_out, ref_lse = batch.reference()
    wide = torch.full((*batch.query.shape[:2], 2 * batch.width), math.nan, device=device)
    wide[..., :batch.width] = batch.query
    transposed = batch.query.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous
    buf = torch.full((batch.num_blocks, batch.kv_cache.shape[1], 2, batch.width), math.nan, device=device)
    buf[:, :, 0] = batch.kv_cache
    for query, cache in [(wide[..., :batch.width], batch.kv_cache), (transposed, batch.kv_cache),
                         (batch.query, buf[:, :, 0])]:
        out, lse = ops.paged_attention_mla_with_lse(query, cache, *batch.args()[2:])
        assert_close(out, ref_out, F32, "out")
        assert_close(lse, ref_lse, F32, "lse")


@pytest.mark.parametrize("device", DEVICES)
def test_whole_row_as_v_equals_paged_attention(device):
    # kv_lora_rank = the row width: V is the whole row, i.e. paged_attention with the latent as one KV head
    batch = LatentBatch([25, 2], [1, 5], block_size=16, num_heads=8, kv_lora_rank=48, rope_dim=0, dtype=F32,
                        device=device)
    out = ops.paged_attention_mla(*batch.args())
    view = batch.kv_cache.unsqueeze(2)
    expected = ops.paged_attention(batch.query, view, view, batch.block_tables, batch.seq_lens,
                                   batch.query_start_loc, batch.scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_mla_no_tokens(device):
    cache = torch.zeros(2, 4, 48, device=device)
    q = torch.empty(0, 4, 48, device=device)
    bt = torch.zeros(0, 1, dtype=torch.int32, device=device)
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    qsl = torch.zeros(1, dtype=torch.int32, device=device)
    out, lse = ops.paged_attention_mla_with_lse(q, cache, bt, lens, qsl, 0.1, 32)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)


def _attention_args():
    batch = LatentBatch([10], [2], block_size=4, num_heads=2, kv_lora_rank=32, rope_dim=16, dtype=F32)
    return dict(query=batch.query, kv_cache=batch.kv_cache, block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                query_start_loc=batch.query_start_loc, scale=0.1, kv_lora_rank=32)


ATTENTION_ERRORS = {
    "rank too big": (dict(kv_lora_rank=49), "kv_lora_rank must be in"),
    "rank zero": (dict(kv_lora_rank=0), "kv_lora_rank must be in"),
    "query width": (lambda a: dict(query=a["query"][..., :40]), "row width 48"),
    "query dtype": (lambda a: dict(query=a["query"].half()), "kv_cache dtype"),
    "query dims": (lambda a: dict(query=a["query"][0]), "query must be"),
    "cache dims": (lambda a: dict(kv_cache=a["kv_cache"].unsqueeze(2)), "kv_cache must be"),
    "block id": (lambda a: dict(block_tables=torch.full_like(a["block_tables"], 1000)), "out of range"),
    "seq len": (lambda a: dict(seq_lens=a["seq_lens"] + 100), "needs more blocks"),
    "seq lens dtype": (lambda a: dict(seq_lens=a["seq_lens"].long()), "seq_lens must be Int"),
    "query_start_loc": (lambda a: dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32)),
                        "number of query tokens"),
    "scale": (dict(scale=0.0), "scale must be"),
    "kv_scale on float cache": (dict(kv_scale=torch.tensor(1.0)), "float8"),
    "meta query": (lambda a: dict(query=a["query"].to("meta")), "meta"),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_ERRORS))
def test_paged_attention_mla_refuses(case):
    args = _attention_args()
    change, message = ATTENTION_ERRORS[case]
    args.update(change(args) if callable(change) else change)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention_mla(**args)


def test_paged_attention_mla_refuses_foreign_and_float8_scale_errors():
    args = _attention_args()
    with pytest.raises((TypeError, RuntimeError)):
        ops.paged_attention_mla(**{**args, "query": args["query"].numpy()})
    fp8 = args["kv_cache"].to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="kv_scale must have shape"):
        ops.paged_attention_mla(**{**args, "kv_cache": fp8}, kv_scale=torch.ones(3))
    with pytest.raises(RuntimeError, match="finite numbers > 0"):
        ops.paged_attention_mla(**{**args, "kv_cache": fp8}, kv_scale=torch.tensor(float("inf")))


# --------------------------------------------------------------------------------------------------
# Pool sizing: the block manager is unchanged, only the bytes per block differ

def test_latent_cache_sizing_and_block_moves():
    import pagedkv
    args = dict(num_layers=61, block_size=64, kv_lora_rank=512, qk_rope_head_dim=64, dtype=BF16)
    per_block = pagedkv.mla_block_bytes(**args)
    assert per_block == 61 * 64 * 576 * 2
    full_kv = pagedkv.block_bytes(num_layers=61, block_size=64, num_kv_heads=128, head_dim=160, dtype=BF16)
    assert full_kv / per_block == pytest.approx(40960 / 576)  # 128 x (192 + 128) elements vs 576 per token
    assert pagedkv.num_mla_blocks_for(10 * per_block + per_block - 1, **args) == 10
    assert pagedkv.num_mla_blocks_for(0, **args) == 0
    with pytest.raises(ValueError):
        pagedkv.mla_block_bytes(**{**args, "kv_lora_rank": 0})
    caches = pagedkv.allocate_mla_cache(2, 6, 4, 32, 16, dtype=F32)
    assert len(caches) == 2 and caches[0].shape == (6, 4, 48) and caches[0].is_contiguous()
    cache = caches[0].normal_()
    before = cache.clone()
    ops.swap_blocks(cache, cache, torch.tensor([[1, 4]]))  # copy-on-write within the pool
    assert torch.equal(cache[4], before[1]) and torch.equal(cache[:4], before[:4])
