"""Bad input to the ops: a clear error naming the argument, and nothing written."""
from __future__ import annotations

import pytest
import torch

from pagedkv import _ops_library
from pagedkv.cache import allocate_kv_cache, block_bytes, num_blocks_for
import pagedkv.ops as ops

from ops_reference import DEVICES, F32, HAS_CUDA
import ops_reference as ref


def test_cpu_attention_isa_switch_rejects_unknown_names():
    before = _ops_library.cpu_attention_isa()
    with pytest.raises(ValueError, match="cpu attention isa"):
        _ops_library.set_cpu_attention_isa("sse9")
    assert _ops_library.cpu_attention_isa() == before


# --------------------------------------------------------------------------------------------------
# Bad input: RuntimeError naming the argument, caches untouched

def _bad_attention_calls():
    b = ref.small_batch()
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
        "slot_mapping must be int32 or int64, got Short": lambda: ops.reshape_and_cache(key, key, kc, vc,
                                                                                          slots.short()),
        "slot_mapping must be int32 or int64, got Float": lambda: ops.reshape_and_cache(key, key, kc, vc,
                                                                                          slots.float()),
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
    batch = ref.small_batch(device)
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
    b = ref.small_batch()
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
    b = ref.small_batch()
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
        "key_cache is value_cache": (lambda: ops.reshape_and_cache(key, key, kc, kc, slots),
                                     "value_cache and key_cache are the same tensor"),
        "key is a view of key_cache": (lambda: ops.reshape_and_cache(kc[0, :3], key, kc, vc, slots), "share memory"),
        "value is a view of value_cache": (lambda: ops.reshape_and_cache(key, vc[1, 2:5], kc, vc, slots),
                                           "share memory"),
        "overlapping caches": (lambda: ops.reshape_and_cache(key, key, buf[:4], buf[2:6], slots), "share memory"),
        "copy same layer twice": (lambda: ops.copy_blocks([kc, kc], [vc, buf[8:12]], torch.tensor([[0, 1]])),
                                  r"key_caches\[0\] and key_caches\[1\] are the same tensor"),
        "copy key is value": (lambda: ops.copy_blocks([kc], [kc], torch.tensor([[0, 1]])),
                              r"key_caches\[0\] and value_caches\[0\] are the same tensor"),
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
    b = ref.small_batch(device)
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
    b = ref.small_batch("cuda")
    q, kc, vc, bt, sl, qsl, scale = b.args()
    with pytest.raises(RuntimeError, match="block_tables"):
        ops.paged_attention(q, kc, vc, bt.cpu(), sl, qsl, scale)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        ops.reshape_and_cache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))


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
