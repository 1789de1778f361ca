// Device code of the CUDA cache ops (torch-free; included by cache_ops.cu and by tests/cuda_emu):
// reshape_and_cache into strided cache views with int32 or int64 slots (16-byte vector stores when
// aligned), into float8 and int4 caches, and copy_blocks.
#pragma once

#include <cstdint>

#include "ops/cuda/device_compat.cuh"
#include "ops/fp8.h"
#include "ops/int4_kv.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace cache_cuda {

constexpr int kThreads = 256;

// Strides (in elements) of a [num_tokens, num_kv_heads, head_dim] key or value input.
struct TokenStrides {
  int64_t token;
  int64_t head;
  int64_t dim;
};

// The cache slot of `token` (slot_t: int32_t or int64_t), or -1 when nothing is written: padding (a
// negative slot), or a slot >= num_slots, which is recorded in index_error (argument 0, at its token)
// when checking is on.
template <typename slot_t>
__device__ __forceinline__ int64_t token_slot(const slot_t* slot_mapping, int64_t token, int64_t num_slots,
                                              IndexError* index_error) {
  const int64_t slot = static_cast<int64_t>(slot_mapping[token]);
  if (slot >= num_slots) {
    if (threadIdx.x == 0) report_bad_index(index_error, 0, slot, token);
    return -1;
  }
  return slot < 0 ? -1 : slot;
}

// One CTA per token; the caches are views with any block, token and head strides (head_dim
// contiguous). Elements move as raw bits (bits_t has the element's width); with kVec16 each thread
// moves 16-byte chunks (every row of the inputs and caches 16-byte aligned). Padding (slot < 0) is
// skipped; a slot >= num_slots is skipped too and recorded in index_error (argument 0, at its token)
// when checking is on.
template <typename bits_t, bool kVec16, typename slot_t>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_kernel(const bits_t* __restrict__ key, const bits_t* __restrict__ value,
                             bits_t* __restrict__ key_cache, bits_t* __restrict__ value_cache,
                             const slot_t* __restrict__ slot_mapping, TokenStrides key_strides,
                             TokenStrides value_strides, CacheStrides key_cache_strides,
                             CacheStrides value_cache_strides, int num_heads, int head_dim, int64_t block_size,
                             int64_t num_slots, IndexError* index_error) {
  const int64_t token = blockIdx.x;
  const int64_t slot = token_slot(slot_mapping, token, num_slots, index_error);
  if (slot < 0) return;
  const bits_t* k = key + token * key_strides.token;
  const bits_t* v = value + token * value_strides.token;
  bits_t* k_dst = key_cache + cache_slot_offset(slot, block_size, key_cache_strides);
  bits_t* v_dst = value_cache + cache_slot_offset(slot, block_size, value_cache_strides);
  if constexpr (kVec16) {
    constexpr int kPerVec = 16 / sizeof(bits_t);
    const int vecs_per_head = head_dim / kPerVec;
    for (int i = threadIdx.x; i < num_heads * vecs_per_head; i += blockDim.x) {
      const int h = i / vecs_per_head, c = (i % vecs_per_head) * kPerVec;
      *reinterpret_cast<uint4*>(k_dst + h * key_cache_strides.head + c) =
          *reinterpret_cast<const uint4*>(k + h * key_strides.head + c);
      *reinterpret_cast<uint4*>(v_dst + h * value_cache_strides.head + c) =
          *reinterpret_cast<const uint4*>(v + h * value_strides.head + c);
    }
  } else {
    for (int i = threadIdx.x; i < num_heads * head_dim; i += blockDim.x) {
      const int h = i / head_dim, d = i % head_dim;
      k_dst[h * key_cache_strides.head + d] = k[h * key_strides.head + d * key_strides.dim];
      v_dst[h * value_cache_strides.head + d] = v[h * value_strides.head + d * value_strides.dim];
    }
  }
}

