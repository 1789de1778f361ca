"""Throughput (GB/s of bytes moved, read + write) of the cache ops vs plain torch indexing doing the
same work: reshape_and_cache vs ``cache.view(-1, H, D)[slots] = key``, copy_blocks vs ``index_copy_``,
swap_blocks vs gather + ``.to(device)`` + ``index_copy_``, offload_blocks / load_blocks (the host tier) vs one
contiguous copy of the same bytes between the same memories (``torch`` column: the roofline). Then reshape_and_cache into vLLM's interleaved
K|V cells (``x[..., :D]``, ``x[..., D:]`` of one ``[blocks, bs, H, 2D]`` tensor) vs two contiguous caches
of the same shape, int64 and int32 slots (ratio > 1: the strided write is slower).

    python benchmarks/bench_cache_ops.py                # CPU (and CUDA <-> CPU swaps when present)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv.ops as ops  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import DTYPES, time_ms  # noqa: E402


def row(name, nbytes, ours_ms, torch_ms):
    print(f"{name:<34}{nbytes / 2**20:>9.1f}{ours_ms:>10.3f}{torch_ms:>10.3f}"
          f"{nbytes / ours_ms / 1e6:>11.1f}{nbytes / torch_ms / 1e6:>11.1f}{torch_ms / ours_ms:>8.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    nb, bs, h, d = args.num_blocks, args.block_size, args.num_kv_heads, args.head_dim
    timing = dict(device=device, warmup=args.warmup, repeats=args.repeats)
    caches = [(torch.randn(nb, bs, h, d, dtype=dtype, device=device),
               torch.randn(nb, bs, h, d, dtype=dtype, device=device)) for _ in range(args.num_layers)]
    key_cache, value_cache = caches[0]
    itemsize = key_cache.element_size()
    block_bytes = bs * h * d * itemsize

    print(f"device={device} dtype={args.dtype} num_blocks={nb} block_size={bs} Hkv={h} D={d} "
          f"layers={args.num_layers} threads={torch.get_num_threads()}")
    print(f"{'op':<34}{'MiB':>9}{'ours ms':>10}{'torch ms':>10}{'ours GB/s':>11}{'torch GB/s':>11}{'speedup':>9}")

    for tokens in (256, 4096):
        key = torch.randn(tokens, h, d, dtype=dtype, device=device)
        value = torch.randn_like(key)
        slots = torch.randperm(nb * bs, device=device)[:tokens]

        def torch_write():
            key_cache.view(-1, h, d)[slots] = key
            value_cache.view(-1, h, d)[slots] = value

        nbytes = 2 * 2 * key.numel() * itemsize
        row(f"reshape_and_cache T={tokens}", nbytes,
            time_ms(lambda: ops.reshape_and_cache(key, value, key_cache, value_cache, slots), **timing),
            time_ms(torch_write, **timing))

    pairs = 256
    perm = torch.randperm(nb)
    mapping = torch.stack([perm[:pairs], perm[pairs:2 * pairs]], dim=1).to(device)
    src_ids, dst_ids = mapping[:, 0], mapping[:, 1]
    keys, values = [k for k, _ in caches], [v for _, v in caches]

    def torch_copy():
        for cache in keys + values:
            cache.index_copy_(0, dst_ids, cache.index_select(0, src_ids))

    row(f"copy_blocks {pairs} pairs x {args.num_layers} layers", 2 * 2 * pairs * args.num_layers * block_bytes,
        time_ms(lambda: ops.copy_blocks(keys, values, mapping), **timing), time_ms(torch_copy, **timing))

    targets = [torch.device("cpu")] + ([device] if device.type == "cuda" else [])
    for target in targets:
        pin = device.type == "cuda" and target.type == "cpu"
        dst = torch.empty(nb // 2, bs, h, d, dtype=dtype, device=target, pin_memory=pin)
        swap_map = torch.stack([torch.randperm(nb)[:pairs], torch.randperm(nb // 2)[:pairs]], dim=1)
        s_ids, d_ids = swap_map[:, 0].to(device), swap_map[:, 1].to(target)

        def torch_swap():
            dst.index_copy_(0, d_ids, key_cache.index_select(0, s_ids).to(target))

        row(f"swap_blocks {device.type}->{target.type} {pairs} blocks", 2 * pairs * block_bytes,
            time_ms(lambda: ops.swap_blocks(key_cache, dst, swap_map), **timing), time_ms(torch_swap, **timing))

    # The host tier: whole blocks of every layer between the caches and the block-major tier, against one
    # contiguous copy of the same bytes between the same two memories (the roofline; ratio = fraction of it).
    pin = device.type == "cuda"
    host = torch.empty(nb // 2, args.num_layers, 2, bs, h, d, dtype=dtype, pin_memory=pin)
    tier_map = torch.stack([torch.randperm(nb)[:pairs], torch.randperm(nb // 2)[:pairs]], dim=1)
    load_map = tier_map.flip(1).contiguous()
    nbytes = 2 * pairs * args.num_layers * block_bytes
    flat_device = torch.empty(nbytes // itemsize, dtype=dtype, device=device)
    flat_host = torch.empty(nbytes // itemsize, dtype=dtype, pin_memory=pin)
    row(f"offload_blocks {pairs} x {args.num_layers} layers", nbytes,
        time_ms(lambda: ops.offload_blocks(keys, values, host, tier_map), **timing),
        time_ms(lambda: flat_host.copy_(flat_device, non_blocking=True), **timing))
    row(f"load_blocks {pairs} x {args.num_layers} layers", nbytes,
        time_ms(lambda: ops.load_blocks(host, keys, values, load_map), **timing),
        time_ms(lambda: flat_device.copy_(flat_host, non_blocking=True), **timing))

    print(f"\n{'reshape_and_cache, same shape':<34}{'contig ms':>10}{'cells ms':>10}{'cells/contig':>14}")
    cells = torch.randn(nb, bs, h, 2 * d, dtype=dtype, device=device)
    for tokens in (256, 4096):
        key = torch.randn(tokens, h, d, dtype=dtype, device=device)
        value = torch.randn_like(key)
        for slot_dtype in (torch.int64, torch.int32):
            slots = torch.randperm(nb * bs, device=device)[:tokens].to(slot_dtype)
            contiguous_ms = time_ms(lambda: ops.reshape_and_cache(key, value, key_cache, value_cache, slots),
                                    **timing)
            cells_ms = time_ms(lambda: ops.reshape_and_cache(key, value, cells[..., :d], cells[..., d:], slots),
                               **timing)
            name = f"T={tokens} {str(slot_dtype).removeprefix('torch.')} slots"
            print(f"{name:<34}{contiguous_ms:>10.3f}{cells_ms:>10.3f}{cells_ms / contiguous_ms:>13.2f}x")


if __name__ == "__main__":
    main()
