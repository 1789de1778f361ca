"""KV quantisation rules side by side on a real model (SmolLM2-135M-Instruct, fp32 weights): which way of
storing K and V in 8 or 4 bits keeps the model's predictions, against an fp32 KV cache.

Every rule is simulated (fake quantisation): the engine keeps its fp32 cache, and each attention layer
reads its history through the rule (quantise, dequantise, in torch) in a dense attention of its own, so a
rule needs no kernel. A rule names, for K and V apart: the element format (e4m3, int8, int4, e2m1, bf16),
the scale (per KV head set by the first prefill with 2x headroom as the engine's dynamic rule, per head
and channel, per token and head, per group of 32 along head_dim), the scale's own storage (fp16 or a
power of two, e8m0), a per-head Hadamard rotation (q and k rotated alike after rope: q.k unchanged),
subtracting the first prefill's per-channel key mean (softmax ignores a constant per query), the first
tokens kept in bf16 (sinks), and the most recent R tokens of each query kept in bf16 (a bf16 window).

Measured as benchmarks/bench_kv_accuracy.py measures the cache dtypes: teacher forcing over the Apache-2.0
license text (2215 tokens, chunked prefill of 512) and, without --text-only, over the chats' prompts +
fp32 answers, plus greedy chats (identical answers, mean agreeing prefix). Bytes per token are K and V
together per element against bf16's 2, with scale metadata; a window's bytes are at the text's length.

    python benchmarks/kv_quant_study.py [--text-only] [--only SUBSTRING] [--chats 32] [--max-tokens 64]
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_kv_accuracy import kl_and_top1  # noqa: E402

from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, conversations, license_text, smollm2_path  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.checkpoints.loader import open_checkpoint  # noqa: E402
from pagedkv.engine.models.layers import Attention  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FORMAT_MAX = {"e4m3": 448.0, "int8": 127.0, "int4": 7.0, "e2m1": 6.0}
FORMAT_BITS = {"fp32": 32, "bf16": 16, "e4m3": 8, "int8": 8, "int4": 4, "e2m1": 4}
SCALE_BYTES = {"fp16": 2, "e8m0": 1}


@dataclass(frozen=True)
class Format:
    """How one of K and V is stored."""
    fmt: str = "fp32"
    scale: str = "head"        # head | channel (static, first prefill) | token | group32 | group64
    scale_fmt: str = "fp16"    # storage of per-token / per-group scales
    rotate: bool = False
    smooth: bool = False       # subtract the first prefill's per-channel mean
    headroom: float = 2.0      # static scales only

    def bytes_per_element(self, head_dim: int) -> float:
        b = FORMAT_BITS[self.fmt] / 8
        if self.scale == "token" and self.fmt not in ("fp32", "bf16"):
            b += SCALE_BYTES[self.scale_fmt] / head_dim
        elif self.scale.startswith("group"):
            b += SCALE_BYTES[self.scale_fmt] / int(self.scale[5:])
        return b


@dataclass(frozen=True)
class Rule:
    name: str
    k: Format
    v: Format
    sinks: int = 0     # first tokens kept in bf16
    window: int = 0    # each query's most recent `window` keys and values in bf16

    def bytes_vs_bf16(self, head_dim: int, tokens: int) -> float:
        quantised = max(tokens - self.sinks - self.window, 0)
        per_elem = (self.k.bytes_per_element(head_dim) + self.v.bytes_per_element(head_dim)) / 2
        return (quantised * per_elem + (tokens - quantised) * 2) / (tokens * 2)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n ** 0.5


def round_scale(scale: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "e8m0":   # a power of two at or above the scale: no saturation
        return torch.exp2(torch.ceil(torch.log2(scale)))
    return scale.to(torch.float16).float()


def to_grid(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """y already divided by its scale; rounds to the format's values (saturating)."""
    m = FORMAT_MAX[fmt]
    if fmt == "e4m3":
        return y.clamp(-m, m).to(torch.float8_e4m3fn).float()
    if fmt in ("int8", "int4"):
        return y.round().clamp(-m, m)
    grid = E2M1.to(y.device)
    mid = (grid[1:] + grid[:-1]) / 2
    return grid[torch.bucketize(y.abs().clamp(max=m), mid)] * y.sign()


