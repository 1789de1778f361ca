"""offload_blocks / load_blocks: whole blocks between the paged caches and the block-major host tier,
bit-exact against a plain copy with every untouched byte compared; layer subsets (first_layer), every cache
dtype, and bad arguments refused before anything is written. CUDA variants are skipped without a GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import pagedkv
import pagedkv.ops as ops

from ops_reference import DEVICES

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def random_bits(shape, dtype, device="cpu", gen=None):
    """A tensor of random bytes (NaN and inf patterns included): the copies move bits, never values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def make_caches(num_layers, num_blocks, block_size, heads, head_dim, dtype, device, gen):
    shape = (num_blocks, block_size, heads, head_dim)
    return ([random_bits(shape, dtype, device, gen) for _ in range(num_layers)],
            [random_bits(shape, dtype, device, gen) for _ in range(num_layers)])


def host_tier(num_slots, num_layers, block_size, heads, head_dim, dtype, device, gen):
    host = random_bits((num_slots, num_layers, 2, block_size, heads, head_dim), dtype, "cpu", gen)
    return host.pin_memory() if device == "cuda" else host


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,heads,head_dim", [(1, 1, 8), (16, 2, 64), (5, 3, 12), (32, 8, 128)])
def test_offload_then_load_is_a_plain_copy(device, dtype, block_size, heads, head_dim):
    gen = torch.Generator().manual_seed(block_size * 1000 + heads * 10 + head_dim)
    num_layers, num_blocks, num_slots = 3, 12, 9
    keys, values = make_caches(num_layers, num_blocks, block_size, heads, head_dim, dtype, device, gen)
    host = host_tier(num_slots, num_layers, block_size, heads, head_dim, dtype, device, gen)
    src = torch.randperm(num_blocks, generator=gen)[:5]
    slots = torch.randperm(num_slots, generator=gen)[:5]
    want_host = bits(host).clone().view(num_slots, num_layers, 2, -1)
    for b, s in zip(src.tolist(), slots.tolist()):
        for layer in range(num_layers):
            want_host[s, layer, 0] = bits(keys[layer][b]).flatten()
            want_host[s, layer, 1] = bits(values[layer][b]).flatten()
    ops.offload_blocks(keys, values, host, torch.stack([src, slots], 1))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(bits(host).view(num_slots, num_layers, 2, -1), want_host)

    # Back into other device blocks (possibly the same ones): every other byte of the caches unchanged.
    dst = torch.randperm(num_blocks, generator=gen)[:5]
    want_k = [bits(k).clone() for k in keys]
    want_v = [bits(v).clone() for v in values]
    for s, b in zip(slots.tolist(), dst.tolist()):
        for layer in range(num_layers):
            want_k[layer][b] = bits(host[s, layer, 0])
            want_v[layer][b] = bits(host[s, layer, 1])
    ops.load_blocks(host, keys, values, torch.stack([slots, dst], 1))
    for layer in range(num_layers):
        assert torch.equal(bits(keys[layer]), want_k[layer])
        assert torch.equal(bits(values[layer]), want_v[layer])