// reshape_and_cache into float8 cache views (format F): one CTA per token, each element divided by its
// KV head's scale, saturated and rounded as fp8.h says. Strides, padding and out-of-range slots as above.
template <typename scalar_t, KvFormat F, typename slot_t>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_fp8_kernel(const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
                                 uint8_t* __restrict__ key_cache, uint8_t* __restrict__ value_cache,
                                 const slot_t* __restrict__ slot_mapping, TokenStrides key_strides,
                                 TokenStrides value_strides, CacheStrides key_cache_strides,
                                 CacheStrides value_cache_strides, int num_heads, int head_dim, int64_t block_size,
                                 int64_t num_slots, KvScale k_scale, KvScale v_scale, IndexError* index_error) {
  const int64_t token = blockIdx.x;
  const int64_t slot = token_slot(slot_mapping, token, num_slots, index_error);
  if (slot < 0) return;
  const scalar_t* k = key + token * key_strides.token;
  const scalar_t* v = value + token * value_strides.token;
  uint8_t* k_dst = key_cache + cache_slot_offset(slot, block_size, key_cache_strides);
  uint8_t* v_dst = value_cache + cache_slot_offset(slot, block_size, value_cache_strides);
  for (int i = threadIdx.x; i < num_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, d = i % head_dim;
    k_dst[h * key_cache_strides.head + d] = fp8_saturating_encode<F>(
        div_rn(static_cast<float>(k[h * key_strides.head + d * key_strides.dim]), k_scale.at(h)));
    v_dst[h * value_cache_strides.head + d] = fp8_saturating_encode<F>(
        div_rn(static_cast<float>(v[h * value_strides.head + d * value_strides.dim]), v_scale.at(h)));
  }
}

// reshape_and_cache_int4 into int4 cache views (rows of ops/int4_kv.h, any block, token and head strides): one
// CTA per token, one thread per (K or V, head, group), which quantises that group's group_size elements (inputs
// with any strides) into its code bytes and its step and minimum. Padding and out-of-range slots as above.
template <typename scalar_t, typename slot_t>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_int4_kernel(const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
                                  uint8_t* __restrict__ key_cache, uint8_t* __restrict__ value_cache,
                                  const slot_t* __restrict__ slot_mapping, TokenStrides key_strides,
                                  TokenStrides value_strides, CacheStrides key_cache_strides,
                                  CacheStrides value_cache_strides, int num_heads, int head_dim, int group_size,
                                  int64_t block_size, int64_t num_slots, IndexError* index_error) {
  const int64_t token = blockIdx.x;
  const int64_t slot = token_slot(slot_mapping, token, num_slots, index_error);
  if (slot < 0) return;
  const int groups = head_dim / group_size, per_cache = num_heads * groups;
  for (int i = threadIdx.x; i < 2 * per_cache; i += blockDim.x) {
    const bool is_value = i >= per_cache;
    const int h = (i % per_cache) / groups, g = i % groups;
    const TokenStrides s = is_value ? value_strides : key_strides;
    const CacheStrides cs = is_value ? value_cache_strides : key_cache_strides;
    const scalar_t* src = (is_value ? value : key) + token * s.token + h * s.head + int64_t(g) * group_size * s.dim;
    uint8_t* row = (is_value ? value_cache : key_cache) + cache_slot_offset(slot, block_size, cs) + h * cs.head;
    int4_encode_group(row, head_dim, g, group_size, [&](int64_t e) { return static_cast<float>(src[e * s.dim]); });
  }
}

// Whether the 16-byte kernel may move a [T, H, D] input with these strides (in elements of elem_size
// bytes) and this base address: contiguous rows of whole 16-byte chunks, all aligned.
inline bool rows_16b_aligned(const void* data, int64_t elem_size, int64_t head_dim, TokenStrides s) {
  const int64_t per_vec = 16 / elem_size;
  return s.dim == 1 && head_dim % per_vec == 0 && s.token % per_vec == 0 && s.head % per_vec == 0 &&
         reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

// One CTA per (src, dst) pair of one layer: copies the key block and the value block in chunks of
// Chunk (uint4 = 16 bytes when the blocks are aligned, else bytes). Out-of-range ids (only possible
// with a device-side mapping) are skipped, and recorded in index_error (argument 0, at the flat index
// of the mapping entry) when checking is on.
template <typename Chunk>
__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(Chunk* __restrict__ key_cache, Chunk* __restrict__ value_cache,
                       const int64_t* __restrict__ block_mapping, int64_t chunks_per_block, int64_t num_blocks,
                       IndexError* index_error) {
  const int64_t src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) {
    if (threadIdx.x == 0) {
      const bool src_bad = src < 0 || src >= num_blocks;
      report_bad_index(index_error, 0, src_bad ? src : dst, 2 * int64_t(blockIdx.x) + (src_bad ? 0 : 1));
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < chunks_per_block; i += blockDim.x) {
    key_cache[dst * chunks_per_block + i] = key_cache[src * chunks_per_block + i];
    value_cache[dst * chunks_per_block + i] = value_cache[src * chunks_per_block + i];
  }
}

}  // namespace cache_cuda
}  // namespace pagedkv
