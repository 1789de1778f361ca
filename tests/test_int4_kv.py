"""int4 KV ops (reshape_and_cache_int4, paged_attention_int4(_with_lse)) against plain torch: the stored bytes
against a torch quantiser, attention against float64 attention over the dequantised rows, byte-moving ops on
the uint8 caches, and clear errors for bad arguments."""
import math

import pytest
import torch

import pagedkv
from pagedkv import ops


def quantize_reference(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., D] float -> int4 rows [..., row_bytes] uint8, by the documented rule, in torch."""
    x = x.float()
    g = x.unflatten(-1, (-1, group_size))
    low = g.amin(-1, keepdim=True).half()
    step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).half()
    q = torch.where(step.float() > 0, ((g - low.float()) / step.float()).round(), torch.zeros_like(g))
    codes = q.clamp(0, 15).to(torch.uint8).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    meta = torch.cat((step, low), dim=-1).flatten(-2).contiguous().view(torch.uint8)
    return torch.cat((packed, meta), dim=-1)


def attention_reference(q, kd, vd, block_tables, seq_lens, qsl, scale, window=-1, softcap=0.0):
    """float64 causal attention of packed q over dequantised caches kd, vd [N, bs, Hkv, D]; out and lse."""
    bs, hkv = kd.shape[1], kd.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    for b in range(seq_lens.numel()):
        L = int(seq_lens[b])
        s, e = int(qsl[b]), int(qsl[b + 1])
        blocks = block_tables[b, :(L + bs - 1) // bs].long()
        k = kd[blocks].flatten(0, 1)[:L].double().repeat_interleave(q.shape[1] // hkv, dim=1)
        v = vd[blocks].flatten(0, 1)[:L].double().repeat_interleave(q.shape[1] // hkv, dim=1)
        qs = q[s:e].double() * scale
        logits = torch.einsum("thd,shd->hts", qs, k)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        pos = torch.arange(L - (e - s), L)[:, None]
        kp = torch.arange(L)[None, :]
        mask = kp > pos
        if window > 0:
            mask |= kp <= pos - window
        logits = logits.masked_fill(mask, -math.inf)
        lse[s:e] = torch.logsumexp(logits, -1).T
        out[s:e] = torch.einsum("hts,shd->thd", torch.softmax(logits, -1), v)
    return out, lse


def make_case(seed, *, num_seqs, hq, hkv, d, group, bs, dtype, q_lens, ctx):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([c + ql for c, ql in zip(ctx, q_lens)], dtype=torch.int32)
    max_blocks = int((seq_lens.max() + bs - 1) // bs) + 1
    num_blocks = num_seqs * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks]
    block_tables = perm.view(num_seqs, max_blocks).int()
    block_tables[:, -1] = 2**30            # past every sequence's length: never read
    row = pagedkv.int4_row_bytes(d, group)
    # Every byte not written is NaN-like garbage (0xFF: codes 15, steps and minimums fp16 NaN).
    kc = torch.full((num_blocks, bs, hkv, row), 0xFF, dtype=torch.uint8)
    vc = torch.full_like(kc, 0xFF)
    total = int(seq_lens.sum())
    k = (torch.randn(total, hkv, d, generator=g) * 2 + 0.5).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    slots = torch.cat([block_tables[b, (p // bs)].long() * bs + p % bs
                       for b in range(num_seqs) for p in torch.arange(int(seq_lens[b]))[None]])
    pad = torch.tensor([-1, -1])
    ops.reshape_and_cache_int4(torch.cat((k, k[:2])), torch.cat((v, v[:2])), kc, vc, torch.cat((slots, pad)), group)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, slots=slots, block_tables=block_tables, seq_lens=seq_lens, qsl=qsl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,group", [(64, 32), (64, 64), (128, 32), (32, 16), (96, 32)])
def test_stored_bytes_match_the_rule(dtype, d, group):
    c = make_case(1, num_seqs=2, hq=4, hkv=2, d=d, group=group, bs=16, dtype=dtype, q_lens=[3, 1], ctx=[20, 37])
    kc = c["kc"].flatten(0, 1)
    assert torch.equal(kc[c["slots"]], quantize_reference(c["k"], group))
    assert torch.equal(c["vc"].flatten(0, 1)[c["slots"]], quantize_reference(c["v"], group))
    written = torch.zeros(kc.shape[0], dtype=torch.bool)
    written[c["slots"]] = True
    assert (kc[~written] == 0xFF).all()              # padding slots and unused slots untouched
    back = ops.int4_kv_dequantize(kc[c["slots"]], group)
    err = (back - c["k"].float()).abs()
    spread = c["k"].float().unflatten(-1, (-1, group))
    spread = (spread.amax(-1) - spread.amin(-1)).repeat_interleave(group, -1)
    assert (err <= spread / 30 * 1.01 + 1e-2).all()   # half a step (fp16-rounded step and minimum)


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("case", [
    dict(hq=4, hkv=1, d=64, group=32, bs=16, q_lens=[1, 1, 1], ctx=[0, 15, 200]),            # decode, MQA
    dict(hq=9, hkv=3, d=64, group=32, bs=16, q_lens=[7, 1], ctx=[33, 100]),                # prefill + decode, GQA
    dict(hq=2, hkv=2, d=128, group=64, bs=8, q_lens=[20], ctx=[0]),                       # prefill, no cache
    dict(hq=8, hkv=2, d=32, group=16, bs=32, q_lens=[5, 3], ctx=[70, 1], window=9),        # sliding window
    dict(hq=4, hkv=2, d=64, group=32, bs=16, q_lens=[4], ctx=[50], softcap=5.0),           # softcap
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_float64_over_dequantised_rows(case, dtype, with_lse):
    case = dict(case)
    window, softcap = case.pop("window", -1), case.pop("softcap", 0.0)
    c = make_case(2, num_seqs=len(case["q_lens"]), dtype=dtype, **case)
    group = case["group"]
    scale = case["d"] ** -0.5
    kd, vd = ops.int4_kv_dequantize(c["kc"], group), ops.int4_kv_dequantize(c["vc"], group)
    ref, ref_lse = attention_reference(c["q"], kd, vd, c["block_tables"], c["seq_lens"], c["qsl"], scale, window,
                                       softcap)
    args = (c["q"], c["kc"], c["vc"], c["block_tables"], c["seq_lens"], c["qsl"], scale, group)
    kw = dict(sliding_window=window, softcap=softcap)
    if with_lse:
        out, lse = ops.paged_attention_int4_with_lse(*args, **kw)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    else:
        out = ops.paged_attention_int4(*args, **kw)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a CUDA GPU (emulated: tests/cuda_emu)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernels_match_the_cpu_ones(dtype):
    """The same bytes from reshape_and_cache_int4 on both backends (int32 and int64 slots), and attention within
    the dtype's tolerance of the CPU kernel's over them."""
    c = make_case(7, num_seqs=3, hq=8, hkv=2, d=128, group=32, bs=16, dtype=dtype, q_lens=[1, 9, 1], ctx=[300, 40, 7])
    kc, vc = torch.full_like(c["kc"], 0xFF).cuda(), torch.full_like(c["vc"], 0xFF).cuda()
    for slot_dtype in (torch.int64, torch.int32):
        ops.reshape_and_cache_int4(c["k"].cuda(), c["v"].cuda(), kc, vc, c["slots"].to("cuda", slot_dtype), 32)
        assert torch.equal(kc.cpu(), c["kc"]) and torch.equal(vc.cpu(), c["vc"])
    args = (c["block_tables"], c["seq_lens"], c["qsl"], 0.1, 32)
    want, want_lse = ops.paged_attention_int4_with_lse(c["q"], c["kc"], c["vc"], *args, sliding_window=50)
    got, got_lse = ops.paged_attention_int4_with_lse(c["q"].cuda(), kc, vc, *(t.cuda() for t in args[:3]), *args[3:],
                                                     sliding_window=50)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse.cpu(), want_lse, atol=1e-4, rtol=1e-4)


def test_int4_attention_is_close_to_full_precision():
    """The format's error, not only the kernel's: random keys and values over 300 positions."""
    c = make_case(3, num_seqs=1, hq=4, hkv=2, d=64, group=32, bs=16, dtype=torch.float32, q_lens=[1], ctx=[300])
    out = ops.paged_attention_int4(c["q"], c["kc"], c["vc"], c["block_tables"], c["seq_lens"], c["qsl"], 0.125, 32)
    k, v = c["k"].double().repeat_interleave(2, 1), c["v"].double().repeat_interleave(2, 1)
    p = torch.softmax(torch.einsum("hd,shd->hs", c["q"][0].double() * 0.125, k), -1)
    exact = torch.einsum("hs,shd->hd", p, v)
    err = (out[0].double() - exact).abs()
    assert err.mean() < 0.05 and err.max() < 0.3       # outputs of size ~0.1-0.4: a 4-bit error, not garbage


def test_opcheck_and_compile():
    c = make_case(4, num_seqs=2, hq=4, hkv=2, d=64, group=32, bs=16, dtype=torch.float32, q_lens=[2, 1], ctx=[5, 17])
    args = (c["q"], c["kc"], c["vc"], c["block_tables"], c["seq_lens"], c["qsl"], 0.125, 32)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_int4.default, args)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention_int4_with_lse.default, args)
    torch.library.opcheck(torch.ops.pagedkv.reshape_and_cache_int4.default,
                          (c["k"][:3], c["v"][:3], c["kc"].clone(), c["vc"].clone(), c["slots"][:3], 32))

    @torch.compile(fullgraph=True, backend="eager")
    def step(k, v, kc, vc, slots, q, bt, sl, qsl):
        ops.reshape_and_cache_int4(k, v, kc, vc, slots, 32)
        return ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, 0.125, 32)

    kc, vc = c["kc"].clone(), c["vc"].clone()
    got = step(c["k"][:3], c["v"][:3], kc, vc, c["slots"][:3], *args[:1], *args[3:6])
    torch.testing.assert_close(got, ops.paged_attention_int4(*args))


def test_byte_moving_ops_keep_int4_blocks_bit_exact():
    (kc, vc), (kc2, vc2) = pagedkv.allocate_int4_kv_cache(2, 6, 16, 2, 64, 32)
    g = torch.Generator().manual_seed(5)
    for cache in (kc, vc, kc2, vc2):
        cache.copy_(torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8))
    before = [t.clone() for t in (kc, vc, kc2, vc2)]
    ops.copy_blocks([kc, kc2], [vc, vc2], torch.tensor([[0, 3], [1, 4]]))
    for new, old in zip((kc, vc, kc2, vc2), before):
        assert torch.equal(new[3], old[0]) and torch.equal(new[4], old[1]) and torch.equal(new[5], old[5])
    cpu = torch.zeros_like(kc)
    ops.swap_blocks(kc, cpu, torch.tensor([[3, 0], [2, 1]]))
    assert torch.equal(cpu[0], kc[3]) and torch.equal(cpu[1], kc[2])
    host = torch.zeros((4, 2, 2, 16, 2, kc.shape[-1]), dtype=torch.uint8)
    ops.offload_blocks([kc, kc2], [vc, vc2], host, torch.tensor([[3, 1]]))
    fresh = [torch.zeros_like(t) for t in (kc, vc, kc2, vc2)]
    ops.load_blocks(host, [fresh[0], fresh[2]], [fresh[1], fresh[3]], torch.tensor([[1, 0]]))
    for new, old in zip(fresh, (kc, vc, kc2, vc2)):
        assert torch.equal(new[0], old[3])
    assert pagedkv.int4_block_bytes(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, group_size=32) == \
        2 * 2 * 16 * 2 * (32 + 8)


def test_bad_arguments_raise():
    c = make_case(6, num_seqs=1, hq=4, hkv=2, d=64, group=32, bs=16, dtype=torch.float32, q_lens=[1], ctx=[3])
    q, kc, vc, bt, sl, qsl = c["q"], c["kc"], c["vc"], c["block_tables"], c["seq_lens"], c["qsl"]
    with pytest.raises(RuntimeError, match="group_size 48 must divide"):
        ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, 0.1, 48)
    with pytest.raises(RuntimeError, match="group_size must be even"):
        ops.reshape_and_cache_int4(c["k"][:1], c["v"][:1], kc, vc, c["slots"][:1], 3)
    with pytest.raises(RuntimeError, match="must be \\[num_blocks, block_size > 0, num_kv_heads = 2, 48\\]"):
        ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, 0.1, 16)        # rows of another group size
    with pytest.raises(RuntimeError, match="key_cache must be uint8"):
        ops.paged_attention_int4(q, kc.float(), vc, bt, sl, qsl, 0.1, 32)
    with pytest.raises(RuntimeError, match="key must be float32, float16 or bfloat16"):
        ops.reshape_and_cache_int4(c["k"][:1].double(), c["v"][:1].double(), kc, vc, c["slots"][:1], 32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.reshape_and_cache_int4(c["k"][:1], c["v"][:1], kc, vc, torch.tensor([10**6]), 32)
    with pytest.raises(RuntimeError, match="head_dim 63"):
        ops.paged_attention_int4(torch.zeros(1, 4, 63), kc, vc, bt, sl, qsl, 0.1, 32)
    with pytest.raises(RuntimeError, match="num_q_heads 3"):
        ops.paged_attention_int4(q[:, :3], kc, vc, bt, sl, qsl, 0.1, 32)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_attention_int4(q, kc, vc, bt, sl + 1000, qsl, 0.1, 32)


HOSTILE = [
    # (call, expected outcome: an exception type or "ok")
    ("ops.reshape_and_cache_int4(k.numpy(), v, kc, vc, slots, 32)", "RuntimeError"),  # the dispatcher refuses
    ("ops.reshape_and_cache_int4(k, v, kc, vc, slots.float(), 32)", "RuntimeError"),
    ("ops.reshape_and_cache_int4(k, v, kc, vc, slots, 2**62)", "RuntimeError"),
    ("ops.reshape_and_cache_int4(k, v, kc, vc, slots, -32)", "RuntimeError"),
    ("ops.reshape_and_cache_int4(k, v, kc, vc, slots, 0)", "RuntimeError"),
    ("ops.reshape_and_cache_int4(k, v, kc, kc, slots, 32)", "RuntimeError"),                  # K and V alias
    ("ops.reshape_and_cache_int4(k, v, kc.as_strided(kc.shape, (0, 0, 0, 1)), vc, slots, 32)", "RuntimeError"),
    ("ops.reshape_and_cache_int4(k, v, kc.to('meta'), vc, slots, 32)", "RuntimeError"),
    ("ops.reshape_and_cache_int4(k, v, kc, vc, torch.full_like(slots, -2**63), 32)", "ok"),   # all padding
    ("ops.reshape_and_cache_int4(k * float('nan'), v * float('inf'), kc, vc, slots, 32)", "ok"),
    ("ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, 0.1, 32)", "ok"),                      # random rows: legal
    ("ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, float('nan'), 32)", "RuntimeError"),
    ("ops.paged_attention_int4(q, kc, vc, bt.fill_(2**31 - 1), sl, qsl, 0.1, 32)", "RuntimeError"),
    ("ops.paged_attention_int4(q, kc, vc, bt, sl.fill_(-5), qsl, 0.1, 32)", "RuntimeError"),
    ("ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, 0.1, 32, sliding_window=0)", "RuntimeError"),
    ("ops.paged_attention_int4(q, kc, vc, bt, sl, qsl, 0.1, 32, softcap=-1.0)", "RuntimeError"),
    ("ops.paged_attention_int4(q.double(), kc, vc, bt, sl, qsl, 0.1, 32)", "RuntimeError"),
]


@pytest.mark.parametrize("call,expected", HOSTILE, ids=[c for c, _ in HOSTILE])
def test_hostile_calls_raise_and_change_nothing(call, expected):
    """Each in its own process: a clear exception (or a run where the input is legal), never an abort; a
    refused write leaves every cache byte as it was."""
    import os
    import subprocess
    import sys
    code = f"""
import torch
from pagedkv import ops
torch.manual_seed(0)
kc = torch.randint(0, 256, (4, 16, 2, 40), dtype=torch.uint8)
vc = torch.randint(0, 256, (4, 16, 2, 40), dtype=torch.uint8)
before = (kc.clone(), vc.clone())
k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
slots = torch.tensor([0, 17, 5])
q = torch.randn(1, 4, 64)
bt, sl, qsl = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([18], dtype=torch.int32), \\
    torch.tensor([0, 1], dtype=torch.int32)
try:
    {call}
except (TypeError, RuntimeError, ValueError) as e:
    assert str(e), "an exception with no message"
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), "a refused call wrote the cache"
    print("raised", type(e).__name__)
else:
    print("raised ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"raised {expected}" in done.stdout, done.stdout + done.stderr
