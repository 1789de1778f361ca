"""float8 KV storage: reshape_and_cache into float8_e4m3fn / float8_e5m2 caches (bit-exact against torch's
own conversion of the same fp32 value), scales per tensor and per KV head, saturation, NaN, padding,
the argument checks, and copy_blocks / swap_blocks / allocate_kv_cache on float8 caches."""
import pytest
import torch

import pagedkv
from ops_reference import DEVICES
from pagedkv import ops

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
INPUTS = [torch.float32, torch.float16, torch.bfloat16]


def quantise_reference(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The contract: fp8(clamp(x / scale, -max, max)), computed by torch in fp32."""
    limit = torch.finfo(dtype).max
    s = torch.ones((), device=x.device) if scale is None else scale.float()
    return (x.float() / s.view(1, -1, 1) if s.dim() else x.float() / s).clamp(-limit, limit).to(dtype)


def random_kv(num_tokens, num_heads, head_dim, dtype, device, fp8):
    """Values spanning the format's range and beyond it (saturation), with some inf and NaN."""
    limit = torch.finfo(fp8).max
    exponent = torch.randint(-20, 4, (num_tokens, num_heads, head_dim), device=device).float()
    x = torch.randn(num_tokens, num_heads, head_dim, device=device) * (limit / 8) * torch.exp2(exponent)
    special = torch.rand(x.shape, device=device)
    x[special < 0.01] = float("inf")
    x[(special >= 0.01) & (special < 0.02)] = float("-inf")
    x[(special >= 0.02) & (special < 0.03)] = float("nan")
    return x.to(dtype)


def same_bytes(got: torch.Tensor, want: torch.Tensor) -> bool:
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    return bool(torch.equal(nan_g, nan_w) and torch.equal(g[~nan_g], w[~nan_w]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("in_dtype", INPUTS)
@pytest.mark.parametrize("scales", ["none", "tensor", "head"])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_reshape_and_cache_fp8_is_bit_exact(device, fp8, in_dtype, scales, block_size):
    num_heads, head_dim, num_blocks = 3, 40, 6
    num_tokens = num_blocks * block_size - 2
    key = random_kv(num_tokens, num_heads, head_dim, in_dtype, device, fp8)
    value = random_kv(num_tokens, num_heads, head_dim, in_dtype, device, fp8)
    k_scale = v_scale = None
    if scales == "tensor":
        k_scale, v_scale = torch.rand((), device=device) * 4 + 0.01, torch.rand((), device=device) * 4 + 0.01
    elif scales == "head":
        k_scale, v_scale = torch.rand(num_heads, device=device) * 4 + 0.01, torch.rand(num_heads, device=device) + 0.5
    key_cache = torch.randint(0, 256, (num_blocks, block_size, num_heads, head_dim), dtype=torch.uint8,
                              device=device).view(fp8)
    value_cache = torch.randint_like(key_cache.view(torch.uint8), 0, 256).view(fp8)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.randint(0, num_tokens, (3,), device=device)] = -1              # padding
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)

    want_k, want_v = before_k.view(-1, num_heads, head_dim), before_v.view(-1, num_heads, head_dim)
    keep = slots >= 0
    want_k[slots[keep]] = quantise_reference(key, k_scale, fp8)[keep]
    want_v[slots[keep]] = quantise_reference(value, v_scale, fp8)[keep]
    assert same_bytes(key_cache.view(-1, num_heads, head_dim), want_k)
    assert same_bytes(value_cache.view(-1, num_heads, head_dim), want_v)
    # Saturation, not inf: e4m3fn has no inf; e5m2 never stores one either.
    assert not key_cache.view(-1, num_heads, head_dim)[slots[keep]].float().isinf().any()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_strided_inputs_and_roundtrip_error(device):
    """A slice of a packed qkv row goes in; reading back x' = stored * scale is within half an ulp."""
    num_tokens, num_heads, head_dim = 37, 4, 64
    qkv = torch.randn(num_tokens, 3 * num_heads, head_dim, device=device)
    key, value = qkv[:, num_heads:2 * num_heads], qkv[:, 2 * num_heads:]
    k_scale = key.abs().amax(dim=(0, 2)) / 448          # per head, as the engine's dynamic rule does
    key_cache = torch.empty(8, 8, num_heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    value_cache = torch.empty_like(key_cache)
    slots = torch.arange(num_tokens, device=device)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, None)
    back = key_cache.view(-1, num_heads, head_dim)[:num_tokens].float() * k_scale.view(1, -1, 1)
    # e4m3: 3 mantissa bits, relative error <= 2^-4 for normal values.
    assert torch.allclose(back, key, rtol=2 ** -4, atol=k_scale.max().item() * 2 ** -9)
    assert same_bytes(value_cache.view(-1, num_heads, head_dim)[:num_tokens], value.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_argument_errors_change_nothing(device):
    cache = torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn, device=device)
    other = torch.zeros_like(cache)
    key = torch.randn(3, 2, 8, device=device)
    slots = torch.arange(3, device=device)
    fp32_cache = torch.zeros(2, 4, 2, 8, device=device)
    cases = [
        ((key, key, fp32_cache, fp32_cache.clone(), slots, torch.ones((), device=device), None),
         "scales apply to float8"),
        ((key, key, cache, other, slots, torch.ones(3, device=device), None), r"shape \[\] .* \[num_kv_heads\]"),
        ((key, key, cache, other, slots, torch.ones((), dtype=torch.float64, device=device), None), "float32"),
        ((key, key, cache, other, slots, None, torch.ones(2, 1, device=device)), "v_scale"),
        ((key, key.half(), cache, other, slots, None, None), "value dtype"),
        ((key, key, cache, other.view(torch.float8_e5m2), slots, None, None), "value_cache dtype"),
        ((key.to(torch.float8_e4m3fn), key.to(torch.float8_e4m3fn), cache, other, slots, None, None),
         "key must be float32, float16 or bfloat16"),
    ]
    if device == "cpu":
        cases += [((key, key, cache, other, slots, torch.tensor(0.0), None), "finite numbers > 0"),
                  ((key, key, cache, other, slots, None, torch.tensor([1.0, float("nan")])), "kv head 1")]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.reshape_and_cache(*args)
    assert not cache.view(torch.uint8).any() and not other.view(torch.uint8).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_copy_and_swap_blocks_move_fp8_bytes(device, fp8):
    layers = pagedkv.allocate_kv_cache(2, 6, 4, 2, 16, dtype=fp8, device=device)
    for k, v in layers:
        k.view(torch.uint8).copy_(torch.randint(0, 256, k.shape, dtype=torch.uint8))
        v.view(torch.uint8).copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8))
    before = [(k.clone(), v.clone()) for k, v in layers]
    mapping = torch.tensor([[0, 3], [5, 1]], device=device)
    ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], mapping)
    for (k, v), (k0, v0) in zip(layers, before):
        for cache, old in ((k, k0), (v, v0)):
            want = old.view(torch.uint8).clone()
            want[3], want[1] = want[0], want[5]
            assert torch.equal(cache.view(torch.uint8), want)
    host = pagedkv.allocate_kv_cache(1, 6, 4, 2, 16, dtype=fp8, device="cpu")[0][0]
    ops.swap_blocks(layers[0][0], host, torch.tensor([[2, 4]]))
    assert torch.equal(host[4].view(torch.uint8).cpu(), layers[0][0][2].view(torch.uint8).cpu())


def test_fp8_cache_sizes():
    args = dict(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)
    fp32 = pagedkv.block_bytes(dtype=torch.float32, **args)
    assert pagedkv.block_bytes(dtype=torch.bfloat16, **args) * 2 == fp32
    for fp8 in FP8:
        assert pagedkv.block_bytes(dtype=fp8, **args) * 4 == fp32
        assert pagedkv.num_blocks_for(1 << 30, dtype=fp8, **args) == (1 << 30) // (fp32 // 4)
