"""Block-manager bookkeeping cost: pagedkv's C++ BlockManager vs a plain-Python implementation of the
seeds' algorithm (benchmarks/seeds_block_manager.py), side by side in one process.

  (1) admission: 256 prompts of 300-800 tokens sharing 8 system prompts. Seeds: per prompt
      can_allocate, allocate (which registers hashes at once) and the prefill slot-mapping tensor.
      pagedkv: per wave of --wave prompts, allocate_batch, slot_mappings and mark_computed (hashes are
      registered only once KV is written, so prompts of one wave cannot hit each other).
  (2) decode: steps at batch 256 producing what a model runner needs: the slot-mapping tensor and the
      padded block-table tensor (and, for pagedkv, seq_lens + mark_computed).
  (3) tiers: lookup + allocate of a 32k-token prompt whose every block hits, on the device (one tier)
      vs in the host tier (the hit is loaded: fresh device blocks and queued loads), alternating.

Run: python benchmarks/bench_block_manager.py [--repeats 5] [--cpu-time]

--cpu-time times with this thread's CPU time instead of the wall clock: on a machine shared with other
work it is far steadier (what other processes do no longer counts), e.g. to compare two builds by
running this once against each (PYTHONPATH=<build> from a directory without a pagedkv/ of its own).
"""
import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seeds_block_manager import Seq, SeedsBlockManager  # noqa: E402

import pagedkv  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 24_000
BATCH = 256


def make_prompts(rng):
    systems = [[rng.randrange(32_000) for _ in range(rng.randrange(150, 400))] for _ in range(8)]
    prompts = []
    for _ in range(BATCH):
        system = rng.choice(systems)
        total = rng.randrange(300, 801)
        prompts.append(system + [rng.randrange(32_000) for _ in range(max(1, total - len(system)))])
    return prompts