@pytest.mark.parametrize("device", DEVICES)
def test_layer_subsets_land_in_their_host_layers(device):
    """Copying layers 2..3 of 5 with first_layer=2 touches only those layers' regions of each slot; a
    per-layer load (one layer at a time) gives the same caches as one load of every layer."""
    gen = torch.Generator().manual_seed(7)
    dtype, num_layers, num_blocks, num_slots, geometry = torch.bfloat16, 5, 8, 6, (4, 2, 16)
    keys, values = make_caches(num_layers, num_blocks, *geometry, dtype, device, gen)
    host = host_tier(num_slots, num_layers, *geometry, dtype, device, gen)
    before = bits(host).clone().view(num_slots, num_layers, 2, -1)
    mapping = torch.tensor([[1, 4], [6, 0]])
    ops.offload_blocks(keys[2:4], values[2:4], host, mapping, first_layer=2)
    after = bits(host).view(num_slots, num_layers, 2, -1)
    for s in range(num_slots):
        for layer in range(num_layers):
            copied = s in (4, 0) and layer in (2, 3)
            if copied:
                b = 1 if s == 4 else 6
                assert torch.equal(after[s, layer, 0], bits(keys[layer][b]).flatten())
                assert torch.equal(after[s, layer, 1], bits(values[layer][b]).flatten())
            else:
                assert torch.equal(after[s, layer], before[s, layer])

    ops.offload_blocks(keys, values, host, mapping)
    per_layer = [(k.clone(), v.clone()) for k, v in zip(keys, values)]
    whole = [(k.clone(), v.clone()) for k, v in zip(keys, values)]
    back = torch.tensor([[4, 7], [0, 3]])
    for layer in range(num_layers):
        ops.load_blocks(host, [per_layer[layer][0]], [per_layer[layer][1]], back, first_layer=layer)
    ops.load_blocks(host, [k for k, _ in whole], [v for _, v in whole], back)
    for (pk, pv), (wk, wv) in zip(per_layer, whole):
        assert torch.equal(bits(pk), bits(wk)) and torch.equal(bits(pv), bits(wv))
    assert torch.equal(bits(whole[0][0][7]), bits(keys[0][1]))


def test_empty_mapping_and_no_layers_are_no_ops():
    keys, values = make_caches(2, 4, 4, 1, 8, torch.float32, "cpu", None)
    host = torch.zeros(3, 2, 2, 4, 1, 8)
    ops.offload_blocks(keys, values, host, torch.empty(0, 2, dtype=torch.int64))
    ops.load_blocks(host, [], [], torch.tensor([[0, 1]]))
    assert torch.count_nonzero(host) == 0


