"""The model-layer ops (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding) against
float64 references on fresh random inputs, against the Hugging Face Llama formulas in float32, plus
opcheck, torch.compile and bad-input checks. CUDA variants are skipped without a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ops_reference as ref
import pagedkv.ops as ops
from ops_reference import BF16, DEVICES, F16, F32, HAS_CUDA, LAYER_TOLERANCE, cos_sin_cache

DTYPES = [F32, F16, BF16]


def assert_close(actual, expected, dtype):
    ref.assert_close(actual, expected, dtype, tolerance=LAYER_TOLERANCE)


def rms_norm_ref(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def hf_rms_norm(x, w, eps):
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rope_ref(positions, x, cache):
    x = x.double()
    half = x.shape[-1] // 2
    cos = cache[positions, :half].double().unsqueeze(1)
    sin = cache[positions, half:].double().unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# --------------------------------------------------------------------------------------------------
# Results

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 256), (3, 5, 72), (2, 4100), (0, 64)])
def test_rms_norm(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_noncontiguous_input_and_hf_formula(device):
    x = torch.randn(256, 16, device=device).t()          # [16, 256], rows strided
    w = torch.randn(256, device=device)
    out = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, hf_rms_norm(x, w, 1e-6), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (9, 256), (2, 3, 40)])
def test_fused_add_rms_norm(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    expected_residual = x + residual                     # rounded once to dtype, as the op does
    expected = rms_norm_ref(expected_residual, w, 1e-6)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 26), (16, 1376), (2, 3, 64)])
def test_silu_and_mul(device, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=device) * 4
    out = ops.silu_and_mul(x)
    d = shape[-1] // 2
    assert out.shape == (*shape[:-1], d) and out.dtype == dtype
    assert_close(out, F.silu(x[..., :d].double()) * x[..., d:].double(), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_noncontiguous_matches_hf(device):
    x = torch.randn(64, 10, device=device).t()           # [10, 64], strided
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :32]) * x[:, 32:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(1, 1, 2), (7, 3, 64), (33, 8, 128), (0, 4, 32)])
def test_rotary_embedding(device, dtype, num_tokens, num_heads, head_dim):
    cache = cos_sin_cache(500, head_dim, device=device)
    positions = torch.randint(0, 500, (num_tokens,), device=device)
    x = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    expected = rope_ref(positions, x, cache)
    ops.rotary_embedding(positions, x, cache)
    assert_close(x, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_on_a_fused_qkv_view(device):
    # Query and key heads of a [T, Hq + 2 Hkv, D] projection rotated in one call; values untouched.
    hq, hkv, d = 4, 2, 32
    qkv = torch.randn(6, hq + 2 * hkv, d, device=device)
    before = qkv.clone()
    positions = torch.tensor([0, 1, 2, 100, 7, 3], device=device)
    cache = cos_sin_cache(128, d, dtype=torch.bfloat16, device=device)   # values used as stored
    qk = qkv[:, :hq + hkv]
    ops.rotary_embedding(positions, qk, cache)
    torch.testing.assert_close(qkv[:, :hq + hkv], rope_ref(positions, before[:, :hq + hkv], cache).float(),
                               atol=2e-5, rtol=2e-5)
    assert torch.equal(qkv[:, hq + hkv:], before[:, hq + hkv:])
    assert torch.equal(qkv[0], before[0])          # position 0 is the identity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [F32, BF16])
def test_rotary_embedding_matches_hf_llama_bit_exactly(device, dtype, cache_dtype):
    # HF casts cos / sin to the tensor's dtype and rounds q * cos, rotate_half(q) * sin and their sum in it.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, h, d = 37, 5, 128
    cache = cos_sin_cache(4096, d, dtype=cache_dtype, device=device)
    positions = torch.randint(0, 4096, (t,), device=device)
    q = torch.randn(t, h, d, dtype=dtype, device=device) * 4
    cos = torch.cat((cache[positions, :d // 2],) * 2, dim=-1).to(dtype)
    sin = torch.cat((cache[positions, d // 2:],) * 2, dim=-1).to(dtype)
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    ops.rotary_embedding(positions, q, cache)
    assert torch.equal(q, expected[0].transpose(0, 1))


# --------------------------------------------------------------------------------------------------
# opcheck, torch.compile

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_layer_ops(device):
    x = torch.randn(5, 64, device=device)
    w = torch.randn(64, device=device)
    torch.library.opcheck(torch.ops.pagedkv.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.pagedkv.fused_add_rms_norm.default, (x.clone(), x.clone() * 2, w, 1e-6))
    torch.library.opcheck(torch.ops.pagedkv.silu_and_mul.default, (torch.randn(3, 2, 10, device=device),))
    torch.library.opcheck(torch.ops.pagedkv.rotary_embedding.default,
                          (torch.tensor([1, 5, 0], device=device), torch.randn(3, 2, 16, device=device),
                           cos_sin_cache(8, 16, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_decoder_layer_glue_under_torch_compile(device):
    torch._dynamo.reset()
    cache = cos_sin_cache(64, 16, device=device)
    w = torch.randn(32, device=device)

    def glue(h, residual, qk, positions, gate_up):
        ops.fused_add_rms_norm(h, residual, w, 1e-6)
        ops.rotary_embedding(positions, qk, cache)
        return ops.rms_norm(h, w, 1e-6) * 2, ops.silu_and_mul(gate_up)

    inputs = [torch.randn(3, 32, device=device), torch.randn(3, 32, device=device),
              torch.randn(3, 4, 16, device=device), torch.tensor([0, 9, 63], device=device),
              torch.randn(3, 48, device=device)]
    eager_inputs = [t.clone() for t in inputs]
    expected = glue(*eager_inputs)
    got = torch.compile(glue, fullgraph=True, backend="inductor")(*inputs)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(inputs, eager_inputs):            # the in-place updates happened in both
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# Bad input: a clear RuntimeError naming the argument, nothing modified

def _bad_cases():
    x, w = torch.randn(4, 8), torch.randn(8)
    qk, pos, cache = torch.randn(3, 2, 8), torch.tensor([0, 1, 2]), cos_sin_cache(4, 8)
    return {
        "rms_norm int input": (lambda: ops.rms_norm(x.int(), w, 1e-6), "input must be float32"),
        "rms_norm weight shape": (lambda: ops.rms_norm(x, torch.randn(7), 1e-6), "weight must be"),
        "rms_norm weight dtype": (lambda: ops.rms_norm(x, w.double(), 1e-6), "weight"),
        "rms_norm negative eps": (lambda: ops.rms_norm(x, w, -1.0), "epsilon"),
        "fused residual shape": (lambda: ops.fused_add_rms_norm(x.clone(), torch.randn(4, 9), w, 1e-6),
                                 "residual shape"),
        "fused residual strided": (lambda: ops.fused_add_rms_norm(x.clone(), torch.randn(8, 4).t(), w, 1e-6),
                                   "contiguous"),
        "fused aliasing": (lambda: ops.fused_add_rms_norm(x, x, w, 1e-6), "input and residual are the same tensor"),
        "silu odd width": (lambda: ops.silu_and_mul(torch.randn(3, 7)), "2 \\* d"),
        "rope odd head_dim": (lambda: ops.rotary_embedding(pos, torch.randn(3, 2, 7), cos_sin_cache(4, 8)), "even"),
        "rope positions dtype": (lambda: ops.rotary_embedding(pos.int(), qk, cache), "int64"),
        "rope positions length": (lambda: ops.rotary_embedding(pos[:2], qk, cache), "positions must be"),
        "rope cache width": (lambda: ops.rotary_embedding(pos, qk, cos_sin_cache(4, 16)), "cos_sin_cache must be"),
        "rope strided head_dim": (lambda: ops.rotary_embedding(pos, torch.randn(3, 8, 2).transpose(1, 2), cache),
                                  "contiguous head_dim"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_layer_ops_reject_bad_input(case):
    fn, message = _bad_cases()[case]
    with pytest.raises(RuntimeError, match=message):
        fn()


def test_rotary_embedding_out_of_range_position_raises_before_writing():
    x = torch.randn(3, 2, 8)
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"positions\[2\] = 4 is outside \[0, 4\)"):
        ops.rotary_embedding(torch.tensor([0, 3, 4]), x, cos_sin_cache(4, 8))
    assert torch.equal(x, before)


def test_fused_add_rms_norm_bad_weight_leaves_inputs_unchanged():
    x, residual = torch.randn(2, 8), torch.randn(2, 8)
    x0, r0 = x.clone(), residual.clone()
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.fused_add_rms_norm(x, residual, torch.randn(4), 1e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def _same_tensor_calls():
    x, w = torch.randn(4, 8), torch.randn(8)
    meta = torch.empty(4, 8, device="meta")
    return x, {
        "wrapper": lambda: ops.fused_add_rms_norm(x, x, w, 1e-6),
        "op": lambda: torch.ops.pagedkv.fused_add_rms_norm(x, x, w, 1e-6),
        "an equal view": lambda: ops.fused_add_rms_norm(x, x.view(4, 8), w, 1e-6),
        "meta (the fake)": lambda: ops.fused_add_rms_norm(meta, meta, torch.empty(8, device="meta"), 1e-6),
        "under torch.compile": lambda: torch.compile(ops.fused_add_rms_norm, fullgraph=True)(x, x, w, 1e-6),
    }


@pytest.mark.parametrize("case", list(_same_tensor_calls()[1]))
def test_fused_add_rms_norm_says_input_and_residual_are_the_same_tensor(case):
    """One tensor as both input and residual: a RuntimeError that says so, and nothing written."""
    x, calls = _same_tensor_calls()
    before = x.clone()
    with pytest.raises(RuntimeError, match="input and residual are the same tensor"):
        calls[case]()
    assert torch.equal(x, before)


def _aliasing_layer_calls():
    buf = torch.randn(5, 8)
    pos, cache = torch.tensor([0, 1, 2]), cos_sin_cache(4, 8)
    flat = torch.randn(64)
    return buf, flat, {
        "fused partial overlap": lambda: ops.fused_add_rms_norm(buf[0:4], buf[1:5], torch.randn(8), 1e-6),
        "fused weight is a row of input": lambda: ops.fused_add_rms_norm(buf[0:2], buf[2:4], buf[1], 1e-6),
        "fused weight is a row of residual": lambda: ops.fused_add_rms_norm(buf[0:2], buf[2:4], buf[3], 1e-6),
        "rope expanded x": lambda: ops.rotary_embedding(pos, buf[:1].view(1, 1, 8).expand(3, 1, 8), cache),
        "rope overlapping heads": lambda: ops.rotary_embedding(pos, flat.as_strided((3, 2, 8), (16, 4, 1)), cache),
        "rope overlapping tokens": lambda: ops.rotary_embedding(pos, flat.as_strided((3, 2, 8), (8, 16, 1)), cache),
        "rope cache inside x": lambda: ops.rotary_embedding(torch.tensor([0]), flat[:16].view(1, 2, 8),
                                                            flat[8:40].view(4, 8)),
    }


@pytest.mark.parametrize("case", list(_aliasing_layer_calls()[2]))
def test_in_place_layer_ops_reject_aliasing(case):
    buf, flat, calls = _aliasing_layer_calls()
    before, flat_before = buf.clone(), flat.clone()
    with pytest.raises(RuntimeError, match="share memory"):
        calls[case]()
    assert torch.equal(buf, before) and torch.equal(flat, flat_before)


def test_rotary_embedding_accepts_strided_views_without_overlap():
    # Every head of a padded buffer ([T, H, 2D] sliced to D) and of a token-major fused projection.
    positions, cache = torch.randint(0, 64, (5,)), cos_sin_cache(64, 16)
    for x in (torch.randn(5, 3, 32)[..., :16], torch.randn(3, 5, 16).transpose(0, 1)):
        expected = rope_ref(positions, x, cache)
        ops.rotary_embedding(positions, x, cache)
        torch.testing.assert_close(x.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_layer_ops_reject_device_mix():
    with pytest.raises(RuntimeError, match="same device"):
        ops.rms_norm(torch.randn(2, 8, device="cuda"), torch.randn(8), 1e-6)
