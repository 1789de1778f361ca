"""torch.ops.pagedkv.* against float64 references (tests/ops_reference.py) on fresh random inputs,
plus opcheck, torch.compile and bad-input checks. CUDA variants are skipped without a GPU."""
from __future__ import annotations

import os

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

import pagedkv.ops as ops
from pagedkv import _C
from pagedkv.cache import allocate_kv_cache, block_bytes, num_blocks_for

import ops_reference as ref
from ops_reference import BF16, CPU_ISAS, DEVICES, F16, F32, HAS_CUDA, PagedBatch, assert_close, cpu_attention_isa

# dtype, block_size, num_kv_heads, group (Hq / Hkv), head_dim, query layout: every value of each axis
# appears at least once without running the full product.
ATTENTION_CONFIGS = [
    (F32, 16, 2, 1, 64, "contiguous"),
    (F16, 1, 1, 4, 80, "strided_tokens"),
    (BF16, 8, 2, 2, 96, "transposed"),
    (F32, 32, 1, 8, 128, "contiguous"),
    (F16, 256, 2, 1, 256, "contiguous"),
    (BF16, 16, 4, 8, 128, "strided_tokens"),
    (F32, 8, 1, 2, 80, "transposed"),
    (BF16, 256, 1, 4, 64, "contiguous"),
    (F16, 32, 2, 8, 96, "contiguous"),
    (BF16, 1, 2, 1, 256, "contiguous"),
    (F16, 16, 8, 1, 128, "transposed"),
    (F32, 256, 2, 4, 96, "strided_tokens"),
    (F32, 16, 4, 2, 32, "contiguous"),       # the engine benchmark's shape
    (BF16, 16, 2, 3, 40, "strided_tokens"),  # decode: 32 + 8 columns, odd group (a lone row in P V)
    (F16, 8, 1, 2, 36, "contiguous"),        # head_dim % 8 != 0: the generic per-row kernel
]

# (cached prefix, query tokens) per sequence: decodes, a fresh prefill, prefills over cached prefixes.
MIXED_BATCH = [(36, 1), (0, 9), (50, 13), (300, 1), (4, 1), (17, 40), (0, 1)]


def config_id(c):
    return f"{str(c[0]).split('.')[-1]}-bs{c[1]}-kv{c[2]}-g{c[3]}-d{c[4]}-{c[5]}"


def mixed_batch(config, device):
    """MIXED_BATCH (each prefix a little longer at random) in one of ATTENTION_CONFIGS."""
    dtype, block_size, num_kv_heads, group, head_dim, layout = config
    prefixes = [p + int(torch.randint(0, 5, ())) for p, _ in MIXED_BATCH]
    return PagedBatch(prefixes, [q for _, q in MIXED_BATCH], block_size=block_size, num_kv_heads=num_kv_heads,
                      group=group, head_dim=head_dim, dtype=dtype, device=device, query_layout=layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ATTENTION_CONFIGS, ids=config_id)