def test_allocate_host_tier_shape_and_sizing():
    host = pagedkv.allocate_host_tier(10, 4, 16, 2, 64, dtype=torch.bfloat16, pin_memory=False)
    assert host.shape == (10, 4, 2, 16, 2, 64) and host.is_contiguous() and not host.is_pinned()
    per_block = pagedkv.block_bytes(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert host[0].numel() * host.element_size() == per_block
    with pytest.raises(ValueError, match="num_host_blocks"):
        pagedkv.allocate_host_tier(0, 4, 16, 2, 64)


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    keys, values = make_caches(2, 6, 4, 2, 16, torch.float16, "cpu", gen)
    host = host_tier(4, 3, 4, 2, 16, torch.float16, "cpu", gen)
    torch.library.opcheck(torch.ops.pagedkv.offload_blocks.default, (keys, values, host, torch.tensor([[5, 1]]), 1))
    torch.library.opcheck(torch.ops.pagedkv.load_blocks.default, (host, keys, values, torch.tensor([[1, 2]]), 1))


def bad_argument_cases():
    """(name, build) pairs: build() returns (op, args) whose call must raise before writing anything."""
    def base(dtype=torch.float32):
        keys, values = make_caches(2, 6, 4, 2, 8, torch.float32, "cpu", torch.Generator().manual_seed(1))
        host = torch.zeros(4, 2, 2, 4, 2, 8, dtype=dtype)
        return keys, values, host

    def case(op, mapping, *, host=None, first_layer=0, caches=None):
        def build():
            keys, values, h = base()
            if caches is not None:
                keys, values = caches(keys, values)
            h = h if host is None else host(h)
            args = (keys, values, h, mapping, first_layer) if op == "offload" else (h, keys, values, mapping,
                                                                                      first_layer)
            return op, args
        return build

    m = torch.tensor
    return [
        ("duplicate host slot", case("offload", m([[0, 1], [2, 1]]))),
        ("duplicate device block", case("load", m([[0, 3], [1, 3]]))),
        ("device block out of range", case("offload", m([[6, 0]]))),
        ("host slot out of range", case("load", m([[4, 0]]))),
        ("negative id", case("offload", m([[-1, 0]]))),
        ("int32 mapping", case("offload", m([[0, 1]], dtype=torch.int32))),
        ("mapping shape", case("offload", m([0, 1]))),
        ("host dtype", case("offload", m([[0, 1]]), host=lambda h: h.half())),
        ("host shape", case("offload", m([[0, 1]]), host=lambda h: h[:, :, :1])),
        ("host not contiguous", case("offload", m([[0, 1]]), host=lambda h: h.transpose(3, 4))),
        ("first_layer out of range", case("offload", m([[0, 1]]), first_layer=1)),
        ("negative first_layer", case("load", m([[0, 1]]), first_layer=-1)),
        ("block geometry", case("offload", m([[0, 1]]), host=lambda h: torch.zeros(4, 2, 2, 4, 1, 16))),
        ("cache not contiguous", case("offload", m([[0, 1]]),
                                      caches=lambda k, v: ([x.transpose(1, 2).contiguous().transpose(1, 2)
                                                            for x in k], v))),
        ("layer counts differ", case("load", m([[0, 1]]), caches=lambda k, v: (k, v[:1]))),
        ("host overlaps a cache", case("load", m([[0, 1]]), host=None,
                                       caches=lambda k, v: (k, [v[0], k[1]]))),
    ]


@pytest.mark.parametrize("name,build", bad_argument_cases(), ids=[c[0] for c in bad_argument_cases()])
def test_bad_arguments_raise_and_write_nothing(name, build):
    op, args = build()
    tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(a, (list, torch.Tensor))
               and isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    fn = ops.offload_blocks if op == "offload" else ops.load_blocks
    with pytest.raises(RuntimeError):
        fn(*args)
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


def test_host_that_is_a_view_of_a_cache_is_refused():
    storage = torch.zeros(2 * 6 * 4 * 2 * 8 * 2)
    keys = [storage[:384].view(6, 4, 2, 8)]
    values = [storage[384:768].view(6, 4, 2, 8)]
    host = storage[:768].view(6, 1, 2, 4, 2, 8)  # the host tier aliases both caches
    with pytest.raises(RuntimeError, match="share memory"):
        ops.offload_blocks(keys, values, host, torch.tensor([[0, 1]]))


def test_hostile_inputs_never_crash_the_process():
    """numpy mappings, huge ids, meta tensors, a CUDA cache without a GPU: errors, never a crash."""
    code = r'''
import numpy as np, torch, pagedkv.ops as ops
keys = [torch.zeros(4, 2, 1, 8)]; values = [torch.zeros(4, 2, 1, 8)]; host = torch.zeros(3, 1, 2, 2, 1, 8)
bad = [lambda: ops.offload_blocks(keys, values, host, np.array([[0, 1]])),
       lambda: ops.offload_blocks(keys, values, host, torch.tensor([[2**62, 1]])),
       lambda: ops.load_blocks(host, keys, values, torch.tensor([[0, 2**40]])),
       lambda: ops.offload_blocks([torch.zeros(4, 2, 1, 8, device="meta")], values, host, torch.tensor([[0, 1]])),
       lambda: ops.offload_blocks(keys, values, host.to(torch.float64), torch.tensor([[0, 1]])),
       lambda: ops.offload_blocks(keys, values, host, torch.tensor([[0, 1]]), first_layer=2**40)]
for i, f in enumerate(bad):
    try:
        f()
    except (RuntimeError, TypeError, ValueError):
        pass
    else:
        raise SystemExit(f"case {i} did not raise")
print("ok")
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_offload_and_load_under_torch_compile():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    keys, values = make_caches(2, 6, 4, 2, 16, torch.float32, "cpu", gen)
    host = host_tier(4, 2, 4, 2, 16, torch.float32, "cpu", gen)

    def demote_then_promote(keys, values, host, out_map, in_map):
        ops.offload_blocks(keys, values, host, out_map)
        ops.load_blocks(host, keys, values, in_map)
        return host.sum()

    compiled = torch.compile(demote_then_promote, fullgraph=True, backend="inductor")
    eager_keys, eager_values, eager_host = [k.clone() for k in keys], [v.clone() for v in values], host.clone()
    out_map, in_map = torch.tensor([[1, 3], [4, 0]]), torch.tensor([[3, 5], [0, 2]])
    demote_then_promote(eager_keys, eager_values, eager_host, out_map, in_map)
    compiled(keys, values, host, out_map, in_map)
    assert torch.equal(bits(host), bits(eager_host))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(keys + values, eager_keys + eager_values))
