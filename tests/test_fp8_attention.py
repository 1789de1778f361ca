"""paged_attention over float8 caches (float8_e4m3fn / float8_e5m2, any query dtype): against the float64
reference of the stored bytes times their KV head's scale, for every block size and GQA ratio, the three
CPU kernels (decode, per-row prefill, GEMM prefill) and every ISA copy, scales per tensor and per head,
saturated values, NaN, sliding window + softcap + split-K, and the argument errors."""
import pytest
import torch

from ops_reference import CPU_ISAS, DEVICES, TOLERANCE, PagedBatch, assert_close, cpu_attention_isa
from pagedkv import ops
from test_fp8_cache import FP8, INPUTS, quantise_reference

SCALES = ["none", "tensor", "head"]


def random_scale(kind, num_kv_heads, device):
    """None, one scale or one per KV head, spread over two decades (some stored values saturate)."""
    if kind == "none":
        return None
    shape = () if kind == "tensor" else (num_kv_heads,)
    return torch.exp(torch.empty(shape).uniform_(-5.0, -0.5)).to(device)


def quantise_cache(cache, scale, fp8):
    """[N, bs, H, D] cache stored as fp8(x / scale) (the reshape_and_cache rule, checked bit-exact in
    test_fp8_cache.py)."""
    n, bs, h, d = cache.shape
    return quantise_reference(cache.reshape(n * bs, h, d), scale, fp8).reshape(n, bs, h, d)


def dequantise(cache, scale):
    s = torch.ones((), device=cache.device) if scale is None else scale.float()
    return cache.double() * (s.double().view(1, 1, -1, 1) if s.dim() else s.double())


class Fp8Batch:
    """A PagedBatch whose caches are float8 (with their scales) and whose query has q_dtype; the
    reference attends over the dequantised caches in float64."""

    def __init__(self, prefixes, q_lens, *, fp8, q_dtype, scales, device, block_size=16, num_kv_heads=2,
                 group=4, head_dim=64):
        self.base = PagedBatch(prefixes, q_lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                               head_dim=head_dim, dtype=torch.float32, device=device)
        self.k_scale = random_scale(scales, num_kv_heads, device)
        self.v_scale = random_scale(scales, num_kv_heads, device)
        self.key_cache = quantise_cache(self.base.key_cache, self.k_scale, fp8)
        self.value_cache = quantise_cache(self.base.value_cache, self.v_scale, fp8)
        self.query = self.base.query.to(q_dtype)

    def args(self):
        b = self.base
        return (self.query, self.key_cache, self.value_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                b.scale)

    def run(self, with_lse=False, **kwargs):
        fn = ops.paged_attention_with_lse if with_lse else ops.paged_attention
        return fn(*self.args(), k_scale=self.k_scale, v_scale=self.v_scale, **kwargs)

    def reference(self, **kwargs):
        b = self.base
        from ops_reference import paged_attention
        return paged_attention(self.query, dequantise(self.key_cache, self.k_scale),
                               dequantise(self.value_cache, self.v_scale), b.block_tables, b.seq_lens,
                               b.query_start_loc, b.scale, **kwargs)


def check(batch, q_dtype, what, **kwargs):
    out, lse = batch.run(with_lse=True, **kwargs)
    assert out.dtype == q_dtype and out.shape == batch.query.shape
    ref_out, ref_lse = batch.reference(**kwargs)
    assert_close(out, ref_out, q_dtype, what)
    assert_close(lse, ref_lse, torch.float32, what + " lse", tolerance={torch.float32: 1e-4})


