"""paged_attention and paged_attention_with_lse against float64 references on fresh random inputs
(every dtype, block size, GQA ratio, head dim, mixed decode/prefill, split-K, window, softcap, lse), on
every CPU ISA copy; CUDA variants are skipped without a GPU."""
from __future__ import annotations

import math
import os

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from pagedkv import _C
import pagedkv.ops as ops

from ops_reference import BF16, CPU_ISAS, DEVICES, F16, F32, PagedBatch, assert_close, cpu_attention_isa


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
    # A decode batch (on the CPU each sequence is one work item over its KV heads, or split over keys
    # or heads when the threads outnumber the sequences), mixed with a micro-GEMM prefill whose last query chunk
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


@pytest.mark.skipif(bool(os.environ.get("PAGEDKV_CPU_BASELINE")), reason="PAGEDKV_CPU_BASELINE caps the choice")
def test_cpu_attention_isa_is_the_best_this_cpu_runs():
    """With no cap, the copy in use is the first this CPU runs; the portable copy runs everywhere."""
    assert ops.cpu_attention_isa() == CPU_ISAS[0]
    assert CPU_ISAS[-1] == "baseline"
    assert set(CPU_ISAS) <= {"amx", "avx512", "avx2", "neon_bf16", "sve", "neon", "baseline"}


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("config", ATTENTION_CONFIGS, ids=config_id)
def test_paged_attention_cpu_each_isa(isa, config):
    """Every copy of the CPU kernels this CPU runs, on the mixed batch (decode, per-row and GEMM prefill)."""
    dtype = config[0]
    batch = mixed_batch(config, "cpu")
    with cpu_attention_isa(isa):
        assert ops.cpu_attention_isa() == isa
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


# head_dim, group, block_size, num_kv_heads, sequence lengths, sliding window, softcap, threads: the
# AVX-512 decode kernel's column blocks (head_dim 48/80/112: a lone, a half-bf16 and a 2+1 tail),
# GQA groups 1..16 (and 20: more rows than one tile of scores holds, the generic kernel), blocks that
# do not divide its 16-key tiles, split-K (few sequences, long), split over KV heads (one short
# sequence), whole sequences (many), lengths 1 and non-multiples of everything.
DECODE_SHAPES = [
    (64, 1, 16, 4, [1, 17, 300], -1, 0.0, 2),
    (128, 4, 16, 2, [1000, 5], -1, 0.0, 2),
    (128, 8, 32, 1, [2049], -1, 0.0, 2),
    (256, 4, 8, 2, [33, 129], -1, 5.0, 1),
    (80, 2, 5, 3, [1, 77, 600], 50, 0.0, 2),
    (112, 3, 1, 2, [40, 3], -1, 0.0, 8),
    (48, 16, 16, 1, [531], 7, 0.0, 2),
    (64, 20, 16, 1, [100, 2], -1, 0.0, 2),
    (128, 4, 64, 8, [1 + int(n) for n in torch.randint(0, 700, (9,))], 100, 0.0, 2),
    (96, 1, 2, 5, [1, 2, 3, 4], -1, 2.0, 2),
    (128, 2, 16, 3, [700, 45], -1, 3.0, 1),  # AMX copy: KV heads scored in pairs, an odd one alone
    # AVX2 / NEON copies: head dims with a last 8 columns (bf16's 16-column chunks), groups of 3, 6, 7
    # (row blocks of 4 with 3 / 2 / 3 left over)
    (40, 3, 3, 2, [1, 19, 260], -1, 0.0, 2),
    (72, 6, 16, 2, [300, 33], -1, 0.0, 1),
    (24, 7, 16, 1, [129], 20, 1.5, 2),
]


def decode_shape_id(shape):
    d, g, bs, hkv, lens, window, softcap, threads = shape
    return f"d{d}-g{g}-bs{bs}-kv{hkv}-n{len(lens)}-w{window}-cap{softcap:g}-t{threads}"