def test_paged_attention_mixed_batch(device, config):
    dtype = config[0]
    batch = mixed_batch(config, device)
    out = ops.paged_attention(*batch.args())
    expected, _ = batch.reference()
    assert out.shape == batch.query.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, expected, dtype, f"seq_lens={batch.seq_lens_list}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_long_context_split_k(device, dtype, q_len):
    # Few sequences x KV heads and a long context: the CPU and CUDA paths split the keys into
    # partitions and merge them by log-sum-exp.
    seq_len = 3000 + int(torch.randint(0, 500, ()))
    batch = PagedBatch([seq_len - q_len], [q_len], block_size=16, num_kv_heads=1, group=4, head_dim=128,
                       dtype=dtype, device=device)
    out, lse = ops.paged_attention_with_lse(*batch.args())
    expected, expected_lse = batch.reference()
    assert_close(out, expected, dtype, f"seq_len={seq_len}")
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("sliding_window,softcap", [(1, 0.0), (7, 0.0), (64, 0.0), (-1, 3.0), (20, 10.0)])
def test_paged_attention_window_softcap_lse(device, dtype, sliding_window, softcap):
    batch = PagedBatch([40, 0, 100, 7], [1, 12, 30, 1], block_size=8, num_kv_heads=2, group=2, head_dim=64,
                       dtype=dtype, device=device)
    out, lse = ops.paged_attention_with_lse(*batch.args(), sliding_window=sliding_window, softcap=softcap)
    expected, expected_lse = batch.reference(sliding_window=sliding_window, softcap=softcap)
    assert lse.shape == batch.query.shape[:2] and lse.dtype == F32
    assert_close(out, expected, dtype, "out")
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)
    plain = ops.paged_attention(*batch.args(), sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(plain, out, atol=0, rtol=0)


CPU_GEMM_MIN_ROWS = 16  # kGemmMinRows in csrc/ops/attention_cpu.cpp: q_len >= 2 and q_len * group >= it -> micro-GEMM path
CPU_GEMM_ROWS_PER_ITEM = 64  # kGemmRowsPerItem: query rows (queries x group) per micro-GEMM work item


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(4, 2, 32), (3, 3, 40), (2, 1, 64)])
@pytest.mark.parametrize("num_threads", [1, 2, 8])
def test_paged_attention_many_decodes(device, dtype, num_kv_heads, group, head_dim, num_threads):
    # A decode batch large enough that the CPU folds each sequence's KV heads into one work item
    # (at least 4 sequences per thread), mixed with a micro-GEMM prefill whose last query chunk
    # (CPU_GEMM_ROWS_PER_ITEM // group queries per chunk) is a single query; odd lengths leave
    # partial key tiles and blocks; sliding window and lse included.
    prefixes = [5, 300, 17, 64, 1, 129, 40, 90, 3, 250, 33, 16, 77, 8, 200, 15, 0, 47]
    q_lens = [1] * 17 + [CPU_GEMM_ROWS_PER_ITEM // group + 1]
    batch = PagedBatch(prefixes, q_lens, block_size=16, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                       dtype=dtype, device=device)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, lse = ops.paged_attention_with_lse(*batch.args())
        windowed = ops.paged_attention(*batch.args(), sliding_window=50)
    finally:
        torch.set_num_threads(threads)
    expected, expected_lse = batch.reference()
    assert_close(out, expected, dtype, "out")
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)
    assert_close(windowed, batch.reference(sliding_window=50)[0], dtype, "windowed")





