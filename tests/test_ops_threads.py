"""Metadata written by another thread while a CPU op runs (block_tables, seq_lens, slot_mapping,
block mappings): the op must never read outside its tensors, and each call either gives the right
result or raises a clean error. Each stress runs in a fresh process so that a crash fails the test
instead of killing the whole pytest run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

STRESS = r"""
import sys, threading, torch
from ops_reference import PagedBatch
import pagedkv.ops as ops

torch.set_num_threads(2)
calls, errors = 0, 0
stop = threading.Event()


def flipper(array, entries, bad_values):
    # Each listed entry flips between its right value and a bad one until stopped.
    right = [array[e] for e in entries]
    i = 0
    while not stop.is_set():
        e = i % len(entries)
        array[entries[e]] = bad_values[i % len(bad_values)]
        array[entries[e]] = right[e]
        i += 1


def run(op, check, array, entries, bad_values, n):
    global calls, errors
    stop.clear()
    t = threading.Thread(target=flipper, args=(array, entries, bad_values))
    t.start()
    try:
        for _ in range(n):
            try:
                result = op()
            except RuntimeError as e:
                assert any(m in str(e) for m in ("out of range", "seq_lens", "is outside")), str(e)
                errors += 1
                continue
            check(result)
            calls += 1
    finally:
        stop.set()
        t.join()


case = {case!r}
if case == "paged_attention":
    batch = PagedBatch([3000, 2000, 0, 7], [1, 1, 24, 3], block_size=8, num_kv_heads=2, group=4, head_dim=64,
                       dtype=torch.float32, device="cpu")
    expected = ops.paged_attention(*batch.args())
    tables, lens = batch.block_tables.numpy(), batch.seq_lens.numpy()
    used = [(b, i) for b, n in enumerate(batch.seq_lens_list) for i in range(-(-n // 8))]
    check = lambda out: torch.equal(out, expected) or sys.exit("wrong result")
    run(lambda: ops.paged_attention(*batch.args()), check, tables, used, [10**6, -1, 2**31 - 1, -2**31], 200)
    run(lambda: ops.paged_attention(*batch.args()), check, lens, [0, 1, 2, 3], [10**6, -7, 2**31 - 1], 200)
elif case == "reshape_and_cache":
    kc, vc = torch.randn(64, 8, 2, 64), torch.randn(64, 8, 2, 64)
    key, value = torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    slots = torch.randperm(512)[:50]
    want_k, want_v = kc.clone(), vc.clone()
    ops.reshape_and_cache(key, value, want_k, want_v, slots)
    def check(_):
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), "wrong result"
    run(lambda: ops.reshape_and_cache(key, value, kc, vc, slots), check, slots.numpy(), list(range(50)),
        [512, 10**12, 2**62], 400)
elif case == "rotary_embedding":
    from ops_reference import cos_sin_cache
    x0, cache, positions = torch.randn(64, 8, 128), cos_sin_cache(256, 128), torch.randint(0, 256, (64,))
    want = x0.clone()
    ops.rotary_embedding(positions, want, cache)
    x = x0.clone()
    def rotate():
        x.copy_(x0)
        ops.rotary_embedding(positions, x, cache)
    def check(_):
        assert torch.equal(x, want), "wrong result"
    run(rotate, check, positions.numpy(), list(range(64)), [256, -1, 10**12, -2**62], 400)
else:  # copy_blocks and swap_blocks mappings
    kc, vc = torch.randn(40, 8, 2, 64), torch.randn(40, 8, 2, 64)
    mapping = torch.stack([torch.arange(0, 10), torch.arange(20, 30)], dim=1)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[20:30], want_v[20:30] = kc[:10], vc[:10]
    def check(_):
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), "wrong result"
    flat = mapping.numpy().reshape(-1)
    run(lambda: ops.copy_blocks([kc], [vc], mapping), check, flat, list(range(20)), [40, -1, 2**62], 400)
    dst = torch.randn(40, 8, 2, 64)
    want = dst.clone()
    want[20:30] = kc[:10]
    def check_swap(_):
        assert torch.equal(dst, want), "wrong result"
    run(lambda: ops.swap_blocks(kc, dst, mapping), check_swap, flat, list(range(20)), [40, -1, 2**62], 400)
print("ok", calls, errors)
"""


@pytest.mark.parametrize("case", ["paged_attention", "reshape_and_cache", "block_mappings", "rotary_embedding"])
def test_metadata_written_by_another_thread(case):
    tests = os.path.dirname(os.path.abspath(__file__))  # the stress script imports ops_reference from here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", STRESS.format(case=case)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout[-2000:]} {result.stderr[-3000:]}"
    _, calls, errors = result.stdout.split()
    assert int(calls) > 0, result.stdout        # some calls ran on the right metadata