class StoredFormat:
    """One layer's K (or V) storage: static state set from the first step's tensor, then the stored value
    (dequantised, back in the model's basis) of any [S, Hkv, D] tensor."""

    def __init__(self, f: Format):
        self.f, self.mean, self.static = f, None, None

    def observe(self, x: torch.Tensor) -> None:
        if self.mean is not None:
            return
        f = self.f
        self.mean = x.mean(0, keepdim=True) if f.smooth else torch.zeros_like(x[:1])
        y = self.basis(x)
        if f.scale == "head":
            self.static = y.abs().amax(dim=(0, 2), keepdim=True).clamp_min(1e-4)
        elif f.scale == "channel":
            self.static = y.abs().amax(dim=0, keepdim=True).clamp_min(1e-4)
        if self.static is not None and f.fmt in FORMAT_MAX:
            self.static = self.static * f.headroom / FORMAT_MAX[f.fmt]

    def basis(self, x: torch.Tensor) -> torch.Tensor:
        x = x - self.mean
        return x @ hadamard(x.shape[-1]).to(x) if self.f.rotate else x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        f = self.f
        if f.fmt == "fp32":
            return x
        y = self.basis(x)
        if f.fmt == "bf16":
            y = y.to(torch.bfloat16).float()
        else:
            if f.scale in ("head", "channel"):
                scale = self.static
            else:
                g = y.shape[-1] if f.scale == "token" else int(f.scale[5:])
                yg = y.unflatten(-1, (-1, g))
                scale = round_scale(yg.abs().amax(-1, keepdim=True).clamp_min(1e-8) / FORMAT_MAX[f.fmt],
                                    f.scale_fmt)
                y = (to_grid(yg / scale, f.fmt) * scale).flatten(-2)
                scale = None
            if scale is not None:
                y = to_grid(y / scale, f.fmt) * scale
        if f.rotate:
            y = y @ hadamard(y.shape[-1]).to(y).T
        return y + self.mean


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