@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("sliding_window,softcap", [(-1, 0.0), (9, 0.0), (100, 5.0)])
@pytest.mark.parametrize("group", [3, 8])
@pytest.mark.parametrize("num_threads", [1, 8])
def test_paged_attention_prefill_gemm_threshold(device, dtype, sliding_window, softcap, group, num_threads):
    # Sequences just below, at and above the CPU GEMM-path threshold, plus a long one that spans
    # several query items and key tiles (head_dim 72: padded to 80 inside the GEMM path; group 3:
    # rows padded to a multiple of 16), in one batch with a decode.
    t = max(2, -(-CPU_GEMM_MIN_ROWS // group))
    batch = PagedBatch([0, 37, 200, 5, 130], [t - 1, t, t + 1, 1, 70], block_size=16, num_kv_heads=2, group=group,
                       head_dim=72, dtype=dtype, device=device, query_layout="strided_tokens")
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, lse = ops.paged_attention_with_lse(*batch.args(), sliding_window=sliding_window, softcap=softcap)
    finally:
        torch.set_num_threads(threads)
    expected, expected_lse = batch.reference(sliding_window=sliding_window, softcap=softcap)
    assert_close(out, expected, dtype, "out")
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_lse_merges_disjoint_key_sets(device, dtype):
    # Cascade property: attention over keys [0, L) equals the lse-weighted merge of attention over
    # [0, L - w) (a decode at length L - w) and over [L - w, L) (sliding window w at length L).
    seq_len, window = 300 + int(torch.randint(0, 50, ())), 64
    batch = PagedBatch([seq_len - 1], [1], block_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=dtype,
                       device=device)
    q, kc, vc, bt, sl, qsl, scale = batch.args()
    full, full_lse = ops.paged_attention_with_lse(q, kc, vc, bt, sl, qsl, scale)
    head, head_lse = ops.paged_attention_with_lse(q, kc, vc, bt, sl - window, qsl, scale)
    tail, tail_lse = ops.paged_attention_with_lse(q, kc, vc, bt, sl, qsl, scale, sliding_window=window)
    top = torch.maximum(head_lse, tail_lse)
    w_head, w_tail = torch.exp(head_lse - top), torch.exp(tail_lse - top)
    merged = (w_head[..., None] * head.float() + w_tail[..., None] * tail.float()) / (w_head + w_tail)[..., None]
    merged_lse = top + torch.log(w_head + w_tail)
    expected, expected_lse = batch.reference()
    assert_close(full, expected, dtype, "full")
    assert_close(merged, expected, dtype, "merged")
    torch.testing.assert_close(merged_lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full_lse, merged_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_empty_and_zero_query_sequences(device):
    batch = PagedBatch([10, 5], [0, 2], block_size=4, num_kv_heads=1, group=2, head_dim=64, dtype=F32, device=device)
    out = ops.paged_attention(*batch.args())
    assert_close(out, batch.reference()[0], F32, "out")
    empty = PagedBatch([3], [0], block_size=4, num_kv_heads=1, group=2, head_dim=64, dtype=F32, device=device)
    assert ops.paged_attention(*empty.args()).shape == (0, 2, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_noncontiguous_metadata(device):
    batch = PagedBatch([30, 3, 70], [1, 6, 2], block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=F32,
                       device=device)
    q, kc, vc, bt, sl, qsl, scale = batch.args()
    wide_tables = torch.stack([bt, torch.full_like(bt, -7)], dim=2)[..., 0]  # column stride 2
    strided_lens = torch.stack([sl, sl], dim=1)[:, 0]
    strided_qsl = torch.stack([qsl, qsl], dim=1)[:, 1]
    assert not (wide_tables.is_contiguous() or strided_lens.is_contiguous() or strided_qsl.is_contiguous())
    out = ops.paged_attention(q, kc, vc, wide_tables, strided_lens, strided_qsl, scale)
    assert_close(out, batch.reference()[0], F32, "out")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_paged_attention_max_seq_len_hint(device, dtype):
    # max_seq_len only sizes the CUDA launch; any value (even a too-small one) gives the same result.
    batch = PagedBatch([900, 20], [1, 1], block_size=16, num_kv_heads=2, group=4, head_dim=128, dtype=dtype,
                       device=device)
    expected, _ = batch.reference()
    for hint in (-1, 901, 64):
        assert_close(ops.paged_attention(*batch.args(), max_seq_len=hint), expected, dtype, f"max_seq_len={hint}")


@hypothesis.settings(max_examples=30, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 5, 16, 64]),
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 8]),
    head_dim=st.sampled_from([8, 12, 64, 80]),
    dtype=st.sampled_from([F32, BF16]),
    sliding_window=st.sampled_from([-1, -1, 1, 5, 300]),
    num_threads=st.sampled_from([1, 2, 8]),  # more threads -> more split-K partitions on CPU
)
def test_paged_attention_random_batches_cpu(data, block_size, num_kv_heads, group, head_dim, dtype, sliding_window,
                                            num_threads):
    num_seqs = data.draw(st.integers(1, 4), label="num_seqs")
    q_lens = data.draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs), label="q_lens")
    prefixes = data.draw(st.lists(st.sampled_from([0, 1, 7, 33, 600, 1500]), min_size=num_seqs, max_size=num_seqs),
                         label="prefixes")
    hypothesis.assume(sum(q_lens) > 0)
    batch = PagedBatch(prefixes, q_lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                       head_dim=head_dim, dtype=dtype, device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, lse = ops.paged_attention_with_lse(*batch.args(), sliding_window=sliding_window)
    finally:
        torch.set_num_threads(threads)
    expected, expected_lse = batch.reference(sliding_window=sliding_window)
    assert_close(out, expected, dtype, "out")
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("config", ATTENTION_CONFIGS, ids=config_id)
def test_paged_attention_cpu_each_isa(isa, config):
    """Every copy of the CPU kernels this CPU runs, on the mixed batch (decode, per-row and GEMM prefill)."""
    dtype = config[0]
    batch = mixed_batch(config, "cpu")
    with cpu_attention_isa(isa):
        assert _C._cpu_attention_isa() == isa
        out, lse = ops.paged_attention_with_lse(*batch.args(), softcap=5.0)
    expected, expected_lse = batch.reference(softcap=5.0)
    assert_close(out, expected, dtype, f"{isa} seq_lens={batch.seq_lens_list}")
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("batch_size,seq_len,num_threads", [(1, 3000, 2), (4, 1300, 8), (3, 700, 1)])
def test_paged_attention_cpu_each_isa_decode(isa, dtype, batch_size, seq_len, num_threads):
    """Decode in every copy: split-K (few items, many threads) and whole items, Llama GQA shape."""
    lens = [seq_len - 1 - int(torch.randint(0, 40, ())) for _ in range(batch_size)]
    batch = PagedBatch(lens, [1] * batch_size, block_size=16, num_kv_heads=2, group=4, head_dim=128, dtype=dtype,
                       device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with cpu_attention_isa(isa):
            out, lse = ops.paged_attention_with_lse(*batch.args())
    finally:
        torch.set_num_threads(threads)
    expected, expected_lse = batch.reference()
    assert_close(out, expected, dtype, isa)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


def test_cpu_attention_isa_switch_rejects_unknown_names():
    before = _C._cpu_attention_isa()
    with pytest.raises(ValueError, match="cpu attention isa"):
        _C._set_cpu_attention_isa("sse9")
    assert _C._cpu_attention_isa() == before


# --------------------------------------------------------------------------------------------------
# reshape_and_cache

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
# opcheck and torch.compile

def _small_batch(device="cpu", dtype=F32):
    return PagedBatch([5, 0, 20], [1, 4, 3], block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=dtype,
                      device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_all_ops(device):
    batch = _small_batch(device)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, batch.args(),
                          {"sliding_window": 5, "softcap": 2.0})
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_with_lse.default, batch.args())
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


# --------------------------------------------------------------------------------------------------
# Bad input: RuntimeError naming the argument, caches untouched

def _bad_attention_calls():
    b = _small_batch()
    q, kc, vc, bt, sl, qsl, scale = b.args()
    garbage_table = bt.clone()
    garbage_table[2, 0] = b.num_blocks + 5
    short_lens = sl.clone()
    short_lens[1] = 2  # fewer KV than its 4 queries
    return {
        "query": lambda: ops.paged_attention(q.double(), kc, vc, bt, sl, qsl, scale),
        "key_cache": lambda: ops.paged_attention(q, kc.half(), vc, bt, sl, qsl, scale),
        "num_q_heads": lambda: ops.paged_attention(torch.randn(8, 3, 64), kc, vc, bt, sl, qsl, scale),
        "head_dim": lambda: ops.paged_attention(torch.randn(8, 4, 32), kc, vc, bt, sl, qsl, scale),
        "block_tables": lambda: ops.paged_attention(q, kc, vc, garbage_table, sl, qsl, scale),
        "seq_lens": lambda: ops.paged_attention(q, kc, vc, bt, short_lens, qsl, scale),
        "query_start_loc": lambda: ops.paged_attention(q, kc, vc, bt, sl, qsl.long(), scale),
        "value_cache": lambda: ops.paged_attention(q, kc, vc[:-1], bt, sl, qsl, scale),
        "softcap": lambda: ops.paged_attention(q, kc, vc, bt, sl, qsl, scale, softcap=-1.0),
    }


@pytest.mark.parametrize("argument", list(_bad_attention_calls()))
def test_paged_attention_rejects_bad_input(argument):
    with pytest.raises(RuntimeError, match=argument):
        _bad_attention_calls()[argument]()


def _bad_cache_calls(kc, vc):
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    return {
        "key dtype": lambda: ops.reshape_and_cache(key.half(), key.half(), kc, vc, slots),
        "slot_mapping must be Long": lambda: ops.reshape_and_cache(key, key, kc, vc, slots.int()),
        "slot_mapping has 2": lambda: ops.reshape_and_cache(key, key, kc, vc, slots[:2]),
        "slot_mapping\\[2\\]": lambda: ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, kc.numel()])),
        "key shape": lambda: ops.reshape_and_cache(torch.randn(3, 4, 64), torch.randn(3, 4, 64), kc, vc, slots),
        "value shape": lambda: ops.reshape_and_cache(key, torch.randn(3, 2, 32), kc, vc, slots),
        "are both slot 9": lambda: ops.reshape_and_cache(key, key, kc, vc, torch.tensor([9, -1, 9])),
        "block_mapping\\[1, 1\\]": lambda: ops.copy_blocks([kc], [vc], torch.tensor([[0, 1], [2, kc.shape[0]]])),
        "block_mapping must be \\[n, 2\\]": lambda: ops.copy_blocks([kc], [vc], torch.tensor([[0, 1, 2]])),
        "value_caches\\[0\\]": lambda: ops.copy_blocks([kc], [vc[:, :4]], torch.tensor([[0, 1]])),
        "key_caches has 1 layers": lambda: ops.copy_blocks([kc], [], torch.tensor([[0, 1]])),
        "block_mapping\\[0, 0\\]": lambda: ops.swap_blocks(kc, vc.clone(), torch.tensor([[-1, 0]])),
        "dst dtype": lambda: ops.swap_blocks(kc, vc.half(), torch.tensor([[0, 0]])),
        "src shape": lambda: ops.swap_blocks(kc, vc[:, :4].contiguous(), torch.tensor([[0, 0]])),
    }


