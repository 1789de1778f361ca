"""CPU prefill over a cached prefix, each ISA copy side by side, against a single-precision matrix product of
the same work: the copies take turns call by call in one process, and each time is the best of --repeats
calls by thread CPU time (so that other processes' preemption on a shared machine is left out).

    python benchmarks/bench_cpu_prefill.py                                   # avx2 vs avx512, fp32/bf16/fp16
    python benchmarks/bench_cpu_prefill.py --isas avx512 --dtypes bfloat16 --cases 2048+128,0+512

Per case (cached + new tokens, one sequence, causal) and dtype it prints, for each copy, the time, the
GFLOP/s of the attention's two products (4 * rows * visible keys * head_dim, rows = new tokens x query
heads) and each copy's time over the first copy's. The reference line is torch's fp32 matrix product
(`torch.mm`, one thread) doing the same multiply-adds as Q K^T of one KV head's rows over all keys,
repeated for the FLOP count of the case: what the BLAS reaches on this core.
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

CASES = [(2048, 128), (0, 512)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PrefillCall:
    """`new` queries of one sequence after `cached` keys, over a shuffled paged cache."""

    def __init__(self, cached, new, dtype, args):
        Hq, Hkv, D, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
        ctx = cached + new
        num_blocks = -(-ctx // bs)
        shape = (num_blocks, bs, Hkv, D)
        self.key_cache = torch.randn(shape).to(dtype)
        self.value_cache = torch.randn(shape).to(dtype)
        self.block_tables = torch.randperm(num_blocks).view(1, num_blocks).int()
        self.seq_lens = torch.tensor([ctx], dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, new], dtype=torch.int32)
        self.query = torch.randn(new, Hq, D).to(dtype)
        self.scale = D ** -0.5
        visible = sum(cached + j + 1 for j in range(new))  # keys each query sees, summed
        self.flop = 4 * Hq * D * visible

    def __call__(self):
        return ops.paged_attention(self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                                   self.query_start_loc, self.scale)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    isas = [i for i in _ops_library.cpu_attention_isas() if i not in ("baseline", "amx")]
    parser.add_argument("--isas", default=",".join(isas), help=f"copies to compare (of {_ops_library.cpu_attention_isas()})")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help=f"dtypes (of {list(DTYPES)})")
    parser.add_argument("--cases", default=",".join(f"{c}+{n}" for c, n in CASES), help="cached+new tokens, ...")
    parser.add_argument("--repeats", type=int, default=10, help="rounds (each copy once per round); best is kept")
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    isas = args.isas.split(",")
    cases = [tuple(int(x) for x in c.split("+")) for c in args.cases.split(",")]
    print(f"CPU prefill: Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size} "
          f"one thread, best of {args.repeats} rounds by thread CPU time, copies alternated")
    print(f"{'case':<16}{'dtype':<10}{'isa':<8}{'ms':>9}{'GFLOP/s':>9}{'/ ' + isas[0]:>10}")
    for cached, new in cases:
        rows = new * args.num_q_heads // args.num_kv_heads
        a, b = torch.randn(rows, args.head_dim), torch.randn(args.head_dim, cached + new)
        for name in args.dtypes.split(","):
            call = PrefillCall(cached, new, DTYPES[name], args)
            best = {isa: float("inf") for isa in isas}
            mm = float("inf")
            for _ in range(args.repeats + 1):  # the first round warms up
                mm = min(mm, thread_seconds(lambda: torch.mm(a, b)))
                for isa in isas:
                    _ops_library.set_cpu_attention_isa(isa)
                    best[isa] = min(best[isa], thread_seconds(call))
            _ops_library.set_cpu_attention_isa("auto")
            label = f"{cached}+{new}"
            for isa in isas:
                ms = best[isa] * 1e3
                print(f"{label:<16}{name:<10}{isa:<8}{ms:>9.2f}{call.flop / ms / 1e6:>9.1f}"
                      f"{ms / (best[isas[0]] * 1e3):>9.2f}x", flush=True)
            mm_flop = 2 * rows * args.head_dim * (cached + new)
            print(f"{label:<16}{name:<10}{'torch.mm':<8}{call.flop * mm / mm_flop * 1e3:>9.2f}"
                  f"{mm_flop / mm / 1e9:>9.1f}   (fp32 GEMM of the same multiply-adds)", flush=True)
            del call


if __name__ == "__main__":
    main()
