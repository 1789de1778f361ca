// Device code of the CUDA MLA ops (torch-free: included by mla.cu and by tests/cuda_emu). The latent cache
// is [num_blocks, block_size, kv_lora_rank + rope_dim] with any block and token strides: one row per token.
// concat_and_cache_mla: one CTA per token writes its latent and rope key into its slot's row.
// paged_attention_mla: one CTA per (query token, head) walks the token's visible rows in tiles of kKeyTile:
// each warp scores rows against the absorbed query over the whole row (K), warp 0 updates the online
// softmax, and the CTA's threads split the kv_lora_rank output elements to accumulate the rows' latent
// part (V). No split-K: long contexts at tiny batches leave SMs idle (a plain kernel, correct first).
#pragma once

#include <cstdint>

#include "ops/attention_plan.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/cache_ops.cuh"
#include "ops/cuda/device_compat.cuh"
#include "ops/fp8.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace mla_cuda {

constexpr int kWriteThreads = 256;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kKeyTile = 32;  // one logit per lane of warp 0 in the softmax step

// Strides (elements) of the [num_tokens, kv_lora_rank] and [num_tokens, rope_dim] inputs.
struct LatentInputStrides {
  int64_t kv_c_token, kv_c_dim, k_pe_token, k_pe_dim;
};

// Stores an input element unchanged (same dtype: raw bits).
struct CopyBits {
  template <typename T>
  __device__ __forceinline__ T operator()(T x) const {
    return x;
  }
};

// Stores fp8(x / scale), saturated and rounded as fp8.h says (IEEE division whatever the compiler flags).
template <KvFormat F>
struct Fp8Store {
  KvScale scale;
  template <typename T>
  __device__ __forceinline__ uint8_t operator()(T x) const {
    return fp8_saturating_encode<F>(div_rn(static_cast<float>(x), scale.at(0)));
  }
};

// One CTA per token: row = store(kv_c[token]) | store(k_pe[token]). Padding (slot < 0) is skipped; a slot >=
// num_slots too, recorded in index_error (argument 0, at its token) when checking is on.
template <typename in_t, typename cache_t, typename Store, typename slot_t>
__global__ void __launch_bounds__(kWriteThreads)
    concat_and_cache_mla_kernel(const in_t* __restrict__ kv_c, const in_t* __restrict__ k_pe,
                                cache_t* __restrict__ kv_cache, const slot_t* __restrict__ slot_mapping,
                                LatentInputStrides in, CacheStrides cache_strides, int kv_lora_rank, int rope_dim,
                                int64_t block_size, int64_t num_slots, Store store, IndexError* index_error) {
  const int64_t token = blockIdx.x;
  const int64_t slot = cache_cuda::token_slot(slot_mapping, token, num_slots, index_error);
  if (slot < 0) return;
  cache_t* row = kv_cache + cache_slot_offset(slot, block_size, cache_strides);
  const in_t* c = kv_c + token * in.kv_c_token;
  const in_t* pe = k_pe + token * in.k_pe_token;
  for (int d = threadIdx.x; d < kv_lora_rank + rope_dim; d += blockDim.x) {
    row[d] = store(d < kv_lora_rank ? c[d * in.kv_c_dim] : pe[(d - kv_lora_rank) * in.k_pe_dim]);
  }
}

// A paged_attention_mla call: paged_attention's parameters with the latent as one KV head (head_dim = the
// row width, key_cache = the latent cache, k_scale = its scale) and the latent part's width.
struct MlaParams : AttentionParams {
  int kv_lora_rank;
};

// Dynamic shared memory of one CTA: the scaled query row (width floats), then the accumulator (rank floats).
PAGEDKV_HD size_t mla_smem_bytes(int width, int kv_lora_rank) { return sizeof(float) * (size_t(width) + kv_lora_rank); }

// The sequence that owns query token `token`: the last b with query_start_loc[b] <= token; -1 when the
// token is past query_start_loc[num_seqs].
__device__ __forceinline__ int mla_token_seq(const MlaParams& p, int64_t token) {
  if (p.num_seqs <= 0 || token >= p.query_start_loc[p.num_seqs]) return -1;
  int lo = 0, hi = p.num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.query_start_loc[mid] <= token) lo = mid; else hi = mid;
  }
  return lo;
}