@pytest.mark.parametrize("case", list(_bad_cache_calls(torch.empty(4, 8, 2, 64), torch.empty(4, 8, 2, 64))))
def test_cache_ops_reject_bad_input_and_leave_caches_unchanged(case):
    kc, vc = torch.randn(4, 8, 2, 64), torch.randn(4, 8, 2, 64)
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(RuntimeError, match=case):
        _bad_cache_calls(kc, vc)[case]()
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("name,value", [("scale", float("nan")), ("scale", float("inf")), ("scale", 0.0),
                                        ("scale", -0.125), ("scale", 1e-60), ("scale", 1e60),
                                        ("softcap", float("nan")), ("softcap", float("inf")), ("softcap", -1.0),
                                        ("softcap", 1e-60), ("softcap", 1e60),
                                        ("sliding_window", 0), ("sliding_window", -5)])
def test_paged_attention_rejects_bad_scalars(device, with_lse, name, value):
    batch = _small_batch(device)
    args, kwargs = list(batch.args()), {}
    if name == "scale":
        args[-1] = value
    else:
        kwargs[name] = value
    op = ops.paged_attention_with_lse if with_lse else ops.paged_attention
    with pytest.raises(RuntimeError, match=f"{name} must be"):
        op(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mapping,message", [
    ([[0, 2], [1, 2]], "destinations must be distinct"),
    ([[5, 7], [3, 1], [6, 7]], "destinations must be distinct"),
    ([[0, 1], [1, 2]], "no chains"),                 # 1 is written and read in the same call
    ([[1, 2], [0, 1]], "no chains"),
    ([[4, 0], [0, 4]], "no chains"),                 # a swap of two blocks is two chained copies
])
def test_copy_blocks_rejects_duplicate_destinations_and_chains(device, mapping, message):
    kc, vc = torch.randn(8, 4, 2, 16, device=device), torch.randn(8, 4, 2, 16, device=device)
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(RuntimeError, match=message):
        ops.copy_blocks([kc, kc0.clone()], [vc, vc0.clone()], torch.tensor(mapping))   # CPU mapping, any device
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_copy_blocks_self_pair_is_a_no_op():
    kc, vc = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    want_k, want_v = ref.copy_blocks([kc], [vc], torch.tensor([[3, 3], [1, 5]]))
    ops.copy_blocks([kc], [vc], torch.tensor([[3, 3], [1, 5]]))
    assert torch.equal(kc, want_k[0]) and torch.equal(vc, want_v[0])


