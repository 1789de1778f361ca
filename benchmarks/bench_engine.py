"""pagedkv.engine vs transformers `generate` on the same random Llama and prompts (generated tokens/s),
and KV memory: how many sequences fit in a fixed KV budget, paged vs one contiguous max-length buffer each.

    python benchmarks/bench_engine.py [--batch 16] [--device cpu] [--threads 2] [--speculative 4]
    python benchmarks/bench_engine.py --tensor-parallel-size 2 --threads 1   # TP=1 vs TP=2, per-rank KV
    python benchmarks/bench_engine.py --contention 1 --threads 2            # quiet vs one busy process
    python benchmarks/bench_engine.py --model-type gemma2 --window 64       # a windowed model, KV held
    python benchmarks/bench_engine.py --model-type mistral --window 256 --contexts 256,1024,4096,8192

--speculative K adds prompt-lookup speculative decoding (K drafts a step) on this workload and on one
whose prompts repeat a passage, where lookup finds drafts: acceptance rate, tokens/s and speed-up over
the same engine without speculation (median over --repeat interleaved rounds), and whether the outputs
are identical.

--model-type mistral|gemma2 builds a Mistral-style (every layer windowed) or Gemma-2-style (windowed and
full layers alternating, softcaps) model of the same shape with a --window-token sliding window; every
engine row reports the KV blocks it held at its peak. --contexts runs one sequence per context length
(prompt + --max-new-tokens generated) and reports the KV it held against what full attention needs.
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import pagedkv  # noqa: E402
import torch  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.execution.model_runner import kv_cache_block_bytes  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048, initializer_range=0.2)
MODEL_TYPE = dict(name="llama", window=None)    # set by --model-type / --window


def build_model(path):
    import transformers

    name = {"llama": "Llama", "mistral": "Mistral", "gemma2": "Gemma2"}[MODEL_TYPE["name"]]
    config = dict(MODEL)
    if MODEL_TYPE["name"] != "llama":
        config.update(sliding_window=MODEL_TYPE["window"])
    if MODEL_TYPE["name"] == "gemma2":     # head_dim as Llama's; the untied LM head keeps outputs varied
        head_dim = MODEL["hidden_size"] // MODEL["num_attention_heads"]
        config.update(head_dim=head_dim, query_pre_attn_scalar=head_dim, tie_word_embeddings=False)
    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(**config)
    if MODEL_TYPE["name"] == "gemma2":
        config._attn_implementation = "eager"          # transformers' Gemma 2 has no SDPA path (softcap)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(n, system_len, seed=0):
    """n chat-style prompts: one shared system prompt + a distinct user turn of 16-64 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(system_len)]
    return [system + [rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randrange(16, 65))]
            for _ in range(n)]


