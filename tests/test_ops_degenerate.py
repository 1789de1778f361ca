"""Random small and degenerate arguments (zero-sized dimensions, empty batches, ids and slots just out
of range, repeated ids, non-contiguous index tensors) through every CPU op: each call either matches
the float64 reference or raises a RuntimeError naming what is wrong, and a raising call writes nothing."""
from __future__ import annotations

import random

import torch

import pagedkv.ops as ops

import ops_reference as ref
from ops_reference import TOLERANCE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ARGUMENT_NAMES = ("query", "key", "value", "block_tables", "seq_lens", "query_start_loc", "slot_mapping",
                  "block_mapping", "src", "dst", "caches")


def maybe_strided(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The same values, sometimes as a non-contiguous view."""
    if t.dim() == 0 or rng.random() < 0.5:
        return t
    return torch.stack([t, torch.full_like(t, -3)], dim=-1)[..., 0]


def reference(fn, *args, **kwargs):
    """The reference result, or None when the reference cannot compute one (then the op must raise)."""
    try:
        return fn(*args, **kwargs)
    except (IndexError, RuntimeError):
        return None


def accepted(want):
    assert want is not None, "the op accepted arguments the reference cannot compute with"
    return want


def attention_call(rng):
    num_blocks, bs, hkv, group, d = rng.choice([0, 1, 3]), rng.choice([1, 4]), rng.choice([1, 2]), \
        rng.choice([0, 1, 3]), rng.choice([8, 12])
    dtype = rng.choice(DTYPES)
    num_seqs = rng.choice([0, 1, 2])
    q_lens = [rng.choice([0, 1, 3]) for _ in range(num_seqs)]
    seq_lens = [q + rng.choice([0, 2, 5]) - rng.choice([0, 0, 1]) for q in q_lens]
    width = rng.choice([0, 1, 2, 3])
    kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.randint(-1, num_blocks + 1, (num_seqs, width), dtype=torch.int32)
    q = torch.randn(sum(q_lens), hkv * group, d, dtype=dtype)
    qsl = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(num_seqs)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    window = rng.choice([-1, -1, 1, 3])
    args = (q, kc, vc, maybe_strided(tables, rng), maybe_strided(lens, rng), maybe_strided(qsl, rng), 0.5)

    # Blocks no query can see (before the first query's window, or of a sequence without queries) need
    # not be valid: the op never reads them, so the reference gets a valid id there instead.
    ref_tables = tables.clone()
    for b in range(num_seqs):
        first_pos = seq_lens[b] - q_lens[b]
        first_key = max(0, first_pos + 1 - window) if window > 0 else 0
        unseen = -(-seq_lens[b] // bs) if q_lens[b] == 0 else min(first_key // bs, width)
        if num_blocks > 0:
            ref_tables[b, :unseen] = 0
    ref_args = (q, kc, vc, ref_tables, lens, qsl, 0.5)

    def check():
        want = reference(ref.paged_attention, *ref_args, sliding_window=window)
        out = ops.paged_attention(*args, sliding_window=window)
        expected, _ = accepted(want)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    return check, [kc, vc]


def cache_write_call(rng):
    num_blocks, bs, hkv, d = rng.choice([0, 1, 3]), rng.choice([1, 4]), rng.choice([0, 1, 2]), rng.choice([1, 8])
    dtype = rng.choice(DTYPES)
    kc, vc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype), torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    t = rng.choice([0, 1, 3])
    key, value = torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype)
    slots = torch.randint(-2, num_blocks * bs + 2, (t,))

    def check():
        want = reference(ref.reshape_and_cache, key, value, kc, vc, slots)
        ops.reshape_and_cache(key, value, kc, vc, maybe_strided(slots, rng))
        want_k, want_v = accepted(want)
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    return check, [kc, vc]


def block_copy_call(rng):
    num_blocks, hkv = rng.choice([0, 1, 4]), rng.choice([0, 1, 2])
    caches = [(torch.randn(num_blocks, 2, hkv, 8), torch.randn(num_blocks, 2, hkv, 8))
              for _ in range(rng.choice([0, 1, 2]))]
    mapping = torch.randint(-1, num_blocks + 1, (rng.choice([0, 1, 2, 3]), 2))
    if rng.random() < 0.5:
        keys, values = [k for k, _ in caches], [v for _, v in caches]

        def check():
            want = reference(ref.copy_blocks, keys, values, mapping)
            ops.copy_blocks(keys, values, maybe_strided(mapping, rng))
            want_k, want_v = accepted(want)
            assert all(torch.equal(a, b) for a, b in zip(keys + values, want_k + want_v))
        return check, [t for pair in caches for t in pair]
    src = torch.randn(num_blocks, 2, hkv, 8)
    dst = src if rng.random() < 0.3 else torch.randn(rng.choice([0, 1, 3]), 2, hkv, 8)

    def check():
        want = reference(ref.swap_blocks, src.clone(), dst, mapping)
        ops.swap_blocks(src, dst, maybe_strided(mapping, rng))
        assert torch.equal(dst, accepted(want))
    return check, [src, dst]


def test_random_degenerate_calls(rng):
    """At least 300 calls, and on until each outcome (a result, an error) has come 30 times: about a third
    of the draws are accepted, so the cap of 3000 is never reached unless one outcome has become rare."""
    outcomes = {"ok": 0, "raised": 0}
    while sum(outcomes.values()) < 300 or min(outcomes.values()) < 30:
        assert sum(outcomes.values()) < 3000, f"one outcome has become rare: {outcomes}"
        make = rng.choice([attention_call, cache_write_call, block_copy_call])
        check, written = make(rng)
        before = [t.clone() for t in written]
        try:
            check()
            outcomes["ok"] += 1
        except RuntimeError as e:
            assert any(name in str(e) for name in ARGUMENT_NAMES), f"message names no argument: {e}"
            assert all(torch.equal(a, b) for a, b in zip(written, before)), f"{make.__name__} wrote before {e}"
            outcomes["raised"] += 1