def test_swap_blocks_mapping_rules():
    src, dst = torch.randn(10, 4, 2, 16), torch.randn(10, 4, 2, 16)
    dst0 = dst.clone()
    with pytest.raises(RuntimeError, match="destinations must be distinct"):
        ops.swap_blocks(src, dst, torch.tensor([[0, 1], [2, 1]]))
    assert torch.equal(dst, dst0)
    # Between two pools a block id may be both a source and a destination: they are different blocks.
    mapping = torch.tensor([[0, 1], [1, 0], [7, 7]])
    expected = ref.swap_blocks(src, dst, mapping)
    ops.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, expected)
    # Within one pool (src is dst) that is a chain.
    pool = torch.randn(10, 4, 2, 16)
    pool0 = pool.clone()
    with pytest.raises(RuntimeError, match="no chains"):
        ops.swap_blocks(pool, pool, torch.tensor([[0, 1], [1, 2]]))
    assert torch.equal(pool, pool0)
    ops.swap_blocks(pool, pool, torch.tensor([[0, 5], [1, 6]]))
    assert torch.equal(pool, ref.swap_blocks(pool0, pool0, torch.tensor([[0, 5], [1, 6]])))


@pytest.mark.parametrize("case", ["swap dst", "swap src", "reshape cache", "copy mapping", "attention cache"])
def test_ops_reject_real_meta_tensors_mixed_with_cpu(case):
    # The meta kernel would be picked and silently do nothing.
    kc, vc, meta = torch.randn(4, 8, 2, 64), torch.randn(4, 8, 2, 64), torch.empty(4, 8, 2, 64, device="meta")
    kc0 = kc.clone()
    b = _small_batch()
    calls = {
        "swap dst": lambda: ops.swap_blocks(kc, meta, torch.tensor([[0, 1]])),
        "swap src": lambda: ops.swap_blocks(meta, kc, torch.tensor([[0, 1]])),
        "reshape cache": lambda: ops.reshape_and_cache(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kc, meta,
                                                       torch.tensor([3])),
        "copy mapping": lambda: ops.copy_blocks([kc], [vc], torch.tensor([[0, 1]], device="meta")),
        "attention cache": lambda: ops.paged_attention(b.query, b.key_cache.to("meta"), b.value_cache,
                                                       *b.args()[3:]),
    }
    with pytest.raises(RuntimeError, match="meta"):
        calls[case]()
    assert torch.equal(kc, kc0)


