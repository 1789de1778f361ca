// Paged-KV index math and softmax-state algebra shared by the CPU (csrc/ops/*.cpp) and CUDA
// (csrc/ops/cuda/*.cu) kernels. Plain C++: compiles with g++ and nvcc alike, no torch includes.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/arith.h"
#include "ops/host_device.h"

namespace pagedkv {

constexpr float kNegInf = -INFINITY;

// IEEE division on the host and the device alike (--use_fast_math makes the device's `/` approximate), so a
// byte a CUDA kernel quantises equals the CPU's and torch's.
PAGEDKV_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---------------------------------------------------------------------------------------------
// Slots and block tables. Slot of token position p: block_table[p / block_size] * block_size +
// p % block_size; the cache is [num_blocks, block_size, num_kv_heads, head_dim].

struct SlotLocation {
  int64_t block;
  int64_t offset;  // token index inside the block
};

PAGEDKV_HD SlotLocation decode_slot(int64_t slot, int64_t block_size) {
  return {slot / block_size, slot % block_size};
}

// Slot holding KV position `pos` of a sequence whose block table row is `block_table`.
PAGEDKV_HD int64_t slot_of_position(const int32_t* block_table, int64_t pos, int64_t block_size) {
  return static_cast<int64_t>(block_table[pos / block_size]) * block_size + pos % block_size;
}

// Strides (in elements) of a [num_blocks, block_size, num_kv_heads, head_dim] cache view whose head_dim
// is contiguous: a contiguous tensor, or a view of a larger one (vLLM's interleaved K|V cells,
// FlashInfer's [pages, 2, ...] halves, an HND tensor transposed).
struct CacheStrides {
  int64_t block;
  int64_t token;
  int64_t head;
};

// Whether every row of a cache view (head_dim contiguous by contract) whose data starts at `data` starts
// 16-byte aligned: the CUDA kernels then move rows in 16-byte chunks.
inline bool cache_rows_16b_aligned(const void* data, int64_t elem_size, CacheStrides s) {
  const int64_t per_vec = 16 / elem_size;
  return s.block % per_vec == 0 && s.token % per_vec == 0 && s.head % per_vec == 0 &&
         reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

// Element offset of (slot, 0, 0) in a cache view with these strides; head h's row is h * s.head further.
PAGEDKV_HD int64_t cache_slot_offset(int64_t slot, int64_t block_size, CacheStrides s) {
  const SlotLocation loc = decode_slot(slot, block_size);
  return loc.block * s.block + loc.offset * s.token;
}

// The strides of a contiguous cache.
PAGEDKV_HD CacheStrides contiguous_cache_strides(int64_t block_size, int64_t num_kv_heads, int64_t head_dim) {
  return {block_size * num_kv_heads * head_dim, num_kv_heads * head_dim, head_dim};
}

// Element offset of (token `offset` of physical block `block`, head 0) in a cache view with these strides.
PAGEDKV_HD int64_t cache_block_offset(int64_t block, int64_t offset, CacheStrides s) {
  return block * s.block + offset * s.token;
}

// Element offset of (KV position pos, head 0) of a sequence whose block table row is block_table (the
// slot of slot_of_position, without dividing it again).
PAGEDKV_HD int64_t cache_position_offset(const int32_t* block_table, int64_t pos, int64_t block_size, CacheStrides s) {
  return cache_block_offset(block_table[pos / block_size], pos % block_size, s);
}

// ---------------------------------------------------------------------------------------------
// Causal masking, bottom-right aligned: query j of a sequence with q_len queries and seq_len keys
// sits at position seq_len - q_len + j and sees keys (pos - sliding_window, pos] (all of [0, pos]
// when sliding_window <= 0).

struct KeyRange {
  int64_t begin;  // first visible key position
  int64_t end;    // one past the last visible key position
};

PAGEDKV_HD int64_t query_position(int64_t seq_len, int64_t q_len, int64_t j) { return seq_len - q_len + j; }

PAGEDKV_HD KeyRange visible_keys(int64_t query_pos, int64_t sliding_window) {
  int64_t begin = 0;
  if (sliding_window > 0 && query_pos + 1 - sliding_window > 0) begin = query_pos + 1 - sliding_window;
  return {begin, query_pos + 1};
}

// Raw score -> logit: the scale is folded into the query beforehand; softcap > 0 applies
// softcap * tanh(s / softcap) (Gemma 2 style).
PAGEDKV_HD float apply_softcap(float s, float softcap) { return softcap > 0.f ? softcap * tanhf(s / softcap) : s; }

// ---------------------------------------------------------------------------------------------
// Online softmax for one query row: running max m and running sum l of exp(s - m); the caller
// keeps the unnormalised accumulator acc = sum_j exp(s_j - m) v_j next to it. The same state folds
// split-K partition results (add_partial), as FlashInfer's state_t merges softmax states.

// Factors of one step of the online softmax: acc = acc * alpha + weight * (what is added).
struct SoftmaxStep {
  float alpha;
  float weight;
};

struct OnlineSoftmax {
  float m = kNegInf;
  float l = 0.f;

  // Moves the running max to cover a new tile whose largest logit is tile_max; returns the factor
  // by which l (already done here) and the caller's accumulator must be multiplied.
  PAGEDKV_HD float rescale_to(float tile_max) {
    const float m_new = fmaxf(m, tile_max);
    const float alpha = (m == kNegInf) ? 0.f : expf(m - m_new);
    l *= alpha;
    m = m_new;
    return alpha;
  }
  // Folds in a normalised partial result o over a disjoint set of keys whose log-sum-exp is lse
  // (the state of that partial is m = lse, l = 1). A partial that saw no key (lse = -inf) gets weight
  // 0 and must be skipped: its o may hold anything.
  PAGEDKV_HD SoftmaxStep add_partial(float lse) {
    if (lse == kNegInf) return {1.f, 0.f};
    const float alpha = rescale_to(lse);
    const float weight = expf(lse - m);
    l += weight;
    return {alpha, weight};
  }
  // Folds in an attention sink (gpt-oss): one more logit in the normaliser that carries no value.
  // Returns the factor that turns an output normalised by the state before the sink (acc * inv_sum())
  // into the one normalised with it; lse() then includes the sink. A row that saw no key keeps output 0
  // and gets lse = sink. The sink must be finite.
  PAGEDKV_HD float add_sink(float sink) {
    rescale_to(sink);
    const float before = l;
    l += expf(sink - m);
    return before / l;
  }
  PAGEDKV_HD float inv_sum() const { return l > 0.f ? 1.f / l : 0.f; }
  // Natural-log log-sum-exp of the logits seen so far; -inf when none.
  PAGEDKV_HD float lse() const { return l > 0.f ? m + logf(l) : kNegInf; }
};

}  // namespace pagedkv
