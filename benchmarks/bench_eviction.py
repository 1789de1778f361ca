"""Eviction with retention priorities: what it buys and what it costs.

  (1) hit rate: 8 system prompts requested with priority 90, interleaved with a stream of distinct user
      prompts at the default priority that overflows the pool many times. The same request stream runs
      through the same pool with plain LRU (no retention), with priority 90 on the system prompt, and with
      the 8 system prompts computed and pinned up front. Prints the hit rate of the system-prompt tokens
      (and of all prompt tokens) per pool size.
  (2) cost: a pool of 10^3 .. 10^6 blocks, every block cached and free, spread over 101 priority levels
      (or all at the default, or with durations and a clock that advances); then operations that each
      admit a fresh 2-block prompt (evicting 2 blocks), compute it and free it. Prints the median time per
      operation: flat from 10^3 to 10^6 blocks means eviction is O(1) in the number of cached blocks.

Run: python benchmarks/bench_eviction.py [--requests 3000] [--rounds 5] [--max-pool 1000000]
"""
import argparse
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv  # noqa: E402

BS = 16


# --- (1) hit rate ------------------------------------------------------------------------------------------

def workload(seed, num_requests, num_systems=8, system_len=256):
    rng = random.Random(seed)
    systems = [[rng.randrange(32_000) for _ in range(system_len)] for _ in range(num_systems)]
    requests = []
    for i in range(num_requests):
        k = rng.randrange(num_systems)
        user = [32_000 + i * 4096 + t for t in range(rng.randrange(128, 1024))]  # distinct from every other
        requests.append((k, systems[k] + user, rng.randrange(8, 64)))  # (system, prompt, output tokens)
    return systems, requests


def serve(num_blocks, systems, requests, mode, concurrency=8):
    """Continuous batching through the manager alone: admit while the pool allows, one decode token per
    running request per step, free on completion. Returns (system hit rate, prompt hit rate, preemptions)."""
    bm = pagedkv.BlockManager(num_blocks, BS)
    running, queue = {}, list(enumerate(requests))
    queue.reverse()
    sys_hit = sys_total = hit = total = preempted = 0
    if mode == "pinned":  # computed once up front, pinned for good
        for k, system in enumerate(systems):
            bm.allocate(-1 - k, system)
            bm.mark_computed(-1 - k)
            bm.pin(-1 - k)
            bm.free(-1 - k)
    while queue or running:
        while queue and len(running) < concurrency:
            rid, (k, prompt, out) = queue[-1]
            if bm.can_allocate(prompt) != pagedkv.AllocStatus.OK:
                break
            queue.pop()
            retention = [(0, len(systems[k]), 90)] if mode == "priority 90" else None
            cached = bm.allocate(rid, prompt, retention=retention)
            sys_hit += min(cached, len(systems[k]))
            sys_total += len(systems[k])
            hit += cached
            total += len(prompt)
            bm.mark_computed(rid)  # prefill
            running[rid] = out
        ids = list(running)
        while ids and not bm.can_append(ids):  # preempt the newest (dropped: only admissions count here)
            bm.free(ids[-1])
            del running[ids.pop()]
            preempted += 1
        if ids:
            bm.append_tokens(ids, [1] * len(ids))
            bm.mark_computed(ids)
        for rid in ids:
            running[rid] -= 1
            if running[rid] <= 0:
                bm.free(rid)
                del running[rid]
    bm.check_invariants()
    return sys_hit / sys_total, hit / total, preempted


# --- (2) cost per operation --------------------------------------------------------------------------------