def test_ops_on_all_meta_tensors_give_shapes():
    b = _small_batch()
    meta_args = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in b.args()]
    assert ops.paged_attention(*meta_args).shape == b.query.shape
    mk = torch.empty(4, 8, 2, 64, device="meta")
    ops.swap_blocks(mk, torch.empty(4, 8, 2, 64, device="meta"), torch.tensor([[0, 1]]))


def _aliasing_cache_calls():
    buf = torch.randn(16, 8, 2, 64)
    kc, vc = buf[:4], buf[4:8]
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 9, 17])
    return buf, {
        "key_cache is value_cache": (lambda: ops.reshape_and_cache(key, key, kc, kc, slots), "share memory"),
        "key is a view of key_cache": (lambda: ops.reshape_and_cache(kc[0, :3], key, kc, vc, slots), "share memory"),
        "value is a view of value_cache": (lambda: ops.reshape_and_cache(key, vc[1, 2:5], kc, vc, slots),
                                           "share memory"),
        "overlapping caches": (lambda: ops.reshape_and_cache(key, key, buf[:4], buf[2:6], slots), "share memory"),
        "copy same layer twice": (lambda: ops.copy_blocks([kc, kc], [vc, buf[8:12]], torch.tensor([[0, 1]])),
                                  "share memory"),
        "copy key is value": (lambda: ops.copy_blocks([kc], [kc], torch.tensor([[0, 1]])), "share memory"),
        "copy overlapping layers": (lambda: ops.copy_blocks([buf[:4], buf[2:6]], [buf[8:12], buf[12:16]],
                                                            torch.tensor([[0, 1]])), "share memory"),
        "swap partial overlap": (lambda: ops.swap_blocks(buf[:6], buf[3:9], torch.tensor([[0, 1]])), "share memory"),
    }


