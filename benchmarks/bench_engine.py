"""pagedkv.engine vs transformers `generate` on the same random Llama and prompts (generated tokens/s),
and KV memory: how many sequences fit in a fixed KV budget, paged vs one contiguous max-length buffer each.

    python benchmarks/bench_engine.py [--batch 16] [--device cpu] [--threads 2] [--speculative 4]

--speculative K adds prompt-lookup speculative decoding (K drafts a step) on this workload and on one
whose prompts repeat a passage, where lookup finds drafts: acceptance rate, tokens/s and speed-up over
the same engine without speculation (median over --repeat interleaved rounds), and whether the outputs
are identical.
"""
import statistics
import argparse
import random
import tempfile
import time

import torch

import pagedkv
from pagedkv.engine import LLM, SamplingParams

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048, initializer_range=0.2)


def build_model(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).eval()
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


def engine_runner(path, prompts, max_new_tokens, device, prefix_caching, speculative=0, engine=None):
    """A function running the prompts through a warmed-up engine, with a cold prefix cache each time;
    `engine` (a list) receives the LLM."""
    spec = dict(speculative="ngram", num_speculative_tokens=speculative) if speculative else {}
    llm = LLM(path, device=device, enable_prefix_caching=prefix_caching, max_num_seqs=len(prompts), **spec)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))   # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    if engine is not None:
        engine.append(llm)

    def run():
        llm.bm.reset_prefix_cache()
        return [o.token_ids for o in llm.generate(prompts, params)]
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
        engines, times = [], [[], []]
        fns = [engine_runner(path, prompts, max_new_tokens, device, True, spec, engines) for spec in (0, k)]
        for _ in range(repeat):
            outs = []
            for fn, t in zip(fns, times):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outs.append(fn())
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t.append(time.perf_counter() - start)
        stats = engines[1].stats()
        generated = len(prompts) * max_new_tokens
        off, on = statistics.median(times[0]), statistics.median(times[1])
        same = sum(a == b for a, b in zip(*outs))
        print(f"{name:44} {stats['spec_acceptance_rate']:8.1%} {generated / off:8.0f} ({generated / min(times[0]):4.0f}) "
              f"{generated / on:8.0f} ({generated / min(times[1]):4.0f}) {off / on:8.2f}x {same:>6}/{len(prompts)}")


def best_of(repeat, fns, device):
    """Runs each fn `repeat` times, interleaved; returns (output, best seconds) per fn. The best time is
    the least disturbed by other processes on a shared machine."""
    results = [[None, float("inf")] for _ in fns]
    for _ in range(repeat):
        for r, fn in zip(results, fns):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            r[0] = fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            r[1] = min(r[1], time.perf_counter() - start)
    return results


def sequences_in_budget(budget_bytes, prompts, max_new_tokens, max_len, block_size, prefix_caching):
    """Fills a BlockManager sized to the budget with the workload's sequences (prompt + output tokens)
    until the next one does not fit; returns how many fit."""
    token_bytes = 2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * \
        (MODEL["hidden_size"] // MODEL["num_attention_heads"]) * 4
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
    args = p.parse_args()
    MODEL.update(initializer_range=args.init_range)
    MODEL.update(hidden_size=args.hidden, intermediate_size=args.hidden * 43 // 16, num_hidden_layers=args.layers)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.batch, args.system_len)
    new = args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(tmp).to(args.device)
        run_transformers(hf, prompts[:2], 2, args.device)      # warm-up
        (hf_out, hf_s), (nopc_out, nopc_s), (eng_out, eng_s) = best_of(args.repeat, [
            lambda: run_transformers(hf, prompts, new, args.device),
            engine_runner(tmp, prompts, new, args.device, prefix_caching=False),
            engine_runner(tmp, prompts, new, args.device, prefix_caching=True)], args.device)
        if args.speculative:
            speculative_rows(tmp, [(f"this workload ({args.system_len}-token system prompt)", prompts),
                                   ("prompts repeating a 64-token passage 4 times", repeated_prompts(args.batch, 64, 4))],
                             new, args.device, args.speculative, args.repeat)

    generated = args.batch * new
    print(f"\n{MODEL['num_hidden_layers']}-layer Llama, hidden {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}, "
          f"{args.device} ({torch.get_num_threads()} threads), batch {args.batch}: shared system prompt of "
          f"{args.system_len} tokens + 16-64 user tokens, {new} new tokens each, greedy, best of {args.repeat}")
    rows = [("transformers generate", hf_s, hf_out), ("pagedkv engine, prefix cache off", nopc_s, nopc_out),
            ("pagedkv engine, prefix cache on", eng_s, eng_out)]
    print(f"{'':34} {'seconds':>8} {'tok/s':>8} {'vs HF':>7} {'same tokens as HF':>18}")
    for name, secs, out in rows:
        same = sum(a == b for a, b in zip(out, hf_out))
        print(f"{name:34} {secs:8.2f} {generated / secs:8.0f} {hf_s / secs:6.2f}x {same:>12}/{args.batch}")

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

if __name__ == "__main__":
    main()
