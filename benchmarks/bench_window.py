"""Sliding windows in the block manager: what a sequence holds, and what the bookkeeping costs.

  (a) KV bytes a sequence holds once its context is computed, for contexts 256..8192 tokens and window
      --window (256), measured by driving pagedkv.BlockManager (allocate, mark_computed, a few decode
      steps): a full-attention Llama, a Mistral-style model (every layer windowed: one windowed group) and
      a Gemma-2-style model (layers alternate windowed / full: two groups of half the layers each, where
      layer i of both groups shares one cache tensor, so a block id costs half the layers' bytes). Same
      geometry for all three (--layers 32, 8 KV heads of 128, bfloat16, block 16). Then how many such
      sequences of 8 x window tokens a fixed KV budget (--budget-gib) holds, admitted one after the
      other and prefilled in chunks of --chunk tokens (allocate(num_new_tokens=), reserve()).
  (b) one decode step's bookkeeping at batch 256 (can_append, append_tokens, block_tables and seq_lens of
      every group, mark_computed, which releases the blocks that leave the window), windows off vs on,
      for one group and for two; contenders interleaved in one process, median of --rounds rounds.

Run: python benchmarks/bench_window.py [--cpu-time] [--rounds 9]
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv  # noqa: E402

BLOCK_SIZE = 16
BATCH = 256
KV_HEADS, HEAD_DIM, ITEMSIZE = 8, 128, 2  # bfloat16


def models(window, layers):
    """name -> (group_windows, layers per group)."""
    return {
        "Llama (full attention)": ([None], layers),
        f"Mistral-style (window {window})": ([window], layers),
        f"Gemma-2-style (alternating, window {window})": ([window, None], layers // 2),
    }


def block_bytes(layers_per_group):
    return pagedkv.block_bytes(num_layers=layers_per_group, block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
                               head_dim=HEAD_DIM, dtype=torch.bfloat16)


def held_blocks(bm, seq_id):
    return sum(len(bm.block_table(seq_id, group=g)) - bm.num_released_blocks(seq_id, group=g)
               for g in range(bm.num_groups))


def bytes_held(windows, layers_per_group, context, decode_steps=4):
    """KV bytes one sequence holds after its `context`-token prompt is computed and a few tokens decoded."""
    bm = pagedkv.BlockManager(len(windows) * (context // BLOCK_SIZE + 8), BLOCK_SIZE, group_windows=windows)
    rng = random.Random(context)
    bm.allocate(0, [rng.randrange(32_000) for _ in range(context)])
    bm.mark_computed(0)
    for _ in range(decode_steps):
        bm.append_token(0, 7)
        bm.mark_computed(0)
    bm.check_invariants()
    used = bm.num_blocks - bm.num_free_blocks
    assert used == held_blocks(bm, 0)
    return used * block_bytes(layers_per_group)


def sequences_in_budget(windows, layers_per_group, context, budget_bytes, chunk):
    """Sequences of `context` tokens admitted one after the other, each prefilled in chunks, until one
    does not fit; returns (sequences fully prefilled, block ids in the pool)."""
    num_blocks = budget_bytes // block_bytes(layers_per_group)
    bm = pagedkv.BlockManager(num_blocks, BLOCK_SIZE, group_windows=windows, enable_prefix_caching=False)
    rng = random.Random(1)
    n = 0
    while True:
        prompt = [rng.randrange(32_000) for _ in range(context)]
        if bm.can_allocate(prompt, num_new_tokens=chunk) != pagedkv.AllocStatus.OK:
            return n, num_blocks
        bm.allocate(n, prompt, num_new_tokens=chunk)
        done = 0
        while done < context:
            end = min(context, done + chunk)
            if bm.num_allocated_tokens(n) < end:
                if not bm.can_reserve(n, end):
                    return n, num_blocks
                bm.reserve(n, end)
            bm.mark_computed(n, end)
            done = end
        n += 1


def memory_tables(args):
    contexts = [256 * 2 ** i for i in range(6)]  # 256 .. 8192
    ms = models(args.window, args.layers)
    print(f"(a) KV held per sequence (MiB) after computing its context, window {args.window}, {args.layers} layers, "
          f"{KV_HEADS} KV heads x {HEAD_DIM}, bfloat16, block {BLOCK_SIZE}")
    print("| context (tokens) | " + " | ".join(ms) + " |")
    print("|---|" + "---|" * len(ms))
    for c in contexts:
        cells = [bytes_held(w, lpg, c) / 2 ** 20 for w, lpg in ms.values()]
        full = cells[0]
        print(f"| {c} | " + " | ".join(f"{x:.0f}" + ("" if i == 0 else f" ({full / x:.1f}x less)")
                                      for i, x in enumerate(cells)) + " |")
    context = 8 * args.window
    budget = int(args.budget_gib * 2 ** 30)
    print(f"\nsequences of {context} tokens (8 x window) in {args.budget_gib:g} GiB of KV, admitted one after "
          f"the other, each prefilled in chunks of {args.chunk} tokens")
    print("| model | block ids in the budget | sequences | vs full attention |")
    print("|---|---|---|---|")
    base = None
    for name, (w, lpg) in ms.items():
        n, blocks = sequences_in_budget(w, lpg, context, budget, args.chunk)
        base = base or n
        print(f"| {name} | {blocks} | {n} | {n / base:.1f}x |")


def admitted(windows, rng_seed):
    """A manager holding BATCH computed sequences of 300-800 tokens (shared system prompts)."""
    rng = random.Random(rng_seed)
    systems = [[rng.randrange(32_000) for _ in range(rng.randrange(150, 400))] for _ in range(8)]
    prompts = [rng.choice(systems) + [rng.randrange(32_000) for _ in range(rng.randrange(150, 400))]
               for _ in range(BATCH)]
    bm = pagedkv.BlockManager(len(windows) * 20_000, BLOCK_SIZE, group_windows=windows)
    ids = list(range(BATCH))
    assert len(bm.allocate_batch(ids, prompts)) == BATCH
    bm.mark_computed(ids)
    return bm


def decode_step_ms(bm, steps):
    ids = list(range(BATCH))
    tokens = [7] * BATCH
    groups = range(bm.num_groups)
    t0 = time.perf_counter()
    for _ in range(steps):
        assert bm.can_append(ids)
        bm.append_tokens(ids, tokens)
        for g in groups:
            bm.block_tables(ids, group=g)
        bm.num_tokens(ids)
        bm.mark_computed(ids)
    return (time.perf_counter() - t0) / steps * 1e3


def bookkeeping_table(args):
    contenders = {
        "1 group": ([None], [args.window]),
        "2 groups": ([None, None], [None, args.window]),
    }
    times = {k: ([], []) for k in contenders}
    for r in range(args.rounds):
        for key, (off, on) in contenders.items():
            bm_off, bm_on = admitted(off, r), admitted(on, r)
            times[key][0].append(decode_step_ms(bm_off, args.steps))
            times[key][1].append(decode_step_ms(bm_on, args.steps))
            bm_on.check_invariants()
    clock = "thread CPU time" if args.cpu_time else "wall clock"
    print(f"\n(b) decode-step bookkeeping at batch {BATCH} (300-800-token contexts, {args.steps} steps per round), "
          f"median of {args.rounds} interleaved rounds, {clock}")
    print(f"| groups | windows off | windows on ({args.window}) | on / off |")
    print("|---|---|---|---|")
    for key, (off, on) in times.items():
        a, b = statistics.median(off), statistics.median(on)
        print(f"| {key} | {a:.3f} ms | {b:.3f} ms | {b / a:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens) in the budget table")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per round")
    ap.add_argument("--cpu-time", action="store_true", help="time with thread CPU time, not the wall clock")
    args = ap.parse_args()
    if args.cpu_time:
        time.perf_counter = time.thread_time
    torch.set_num_threads(1)
    memory_tables(args)
    bookkeeping_table(args)


if __name__ == "__main__":
    main()
