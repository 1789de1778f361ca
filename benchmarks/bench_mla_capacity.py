"""MLA's latent cache against full per-head K/V: bytes per token and tokens that fit in a memory budget.

DeepSeek V3's attention (61 layers, 128 heads, K = qk_nope 128 + rope 64 = 192 dims, V = 128 dims,
kv_lora_rank 512): caching full K and V costs 128 x (192 + 128) = 40,960 elements per token and layer;
the latent cache of concat_and_cache_mla costs one row of 512 + 64 = 576, the same for every head. The
block manager is the same for both (block_size tokens per block): the pool is the budget divided by a
block's bytes (pagedkv.block_bytes / pagedkv.mla_block_bytes), so only the bytes per block change.

With --speed, also CPU decode attention over the latent cache (paged_attention_mla, bf16, DeepSeek's
576-wide rows) at a few batch sizes and context lengths, medians of interleaved rounds.

    python benchmarks/bench_mla_capacity.py [--budget-gb 80] [--block-size 64] [--speed]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import pagedkv  # noqa: E402  (before torch: the OpenMP wait policy)
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import read_bandwidth_gbs  # noqa: E402

LAYERS, HEADS, K_DIM, V_DIM, RANK, ROPE = 61, 128, 192, 128, 512, 64


def capacity_table(budget_bytes: int, block_size: int) -> None:
    print(f"DeepSeek V3 KV capacity in {budget_bytes / 1e9:.0f} GB ({LAYERS} layers, block_size {block_size})\n")
    print(f"| cache | dtype | elements / token / layer | bytes / token / layer | bytes / token | "
          f"tokens in {budget_bytes / 1e9:.0f} GB | vs full K/V |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8")]:
        # full K/V: per-head K (192) and V (128); block_bytes counts K and V of head_dim each, so (192+128)/2
        full_block = pagedkv.block_bytes(num_layers=LAYERS, block_size=block_size, num_kv_heads=HEADS,
                                         head_dim=(K_DIM + V_DIM) // 2, dtype=dtype)
        latent_block = pagedkv.mla_block_bytes(num_layers=LAYERS, block_size=block_size, kv_lora_rank=RANK,
                                               qk_rope_head_dim=ROPE, dtype=dtype)
        full_tokens = pagedkv.num_blocks_for(budget_bytes, num_layers=LAYERS, block_size=block_size,
                                             num_kv_heads=HEADS, head_dim=(K_DIM + V_DIM) // 2,
                                             dtype=dtype) * block_size
        latent_tokens = pagedkv.num_mla_blocks_for(budget_bytes, num_layers=LAYERS, block_size=block_size,
                                                   kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                                                   dtype=dtype) * block_size
        for label, elems, block, tokens in [("full K/V", HEADS * (K_DIM + V_DIM), full_block, full_tokens),
                                            ("MLA latent", RANK + ROPE, latent_block, latent_tokens)]:
            per_token = block // block_size
            print(f"| {label} | {name} | {elems:,} | {per_token // LAYERS:,} | {per_token:,} | {tokens:,} | "
                  f"{tokens / full_tokens:.1f}x |")


def speed_table(rounds: int) -> None:
    print(f"\nCPU decode, paged_attention_mla (bf16 query and cache, rows of {RANK}+{ROPE}, block_size 64, "
          f"{torch.get_num_threads()} threads, ISA clone chosen at load), median of {rounds} rounds; share = the "
          "latent bytes a call must read (each row once) per second over a streaming read measured before "
          "each case\n")
    print("| batch | heads | context | ms / call | (head, row) scores / s | latent GB/s | read GB/s | share |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, heads, context in [(1, 16, 4096), (8, 16, 2048), (4, 16, 8192), (8, 128, 1024), (1, 128, 8192)]:
        bs = 64
        blocks = batch * -(-context // bs)
        cache = torch.randn(blocks, bs, RANK + ROPE, dtype=torch.bfloat16)
        tables = torch.randperm(blocks).int().view(batch, -1)
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        qsl = torch.arange(batch + 1, dtype=torch.int32)
        q = torch.randn(batch, heads, RANK + ROPE, dtype=torch.bfloat16)
        run = lambda: pagedkv.ops.paged_attention_mla(q, cache, tables, seq_lens, qsl, 192 ** -0.5, RANK)  # noqa: E731
        run()
        read = read_bandwidth_gbs(rounds)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        gbs = batch * context * (RANK + ROPE) * 2 / (ms / 1e3) / 1e9
        print(f"| {batch} | {heads} | {context} | {ms:.2f} | {batch * heads * context / (ms / 1e3):,.0f} | "
              f"{gbs:.1f} | {read:.1f} | {gbs / read:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gb", type=float, default=80.0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    capacity_table(int(args.budget_gb * 1e9), args.block_size)
    if args.speed:
        speed_table(args.rounds)


if __name__ == "__main__":
    main()
