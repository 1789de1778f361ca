"""float8 KV cache: model accuracy, memory and speed against 16/32-bit KV.

Accuracy: prompts are teacher-forced through the engine's model with each KV format: the prompt as the
first prefill (it sets dynamic scales), then the 64 tokens the fp32-KV engine generated greedily, in one
chunk over the cached prompt. Reported per format: the mean KL divergence of the next-token
distributions from fp32 KV's, and the greedy agreement (how often the argmax equals fp32 KV's) over those
64 positions. Models: the random Llama of the engine tests, bench_engine's, and bench_engine's with a
wide K range (each KV head's k_proj rows scaled by a different factor, 1x to 64x), where per-head
scales matter. bf16 KV rounds K (after RoPE) and V to bfloat16 in an fp32 model, so only the KV
precision differs.

Memory: sequences of bench_engine's workload that fit in a fixed KV budget per format.

Speed: CPU decode attention B=16, L=2048, 32/8 heads, D=128, bf16 query over bf16 / e4m3 / e5m2
caches side by side in one process (interleaved rounds, medians, spread); engine tokens/s with
fp8 vs bf16 KV (bf16 model) on bench_engine's workload.

    python benchmarks/bench_fp8.py [--skip-accuracy] [--skip-speed] [--rounds 15]
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import pagedkv  # noqa: E402,F401  (before torch: the OpenMP wait policy)
import torch  # noqa: E402

import bench_engine  # noqa: E402
from pagedkv import ops  # noqa: E402
from pagedkv.engine import LLM, SamplingParams  # noqa: E402
from pagedkv.engine.models.layers import AttentionMetadata, KVGroupInputs  # noqa: E402

NEW_TOKENS = 64
KV_FORMATS = [  # (label, kv_cache_dtype, kv_scale, round K/V to bf16)
    ("bf16", "auto", "dynamic", True),
    ("e4m3, scale 1", "fp8_e4m3", 1.0, False),
    ("e4m3, dynamic per tensor", "fp8_e4m3", "dynamic_tensor", False),
    ("e4m3, dynamic per head", "fp8_e4m3", "dynamic", False),
    ("e5m2, scale 1", "fp8_e5m2", 1.0, False),
    ("e5m2, dynamic per head", "fp8_e5m2", "dynamic", False),
]


def save_llama(path, config, seed=0, k_proj_head_factors=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    if k_proj_head_factors is not None:
        d = config["hidden_size"] // config["num_attention_heads"]
        with torch.no_grad():
            for layer in model.model.layers:
                for h, f in enumerate(k_proj_head_factors):
                    layer.self_attn.k_proj.weight[h * d:(h + 1) * d] *= f
    model.save_pretrained(path, safe_serialization=True)


def round_kv_to_bf16(model):
    """K (after RoPE) and V rounded to bfloat16 before they are cached: bf16 KV in an fp32 model."""
    attn = model.model.layers[0].self_attn
    num_heads, q_size, kv_size = attn.num_heads, attn.q_size, attn.kv_size
    rope = model.model.rotary_emb
    rope_forward = rope.forward

    def rope_then_round(positions, qk):
        rope_forward(positions, qk)
        qk[:, num_heads:] = qk[:, num_heads:].bfloat16().float()
    rope.forward = rope_then_round
    for layer in model.model.layers:
        proj = layer.self_attn.qkv_proj
        proj_forward = proj.forward

        def project_then_round(x, proj_forward=proj_forward):
            y = proj_forward(x)
            y[:, q_size + kv_size:] = y[:, q_size + kv_size:].bfloat16().float()
            return y
        proj.forward = project_then_round


@torch.inference_mode()
def teacher_forced_logits(llm, prompt, continuation):
    """[len(continuation), vocab] float32 next-token logits after prompt + continuation[:i]."""
    model, caches, bs = llm.model, llm.runner.kv_caches, llm.config.block_size
    total = len(prompt) + len(continuation)
    table = torch.arange(-(-total // bs), dtype=torch.int32).view(1, -1)
    out = None
    for start, tokens in ((0, prompt), (len(prompt), continuation[:-1])):
        end = start + len(tokens)
        meta = AttentionMetadata(seq_lens=torch.tensor([end], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, len(tokens)], dtype=torch.int32),
                                 max_seq_len=end, groups=[KVGroupInputs(torch.arange(start, end), table)],
                                 logits_indices=torch.arange(len(tokens)))
        hidden = model(torch.tensor(tokens), torch.arange(start, end), caches, meta)
        logits = model.compute_logits(hidden)
        out = logits[-1:] if out is None else torch.cat([out, logits])
    return out


def accuracy(path, prompts, label):
    ref_llm = LLM(path, block_size=16, num_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    ref = [teacher_forced_logits(ref_llm, p, c).log_softmax(-1) for p, c in zip(prompts, continuations)]
    rows = []
    for name, kv_dtype, kv_scale, bf16 in KV_FORMATS:
        kls, agree = [], []
        for p, c, r in zip(prompts, continuations, ref):
            llm = LLM(path, block_size=16, num_blocks=64, enable_prefix_caching=False, kv_cache_dtype=kv_dtype,
                      kv_scale=kv_scale)      # fresh per prompt: dynamic scales from its own first prefill
            if bf16:
                round_kv_to_bf16(llm.model)
            lp = teacher_forced_logits(llm, p, c).log_softmax(-1)
            kls.append(torch.sum(r.exp() * (r - lp), dim=-1).mean().item())
            agree.append((lp.argmax(-1) == r.argmax(-1)).float().mean().item())
        rows.append((name, statistics.mean(kls), statistics.mean(agree)))
    print(f"\n{label}: {len(prompts)} prompts, {NEW_TOKENS} teacher-forced tokens each, against fp32 KV")
    print(f"| KV cache | mean KL (nats) | greedy agreement |\n|---|---|---|")
    for name, kl, ag in rows:
        print(f"| {name} | {kl:.2e} | {ag * 100:.1f}% |")
    return {name: kl for name, kl, _ in rows}


def k_ranges(path, prompt):
    """Max |K| per KV head of layer 0 over the prompt (how wide the K ranges are)."""
    llm = LLM(path, block_size=16, num_blocks=64, kv_cache_dtype="fp8_e4m3")
    teacher_forced_logits(llm, prompt, prompt[:2])
    s = llm.runner.kv_scales[0].k_scale
    return [round(x, 1) for x in (s * 448 / 2).tolist()]


def memory_table(budget_mb=64):
    prompts = bench_engine.make_prompts(64, 200)
    budget = budget_mb << 20
    print(f"\nSequences of bench_engine's workload (200-token system prompt + 16-64 user tokens + 128 generated) "
          f"in a {budget_mb} MiB KV budget, block size 16, bench_engine's model")
    print("| KV cache | bytes/token | sequences (no prefix caching) | sequences (prefix caching) |\n|---|---|---|---|")
    base = None
    for name, elem in (("fp32", 4), ("bf16", 2), ("fp8 (e4m3 / e5m2)", 1)):
        fp32_equivalent = budget * 4 // elem    # sequences_in_budget counts fp32 bytes per token
        n = [bench_engine.sequences_in_budget(fp32_equivalent, prompts, 128, None, 16, pc) for pc in (False, True)]
        base = base or n[0]
        print(f"| {name} | {bench_engine.kv_token_bytes() * elem // 4} | {n[0]} ({n[0] / base:.1f}x) | {n[1]} |")


def decode_speed(rounds):
    torch.manual_seed(0)
    B, L, Hq, Hkv, D, bs = 16, 2048, 32, 8, 128, 16
    nb = B * L // bs
    bt = torch.randperm(nb, dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), L, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    q = torch.randn(B, Hq, D).bfloat16()
    k, v = torch.randn(nb, bs, Hkv, D), torch.randn(nb, bs, Hkv, D)
    scale = torch.full((Hkv,), 0.02)
    caches = {"bf16": (k.bfloat16(), v.bfloat16(), None)}
    for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        caches[name] = ((k / 0.02).to(dt), (v / 0.02).to(dt), scale)
    fns = {n: (lambda kc=kc, vc=vc, s=s: ops.paged_attention(q, kc, vc, bt, sl, qsl, D ** -0.5, k_scale=s, v_scale=s))
           for n, (kc, vc, s) in caches.items()}
    times = {n: [] for n in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[n].append((time.perf_counter() - t0) * 1e3)
    print(f"\nCPU decode attention, B={B} L={L} {Hq}/{Hkv} heads D={D}, bf16 query, {torch.get_num_threads()} threads, "
          f"ISA {ops_isa()}, {rounds} interleaved rounds")
    print("| KV cache | median ms | min-max ms | KV GB/s | bf16 time / this |\n|---|---|---|---|---|")
    med = {n: statistics.median(t) for n, t in times.items()}
    for n, t in times.items():
        kv_bytes = caches[n][0].numel() * caches[n][0].element_size() * 2
        print(f"| {n} | {med[n]:.1f} | {min(t):.1f}-{max(t):.1f} | {kv_bytes / med[n] / 1e6:.1f} | "
              f"{med['bf16'] / med[n]:.2f}x |")


def ops_isa():
    from pagedkv import _ops_library
    return _ops_library.cpu_attention_isa()


def engine_speed(rounds, num_prompts=16, new_tokens=64):
    path = tempfile.mkdtemp(prefix="bench_fp8_")
    bench_engine.build_model(path)
    prompts = bench_engine.make_prompts(num_prompts, 200)
    runners = {}
    for name, kv in (("bf16 KV", "auto"), ("e4m3 KV", "fp8_e4m3")):
        llm = LLM(path, dtype="bfloat16", max_num_seqs=num_prompts, enable_prefix_caching=False, kv_cache_dtype=kv)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        runners[name] = (lambda llm=llm, params=params: llm.generate(prompts, params, use_tqdm=False))
    results = bench_engine.timed_rounds(rounds, list(runners.values()), "cpu")
    tokens = num_prompts * new_tokens
    print(f"\nEngine, bench_engine's model in bf16, {num_prompts} prompts x {new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, {rounds} interleaved rounds")
    print("| KV cache | median tok/s | min-max tok/s |\n|---|---|---|")
    for name, (_, secs) in zip(runners, results):
        print(f"| {name} | {tokens / statistics.median(secs):.0f} | {tokens / max(secs):.0f}-{tokens / min(secs):.0f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    if not args.skip_accuracy:
        from engine_fixtures import TINY
        rng = random.Random(0)
        work = tempfile.mkdtemp(prefix="bench_fp8_")
        kv_heads = bench_engine.MODEL["num_key_value_heads"]
        models = [("engine tests' random Llama", TINY, None),
                  ("bench_engine's Llama", bench_engine.MODEL, None),
                  ("bench_engine's Llama, k_proj scaled per KV head", bench_engine.MODEL,
                   [4.0 ** h for h in range(kv_heads)])]
        for i, (label, config, factors) in enumerate(models):
            path = os.path.join(work, str(i))
            save_llama(path, config, k_proj_head_factors=factors)
            vocab = config["vocab_size"]
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 64))] for _ in range(args.prompts)]
            kl = accuracy(path, prompts, f"{label} (max |K| per KV head, layer 0: {k_ranges(path, prompts[0])})")
            if factors is not None:
                head = kl["e4m3, dynamic per head"]
                print(f"per-head dynamic e4m3 KL / e4m3 scale 1: {head / kl['e4m3, scale 1']:.3f}, "
                      f"/ e5m2 scale 1: {head / kl['e5m2, scale 1']:.3f}")
        memory_table()
    if not args.skip_speed:
        decode_speed(args.rounds)
        engine_speed(max(3, args.rounds // 5))


if __name__ == "__main__":
    main()