@torch.inference_mode()
def run_transformers(model, prompts, max_new_tokens, device):
    """One padded batch through model.generate (left padding, greedy)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         min_new_tokens=0)
    return [row[width:].tolist() for row in out]


def engine_runner(path, prompts, max_new_tokens, device, prefix_caching, tensor_parallel_size=1, threads=None,
                  speculative=0, **llm_kwargs):
    """A function running the prompts through a warmed-up engine, with a cold prefix cache each time (its
    LLM is the function's `llm` attribute). threads: torch CPU threads while it runs (and of each
    tensor-parallel worker, fixed at its start); speculative: prompt-lookup drafts a step (0: off)."""
    if threads:
        torch.set_num_threads(threads)
    spec = dict(speculative="ngram", num_speculative_tokens=speculative) if speculative else {}
    llm = LLM(path, device=device, enable_prefix_caching=prefix_caching, max_num_seqs=len(prompts),
              tensor_parallel_size=tensor_parallel_size, **spec, **llm_kwargs)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))   # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)

    def run():
        if threads:
            torch.set_num_threads(threads)
        llm.bm.reset_prefix_cache()
        return [o.token_ids for o in llm.generate(prompts, params)]
    run.llm = llm
    return run


def repeated_prompts(n, passage_len, copies, seed=0):
    """n prompts, each a random passage of passage_len tokens repeated `copies` times."""
    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(passage_len)] * copies for _ in range(n)]


def speculative_rows(path, workloads, max_new_tokens, device, k, repeat):
    """For each (name, prompts): the engine without and with k-token prompt lookup, interleaved rounds."""
    print(f"\nprompt-lookup speculative decoding, {k} drafts a step, greedy, prefix cache on, {max_new_tokens} new "
          f"tokens each; median of {repeat} interleaved rounds (best in brackets)")
    print(f"{'workload':44} {'accepted':>9} {'tok/s off':>15} {'tok/s on':>15} {'speed-up':>9} {'identical':>10}")
    for name, prompts in workloads:
        fns = [engine_runner(path, prompts, max_new_tokens, device, True, speculative=spec) for spec in (0, k)]
        (out_off, times_off), (out_on, times_on) = timed_rounds(repeat, fns, device)
        stats = fns[1].llm.stats()
        generated = len(prompts) * max_new_tokens
        off, on = statistics.median(times_off), statistics.median(times_on)
        same = sum(a == b for a, b in zip(out_off, out_on))
        print(f"{name:44} {stats['spec_acceptance_rate']:8.1%} {generated / off:8.0f} ({generated / min(times_off):4.0f}) "
              f"{generated / on:8.0f} ({generated / min(times_on):4.0f}) {off / on:8.2f}x {same:>6}/{len(prompts)}")


def timed_rounds(repeat, fns, device):
    """Runs each fn `repeat` times, interleaved; returns (output, [seconds of each round]) per fn."""
    results = [[None, []] for _ in fns]
    for _ in range(repeat):
        for r, fn in zip(results, fns):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            r[0] = fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            r[1].append(time.perf_counter() - start)
    return results


def best_of(repeat, fns, device):
    """(output, best seconds) per fn over interleaved rounds. The best time is the least disturbed by
    other processes on a shared machine."""
    return [(out, min(times)) for out, times in timed_rounds(repeat, fns, device)]


def kv_token_bytes(tensor_parallel_size=1):
    """fp32 KV bytes of one token on one rank (KV heads split over the ranks, at least one each)."""
    kv_heads = max(1, MODEL["num_key_value_heads"] // tensor_parallel_size)
    return 2 * MODEL["num_hidden_layers"] * kv_heads * (MODEL["hidden_size"] // MODEL["num_attention_heads"]) * 4


def sequences_in_budget(budget_bytes, prompts, max_new_tokens, max_len, block_size, prefix_caching,
                        tensor_parallel_size=1):
    """Fills a BlockManager sized to the budget (per rank) with the workload's sequences (prompt + output
    tokens) until the next one does not fit; returns how many fit."""
    token_bytes = kv_token_bytes(tensor_parallel_size)
    if block_size is None:                       # contiguous: every sequence reserves max_len tokens
        return budget_bytes // (max_len * token_bytes)
    bm = pagedkv.BlockManager(budget_bytes // (block_size * token_bytes), block_size,
                              enable_prefix_caching=prefix_caching)
    rng = random.Random(1)
    for i in range(10 ** 6):
        tokens = prompts[i % len(prompts)][:-1] + [rng.randrange(MODEL["vocab_size"])] * (max_new_tokens + 1)
        if bm.can_allocate(tokens) != pagedkv.AllocStatus.OK:
            return i
        bm.allocate(i, tokens)
        bm.mark_computed(i)
    raise AssertionError("unreachable")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--kv-budget-mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="best time of this many runs each")
    p.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    p.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="also measure prompt-lookup speculative decoding with K drafts a step")
    p.add_argument("--init-range", type=float, default=MODEL["initializer_range"],
                   help="the random model's weight scale (smaller: its greedy outputs repeat more)")
    p.add_argument("--contention", type=int, default=0, metavar="N",
                   help="> 0: time the engine quiet and with N busy processes on the machine, interleaved "
                        "(--repeat rounds each), and report both medians instead")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="> 1: compare the engine at TP=1 and at this TP size (--threads per rank) instead")
    p.add_argument("--model-type", choices=["llama", "mistral", "gemma2"], default="llama")
    p.add_argument("--window", type=int, default=256, help="sliding window of mistral / gemma2, in tokens")
    p.add_argument("--contexts", default=None, metavar="N,N,...",
                   help="instead: KV held by one sequence of each context length (prompt + --max-new-tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-mib", type=int, default=16, help="--contexts: the KV pool the 8x-window sequences share")
    args = p.parse_args()
    MODEL.update(hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16, num_hidden_layers=args.layers)
    MODEL.update(initializer_range=args.init_range)
    MODEL_TYPE.update(name=args.model_type, window=args.window)
    if args.contexts:
        return kv_held_by_context(args, [int(c) for c in args.contexts.split(",")])
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.batch, args.system_len)
    if args.tensor_parallel_size > 1:
        return compare_tensor_parallel(args, prompts)
    if args.contention:
        return compare_contention(args, prompts)
    new = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(tmp).to(args.device)
        run_transformers(hf, prompts[:2], 2, args.device)      # warm-up
        engines = [engine_runner(tmp, prompts, new, args.device, prefix_caching=pc, block_size=args.block_size)
                   for pc in (False, True)]
        (hf_out, hf_s), (nopc_out, nopc_s), (eng_out, eng_s) = best_of(args.repeat, [
            lambda: run_transformers(hf, prompts, new, args.device), *engines], args.device)
        if args.speculative:
            speculative_rows(tmp, [(f"this workload ({args.system_len}-token system prompt)", prompts),
                                   ("prompts repeating a 64-token passage 4 times", repeated_prompts(args.batch, 64, 4))],
                             new, args.device, args.speculative, args.repeat)

    generated = args.batch * new
    print(f"\n{MODEL['num_hidden_layers']}-layer {model_name()}, hidden {MODEL['hidden_size']}, vocab "
          f"{MODEL['vocab_size']}, {args.device} ({torch.get_num_threads()} threads), batch {args.batch}: shared "
          f"system prompt of {args.system_len} tokens + 16-64 user tokens, {new} new tokens each, greedy, best of "
          f"{args.repeat}; KV blocks of {args.block_size} tokens held at the peak")
    rows = [("transformers generate", hf_s, hf_out, None), ("pagedkv engine, prefix cache off", nopc_s, nopc_out,
                                                            engines[0].llm),
            ("pagedkv engine, prefix cache on", eng_s, eng_out, engines[1].llm)]
    print(f"{'':34} {'seconds':>8} {'tok/s':>8} {'vs HF':>7} {'same tokens as HF':>18} {'peak KV blocks':>15} "
          f"{'MiB':>6}")
    for name, secs, out, llm in rows:
        same = sum(a == b for a, b in zip(out, hf_out))
        held = "" if llm is None else f"{llm.peak_used_blocks:15} {held_bytes(llm, llm.peak_used_blocks) / 2**20:6.1f}"
        print(f"{name:34} {secs:8.2f} {generated / secs:8.0f} {hf_s / secs:6.2f}x {same:>12}/{args.batch} {held}")
    if args.model_type != "llama":
        return          # the budget table below counts full-attention sequences

    budget = args.kv_budget_mib << 20
    longest = max(map(len, prompts)) + new
    rows = [(f"contiguous, max_len {MODEL['max_position_embeddings']} (model limit) each",
             sequences_in_budget(budget, prompts, new, MODEL["max_position_embeddings"], None, False)),
            (f"contiguous, max_len {longest} (longest sequence) each",
             sequences_in_budget(budget, prompts, new, longest, None, False)),
            ("paged, block 16", sequences_in_budget(budget, prompts, new, None, 16, False)),
            ("paged, block 16, shared prefix cached", sequences_in_budget(budget, prompts, new, None, 16, True))]
    print(f"\nsequences that fit in {args.kv_budget_mib} MiB of fp32 KV (sequence = prompt + {new} tokens, "
          f"{sum(map(len, prompts)) // len(prompts) + new} tokens on average)")
    base = rows[0][1]
    for name, count in rows:
        print(f"{name:48} {count:6} {count / base:7.2f}x")

def model_name() -> str:
    name = {"llama": "Llama", "mistral": "Mistral-style", "gemma2": "Gemma-2-style"}[MODEL_TYPE["name"]]
    return name if MODEL_TYPE["name"] == "llama" else f"{name} (window {MODEL_TYPE['window']})"


def held_bytes(llm, blocks: int) -> int:
    """KV bytes of `blocks` block ids of this engine (every cache tensor's share of a block id)."""
    return blocks * sum(k[0].nbytes + v[0].nbytes for k, v in llm.runner.kv_caches)


def kv_held_by_context(args, contexts):
    """One sequence per context length (a random prompt of context - new tokens, new generated): the KV
    blocks the engine held after its last decode step, against what full attention holds (every token's
    block, every layer). Then how many sequences of 8x the window run at once in a pool of --pool-mib."""
    new, bs = args.max_new_tokens, args.block_size
    fit_context = 8 * args.window
    MODEL.update(max_position_embeddings=max(MODEL["max_position_embeddings"], max(contexts) + 1, fit_context + 1))
    rng = random.Random(0)
    print(f"\n{MODEL['num_hidden_layers']}-layer {model_name()}, hidden {MODEL['hidden_size']}, "
          f"{MODEL['num_key_value_heads']} KV heads, fp32 KV, block {bs}: one sequence of each context length "
          f"({new} tokens generated), {args.device}")
    print(f"{'context':>8} {'blocks held':>12} {'KV MiB held':>12} {'full attention MiB':>19} {'held / full':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        for context in contexts:
            prompt = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(context - new)]
            llm = LLM(tmp, device=args.device, block_size=bs, max_num_batched_tokens=max(4096, context),
                      enable_prefix_caching=False, history_size=new + 1)
            llm.generate(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
            decoding = llm.history[-2]["used_blocks"]        # the last step before the sequence ended
            held = held_bytes(llm, decoding)
            full = -(-context // bs) * kv_cache_block_bytes(llm.model, bs, torch.float32) * \
                len(llm.runner.layer_caches) // len(llm.runner.kv_caches)    # every layer, every token
            print(f"{context:8} {decoding:12} {held / 2**20:12.2f} {full / 2**20:19.2f} {held / full:12.3f}")

        prompts = [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(fit_context - new)] for _ in range(args.batch)]
        llm = LLM(tmp, device=args.device, block_size=bs, kv_cache_bytes=args.pool_mib << 20, max_num_seqs=args.batch,
                  enable_prefix_caching=False, history_size=10 ** 6)
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        secs = time.perf_counter() - start
        assert not any(o.error for o in outs), [o.error for o in outs if o.error]
        stats = llm.stats()
        print(f"\n{args.batch} sequences of {fit_context} tokens (8x the window {args.window}; {new} generated) in "
              f"{args.pool_mib} MiB of KV ({llm.num_blocks} blocks): at most {max(h['running'] for h in llm.history)} "
              f"running at once, {stats['num_preemptions']} preemptions, {args.batch * new / secs:.0f} tok/s")


def spinners(n):
    """n processes that keep one CPU each busy (a Python loop), until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def compare_contention(args, prompts):
    """The engine (prefix cache on) with and without N busy processes beside it: rounds alternate quiet /
    loaded, so slow drifts of the machine hit both; reports the medians and their ratio."""
    new = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        run = engine_runner(tmp, prompts, new, args.device, True, threads=args.threads)
        quiet, loaded = [], []
        for _ in range(args.repeat):
            for times, busy in ((quiet, 0), (loaded, args.contention)):
                procs = spinners(busy)
                try:
                    time.sleep(0.2 if busy else 0)           # let them start spinning
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                finally:
                    for proc in procs:
                        proc.kill()
                        proc.wait()
    generated = args.batch * new
    q, l = generated / statistics.median(quiet), generated / statistics.median(loaded)
    print(f"\nengine (prefix cache on), {args.device}, {torch.get_num_threads()} torch threads, batch {args.batch}, "
          f"{new} new tokens; {args.repeat} rounds each, alternating; {os.cpu_count()} CPUs")
    print(f"{'':34} {'median tok/s':>13} {'best tok/s':>11}")
    print(f"{'quiet':34} {q:13.0f} {generated / min(quiet):11.0f}")
    print(f"{f'{args.contention} busy process(es) beside it':34} {l:13.0f} {generated / min(loaded):11.0f}")
    print(f"loaded / quiet median: {l / q:.2f}")


def compare_tensor_parallel(args, prompts):
    """The engine (prefix cache on) at TP=1 with --threads threads, at TP=1 with N times as many, and at
    TP=N with --threads per rank, side by side; then KV memory and communication per rank."""
    n, threads, new = args.tensor_parallel_size, args.threads or 1, args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        runners = [engine_runner(tmp, prompts, new, args.device, True, threads=threads),
                   engine_runner(tmp, prompts, new, args.device, True, threads=threads * n),
                   engine_runner(tmp, prompts, new, args.device, True, tensor_parallel_size=n, threads=threads)]
        tp = runners[2].llm.tp
        before = dict(tp.stats)
        results = timed_rounds(args.repeat, runners, args.device)
        comm = {k: (v - before[k]) / args.repeat for k, v in tp.stats.items()}
        engine_block_bytes = {size: kv_cache_block_bytes(r.llm.model, 16, torch.float32)
                              for size, r in ((1, runners[0]), (n, runners[2]))}
        runners[2].llm.close()

    generated = args.batch * new
    print(f"\n{MODEL['num_hidden_layers']}-layer Llama, hidden {MODEL['hidden_size']}, {MODEL['num_attention_heads']} "
          f"heads / {MODEL['num_key_value_heads']} KV heads, vocab {MODEL['vocab_size']}, {args.device}, batch "
          f"{args.batch}: shared system prompt of {args.system_len} tokens + 16-64 user tokens, {new} new tokens "
          f"each, greedy, prefix cache on; {args.repeat} interleaved rounds")
    names = [f"TP=1, {threads} thread(s)", f"TP=1, {threads * n} threads", f"TP={n}, {threads} thread(s) per rank"]
    base = statistics.median(results[0][1])
    print(f"{'':32} {'median s':>9} {'best s':>8} {'tok/s':>8} {'vs TP=1':>8} {'same tokens':>12}")
    for name, (out, times) in zip(names, results):
        med = statistics.median(times)
        same = sum(a == b for a, b in zip(out, results[0][0]))
        print(f"{name:32} {med:9.2f} {min(times):8.2f} {generated / med:8.0f} {base / med:7.2f}x "
              f"{same:>8}/{args.batch}")

    budget = args.kv_budget_mib << 20
    print(f"\nKV memory per rank ({args.kv_budget_mib} MiB of fp32 KV on each rank, paged, block 16, "
          f"shared prefix cached)")
    print(f"{'':10} {'KV bytes/token/rank':>20} {'engine block bytes/rank':>24} {'sequences that fit per rank':>28}")
    for size in (1, n):
        fit = sequences_in_budget(budget, prompts, new, None, 16, True, tensor_parallel_size=size)
        print(f"{'TP=' + str(size):10} {kv_token_bytes(size):20} {engine_block_bytes[size]:24} {fit:28}")

    steps = comm["steps"]
    print(f"\ncommunication per step at TP={n} (mean over {steps:.0f} steps of one round; "
          f"{comm['broadcasts'] - steps:.0f} step messages overflowed the buffer)")
    for what in ("broadcast", "all_reduce", "gather"):
        print(f"{what:12} {comm[what + 's'] / steps:6.1f} calls {comm[what + '_bytes'] / steps / 1024:10.1f} KiB")


if __name__ == "__main__":
    main()
