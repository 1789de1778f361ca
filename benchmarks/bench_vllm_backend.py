"""pagedkv's vLLM attention backend (pagedkv.integrations.vllm) against vLLM's own CPU attention, inside vLLM.

  (1) end to end: vLLM's `LLM.generate` on bench_engine's workload (its random 4-layer Llama, 16 prompts
      sharing a 256-token system prompt, 64 greedy new tokens each, prefix caching on, fp32, eager), with
      PAGEDKV_VLLM_ATTENTION=1 and without, each run in its own process (the plugin is chosen per
      process), the two settings alternating for --rounds rounds. Each process warms up, then times
      --repeats generations with a cold prefix cache and reports its median tokens/s; the ratio is
      pagedkv / vLLM of the per-round medians (min / median over rounds). Both must produce the same tokens.
  (2) the attention op alone, in vLLM's layout at vLLM's block sizes: the backend's `forward` (pagedkv's
      `paged_attention` on K/V views of one layer's vLLM KV tensor, the layout vLLM resolves for it)
      against `torch.ops._C.cpu_attention_with_kv_cache` on vLLM's own cache (bench_vs_vllm.py's cases and
      call), fp32 and bf16, both written by their own write ops from the same K/V and checked against
      each other before timing. Ratio = vLLM time / backend time (> 1: the backend is faster). The last
      column times pagedkv's paged_attention alone on two contiguous caches (its own layout).

Needs vLLM and pagedkv in one environment (scripts/setup_vllm_venv.sh); without vLLM it says so and exits 0.

    VLLM_VENV/bin/python benchmarks/bench_vllm_backend.py [--rounds 5] [--only e2e|attention] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ENV = "PAGEDKV_VLLM_ATTENTION"  # pagedkv.integrations.vllm.ENV (not imported: vLLM may be missing)
VLLM_BLOCK_SIZES = (32, 128)    # vLLM's CPU attention takes multiples of 32; 128 is its CPU default


# --------------------------------------------------------------------------------------------------
# End to end

def child(args) -> None:
    """One process: a warmed-up vLLM engine timed on the workload; prints JSON on its last line."""
    from bench_engine import make_prompts
    from bench_engine_vs_vllm import vllm_runner

    prompts = make_prompts(args.batch, args.system_len)
    run = vllm_runner(args.child_model, prompts, args.max_new_tokens, args.block_size)
    tokens = run()
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        rates.append(args.batch * args.max_new_tokens / (time.perf_counter() - start))
    print(json.dumps({"tok_s": statistics.median(rates), "tokens": tokens}))


def run_e2e(args) -> None:
    from bench_engine import build_model

    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        rates: dict[str, list[float]] = {"pagedkv": [], "vLLM": []}
        tokens = {}
        for _ in range(args.rounds):
            for name, flag in (("pagedkv", "1"), ("vLLM", "0")):
                cmd = [sys.executable, os.path.abspath(__file__), "--child-model", tmp, "--repeats", str(args.repeats),
                       "--batch", str(args.batch), "--system-len", str(args.system_len),
                       "--max-new-tokens", str(args.max_new_tokens), "--block-size", str(args.block_size)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, ENV: flag})
                if proc.returncode != 0:
                    raise RuntimeError(f"vLLM ({name}) failed:\n{proc.stderr[-4000:]}")
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                rates[name].append(result["tok_s"])
                tokens[name] = result["tokens"]
    ratios = [p / v for p, v in zip(rates["pagedkv"], rates["vLLM"])]
    same = sum(a == b for a, b in zip(tokens["pagedkv"], tokens["vLLM"]))
    print(f"\n## End to end: vLLM {_vllm_version()} LLM.generate, bench_engine's workload (batch {args.batch}, "
          f"system prompt {args.system_len}, {args.max_new_tokens} new tokens, fp32, prefix caching, block "
          f"{args.block_size}); {args.rounds} alternating rounds, median of {args.repeats} runs each; "
          f"{os.cpu_count()} CPUs; same tokens: {same}/{args.batch}\n")
    print("| attention | tok/s median | tok/s best |\n|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.0f} | {max(r):.0f} |")
    print(f"\npagedkv / vLLM tok/s: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x")


def _vllm_version() -> str:
    import vllm
    return vllm.__version__


# --------------------------------------------------------------------------------------------------
# Attention op

def backend_attention(impl, case, block_size, generator):
    """The backend's forward on one layer's vLLM KV tensor [num_blocks, Hkv, block_size, 2 D] with the
    strides of the layout vLLM resolves for it (each token's heads adjacent, K|V in each cell)."""
    from bench_vs_vllm import HEAD_DIM, NUM_KV_HEADS, shuffled_pool

    import pagedkv.integrations.vllm as pagedkv_vllm

    num_blocks, tables, slots = shuffled_pool(case.batch, case.ctx, block_size, generator)
    kv = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, 2 * HEAD_DIM, dtype=case.dtype).transpose(1, 2)
    layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    impl.do_kv_cache_update(layer, case.key, case.value, kv, slots)
    metadata = pagedkv_vllm.PagedKVAttentionMetadata(
        num_actual_tokens=len(case.query), max_seq_len=case.ctx, query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens, block_table=tables, slot_mapping=slots)
    output = torch.empty_like(case.query)

    def step():
        return impl.forward(layer, case.query, None, None, kv, metadata, output)
    return step