class StudyAttention:
    """Replaces Attention.forward while active: K/V written to the fp32 cache as computed; attention per
    sequence over the history as the rule stores it (bf16 sinks and window taken from the exact values)."""

    def __init__(self, rule: Rule):
        self.rule = rule

    def __enter__(self):
        rule = self.rule
        original = Attention.forward
        self.original = original

        def forward(attn, positions, x, rope, kv_cache, meta):
            group = meta.groups[attn.kv_group]
            qk, v = attn.project(positions, x, rope)
            q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)
            key_cache, value_cache = kv_cache
            if not hasattr(attn, "study"):
                attn.study = (StoredFormat(rule.k), StoredFormat(rule.v))
                attn.study[0].observe(k.float())
                attn.study[1].observe(v.float())
            torch.ops.pagedkv.reshape_and_cache(k, v, key_cache, value_cache, group.slot_mapping)
            out = torch.empty_like(q)
            starts = meta.query_start_loc.tolist()
            for b, seq_len in enumerate(meta.seq_lens.tolist()):
                blocks = group.block_tables[b, :(seq_len + key_cache.shape[1] - 1) // key_cache.shape[1]]
                kh = key_cache[blocks.long()].flatten(0, 1)[:seq_len].float()
                vh = value_cache[blocks.long()].flatten(0, 1)[:seq_len].float()
                out[starts[b]:starts[b + 1]] = attend(attn, rule, q[starts[b]:starts[b + 1]].float(), kh, vh)
            out = attn.o_proj.forward(out.reshape(-1, attn.q_size))
            return out if attn.tp is None else attn.tp.all_reduce(out)

        Attention.forward = forward
        return self

    def __exit__(self, *exc):
        Attention.forward = self.original


def attend(attn, rule: Rule, q, kh, vh):
    """q [L, Hq, D] (the last L positions of the S-long history kh, vh [S, Hkv, D]) -> [L, Hq, D]."""
    fk, fv = attn.study
    L, S = q.shape[0], kh.shape[0]
    hkv, d = kh.shape[1], kh.shape[2]
    g = attn.num_heads // hkv
    kq, vq = fk(kh), fv(vh)
    if rule.sinks:
        kq[:rule.sinks], vq[:rule.sinks] = bf16(kh[:rule.sinks]), bf16(vh[:rule.sinks])
    qg = q.view(L, hkv, g, d).permute(1, 2, 0, 3)            # [Hkv, G, L, D]
    scores = torch.einsum("hgld,shd->hgls", qg, kq) * attn.scale
    qpos = torch.arange(S - L, S)[:, None]
    kpos = torch.arange(S)[None, :]
    if rule.window:
        near = (qpos - kpos < rule.window) & (kpos >= rule.sinks)
        exact = torch.einsum("hgld,shd->hgls", qg, bf16(kh)) * attn.scale
        scores = torch.where(near, exact, scores)
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if rule.window:
        out = torch.einsum("hgls,shd->hgld", p * ~near, vq) + torch.einsum("hgls,shd->hgld", p * near, bf16(vh))
    else:
        out = torch.einsum("hgls,shd->hgld", p, vq)
    return out.permute(2, 0, 1, 3).reshape(L, attn.num_heads, d).to(q.dtype)


E4 = Format("e4m3")
R4 = Format("e4m3", rotate=True)
I8T = Format("int8", scale="token", rotate=True)
BF = Format("bf16")
RULES = [
    Rule("fp32 K and V (reference; the study's own attention)", Format(), Format()),
    Rule("bf16 K and V", BF, BF),
    Rule("(a) e4m3, per-head dynamic scale (old default)", E4, E4),
    Rule("(b) e4m3, Hadamard-rotated K and V", R4, R4),
    Rule("(c) (b) + first 4 tokens bf16", R4, R4, sinks=4),
    Rule("(d) (b) + bf16 window of 32", R4, R4, window=32),
    Rule("(d) (b) + bf16 window of 64", R4, R4, window=64),
    Rule("(d) (b) + bf16 window of 128", R4, R4, window=128),
    Rule("(d) (c) + bf16 window of 128", R4, R4, sinks=4, window=128),
    Rule("(d) (b) + bf16 window of 256", R4, R4, window=256),
    Rule("(d) (b) + bf16 window of 512", R4, R4, window=512),
    Rule("(d) (b) + first 16 tokens and window of 32 bf16", R4, R4, sinks=16, window=32),
    Rule("(d) (b) + first 16 tokens and window of 64 bf16", R4, R4, sinks=16, window=64),
    Rule("(d) (b) + first 16 tokens and window of 128 bf16", R4, R4, sinks=16, window=128),
    Rule("(c) (b) + first 16 tokens bf16", R4, R4, sinks=16),
    Rule("(e) K int8 rotated, per-token fp16 scale; V (b)", I8T, R4),
    Rule("(e) K int8 rotated, per-token e8m0 scale; V (b)", replace(I8T, scale_fmt="e8m0"), R4),
    Rule("(e) K int8 rotated, per-head static scale; V (b)", Format("int8", rotate=True), R4),
    Rule("(e) K int8 unrotated, per-token fp16 scale; V (b)", replace(I8T, rotate=False), R4),
    Rule("(f) K e4m3 rotated, per-channel scale; V (b)", Format("e4m3", scale="channel", rotate=True), R4),
    Rule("(g) K e4m3 smoothed + rotated; V (b)", replace(R4, smooth=True), R4),
    Rule("(h) K int8 smoothed + rotated, per-token; V (b)", replace(I8T, smooth=True), R4),
    Rule("(h) K and V int8 rotated, per-token fp16 scale", I8T, I8T),
    Rule("(h) K int8 rotated per-token; V (b); first 4 tokens bf16", I8T, R4, sinks=4),
    Rule("(h) K and V int8 rotated per-token; bf16 window of 32", I8T, I8T, window=32),
    Rule("K bf16; V (b)", BF, R4),
    Rule("K fp32; V (b)", Format(), R4),
    Rule("4-bit: K and V int4 rotated, group 32 fp16 scale", Format("int4", "group32", rotate=True),
         Format("int4", "group32", rotate=True)),
    Rule("4-bit: K and V e2m1 rotated, group 32 fp16 scale", Format("e2m1", "group32", rotate=True),
         Format("e2m1", "group32", rotate=True)),
    Rule("4-bit: K int4 per-channel static; V int4 group 32", Format("int4", "channel", rotate=False),
         Format("int4", "group32", rotate=True)),
    Rule("4-bit: K int4 rotated g32, V int4 g64; 4 sinks + window 128 bf16",
         Format("int4", "group32", rotate=True), Format("int4", "group64", rotate=True), sinks=4, window=128),
    Rule("4-bit: K int8 rotated per-token; V int4 rotated group 32", I8T, Format("int4", "group32", rotate=True)),
]


def run_rule(model, rule, text_ids, convs, args, reference):
    with StudyAttention(rule):
        llm = LLM(model)
        result = {}
        if convs:
            outs = llm.chat(convs, SamplingParams(max_tokens=args.max_tokens))
            result["answers"] = [o.token_ids for o in outs]
            result["prompts"] = [o.prompt_token_ids for o in outs]
        result["text"] = llm.prompt_logits(text_ids, chunk_size=args.chunk_size)
        if convs:
            ref = result if reference is None else reference
            result["chats"] = [llm.prompt_logits(p + a, chunk_size=args.chunk_size)[len(p) - 1:-1]
                               for p, a in zip(ref["prompts"], ref["answers"])]
    return result, llm.model_config.head_dim


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--num-system-prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--text-only", action="store_true", help="teacher forcing over the text only")
    p.add_argument("--only", default=None, help="run only the rules whose name contains this (| separates)")
    args = p.parse_args()
    model = smollm2_path()
    if model is None:
        print(f"needs the real model: {SMOLLM2_INSTALL}")
        return 0
    import platform
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    text_ids = open_checkpoint(model).tokenizer().encode(license_text()).ids
    convs = None if args.text_only else conversations(args.chats, args.num_system_prompts)
    header = "| rule | bytes vs bf16 | text top-1 | text KL/token |"
    if convs:
        header += " chats top-1 | chats KL/token | chats identical | mean agreeing prefix |"
    print(header + "\n" + "|---" * (header.count("|") - 1) + "|", flush=True)
    reference = None
    for rule in RULES:
        if reference is not None and args.only and not any(s in rule.name for s in args.only.split("|")):
            continue
        start = time.perf_counter()
        result, head_dim = run_rule(model, rule, text_ids, convs, args, reference)
        if reference is None:
            reference = result
        kl, top1, n = kl_and_top1(reference["text"], result["text"])
        row = f"| {rule.name} | {rule.bytes_vs_bf16(head_dim, len(text_ids)):.3f}x | {top1 / n:.2%} | {kl / n:.1e} |"
        if convs:
            ckl = ctop1 = cn = 0
            for ref, got in zip(reference["chats"], result["chats"]):
                a, b, c = kl_and_top1(ref, got)
                ckl, ctop1, cn = ckl + a, ctop1 + b, cn + c
            same = sum(r == g for r, g in zip(reference["answers"], result["answers"]))
            prefix = sum(next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
                         for r, g in zip(reference["answers"], result["answers"])) / len(convs)
            row += f" {ctop1 / cn:.2%} | {ckl / cn:.1e} | {same}/{len(convs)} | {prefix:.1f} |"
        print(row + f"  <!-- {time.perf_counter() - start:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
