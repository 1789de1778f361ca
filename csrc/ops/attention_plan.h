// What the CPU (attention_cpu.cpp) and CUDA (cuda/attention.cuh) paged attention share above the
// per-key math of paged_kv.h: the parameters of a call, split-K partitioning of a key range and the
// merge of partition results. Torch-free; compiles with g++ and nvcc.
#pragma once

#include <cstdint>

#include "ops/fp8.h"
#include "ops/paged_kv.h"

namespace pagedkv {

struct IndexError;  // ops/cuda/device_compat.cuh

// Split-K: a partition covers at least kMinPartitionKeys keys (shorter ones cost more in merging
// than they gain in parallelism), and a key range is split into at most kMaxPartitions.
constexpr int64_t kMinPartitionKeys = 256;
constexpr int64_t kMaxPartitions = 64;

// One paged_attention call: pointers into the caller's tensors and the shapes read off them.
struct AttentionParams {
  const void* query;  // [T, Hq, D], strides in elements
  int64_t q_stride_token, q_stride_head, q_stride_dim;
  const void* key_cache;  // [num_blocks, block_size, Hkv, D] views, head_dim contiguous
  const void* value_cache;
  CacheStrides cache_strides;      // of both views (elements): K and V have the same strides
  const int32_t* block_tables;     // [B, max_blocks]
  const int32_t* seq_lens;         // [B]
  const int32_t* query_start_loc;  // [B + 1]
  void* out;                       // [T, Hq, D], query dtype
  float* lse;                      // [T, Hq] or nullptr
  float* partial_out;              // split-K partials (rows x D), backend-specific row order
  float* partial_lse;
  IndexError* index_error;  // CUDA only: non-null under PAGEDKV_CHECK_INDICES=1
  int num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t num_blocks;
  int64_t sliding_window;  // -1: none
  float scale, softcap;
  KvScale k_scale, v_scale;  // float8 caches: x = stored * scale of the KV head (null: 1)
  const float* sinks;        // [Hq] attention sinks (OnlineSoftmax::add_sink), or nullptr
};

// How many partitions to split a range of num_keys keys into when only work_units units of work
// (items, CTAs) exist and target_units would keep the machine busy: 1 when there is enough work already
// or the keys are too few.
PAGEDKV_HD int64_t num_partitions(int64_t num_keys, int64_t work_units, int64_t target_units) {
  const int64_t wanted = ceil_div(target_units, work_units > 0 ? work_units : 1);
  const int64_t by_keys = num_keys / kMinPartitionKeys;
  const int64_t parts = wanted < by_keys ? wanted : by_keys;
  return parts < 1 ? 1 : (parts > kMaxPartitions ? kMaxPartitions : parts);
}

// Keys per partition of a range of num_keys split num_partitions ways (never below kMinPartitionKeys,
// so with a partition count planned for a longer range the last partitions are just empty).
PAGEDKV_HD int64_t partition_size(int64_t num_keys, int64_t num_partitions) {
  const int64_t size = ceil_div(num_keys, num_partitions);
  return size > kMinPartitionKeys ? size : kMinPartitionKeys;
}

// Partition `partition` of `keys`; the last one runs to the end whatever its nominal size, so a
// too-small size never drops keys.
PAGEDKV_HD KeyRange partition_keys(KeyRange keys, int64_t partition, int64_t num_partitions,
                                   int64_t partition_size) {
  const int64_t begin = keys.begin + partition * partition_size;
  int64_t end = partition + 1 == num_partitions ? keys.end : begin + partition_size;
  if (end > keys.end) end = keys.end;
  return {begin < keys.end ? begin : keys.end, end};
}

// Merges element [d] of one row's partition results: partition p left a normalised output at
// partial_out[p * out_stride + d] and its log-sum-exp at partial_lse[p * lse_stride]. Returns the
// merged element; `state` (fresh on entry) ends with the merged lse.
PAGEDKV_HD float merge_partition_element(const float* partial_out, int64_t out_stride, const float* partial_lse,
                                         int64_t lse_stride, int64_t num_parts, int64_t d, OnlineSoftmax& state) {
  float o = 0.f;
  for (int64_t p = 0; p < num_parts; ++p) {
    const SoftmaxStep step = state.add_partial(partial_lse[p * lse_stride]);
    if (step.weight > 0.f) o = o * step.alpha + step.weight * partial_out[p * out_stride + d];
  }
  return o * state.inv_sum();
}

}  // namespace pagedkv