def run_attention(args) -> None:
    from bench_vs_vllm import (AGREEMENT_TOLERANCE, ATTENTION_CASES, DTYPES, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS,
                               AttentionCase, pagedkv_attention, vllm_attention)
    from timing import time_ms

    from vllm.config import VllmConfig, set_current_vllm_config

    import pagedkv.integrations.vllm as pagedkv_vllm

    cpu = torch.device("cpu")
    torch.set_num_threads(args.threads)
    with set_current_vllm_config(VllmConfig()):
        impl = pagedkv_vllm.PagedKVAttentionImpl(NUM_Q_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, NUM_KV_HEADS)
    print(f"\n## Attention op in vLLM's layout (Hq {NUM_Q_HEADS} / Hkv {NUM_KV_HEADS} / D {HEAD_DIM}, "
          f"{args.threads} threads; {args.rounds} rounds, median of {args.repeats} calls each)\n")
    print("| case | dtype | block | backend ms | vLLM ms (isa) | vLLM / backend min / med | paged_attention on "
          "contiguous caches ms |")
    print("|---|---|---|---|---|---|---|")
    for dtype_name, dtype in DTYPES.items():
        for seed, (label, batch, ctx, q_len) in enumerate(ATTENTION_CASES):
            for block_size in VLLM_BLOCK_SIZES:
                case = AttentionCase(batch, ctx, q_len, dtype, seed)
                generator = torch.Generator().manual_seed(seed)
                ours = backend_attention(impl, case, block_size, generator)
                theirs = vllm_attention(case, block_size)
                kernel = pagedkv_attention(case, block_size, generator)   # its own layout, same block size
                tol = AGREEMENT_TOLERANCE[dtype]
                for name, step in (("vLLM", theirs), ("contiguous", kernel)):
                    torch.testing.assert_close(ours().float(), step().float(), atol=tol, rtol=tol,
                                               msg=lambda m: f"{label} {dtype_name} block {block_size} {name}: {m}")
                del case.key, case.value
                times: tuple[list[float], list[float], list[float]] = ([], [], [])
                for _ in range(args.rounds):
                    for t, step in zip(times, (ours, theirs, kernel)):
                        t.append(time_ms(step, cpu, 1, args.repeats))
                ratios = [v / p for p, v in zip(times[0], times[1])]
                print(f"| {label} | {dtype_name} | {block_size} | {statistics.median(times[0]):.2f} | "
                      f"{statistics.median(times[1]):.2f} ({theirs.isa}) | {min(ratios):.2f}x / "
                      f"{statistics.median(ratios):.2f}x | {statistics.median(times[2]):.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per process / calls per round (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the attention op, both the same")
    p.add_argument("--only", choices=["e2e", "attention"])
    p.add_argument("--quick", action="store_true", help="2 rounds, a smaller workload (a smoke run)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's block size end to end")
    p.add_argument("--child-model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_model:
        return child(args)
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means: no vLLM here
        print(f"bench_vllm_backend: vLLM is not importable here ({type(e).__name__}: {e}); run it with the "
              "venv scripts/setup_vllm_venv.sh creates. Skipped.")
        return
    if args.quick:
        args.rounds, args.batch, args.max_new_tokens = 2, 8, 16
    print(f"bench_vllm_backend: a shared machine ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}); "
          "contenders alternate, so drifts hit both alike")
    if args.only in (None, "attention"):
        run_attention(args)
    if args.only in (None, "e2e"):
        run_e2e(args)


if __name__ == "__main__":
    main()
