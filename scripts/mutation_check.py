#!/usr/bin/env python3
"""Mutation check of the emulated CUDA kernel tests (not part of CI; takes several minutes).

Plants one-line bugs in the kernel headers (csrc/ops/cuda/*.cuh) one at a time -- a removed barrier, a
changed shuffle offset, a wrong lane, an off-by-one bound, a skipped mask -- rebuilds the emulated tests
(no sanitizers), runs them, and prints a table: mutation, caught. It works on a private copy of the
sources in a temporary folder, so the working tree is never touched (it is safe to commit meanwhile).
Every planted bug must make the tests fail. Exit status 1 if one survives.
Usage: scripts/mutation_check.py [--only SUBSTRING]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")
COPIED = ["CMakeLists.txt", "csrc", "tests/cpp", "tests/cpu_kernels", "tests/cuda_emu", "build_deps"]  # what the C++ build reads
SRC = BUILD = ""  # the private copy and its build folder, set in main()
ATTN, CACHE, LAYER = "csrc/ops/cuda/attention.cuh", "csrc/ops/cuda/cache_ops.cuh", "csrc/ops/cuda/layer_ops.cuh"

# (name, file, original text, mutated text): the original must occur exactly once.
MUTATIONS = [
    ("attention: barrier after staging the tile's row offsets removed", ATTN,
     "    if (tid < n) key_rows_s[tid] = checked_row_offset(p, seq, tile + tid);\n    __syncthreads();\n",
     "    if (tid < n) key_rows_s[tid] = checked_row_offset(p, seq, tile + tid);\n"),
    ("attention: barrier between logits and softmax removed", ATTN,
     "      logits_s[i] = s;\n    }\n    __syncthreads();\n",
     "      logits_s[i] = s;\n    }\n"),
    ("attention: barrier before the output write removed", ATTN,
     "  }\n  __syncthreads();\n\n  // --- normalise",
     "  }\n\n  // --- normalise"),
    ("attention: tile-max shuffle starts at offset 8 (half-warp max)", ATTN,
     "for (int offset = 16; offset > 0; offset /= 2) {\n        tile_max",
     "for (int offset = 8; offset > 0; offset /= 2) {\n        tile_max"),
    ("attention: softmax-sum shuffle skips offset 1", ATTN,
     "for (int offset = 16; offset > 0; offset /= 2) sum +=",
     "for (int offset = 16; offset > 1; offset /= 2) sum +="),
    ("attention: query-tile scan adds at lane > offset (wrong lane)", ATTN,
     "if (lane >= offset) inclusive += other;",
     "if (lane > offset) inclusive += other;"),
    ("attention: scan carry read from lane 30 instead of 31", ATTN,
     "carry += __shfl_sync(0xffffffffu, inclusive, 31);",
     "carry += __shfl_sync(0xffffffffu, inclusive, 30);"),
    ("attention: key tile one short (off-by-one bound)", ATTN,
     "const int n = int(min_i64(KT, keys.end - tile));",
     "const int n = int(min_i64(KT, keys.end - tile - 1));"),
    ("attention: sliding-window mask skipped in the logits", ATTN,
     "if (j < n && pos >= visible.begin && pos < visible.end && key_rows_s[j] >= 0)",
     "if (j < n && pos < visible.end && key_rows_s[j] >= 0)"),
    ("attention: the cache's head stride taken as head_dim (contiguous caches only)", ATTN,
     "const int64_t head_offset = kv_head * p.cache_strides.head;",
     "const int64_t head_offset = kv_head * p.head_dim;"),
    ("attention: the cache's token stride taken as num_kv_heads * head_dim", ATTN,
     "return cache_block_offset(block, pos % p.block_size, p.cache_strides);",
     "return block * p.cache_strides.block + pos % p.block_size * p.num_kv_heads * p.head_dim;"),
    ("attention: P.V runs over the whole tile (masked keys multiplied by zero)", ATTN,
     "        float a = acc_s[i] * alpha_s[r];\n        for (int j = int(max_i64(0, visible.begin - tile)); j < j_end; ++j) {",
     "        float a = acc_s[i] * alpha_s[r];\n        for (int j = 0; j < n; ++j) {"),
    ("attention: last row's softmax state not initialised", ATTN,
     "if (tid < rows) state_s[tid] = OnlineSoftmax{};",
     "if (tid < rows - 1) state_s[tid] = OnlineSoftmax{};"),
    ("reshape_and_cache: 16-byte chunk offset not scaled by elements per chunk", CACHE,
     "const int h = i / vecs_per_head, c = (i % vecs_per_head) * kPerVec;",
     "const int h = i / vecs_per_head, c = (i % vecs_per_head);"),
    ("reshape_and_cache: V rows addressed with the K cache's strides", CACHE,
     "bits_t* v_dst = value_cache + cache_slot_offset(slot, block_size, value_cache_strides);",
     "bits_t* v_dst = value_cache + cache_slot_offset(slot, block_size, key_cache_strides);"),
    ("reshape_and_cache fp8: the cache's head stride taken as head_dim (contiguous caches only)", CACHE,
     "k_dst[h * key_cache_strides.head + d] = fp8_saturating_encode<F>(",
     "k_dst[h * head_dim + d] = fp8_saturating_encode<F>("),
    ("copy_blocks: last chunk of each block not copied (off-by-one bound)", CACHE,
     "for (int64_t i = threadIdx.x; i < chunks_per_block; i += blockDim.x) {",
     "for (int64_t i = threadIdx.x; i < chunks_per_block - 1; i += blockDim.x) {"),
    ("block_sum: barrier after the per-warp sums removed", LAYER,
     "  if (lane == 0) warp_sums[warp] = v;\n  __syncthreads();\n",
     "  if (lane == 0) warp_sums[warp] = v;\n"),
    ("block_sum: warp reduction starts at offset 8", LAYER,
     "for (int offset = 16; offset > 0; offset >>= 1) v +=",
     "for (int offset = 8; offset > 0; offset >>= 1) v +="),
    ("block_sum: last warp's sum skipped", LAYER,
     "for (int w = 0; w < int((blockDim.x + 31) / 32); ++w)",
     "for (int w = 0; w < int((blockDim.x + 31) / 32) - 1; ++w)"),
    ("rotary: sin read one element early", LAYER,
     "const cache_t* sin = cos + half;",
     "const cache_t* sin = cos + half - 1;"),
]


def run(cmd, timeout=None):
    return subprocess.run(cmd, cwd=SRC, capture_output=True, text=True, timeout=timeout)


def copy_sources():
    global SRC, BUILD
    SRC = tempfile.mkdtemp(prefix="pagedkv-mutation-")
    BUILD = os.path.join(SRC, "build")
    for rel in COPIED:
        src = os.path.join(ROOT, rel)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(SRC, rel))
        elif os.path.exists(src):
            shutil.copy2(src, os.path.join(SRC, rel))


def configure():
    includes = run([PY, "-c", "from torch.utils.cpp_extension import include_paths; print(';'.join(include_paths()))"])
    run(["cmake", "-S", ".", "-B", BUILD, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
         f"-DPAGEDKV_TORCH_INCLUDE_DIRS={includes.stdout.strip()}"]).check_returncode()


def build_and_test():
    """'pass', 'fail' (tests failed), 'build' (did not compile) or 'timeout'."""
    if run(["cmake", "--build", BUILD, "--target", "test_cuda_kernels", "test_cuda_emu_runtime"]).returncode:
        return "build"
    try:
        for exe in ("test_cuda_kernels", "test_cuda_emu_runtime"):
            if run([os.path.join(BUILD, exe)], timeout=600).returncode:
                return "fail"
    except subprocess.TimeoutExpired:
        return "timeout"
    return "pass"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the mutations whose name contains this")
    args = parser.parse_args()
    copy_sources()
    try:
        check(args)
    finally:
        shutil.rmtree(SRC, ignore_errors=True)


def check(args):
    configure()
    baseline = build_and_test()
    if baseline != "pass":
        sys.exit(f"the unmutated tests must pass first (got: {baseline})")
    rows = []
    for name, path, original, mutated in MUTATIONS:
        if args.only not in name:
            continue
        full = os.path.join(SRC, path)
        with open(full) as f:
            source = f.read()
        if source.count(original) != 1:
            sys.exit(f"mutation {name!r}: its original text occurs {source.count(original)} times in {path}")
        t0 = time.time()
        try:
            with open(full, "w") as f:
                f.write(source.replace(original, mutated))
            result = build_and_test()
        finally:
            with open(full, "w") as f:
                f.write(source)
        caught = {"fail": "yes", "timeout": "yes (hang)", "build": "NO (did not compile)", "pass": "NO"}[result]
        rows.append((name, caught))
        print(f"{name}: {caught} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"| {'mutation':<{width}} | caught |")
    print(f"|{'-' * (width + 2)}|--------|")
    for name, caught in rows:
        print(f"| {name:<{width}} | {caught} |")
    survived = [r for r in rows if not r[1].startswith("yes")]
    print(f"{len(rows) - len(survived)} of {len(rows)} planted bugs caught")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