# Decode (q_len 1), per-row prefill (q_len * group < 16) and GEMM prefill in one batch.
MIXED_Q_LENS = [1, 2, 20, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_dtype", INPUTS)
@pytest.mark.parametrize("scales", SCALES)
def test_fp8_attention_every_block_size_and_gqa_ratio(device, fp8, q_dtype, scales):
    for block_size in [1, 8, 16, 32]:
        for num_kv_heads, group in [(4, 1), (2, 4), (1, 8)]:
            prefixes = torch.randint(0, 40, (len(MIXED_Q_LENS),)).tolist()
            batch = Fp8Batch(prefixes, MIXED_Q_LENS, fp8=fp8, q_dtype=q_dtype, scales=scales, device=device,
                             block_size=block_size, num_kv_heads=num_kv_heads, group=group)
            check(batch, q_dtype, f"bs={block_size} kv={num_kv_heads} group={group}")


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_dim", [64, 40, 12])  # vector rows, a vector tail, narrower than a vector
def test_fp8_attention_every_cpu_isa(isa, fp8, head_dim):
    with cpu_attention_isa(isa):
        for q_dtype in INPUTS:
            batch = Fp8Batch([30, 5, 0], [1, 3, 24], fp8=fp8, q_dtype=q_dtype, scales="head", device="cpu",
                             head_dim=head_dim)
            check(batch, q_dtype, f"{isa} {q_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_sliding_window_softcap_split_k(device, fp8):
    # One long decode and one long prefill chunk: few work items, so long key ranges are split.
    batch = Fp8Batch([3000, 2500], [1, 17], fp8=fp8, q_dtype=torch.bfloat16, scales="head", device=device,
                     num_kv_heads=2, group=4, head_dim=128)
    for kwargs in [{}, {"sliding_window": 700}, {"softcap": 30.0}, {"sliding_window": 1500, "softcap": 5.0}]:
        check(batch, torch.bfloat16, str(kwargs), **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_scale_one_equals_no_scale_and_saturated_values_read_back(device, fp8):
    batch = Fp8Batch([50, 9], [1, 20], fp8=fp8, q_dtype=torch.float32, scales="none", device=device)
    ones = torch.ones((), device=device)
    with_ones = ops.paged_attention(*batch.args(), k_scale=ones, v_scale=ones.expand(2).contiguous())
    assert torch.equal(batch.run(), with_ones)
    # Every value at the format's largest finite magnitude (what saturation stores).
    limit = torch.finfo(fp8).max
    batch.key_cache = (torch.sign(batch.base.key_cache) * limit).to(fp8)
    batch.value_cache = (torch.sign(batch.base.value_cache) * limit).to(fp8)
    batch.k_scale = torch.full((), 1.0 / limit, device=device)
    batch.v_scale = torch.full((2,), 2.0 / limit, device=device)
    check(batch, torch.float32, "saturated")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_lens", [[1], [3], [20]], ids=["decode", "rows", "gemm"])
def test_fp8_nan_reaches_only_rows_that_see_it(device, fp8, q_lens):
    batch = Fp8Batch([10], q_lens, fp8=fp8, q_dtype=torch.float32, scales="tensor", device=device,
                     num_kv_heads=1, group=2)
    ref, _ = batch.reference()   # before the NaN (the reference's 0 * NaN would leak into masked rows)
    seq_len = int(batch.base.seq_lens[0])
    pos = seq_len - 1  # the last key: visible to the last query only
    block = int(batch.base.block_tables[0, pos // batch.key_cache.shape[1]])
    nan = torch.tensor(float("nan"), device=device).to(fp8)
    batch.key_cache[block, pos % batch.key_cache.shape[1], 0, 3] = nan
    batch.value_cache[block, pos % batch.key_cache.shape[1], 0, 5] = nan
    out = batch.run()
    assert out[-1].isnan().any()
    if q_lens[0] > 1:
        assert_close(out[:-1], ref[:-1], torch.float32, "rows that do not see the NaN key")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_attention_argument_errors(device):
    batch = Fp8Batch([8], [2], fp8=torch.float8_e4m3fn, q_dtype=torch.float16, scales="head", device=device)
    q, kc, vc, bt, sl, qsl, scale = batch.args()
    s = torch.ones(2, device=device)
    cases = [
        # scales with a 16-bit cache
        ((q, kc.to(torch.float16), vc.to(torch.float16)), {"k_scale": s}, "scales apply to float8"),
        ((q, kc, vc), {"k_scale": s.double()}, "k_scale must be float32"),
        ((q, kc, vc), {"v_scale": torch.ones(3, device=device)}, "v_scale must have shape"),
        ((q, kc, vc), {"k_scale": torch.ones(2, 1, device=device)}, "k_scale must have shape"),
        ((q, kc, vc.view(torch.float8_e5m2)), {}, "must equal query dtype"),  # mixed formats
        ((q, kc, vc.view(torch.uint8)), {}, "value_cache must be"),
    ]
    if device == "cpu":
        cases.append(((q, kc, vc), {"k_scale": -s}, "finite numbers > 0"))
        cases.append(((q, kc, vc), {"v_scale": torch.tensor(float("nan"))}, "finite numbers > 0"))
    else:
        cases.append(((q, kc, vc), {"k_scale": torch.ones(2)}, "k_scale is on cpu"))
    for head, kwargs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.paged_attention(*head, bt, sl, qsl, scale, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_ops_pass_opcheck(device):
    """Fakes and autograd registration agree with the kernels for float8 caches and scales. (opcheck's
    test_schema cannot run here: it multiplies the float8 caches, which torch does not implement.)"""
    batch = Fp8Batch([9, 4], [1, 3], fp8=torch.float8_e5m2, q_dtype=torch.bfloat16, scales="head", device=device)
    scales = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, batch.args(), {"softcap": 3.0, **scales},
                          test_utils=utils)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_with_lse.default, batch.args(), scales, test_utils=utils)
    key = torch.randn(3, 2, 64, device=device)
    torch.library.opcheck(torch.ops.pagedkv.reshape_and_cache.default,
                          (key, torch.randn_like(key), batch.key_cache, batch.value_cache,
                           torch.tensor([3, -1, 17], device=device), batch.k_scale, batch.v_scale), test_utils=utils)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_decode_extreme_scales_every_cpu_isa(isa, fp8):
    # Scales that are not normal floats, or whose product with 256 is not (the e4m3 widening's factor):
    # decode must not fold them into the query and the accumulators (0 * inf would be NaN).
    batch = Fp8Batch([70, 200], [1, 1], fp8=fp8, q_dtype=torch.float32, scales="head", device="cpu",
                     num_kv_heads=2, group=4, head_dim=64)
    batch.k_scale = torch.tensor([0.05, 1e-39])
    batch.v_scale = torch.tensor([2e36, 0.05])
    batch.key_cache = quantise_cache(batch.base.key_cache, batch.k_scale, fp8)
    batch.value_cache = quantise_cache(batch.base.value_cache, batch.v_scale, fp8)
    with cpu_attention_isa(isa):
        out = batch.run()
    assert not out.isnan().any(), isa
    assert_close(out, batch.reference()[0], torch.float32, isa)