// scalar_t: query and output type; cache_t: the latent cache's (scalar_t or a float8 type: the scale is
// folded into the query for K and into the output for V).
template <typename scalar_t, typename cache_t>
__global__ void __launch_bounds__(kThreads) paged_attention_mla_kernel(const MlaParams p) {
  PAGEDKV_DYNAMIC_SHARED(smem);
  PAGEDKV_SHARED_ARRAY(float, logits_s, kKeyTile);  // logits, then probabilities
  PAGEDKV_SHARED_ARRAY(int64_t, rows_s, kKeyTile);  // element offset of each tile row (-1: outside the cache)
  PAGEDKV_SHARED_ARRAY(float, stats_s, 2);          // per tile: alpha; at the end: 1 / l and lse
  const int W = p.head_dim, R = p.kv_lora_rank, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  float* q_s = reinterpret_cast<float*>(smem);
  float* acc_s = q_s + W;

  const int64_t token = blockIdx.x;
  const int head = blockIdx.y;
  const int seq = mla_token_seq(p, token);
  if (seq < 0) return;
  const int64_t q_start = p.query_start_loc[seq];
  const int64_t q_len = p.query_start_loc[seq + 1] - q_start;
  const KeyRange keys = visible_keys(query_position(p.seq_lens[seq], q_len, token - q_start), -1);
  const float kv_scale = p.k_scale.at(0);
  const auto* query = static_cast<const scalar_t*>(p.query) + token * p.q_stride_token + head * p.q_stride_head;
  for (int d = tid; d < W; d += kThreads) q_s[d] = static_cast<float>(query[d]) * (p.scale * kv_scale);
  for (int d = tid; d < R; d += kThreads) acc_s[d] = 0.f;

  const auto* cache = static_cast<const cache_t*>(p.key_cache);
  OnlineSoftmax state;  // warp 0's, identical in its lanes
  for (int64_t tile = keys.begin; tile < keys.end; tile += kKeyTile) {
    const int n = int(attention_cuda::min_i64(kKeyTile, keys.end - tile));
    __syncthreads();  // the previous tile's readers are done with rows_s, logits_s and stats_s
    if (tid < n) rows_s[tid] = attention_cuda::checked_row_offset(p, seq, tile + tid);
    __syncthreads();

    // --- logits: one row per warp at a time, lanes over the row
    for (int j = warp; j < n; j += kWarps) {
      float dot = 0.f;
      if (rows_s[j] >= 0) {
        const cache_t* row = cache + rows_s[j];
        for (int d = lane; d < W; d += 32) dot += q_s[d] * static_cast<float>(row[d]);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (lane == 0) logits_s[j] = rows_s[j] >= 0 ? dot : kNegInf;
    }
    __syncthreads();

    // --- online softmax step (warp 0): logits -> probabilities, alpha for the accumulator
    if (warp == 0) {
      const float s = lane < n ? logits_s[lane] : kNegInf;
      float tile_max = s;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      const float alpha = state.rescale_to(tile_max);
      const float prob = s == kNegInf ? 0.f : expf(s - state.m);
      float sum = prob;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      state.l += sum;
      if (lane < n) logits_s[lane] = prob;
      if (lane == 0) stats_s[0] = alpha;
    }
    __syncthreads();

    // --- acc = alpha * acc + P V, V being each row's first kv_lora_rank elements
    const float alpha = stats_s[0];
    for (int d = tid; d < R; d += kThreads) {
      float a = acc_s[d] * alpha;
      for (int j = 0; j < n; ++j) {
        if (rows_s[j] >= 0) a += logits_s[j] * static_cast<float>(cache[rows_s[j] + d]);
      }
      acc_s[d] = a;
    }
  }
  __syncthreads();
  if (tid == 0) {
    stats_s[0] = state.inv_sum() * kv_scale;
    stats_s[1] = state.lse();
  }
  __syncthreads();
  const int64_t out_row = token * p.num_q_heads + head;
  auto* out = static_cast<scalar_t*>(p.out) + out_row * R;
  for (int d = tid; d < R; d += kThreads) out[d] = static_cast<scalar_t>(acc_s[d] * stats_s[0]);
  if (tid == 0 && p.lse != nullptr) p.lse[out_row] = stats_s[1];
}

}  // namespace mla_cuda
}  // namespace pagedkv
