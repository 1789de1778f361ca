// Device code and launch planning of the CUDA paged attention (torch-free: the GPU build includes it
// from attention.cu, the CPU-emulated tests from tests/cuda_emu). One kernel serves decode and
// prefill: a CTA takes a tile of rows (queries of one sequence x query heads of one KV-head group)
// and one split-K partition of their keys, stages each KV tile in shared memory once for all its rows
// (16-byte loads), and keeps an online softmax per row. With more than one partition a small merge
// kernel folds the partials by log-sum-exp. Launch shapes come from tensor shapes (and the
// max_seq_len hint) only: no host sync, so a decode step can be captured in a CUDA graph.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ops/attention_plan.h"
#include "ops/cuda/device_compat.cuh"
#include "ops/int4_kv.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace attention_cuda {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 16;          // rows (query x head) per CTA
constexpr int kMaxKeyTile = 64;       // keys staged per step (the softmax step assumes <= 64)
constexpr size_t kSmemBudget = 96 * 1024;

// Index arguments named in an IndexError (see index_error_message).
constexpr int kBadBlockId = 0;  // a block_tables entry outside [0, num_blocks)
constexpr int kBadSeqLen = 1;   // a seq_lens entry beyond the block table's max_blocks * block_size keys

__device__ __forceinline__ int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

// Shared-memory layout of one CTA (byte offsets, each section 16-byte aligned).
struct SmemLayout {
  size_t q, acc, logits, state, alpha, key_rows, k_tile, v_tile, total;
  int row_stride;  // elements per staged KV row (head_dim + padding against bank conflicts)

  PAGEDKV_HD static size_t align16(size_t x) { return (x + 15) / 16 * 16; }
  PAGEDKV_HD static SmemLayout make(int head_dim, int key_tile, int elem_size, bool vec16) {
    SmemLayout s{};
    s.row_stride = head_dim + (vec16 ? 16 / elem_size : 1);
    size_t off = 0;
    s.q = off, off = align16(off + sizeof(float) * kMaxRows * head_dim);
    s.acc = off, off = align16(off + sizeof(float) * kMaxRows * head_dim);
    s.logits = off, off = align16(off + sizeof(float) * kMaxRows * key_tile);
    s.state = off, off = align16(off + sizeof(OnlineSoftmax) * kMaxRows);
    s.alpha = off, off = align16(off + sizeof(float) * kMaxRows);
    s.key_rows = off, off = align16(off + sizeof(int64_t) * key_tile);
    s.k_tile = off, off = align16(off + size_t(elem_size) * key_tile * s.row_stride);
    s.v_tile = off, off = align16(off + size_t(elem_size) * key_tile * s.row_stride);
    s.total = off;
    return s;
  }
};

// The call's parameters plus the CTA tiling chosen by plan_paged_attention.
struct KernelParams : AttentionParams {
  int heads_per_cta, head_chunks, queries_per_cta, key_tile;
  int int4_group;  // int4 caches (cache_t = Int4Rows): elements per group of a row
};

// The kernel's cache_t for int4 caches: uint8 rows of ops/int4_kv.h, decoded to fp32 as they are staged.
struct Int4Rows {};

// What a cache row becomes in shared memory (the element size plan_paged_attention plans with): the cache's
// own elements, or fp32 for int4 rows.
template <typename cache_t>
struct Staged {
  using type = cache_t;  // the bytes in global memory, element for element
  using stored = cache_t;
};
template <>
struct Staged<Int4Rows> {
  using type = float;
  using stored = uint8_t;
};

// What launch_paged_attention needs beyond the params: grid, dynamic shared memory, kernel variant.
struct AttentionLaunch {
  unsigned grid_x, grid_y, grid_z;  // query tiles, KV heads x head chunks, split-K partitions
  size_t smem;
  bool vec16;      // 16-byte staging of K/V rows
  bool smem_fits;  // false: head_dim too large for kSmemBudget
};