def _cpu_attention_with_lse(batch, isa, num_threads, **kwargs):
    """paged_attention_with_lse of the batch in one CPU ISA copy on num_threads threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with cpu_attention_isa(isa):
            return ops.paged_attention_with_lse(*batch.args(), **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=decode_shape_id)
def test_paged_attention_cpu_decode_shapes(isa, dtype, shape):
    """Decode batches in every ISA copy against the float64 reference. Cache rows the kernel must not
    read (unused slots of a sequence's last block, blocks of no sequence) hold NaN, and block tables
    are padded with -1 past each sequence's blocks."""
    head_dim, group, block_size, num_kv_heads, lens, window, softcap, num_threads = shape
    lens = [max(1, n - int(torch.randint(0, 3, ()))) for n in lens]
    batch = PagedBatch([n - 1 for n in lens], [1] * len(lens), block_size=block_size, num_kv_heads=num_kv_heads,
                       group=group, head_dim=head_dim, dtype=dtype, device="cpu")
    used = torch.zeros(batch.num_blocks * block_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        blocks = -(-n // block_size)
        slots = batch.block_tables[b, :blocks].long()[:, None] * block_size + torch.arange(block_size)
        used[slots.flatten()[:n]] = True
        batch.block_tables[b, blocks:] = -1
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    out, lse = _cpu_attention_with_lse(batch, isa, num_threads, sliding_window=window, softcap=softcap)
    expected, expected_lse = batch.reference(sliding_window=window, softcap=softcap)
    assert_close(out, expected, dtype, f"{isa} seq_lens={lens}")
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


# head_dim, group, block_size, num_kv_heads, cached prefixes, query lengths, sliding window, softcap,
# threads: the micro-GEMM prefill in every ISA copy (bf16 over 32-multiple head dims: AMX tiles in the
# AMX copy), with key ranges that start and end off 16-key tiles (prefixes, split-K partitions, sliding
# windows, blocks of 1 and 5 keys: staged rows), padded row tiles (group 3), up to 64 rows per item
# (AMX: up to 512, in blocks of 64 whose last may be shorter), G = 1..16; head_dim 80 stays on the fp32
# path everywhere.
PREFILL_SHAPES = [
    (128, 4, 16, 2, [2040, 300], [128, 37], -1, 0.0, 2),  # the benchmark's shape (fewer KV heads)
    (64, 8, 32, 1, [0, 500], [70, 9], 100, 0.0, 2),
    (256, 1, 16, 2, [33], [50], -1, 5.0, 1),
    (32, 3, 5, 2, [129, 7], [40, 23], 9, 0.0, 8),
    (96, 2, 1, 3, [64, 0], [33, 16], -1, 2.0, 2),
    (128, 16, 64, 1, [700], [20], 50, 0.0, 8),
    (80, 2, 16, 2, [100], [30], -1, 0.0, 2),
]


def prefill_shape_id(shape):
    d, g, bs, hkv, prefixes, q_lens, window, softcap, threads = shape
    return f"d{d}-g{g}-bs{bs}-kv{hkv}-p{max(prefixes)}-q{max(q_lens)}-w{window}-cap{softcap:g}-t{threads}"


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=prefill_shape_id)
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "inf_value"])
def test_paged_attention_cpu_prefill_shapes(isa, dtype, shape, poison):
    """Prefill over cached prefixes in every ISA copy against the float64 reference. Unused cache rows
    hold NaN and block tables are padded with -1; with `poison`, the value of each sequence's last key
    is inf: only its last query sees it (the rows of that query are not compared), every other row of
    the tile that holds it must mask it exactly (no 0 * inf)."""
    head_dim, group, block_size, num_kv_heads, prefixes, q_lens, window, softcap, num_threads = shape
    prefixes = [p + int(torch.randint(0, 5, ())) for p in prefixes]
    q_lens = [q - int(torch.randint(0, 3, ())) for q in q_lens]
    batch = PagedBatch(prefixes, q_lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                       head_dim=head_dim, dtype=dtype, device="cpu")
    lens = batch.seq_lens_list
    used = torch.zeros(batch.num_blocks * block_size, dtype=torch.bool)
    last_slots = []
    for b, n in enumerate(lens):
        blocks = -(-n // block_size)
        slots = batch.block_tables[b, :blocks].long()[:, None] * block_size + torch.arange(block_size)
        used[slots.flatten()[:n]] = True
        last_slots.append(int(slots.flatten()[n - 1]))
        batch.block_tables[b, blocks:] = -1
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    # The rows compared do not see the poisoned values: the reference (whose P V would multiply them by 0)
    # is taken before.
    expected, expected_lse = batch.reference(sliding_window=window, softcap=softcap)
    if poison:
        batch.value_cache.view(-1, num_kv_heads, head_dim)[last_slots] = float("inf")
    out, lse = _cpu_attention_with_lse(batch, isa, num_threads, sliding_window=window, softcap=softcap)
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    if poison:
        keep[batch.query_start_loc[1:].long() - 1] = False
    what = f"{isa} prefixes={prefixes} q_lens={q_lens}"
    assert_close(out[keep], expected[keep], dtype, what)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("sliding_window", [7, 13, 20, 29, -1])
def test_paged_attention_cpu_prefill_runs_across_short_blocks(isa, sliding_window):
    # Blocks of 8 keys whose table puts block ids k at every even entry and k + 2 at every odd one: a run
    # of 16 keys starting inside an even entry's block ends in the next even one, 15 slots on, although
    # the block between them is not contiguous. A kernel that reads such a run in place (as consecutive
    # slots) reads the wrong middle block; the AMX bf16 prefill once did.
    batch = PagedBatch([200], [24], block_size=8, num_kv_heads=2, group=2, head_dim=64, dtype=BF16, device="cpu")
    blocks = -(-batch.seq_lens_list[0] // 8)
    batch.block_tables[0, :blocks] = torch.tensor([k if k % 2 == 0 else k + 2 for k in range(blocks)],
                                                  dtype=torch.int32)
    assert len(set(batch.block_tables[0, :blocks].tolist())) == blocks <= batch.num_blocks - 2
    out, lse = _cpu_attention_with_lse(batch, isa, 2, sliding_window=sliding_window)
    expected, expected_lse = batch.reference(sliding_window=sliding_window)
    assert_close(out, expected, BF16, f"{isa} window={sliding_window}")
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


def poison_unused_blocks(batch):
    """NaN in every cache block no sequence's table reaches (the kernels must not read them)."""
    used = set()
    for b, n in enumerate(batch.seq_lens_list):
        used |= set(batch.block_tables[b, :-(-n // batch.key_cache.shape[1])].tolist())
    unused = [i for i in range(batch.num_blocks) if i not in used]
    batch.key_cache[unused] = float("nan")
    batch.value_cache[unused] = float("nan")
    return unused


SINK_CASES = [  # (prefixes, q_lens, block_size, kv heads, group, head_dim, window, softcap)
    ([36, 0, 50, 300, 0], [1, 9, 13, 1, 1], 16, 2, 2, 64, -1, 0.0),   # decode, fresh and cached prefills
    ([40, 0, 100, 7], [1, 12, 30, 1], 8, 2, 4, 32, 7, 0.0),           # window
    ([40, 0, 100], [1, 20, 3], 8, 1, 8, 64, 20, 5.0),                 # window + softcap, the GEMM path
    ([3000], [1], 16, 1, 4, 128, -1, 0.0),                            # split-K: partials merged, then the sink
    ([2500], [3], 16, 2, 2, 64, -1, 3.0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("case", SINK_CASES, ids=[f"case{i}" for i in range(len(SINK_CASES))])
def test_paged_attention_sinks(device, dtype, case):
    """Attention sinks (gpt-oss) against the float64 reference: out and lse, every dtype, GQA, windows,
    softcap, split-K, NaN in every unread block; sinks=None is the old result bit for bit."""
    prefixes, q_lens, block_size, kv_heads, group, head_dim, window, softcap = case
    batch = PagedBatch(prefixes, q_lens, block_size=block_size, num_kv_heads=kv_heads, group=group,
                       head_dim=head_dim, dtype=dtype, device=device)
    poison_unused_blocks(batch)
    # logits of scale ~1 over up to 3000 keys: a sink around log(keys) weighs about as much as they do
    sinks = torch.randn(kv_heads * group, device=device) * 2 + math.log(max(batch.seq_lens_list))
    kwargs = dict(sliding_window=window, softcap=softcap)
    out, lse = ops.paged_attention_with_lse(*batch.args(), sinks=sinks, **kwargs)
    expected, expected_lse = batch.reference(sinks=sinks, **kwargs)
    assert_close(out, expected, dtype, "out with sinks")
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.paged_attention(*batch.args(), sinks=sinks, **kwargs), out, atol=0, rtol=0)
    plain, _ = batch.reference(**kwargs)
    assert (expected - plain).abs().max() > 1e-3          # the sinks change the answer: the check is not void
    torch.testing.assert_close(ops.paged_attention(*batch.args(), sinks=None, **kwargs),
                               ops.paged_attention(*batch.args(), **kwargs), atol=0, rtol=0)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("config", ATTENTION_CONFIGS[:8], ids=config_id)
def test_paged_attention_sinks_each_isa(isa, config):
    dtype = config[0]
    batch = mixed_batch(config, "cpu")
    poison_unused_blocks(batch)
    sinks = torch.randn(batch.query.shape[1]) * 2
    with cpu_attention_isa(isa):
        out, lse = ops.paged_attention_with_lse(*batch.args(), softcap=5.0, sinks=sinks)
    expected, expected_lse = batch.reference(softcap=5.0, sinks=sinks)
    assert_close(out, expected, dtype, f"{isa} with sinks")
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


def test_sinks_merge_with_lse_over_disjoint_key_sets():
    """A cascade: the sink goes with one part only; merged by lse, the result is the whole call's."""
    batch = PagedBatch([63], [1], block_size=16, num_kv_heads=2, group=2, head_dim=32, dtype=F32, device="cpu")
    sinks = torch.randn(4)
    whole, whole_lse = ops.paged_attention_with_lse(*batch.args(), sinks=sinks)
    first = batch.block_tables.clone()
    first_len = torch.tensor([32], dtype=torch.int32)
    # part 1: the first 32 keys as their own sequence (a query at position 31 sees them all), with the sink;
    # part 2: the last 32 keys (blocks 2 and 3 of the table) without it.
    second = batch.block_tables[:, 2:].contiguous()
    o1, l1 = ops.paged_attention_with_lse(batch.query, batch.key_cache, batch.value_cache, first, first_len,
                                          batch.query_start_loc, batch.scale, sinks=sinks)
    o2, l2 = ops.paged_attention_with_lse(batch.query, batch.key_cache, batch.value_cache, second, first_len,
                                          batch.query_start_loc, batch.scale)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp()[..., None], (l2 - m).exp()[..., None]
    torch.testing.assert_close((w1 * o1 + w2 * o2) / (w1 + w2), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m + torch.log(w1[..., 0] + w2[..., 0]), whole_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (lambda h: torch.zeros(h, dtype=torch.float64), "float32"),
    (lambda h: torch.zeros(h + 1), r"\[num_q_heads\]"),
    (lambda h: torch.zeros(1, h), r"\[num_q_heads\]"),
    (lambda h: torch.full((h,), float("nan")), "finite"),
    (lambda h: torch.full((h,), float("inf")), "finite"),
])
def test_bad_sinks_are_refused(bad, match):
    batch = PagedBatch([8], [1], block_size=4, num_kv_heads=1, group=2, head_dim=16, dtype=F32, device="cpu")
    with pytest.raises(RuntimeError, match=match):
        ops.paged_attention(*batch.args(), sinks=bad(2))
    with pytest.raises((TypeError, RuntimeError)):
        ops.paged_attention(*batch.args(), sinks=[0.0, 0.0])