def filled_pool(num_blocks, levels, rng):
    """A pool whose every block holds cached KV, free, at priorities per `levels`."""
    bm = pagedkv.BlockManager(num_blocks, BS, max_pinned_fraction=0.0)
    seq_blocks = min(num_blocks, 1000)
    next_token = 0
    for sid in range(num_blocks // seq_blocks):
        tokens = np.arange(next_token, next_token + seq_blocks * BS, dtype=np.int64)
        next_token += seq_blocks * BS
        retention = None
        if levels != "default":  # 10 ranges of random priorities (and durations) per sequence
            step = seq_blocks * BS // 10
            duration = (lambda: rng.choice([1.0, 10.0, 100.0])) if levels == "durations" else (lambda: None)
            retention = [(i * step, (i + 1) * step, rng.randrange(101), duration()) for i in range(10)]
        bm.allocate(sid, tokens, retention=retention)
        bm.mark_computed(sid)
        bm.free(sid)
    assert bm.stats()["cached_free_blocks"] == num_blocks
    return bm, next_token


class Pool:
    """A filled pool and the operation timed on it."""

    def __init__(self, num_blocks, levels, seed=0):
        self.levels = levels
        self.bm, self.next_token = filled_pool(num_blocks, levels, random.Random(seed))
        self.sid = 10 ** 9

    def time_ops(self, ops):
        bm, first = self.bm, self.next_token
        prompts = [list(range(first + i * 2 * BS, first + (i + 1) * 2 * BS)) for i in range(ops)]
        self.next_token += ops * 2 * BS
        before = bm.stats()["evictions"]
        t0 = time.perf_counter()
        for prompt in prompts:
            self.sid += 1
            bm.allocate(self.sid, prompt)
            bm.mark_computed(self.sid)
            bm.free(self.sid)
            if self.levels == "durations":
                bm.set_time(bm.now + 0.01)
        dt = (time.perf_counter() - t0) / ops
        assert bm.stats()["evictions"] - before == 2 * ops  # every operation evicted two cached blocks
        return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--pools", type=int, nargs="+", default=[384, 512, 768, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=20_000, help="operations per timed round")
    ap.add_argument("--max-pool", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    systems, requests = workload(args.seed, args.requests)
    prompt_blocks = sum(len(p) for _, p, _ in requests) // BS
    print(f"(1) {args.requests} requests, 8 system prompts of {len(systems[0])} tokens, distinct user prompts "
          f"of 128-1023 tokens, 8-63 output tokens, block_size={BS}, up to 8 running")
    modes = ("LRU", "priority 90", "pinned")
    print("| pool (blocks) | pool turnovers | system-prompt hit rate: LRU | priority 90 | pinned "
          "| all prompt tokens: LRU | priority 90 | pinned | preempted: LRU | priority 90 | pinned |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for nb in args.pools:
        res = [serve(nb, systems, requests, m) for m in modes]
        print(f"| {nb} | {prompt_blocks / nb:.0f} | " + " | ".join(f"{r[0]:.1%}" for r in res) + " | "
              + " | ".join(f"{r[1]:.1%}" for r in res) + " | " + " | ".join(str(r[2]) for r in res) + " |")

    sizes = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= args.max_pool]
    variants = ("default", "spread", "durations")
    pools = {(n, v): Pool(n, v, args.seed) for n in sizes for v in variants}
    times = {key: [] for key in pools}
    rng = random.Random(args.seed)
    for _ in range(args.rounds):  # every pool once per round, in a fresh order: drifts hit all alike
        keys = list(pools)
        rng.shuffle(keys)
        for key in keys:
            times[key].append(pools[key].time_ops(args.ops))
    for key, pool in pools.items():
        if key[0] <= 100_000:
            pool.bm.check_invariants()  # O(n): skipped for the largest pools
    print(f"\n(2) time per operation (admit a fresh 2-block prompt, evicting 2 cached blocks; compute; free), "
          f"median of {args.rounds} rounds of {args.ops} operations, pools interleaved, block_size={BS}")
    print("| cached blocks | all at default priority | 101 priority levels | 101 levels + durations, clock "
          "advancing |")
    print("|---|---|---|---|")
    for n in sizes:
        row = []
        for v in variants:
            t, t0 = statistics.median(times[n, v]), statistics.median(times[sizes[0], v])
            row.append(f"{t * 1e6:.2f} us ({t / t0:.2f}x)")
        print(f"| {n:,} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