// Launch planning (host, torch-free). Fills p's tiling fields (heads_per_cta, head_chunks,
// queries_per_cta, key_tile) from its shapes. caches_aligned16: every row of both cache views starts
// 16-byte aligned (cache_rows_16b_aligned); max_seq_len: the caller's hint (<= 0: the block tables'
// capacity); multiprocessors: SMs of the device.
inline AttentionLaunch plan_paged_attention(KernelParams& p, int elem_size, bool caches_aligned16,
                                            int64_t max_seq_len, int multiprocessors) {
  AttentionLaunch launch{};
  const int group = p.num_q_heads / p.num_kv_heads;
  p.heads_per_cta = std::min(group, kMaxRows);
  p.head_chunks = int(ceil_div(group, p.heads_per_cta));
  p.queries_per_cta = std::max(1, kMaxRows / p.heads_per_cta);
  launch.vec16 = (p.head_dim * elem_size) % 16 == 0 && caches_aligned16;
  int key_tile = kMaxKeyTile;
  while (key_tile > 8 && SmemLayout::make(p.head_dim, key_tile, elem_size, launch.vec16).total > kSmemBudget) {
    key_tile /= 2;
  }
  p.key_tile = key_tile;
  launch.smem = SmemLayout::make(p.head_dim, key_tile, elem_size, launch.vec16).total;
  launch.smem_fits = launch.smem <= kSmemBudget;
  // Tiles: an upper bound from shapes (every sequence wastes at most one partial tile).
  const int64_t num_tiles = ceil_div(p.num_tokens, p.queries_per_cta) + p.num_seqs;
  // Split-K when the CTAs (query tiles x KV heads x head chunks) would not fill the GPU twice over,
  // e.g. decode at small batch and long context; partials cost parts x T x Hq x D floats.
  const int64_t max_len = max_seq_len > 0 ? max_seq_len : int64_t(p.max_blocks) * p.block_size;
  const int64_t ctas = std::max<int64_t>(1, num_tiles * p.num_kv_heads * p.head_chunks);
  const int64_t parts = num_partitions(max_len, ctas, 2 * int64_t(multiprocessors));
  launch.grid_x = unsigned(num_tiles);
  launch.grid_y = unsigned(p.num_kv_heads * p.head_chunks);
  launch.grid_z = unsigned(parts);
  return launch;
}

// Which (sequence, query tile) linear tile `tile` is: sequences own ceil(q_len / queries_per_cta)
// consecutive tiles. Warp 0 scans query_start_loc 32 sequences at a time; -1 when past the end.
__device__ inline void find_query_tile(const KernelParams& p, int tile, int* seq_out, int* tile_out) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int base = 0; base < p.num_seqs; base += 32) {
    const int b = base + lane;
    const int tiles = b < p.num_seqs
                          ? int(ceil_div(p.query_start_loc[b + 1] - p.query_start_loc[b], p.queries_per_cta))
                          : 0;
    int inclusive = tiles;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const int first = carry + inclusive - tiles;
    if (tiles > 0 && tile >= first && tile < first + tiles) {
      *seq_out = b;
      *tile_out = tile - first;
    }
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
    if (carry > tile) break;
  }
}

// Element offset of the row (KV head 0) of key position pos of sequence seq in the cache views, or -1
// when the metadata points outside the cache (recorded in p.index_error when checking is on): the key
// then takes part in nothing.
__device__ __forceinline__ int64_t checked_row_offset(const AttentionParams& p, int seq, int64_t pos) {
  const int64_t column = pos / p.block_size;
  if (column >= p.max_blocks) {
    report_bad_index(p.index_error, kBadSeqLen, p.seq_lens[seq], seq);
    return -1;
  }
  const int64_t block = p.block_tables[int64_t(seq) * p.max_blocks + column];
  if (block < 0 || block >= p.num_blocks) {
    report_bad_index(p.index_error, kBadBlockId, block, int64_t(seq) * p.max_blocks + column);
    return -1;
  }
  return cache_block_offset(block, pos % p.block_size, p.cache_strides);
}

