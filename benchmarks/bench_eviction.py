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
import random
import statistics
import time

import numpy as np

import pagedkv

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
    running request per step, free on completion. Returns (system hit rate, prompt hit rate, evictions)."""
    bm = pagedkv.BlockManager(num_blocks, BS)
    running, queue = {}, list(enumerate(requests))
    queue.reverse()
    sys_hit = sys_total = hit = total = 0
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
        if ids:
            bm.append_tokens(ids, [1] * len(ids))
            bm.mark_computed(ids)
        for rid in ids:
            running[rid] -= 1
            if running[rid] <= 0:
                bm.free(rid)
                del running[rid]
    bm.check_invariants()
    return sys_hit / sys_total, hit / total, bm.stats()["evictions"]


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


def cost_per_op(num_blocks, levels, ops, rounds, seed=0):
    rng = random.Random(seed)
    bm, next_token = filled_pool(num_blocks, levels, rng)
    times = []
    sid = 10 ** 9
    for _ in range(rounds):
        prompts = [list(range(next_token + i * (BS + 1), next_token + (i + 1) * (BS + 1))) for i in range(ops)]
        next_token += ops * (BS + 1)
        before = bm.stats()["evictions"]
        t0 = time.perf_counter()
        for prompt in prompts:
            sid += 1
            bm.allocate(sid, prompt)
            bm.mark_computed(sid)
            bm.free(sid)
            if levels == "durations":
                bm.set_time(bm.now + 0.01)
        times.append((time.perf_counter() - t0) / ops)
        assert bm.stats()["evictions"] - before == 2 * ops  # every operation evicted two cached blocks
    bm.check_invariants() if num_blocks <= 100_000 else None  # (a full check is O(n); skip the largest)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--pools", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", type=int, default=20_000, help="operations per timed round")
    ap.add_argument("--max-pool", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    systems, requests = workload(args.seed, args.requests)
    prompt_blocks = sum(len(p) for _, p, _ in requests) // BS
    print(f"(1) {args.requests} requests, 8 system prompts of {len(systems[0])} tokens, distinct user prompts "
          f"of 128-1023 tokens, 8-63 output tokens, block_size={BS}, up to 8 running")
    print("| pool (blocks) | pool turnovers | system-prompt hit rate: LRU | priority 90 | pinned "
          "| all prompt tokens: LRU | priority 90 | evictions: LRU | priority 90 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for nb in args.pools:
        res = {m: serve(nb, systems, requests, m) for m in ("LRU", "priority 90", "pinned")}
        print(f"| {nb} | {prompt_blocks / nb:.0f} | {res['LRU'][0]:.1%} | {res['priority 90'][0]:.1%} "
              f"| {res['pinned'][0]:.1%} | {res['LRU'][1]:.1%} | {res['priority 90'][1]:.1%} "
              f"| {res['LRU'][2]} | {res['priority 90'][2]} |")

    sizes = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= args.max_pool]
    print(f"\n(2) time per operation (admit a fresh 2-block prompt, evicting 2 cached blocks; compute; free), "
          f"median of {args.rounds} rounds of {args.ops} operations, block_size={BS}")
    print("| cached blocks | all at default priority | 101 priority levels | 101 levels + durations, clock "
          "advancing |")
    print("|---|---|---|---|")
    base = {}
    for n in sizes:
        row = []
        for levels in ("default", "spread", "durations"):
            t = cost_per_op(n, levels, args.ops, args.rounds)
            base.setdefault(levels, t)
            row.append(f"{t * 1e6:.2f} us ({t / base[levels]:.2f}x)")
        print(f"| {n:,} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
