"""CPU decode of each ISA copy side by side, against a streaming read and against itself with the K/V in
cache: the copies take turns call by call in one process, each case's time is the best of --repeats calls
by thread CPU time (so that other processes' preemption on a shared machine is left out), and the
streaming read (a 256 MiB fp32 sum, timed the same way) is measured in every round too.

    python benchmarks/bench_cpu_decode.py --threads 1                       # avx2 vs avx512, fp32/bf16/fp16/fp8
    python benchmarks/bench_cpu_decode.py --isas avx2 --dtypes bfloat16 --hot
    python benchmarks/bench_cpu_decode.py --hot          # on aarch64: neon_bf16 vs sve vs neon (those the CPU has)

Per case and K/V dtype it prints, for each copy, the time, the K/V bytes per second as a share of the
streaming read, and with --hot the time of the same call with every block table pointing at the first
four blocks of the pool (the K/V stay in L2: the kernel's compute time, so `hot / time` is the share of
a call that computation alone explains). float8 caches are read with a bfloat16 query and one scale per
KV head. The last column is each copy's time over the first copy's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pagedkv.ops as ops  # noqa: E402
from pagedkv import _ops_library  # noqa: E402
from timing import thread_seconds  # noqa: E402

CASES = [(16, 2048), (4, 8192), (64, 512)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class DecodeCall:
    """One decode step of `batch` sequences of `ctx` keys over a shuffled paged cache (or, hot, over the
    pool's first four blocks)."""

    def __init__(self, batch, ctx, dtype, args, hot=False):
        Hq, Hkv, D, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
        per_seq = -(-ctx // bs)
        num_blocks = batch * per_seq
        fp8 = dtype.itemsize == 1
        shape = (num_blocks, bs, Hkv, D)
        self.key_cache = torch.randn(shape).to(dtype)
        self.value_cache = torch.randn(shape).to(dtype)
        tables = torch.randperm(num_blocks) if not hot else torch.arange(num_blocks) % 4
        self.block_tables = tables.view(batch, per_seq).int()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
        self.query = torch.randn(batch, Hq, D, dtype=torch.bfloat16 if fp8 else dtype)
        self.scales = (torch.full((Hkv,), 0.5), torch.full((Hkv,), 0.5)) if fp8 else (None, None)
        self.scale = D ** -0.5
        self.kv_bytes = 2 * self.key_cache.numel() * self.key_cache.element_size()

    def __call__(self):
        return ops.paged_attention(self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                                   self.query_start_loc, self.scale, k_scale=self.scales[0], v_scale=self.scales[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    isas = [i for i in _ops_library.cpu_attention_isas() if i not in ("baseline", "amx")]
    parser.add_argument("--isas", default=",".join(isas), help=f"copies to compare (of {_ops_library.cpu_attention_isas()})")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"K/V dtypes (of {list(DTYPES)})")
    parser.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES), help="batch x context, ...")
    parser.add_argument("--repeats", type=int, default=15, help="rounds (each copy once per round); best is kept")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hot", action="store_true", help="also time each call with its K/V in L2")
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isas = args.isas.split(",")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.threads != 1:
        print("note: thread CPU time measures the calling thread only; use --threads 1")
    print(f"CPU decode: Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size} "
          f"threads={args.threads} best of {args.repeats} rounds by thread CPU time, copies alternated; "
          f"share = K/V bytes / time / streaming read")
    data = torch.ones(64 << 20, dtype=torch.float32)
    print(f"{'case':<12}{'dtype':<10}{'isa':<8}{'read GB/s':>10}{'ms':>9}{'share':>7}"
          + (f"{'hot ms':>9}{'hot/ms':>8}" if args.hot else "") + f"{'/ ' + isas[0]:>10}")
    for batch, ctx in cases:
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            calls = {"cold": DecodeCall(batch, ctx, dtype, args)}
            if args.hot:
                calls["hot"] = DecodeCall(batch, ctx, dtype, args, hot=True)
            best = {(isa, kind): float("inf") for isa in isas for kind in calls}
            read = float("inf")
            for _ in range(args.repeats + 1):  # the first round warms up
                read = min(read, thread_seconds(data.sum))
                for isa in isas:
                    _ops_library.set_cpu_attention_isa(isa)
                    for kind, call in calls.items():
                        best[isa, kind] = min(best[isa, kind], thread_seconds(call))
            _ops_library.set_cpu_attention_isa("auto")
            bandwidth = data.numel() * 4 / read / 1e9
            kv_bytes = calls["cold"].kv_bytes
            for isa in isas:
                ms = best[isa, "cold"] * 1e3
                line = (f"{f'B{batch} L{ctx}':<12}{name:<10}{isa:<8}{bandwidth:>10.1f}{ms:>9.2f}"
                        f"{kv_bytes / (ms / 1e3) / 1e9 / bandwidth:>7.2f}")
                if args.hot:
                    hot = best[isa, "hot"] * 1e3
                    line += f"{hot:>9.2f}{hot / ms:>8.2f}"
                print(line + f"{ms / (best[isas[0], 'cold'] * 1e3):>9.2f}x", flush=True)
            del calls


if __name__ == "__main__":
    main()