// scalar_t: the query and output type; cache_t: the caches' (scalar_t, a float8 type staged as such in
// shared memory: the K scale is folded into the query and the V scale into the output; or Int4Rows, rows
// decoded to fp32 as they are staged). kVec16: 16-byte staging loads (raw caches) and shared-memory reads.
template <typename scalar_t, typename cache_t, bool kVec16>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const KernelParams p) {
  using stage_t = typename Staged<cache_t>::type;
  using stored_t = typename Staged<cache_t>::stored;
  constexpr bool kInt4 = std::is_same_v<cache_t, Int4Rows>;
  PAGEDKV_DYNAMIC_SHARED(smem);
  const SmemLayout L = SmemLayout::make(p.head_dim, p.key_tile, sizeof(stage_t), kVec16);
  float* q_s = reinterpret_cast<float*>(smem + L.q);
  float* acc_s = reinterpret_cast<float*>(smem + L.acc);
  float* logits_s = reinterpret_cast<float*>(smem + L.logits);
  OnlineSoftmax* state_s = reinterpret_cast<OnlineSoftmax*>(smem + L.state);
  float* alpha_s = reinterpret_cast<float*>(smem + L.alpha);
  int64_t* key_rows_s = reinterpret_cast<int64_t*>(smem + L.key_rows);  // cache row offsets (KV head 0) of the tile
  stage_t* k_s = reinterpret_cast<stage_t*>(smem + L.k_tile);
  stage_t* v_s = reinterpret_cast<stage_t*>(smem + L.v_tile);
  PAGEDKV_SHARED(int, seq_s);
  PAGEDKV_SHARED(int, tile_s);

  // --- which rows and keys this CTA owns
  if (threadIdx.x == 0) seq_s = -1;
  __syncthreads();
  if (threadIdx.x < 32) find_query_tile(p, blockIdx.x, &seq_s, &tile_s);
  __syncthreads();
  const int seq = seq_s;
  if (seq < 0) return;
  const int D = p.head_dim, KT = p.key_tile, tid = threadIdx.x;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head0 = kv_head * group + (blockIdx.y % p.head_chunks) * p.heads_per_cta;
  const int num_heads = min(p.heads_per_cta, kv_head * group + group - head0);
  const int64_t q_start = p.query_start_loc[seq];
  const int64_t q_len = p.query_start_loc[seq + 1] - q_start;
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t q_begin = int64_t(tile_s) * p.queries_per_cta;
  const int q_count = int(min_i64(p.queries_per_cta, q_len - q_begin));
  const int rows = q_count * num_heads;  // row r: query q_begin + r / num_heads, head head0 + r % num_heads
  const KeyRange cta_keys{visible_keys(query_position(seq_len, q_len, q_begin), p.sliding_window).begin,
                          query_position(seq_len, q_len, q_begin + q_count - 1) + 1};
  const int num_parts = gridDim.z;
  const int64_t part_size = partition_size(cta_keys.end - cta_keys.begin, num_parts);
  const KeyRange keys = partition_keys(cta_keys, blockIdx.z, num_parts, part_size);

  // --- queries (pre-scaled, fp32) and fresh softmax state
  const auto* query = static_cast<const scalar_t*>(p.query);
  const float q_scale = p.scale * p.k_scale.at(kv_head), v_scale = p.v_scale.at(kv_head);
  for (int i = tid; i < rows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    const int64_t token = q_start + q_begin + r / num_heads, head = head0 + r % num_heads;
    q_s[i] = static_cast<float>(query[token * p.q_stride_token + head * p.q_stride_head + d * p.q_stride_dim]) *
             q_scale;
    acc_s[i] = 0.f;
  }
  if (tid < rows) state_s[tid] = OnlineSoftmax{};

  const auto* key_cache = static_cast<const stored_t*>(p.key_cache);
  const auto* value_cache = static_cast<const stored_t*>(p.value_cache);
  const int64_t head_offset = kv_head * p.cache_strides.head;
  constexpr int kPerVec = 16 / sizeof(stage_t);
  for (int64_t tile = keys.begin; tile < keys.end; tile += KT) {
    const int n = int(min_i64(KT, keys.end - tile));
    __syncthreads();  // previous tile's readers are done with rows, KV and logits
    if (tid < n) key_rows_s[tid] = checked_row_offset(p, seq, tile + tid);
    __syncthreads();

    // --- stage K and V rows of this tile (each read once for all rows of the CTA); the rows of
    // keys outside the cache are zeros. int4: one thread per code byte (two elements and their group's
    // step and minimum).
    if constexpr (kInt4) {
      const int pairs = D / 2;
      for (int i = tid; i < n * pairs; i += kThreads) {
        const int j = i / pairs, c = i % pairs;
        Int4Pair k2{0.f, 0.f}, v2{0.f, 0.f};
        if (key_rows_s[j] >= 0) {
          const int64_t src = key_rows_s[j] + head_offset;
          k2 = int4_decode_pair(key_cache + src, D, p.int4_group, c);
          v2 = int4_decode_pair(value_cache + src, D, p.int4_group, c);
        }
        k_s[j * L.row_stride + 2 * c] = k2.first, k_s[j * L.row_stride + 2 * c + 1] = k2.second;
        v_s[j * L.row_stride + 2 * c] = v2.first, v_s[j * L.row_stride + 2 * c + 1] = v2.second;
      }
    } else if constexpr (kVec16) {
      const int vecs = D / kPerVec;
      for (int i = tid; i < n * vecs; i += kThreads) {
        const int j = i / vecs, c = (i % vecs) * kPerVec;
        uint4 k_raw = make_uint4(0u, 0u, 0u, 0u), v_raw = k_raw;
        if (key_rows_s[j] >= 0) {
          const int64_t src = key_rows_s[j] + head_offset + c;
          k_raw = *reinterpret_cast<const uint4*>(key_cache + src);
          v_raw = *reinterpret_cast<const uint4*>(value_cache + src);
        }
        *reinterpret_cast<uint4*>(k_s + j * L.row_stride + c) = k_raw;
        *reinterpret_cast<uint4*>(v_s + j * L.row_stride + c) = v_raw;
      }
    } else {
      for (int i = tid; i < n * D; i += kThreads) {
        const int j = i / D, d = i % D;
        cache_t k = static_cast<cache_t>(0.f), v = k;
        if (key_rows_s[j] >= 0) {
          const int64_t src = key_rows_s[j] + head_offset + d;
          k = key_cache[src];
          v = value_cache[src];
        }
        k_s[j * L.row_stride + d] = k;
        v_s[j * L.row_stride + d] = v;
      }
    }
    __syncthreads();

    // --- logits: one (row, key) dot product per item; masked keys get -inf
    for (int i = tid; i < rows * KT; i += kThreads) {
      const int r = i / KT, j = i % KT;
      float s = kNegInf;
      const KeyRange visible =
          visible_keys(query_position(seq_len, q_len, q_begin + r / num_heads), p.sliding_window);
      const int64_t pos = tile + j;
      if (j < n && pos >= visible.begin && pos < visible.end && key_rows_s[j] >= 0) {
        const float* q = q_s + r * D;
        const stage_t* k = k_s + j * L.row_stride;
        float dot = 0.f;
        if constexpr (kVec16) {
          for (int d = 0; d < D; d += kPerVec) {
            const uint4 raw = *reinterpret_cast<const uint4*>(k + d);
            const stage_t* e = reinterpret_cast<const stage_t*>(&raw);
#pragma unroll
            for (int x = 0; x < kPerVec; ++x) dot += q[d + x] * static_cast<float>(e[x]);
          }
        } else {
          for (int d = 0; d < D; ++d) dot += q[d] * static_cast<float>(k[d]);
        }
        s = apply_softcap(dot, p.softcap);
      }
      logits_s[i] = s;
    }
    __syncthreads();

    // --- online softmax update, one warp per row: logits -> probabilities, alpha for the accumulator
    for (int r = tid / 32; r < rows; r += kWarps) {
      const int lane = tid % 32;
      float* s = logits_s + r * KT;
      const float s0 = lane < KT ? s[lane] : kNegInf;
      const float s1 = lane + 32 < KT ? s[lane + 32] : kNegInf;
      float tile_max = fmaxf(s0, s1);
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      }
      OnlineSoftmax st = state_s[r];
      const float alpha = st.rescale_to(tile_max);
      const float p0 = s0 == kNegInf ? 0.f : expf(s0 - st.m);
      const float p1 = s1 == kNegInf ? 0.f : expf(s1 - st.m);
      if (lane < KT) s[lane] = p0;
      if (lane + 32 < KT) s[lane + 32] = p1;
      float sum = p0 + p1;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      if (lane == 0) {
        st.l += sum;
        state_s[r] = st;
        alpha_s[r] = alpha;
      }
    }
    __syncthreads();

    // --- acc = alpha * acc + P V over the row's visible keys only: masked keys are never touched,
    // so inf/NaN in their V cannot reach the row. Each thread owns fixed (row, dims) items.
    if constexpr (kVec16) {
      const int quads = D / 4;
      for (int i = tid; i < rows * quads; i += kThreads) {
        const int r = i / quads, d = (i % quads) * 4;
        const KeyRange visible =
            visible_keys(query_position(seq_len, q_len, q_begin + r / num_heads), p.sliding_window);
        const int j_end = int(min_i64(n, visible.end - tile));
        const float alpha = alpha_s[r];
        const float* prob = logits_s + r * KT;
        float4 a = *reinterpret_cast<float4*>(acc_s + r * D + d);
        a.x *= alpha, a.y *= alpha, a.z *= alpha, a.w *= alpha;
        for (int j = int(max_i64(0, visible.begin - tile)); j < j_end; ++j) {
          const float pj = prob[j];
          const stage_t* v = v_s + j * L.row_stride + d;
          a.x += pj * static_cast<float>(v[0]);
          a.y += pj * static_cast<float>(v[1]);
          a.z += pj * static_cast<float>(v[2]);
          a.w += pj * static_cast<float>(v[3]);
        }
        *reinterpret_cast<float4*>(acc_s + r * D + d) = a;
      }
    } else {
      for (int i = tid; i < rows * D; i += kThreads) {
        const int r = i / D, d = i % D;
        const KeyRange visible =
            visible_keys(query_position(seq_len, q_len, q_begin + r / num_heads), p.sliding_window);
        const int j_end = int(min_i64(n, visible.end - tile));
        const float* prob = logits_s + r * KT;
        float a = acc_s[i] * alpha_s[r];
        for (int j = int(max_i64(0, visible.begin - tile)); j < j_end; ++j) {
          a += prob[j] * static_cast<float>(v_s[j * L.row_stride + d]);
        }
        acc_s[i] = a;
      }
    }
  }
  __syncthreads();

  // --- normalise and write the final output, or this partition's partial (out, lse)
  for (int i = tid; i < rows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    const int64_t token = q_start + q_begin + r / num_heads, head = head0 + r % num_heads;
    const int64_t row = token * p.num_q_heads + head;
    float o = acc_s[i] * state_s[r].inv_sum() * v_scale;
    if (num_parts == 1 && p.sinks != nullptr) {    // the sink joins the final normaliser (after the merge if split)
      OnlineSoftmax with_sink = state_s[r];
      o *= with_sink.add_sink(p.sinks[head]);
    }
    if (num_parts == 1) {
      static_cast<scalar_t*>(p.out)[row * D + d] = static_cast<scalar_t>(o);
    } else {
      p.partial_out[(int64_t(blockIdx.z) * p.num_tokens * p.num_q_heads + row) * D + d] = o;
    }
  }
  if (tid < rows) {
    const int64_t token = q_start + q_begin + tid / num_heads, head = head0 + tid % num_heads;
    const int64_t row = token * p.num_q_heads + head;
    OnlineSoftmax final_state = state_s[tid];
    if (num_parts == 1 && p.sinks != nullptr) final_state.add_sink(p.sinks[head]);
    const float lse = final_state.lse();
    if (num_parts > 1) {
      p.partial_lse[int64_t(blockIdx.z) * p.num_tokens * p.num_q_heads + row] = lse;
    } else if (p.lse != nullptr) {
      p.lse[row] = lse;
    }
  }
}

// One CTA per (token, query head) row: folds the split-K partials with the shared merge.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    merge_partitions_kernel(const float* __restrict__ partial_out, const float* __restrict__ partial_lse,
                            scalar_t* __restrict__ out, float* __restrict__ lse, const float* __restrict__ sinks,
                            int num_parts, int64_t num_rows, int num_q_heads, int head_dim) {
  const int64_t row = blockIdx.x;
  OnlineSoftmax state;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    state = OnlineSoftmax{};
    float o = merge_partition_element(partial_out + row * head_dim, num_rows * head_dim, partial_lse + row,
                                      num_rows, num_parts, d, state);
    if (sinks != nullptr) o *= state.add_sink(sinks[row % num_q_heads]);   // the partials carry no sink
    out[row * head_dim + d] = static_cast<scalar_t>(o);
  }
  if (lse != nullptr && threadIdx.x == 0) lse[row] = state.lse();  // thread 0 merged element 0 (head_dim >= 1)
}

}  // namespace attention_cuda
}  // namespace pagedkv