def admit_seeds(prompts):
    bm = SeedsBlockManager(NUM_BLOCKS, BLOCK_SIZE)
    seqs, cached = [], 0
    t0 = time.perf_counter()
    for tokens in prompts:
        seq = Seq(tokens, BLOCK_SIZE)
        assert bm.can_allocate(seq)
        bm.allocate(seq)
        bs, table = BLOCK_SIZE, seq.block_table
        torch.tensor([table[p // bs] * bs + p % bs for p in range(seq.num_cached_tokens, len(seq))], dtype=torch.int64)
        cached += seq.num_cached_tokens
        seqs.append(seq)
    return time.perf_counter() - t0, cached, (bm, seqs)


def admit_pagedkv(prompts, wave):
    """Admission as a scheduler step does it: a wave of prompts per call, then their prefill slot
    mapping, then mark_computed once their KV is written (so prompts hit waves before theirs)."""
    bm = pagedkv.BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    cached = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), wave):
        ids = list(range(start, min(start + wave, len(prompts))))
        hits = bm.allocate_batch(ids, prompts[start:start + wave])
        assert len(hits) == len(ids)
        bm.slot_mappings(ids, hits)
        bm.mark_computed(ids)
        cached += sum(hits)
    return time.perf_counter() - t0, cached, bm


def decode_seeds(state, steps):
    bm, seqs = state
    t0 = time.perf_counter()
    for _ in range(steps):
        slots = []
        for seq in seqs:
            seq.token_ids.append(7)
            assert bm.can_append(seq)
            bm.may_append(seq)
            p = len(seq) - 1
            slots.append(seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        width = max(len(s.block_table) for s in seqs)
        block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    del slot_mapping, block_tables
    return (time.perf_counter() - t0) / steps


def decode_pagedkv(bm, steps):
    ids = list(range(BATCH))
    tokens = [7] * BATCH
    t0 = time.perf_counter()
    for _ in range(steps):
        assert bm.can_append(ids)
        bm.append_tokens(ids, tokens)
        bm.block_tables(ids)
        bm.num_tokens(ids)
        bm.mark_computed(ids)
    return (time.perf_counter() - t0) / steps


TIER_PROMPT = 32_768


def tier_lookup_allocate(bm, prompt, reps):
    """Median time of lookup + allocate of the prompt (its loads, if any, then fail so that the next
    repeat hits the same tier again; freed outside the timing)."""
    times = []
    for sid in range(reps):
        bm.lookup([1, 2, 3])  # the manager remembers only its last lookup: this one walks the trie again
        t0 = time.perf_counter()
        device_blocks, host_blocks, _ = bm.lookup(prompt)
        bm.allocate(sid, prompt)
        times.append(time.perf_counter() - t0)
        assert device_blocks + host_blocks == len(prompt) // BLOCK_SIZE - 1
        if host_blocks:
            bm.take_loads()
            bm.complete_loads(False)  # nothing enters the device: the prompt stays a host hit
        bm.free(sid)
    return statistics.median(times)


def tier_managers():
    """(one tier: the prompt cached on the device, two tiers: the prompt only in the host tier)."""
    prompt = np.asarray(random.Random(7).choices(range(32_000), k=TIER_PROMPT), dtype=np.int64)
    blocks = TIER_PROMPT // BLOCK_SIZE
    device = pagedkv.BlockManager(2 * blocks, BLOCK_SIZE)
    tiered = pagedkv.BlockManager(2 * blocks, BLOCK_SIZE, num_host_blocks=2 * blocks)
    for bm in (device, tiered):
        bm.allocate(-1, prompt)
        bm.mark_computed(-1)
        bm.free(-1)
    tiered.plan_offloads(blocks)
    tiered.take_offloads()
    tiered.complete_offloads(True)
    tiered.allocate(-2, np.arange(2 * blocks * BLOCK_SIZE, dtype=np.int64) + 100_000)  # evicts the device copies
    tiered.free(-2)
    assert device.lookup(prompt) == (blocks - 1, 0, 0) and tiered.lookup(prompt)[1] == blocks - 1
    return prompt, device, tiered


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per repeat")
    ap.add_argument("--wave", type=int, default=16, help="prompts admitted per pagedkv scheduler step")
    ap.add_argument("--cpu-time", action="store_true", help="time with thread CPU time, not the wall clock")
    args = ap.parse_args()
    if args.cpu_time:
        time.perf_counter = time.thread_time
    torch.set_num_threads(1)
    rows = {"admit": [[], []], "admit_np": [[], []], "decode": [[], []]}
    tiers = [[], []]
    prompt, one_tier, two_tiers = tier_managers()
    hits = None
    for r in range(args.repeats):
        prompts = make_prompts(random.Random(r))
        # What a tokenizer hands over as arrays (HF tokenizers' return_tensors="np"): read by the buffer
        # protocol, no Python call per token.
        arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
        t_seeds, c_seeds, state = admit_seeds(prompts)
        t_np, c_np, _ = admit_pagedkv(arrays, args.wave)
        t_pkv, c_pkv, bm = admit_pagedkv(prompts, args.wave)
        assert c_np == c_pkv
        rows["admit"][0].append(t_seeds)
        rows["admit"][1].append(t_pkv)
        rows["admit_np"][0].append(t_seeds)
        rows["admit_np"][1].append(t_np)
        hits = (c_seeds, c_pkv, sum(map(len, prompts)))
        rows["decode"][0].append(decode_seeds(state, args.steps))
        rows["decode"][1].append(decode_pagedkv(bm, args.steps))
        bm.check_invariants()
        tiers[0].append(tier_lookup_allocate(one_tier, prompt, 5))
        tiers[1].append(tier_lookup_allocate(two_tiers, prompt, 5))

    print(f"block_size={BLOCK_SIZE}, batch={BATCH}, median of {args.repeats} repeats, torch threads=1, "
          f"{'thread CPU time' if args.cpu_time else 'wall clock'}; {pagedkv.__file__}")
    print(f"cached prompt tokens: seeds {hits[0]}, pagedkv {hits[1]} of {hits[2]} (pagedkv admits {args.wave} per step)")
    print("| phase | seeds (pure Python) | pagedkv (C++) | speed-up |")
    print("|---|---|---|---|")
    labels = {"admit": "admit 256 prompts (total), token lists", "admit_np": "admit 256 prompts, numpy arrays",
              "decode": f"decode step, batch {BATCH}"}
    for key, (py, cpp) in rows.items():
        a, b = statistics.median(py), statistics.median(cpp)
        print(f"| {labels[key]} | {a * 1e3:.2f} ms | {b * 1e3:.3f} ms | {a / b:.1f}x |")
    one_tier.check_invariants()
    two_tiers.check_invariants()
    a, b = statistics.median(tiers[0]), statistics.median(tiers[1])
    print()
    print("| lookup + allocate, 32k-token prompt | device hit (one tier) | host-tier hit (loaded) | ratio |")
    print("|---|---|---|---|")
    print(f"| {TIER_PROMPT // BLOCK_SIZE - 1} blocks hit | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