@pytest.mark.parametrize("case", list(_aliasing_cache_calls()[1]))
def test_cache_ops_reject_aliasing_outputs(case):
    buf, calls = _aliasing_cache_calls()
    before = buf.clone()
    fn, message = calls[case]
    with pytest.raises(RuntimeError, match=message):
        fn()
    assert torch.equal(buf, before)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_sized_heads_are_rejected(device):
    # A query without heads divided by zero in the CPU planner; a cache without KV heads has blocks of
    # zero bytes but a nonzero stride, and copy_blocks copied from a null pointer.
    b = _small_batch(device)
    q, kc, vc, bt, sl, qsl, scale = b.args()
    with pytest.raises(RuntimeError, match="num_q_heads 0 must be a positive multiple"):
        ops.paged_attention(q[:, :0], kc, vc, bt, sl, qsl, scale)
    empty = torch.empty(3, 4, 0, 8, device=device)
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        ops.copy_blocks([empty], [empty.clone()], torch.tensor([[0, 2]]))
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        ops.reshape_and_cache(torch.empty(2, 0, 8, device=device), torch.empty(2, 0, 8, device=device), empty,
                              empty.clone(), torch.tensor([0, 5], device=device))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_rejects_device_mix():
    b = _small_batch("cuda")
    q, kc, vc, bt, sl, qsl, scale = b.args()
    with pytest.raises(RuntimeError, match="block_tables"):
        ops.paged_attention(q, kc, vc, bt.cpu(), sl, qsl, scale)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        ops.reshape_and_cache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))


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


@pytest.mark.parametrize("call,error", [
    (lambda: num_blocks_for(10**6, num_layers=0, block_size=16, num_kv_heads=2, head_dim=64, dtype=F32), ValueError),
    (lambda: num_blocks_for(float("nan"), num_layers=1, block_size=16, num_kv_heads=2, head_dim=64, dtype=F32),
     TypeError),
    (lambda: num_blocks_for(10**6, num_layers=1, block_size=16.5, num_kv_heads=2, head_dim=64, dtype=F32), TypeError),
    (lambda: block_bytes(num_layers=1, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.int32), ValueError),
    (lambda: allocate_kv_cache(1, 10, 16, 2, 64, dtype=torch.float64), ValueError),
    (lambda: allocate_kv_cache(True, 10, 16, 2, 64), TypeError),
    (lambda: allocate_kv_cache(1, 10, 16, 0, 64), ValueError),
])
def test_cache_sizing_rejects_bad_arguments(call, error):
    with pytest.raises(error):
        call()
