// CPU kernels of the int4 KV ops: reshape_and_cache_int4 (each token's K and V heads into int4 rows) and
// paged_attention_int4(_with_lse). Attention runs one work item per (query token, KV head) with the KV head's
// query heads (GQA): a tile of K and V rows is decoded to fp32 once for them, scored and accumulated with an
// online softmax per head. The inner loops have AVX-512 and AVX2 clones picked at load time (x86-64).
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "ops/int4.h"
#include "ops/int4_kv.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace {

// ---------------------------------------------------------------------------------------------------
// reshape_and_cache_int4

template <typename scalar_t>
void write_int4_rows(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                     const Tensor& value_cache, const Tensor& slots, int64_t group_size) {
  const int64_t heads = key.size(1), D = key.size(2), block_size = key_cache.size(1);
  const int64_t* slot = slots.mutable_data_ptr<int64_t>();
  const CacheStrides strides = cache_strides(key_cache);
  const CacheStrides v_strides = cache_strides(value_cache);
  parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding
      for (int w = 0; w < 2; ++w) {
        const Tensor& in = w == 0 ? key : value;
        const CacheStrides& s = w == 0 ? strides : v_strides;
        const auto* x = static_cast<const scalar_t*>(in.data_ptr());
        auto* cache = static_cast<uint8_t*>((w == 0 ? key_cache : value_cache).data_ptr());
        const int64_t s0 = in.stride(0), s1 = in.stride(1), s2 = in.stride(2);
        for (int64_t h = 0; h < heads; ++h) {
          uint8_t* row = cache + cache_slot_offset(slot[t], block_size, s) + h * s.head;
          const scalar_t* src = x + t * s0 + h * s1;
          for (int64_t g = 0; g < D / group_size; ++g) {
            const scalar_t* first = src + g * group_size * s2;
            int4_encode_group(row, D, g, group_size, [&](int64_t i) { return static_cast<float>(first[i * s2]); });
          }
        }
      }
    }
  });
}

void reshape_and_cache_int4_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache,
                                Tensor& value_cache, const Tensor& slot_mapping, int64_t group_size) {
  check_reshape_and_cache_int4(key, value, key_cache, value_cache, slot_mapping, group_size);
  // A private int64 copy: the kernel reads exactly the values checked, whatever another thread writes.
  const Tensor slots = contiguous_copy(slot_mapping, ScalarType::Long);
  check_slot_values(slots, key_cache.size(0) * key_cache.size(1));
  dispatch_float(key.scalar_type(), [&](auto type_tag) {
    write_int4_rows<decltype(type_tag)>(key, value, key_cache, value_cache, slots, group_size);
  });
}

// ---------------------------------------------------------------------------------------------------
// paged_attention_int4: inner loops

#if defined(__x86_64__)
#define PAGEDKV_INT4_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PAGEDKV_INT4_CLONES
#endif

constexpr int64_t kKeyTile = 16;  // K and V rows decoded to fp32 at a time

// dst[d] = code(d) * step + lo of one row's head_dim elements.
PAGEDKV_INT4_CLONES void decode_row(const uint8_t* row, int64_t D, int64_t group_size, float* dst) {
  for (int64_t g = 0; g < D / group_size; ++g) {
    const Int4Group gr = int4_group(row, D, g);
    const uint8_t* codes = row + g * group_size / 2;
    float* out = dst + g * group_size;
#pragma omp simd
    for (int64_t i = 0; i < group_size / 2; ++i) {
      out[2 * i] = static_cast<float>(codes[i] & 0xf) * gr.step + gr.lo;
      out[2 * i + 1] = static_cast<float>(codes[i] >> 4) * gr.step + gr.lo;
    }
  }
}

// scores[j] = q . rows[j] for the n rows of a tile (D apart).
PAGEDKV_INT4_CLONES void score_tile(const float* q, const float* rows, int64_t n, int64_t D, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const float* k = rows + j * D;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
    scores[j] = s;
  }
}

// acc = acc * alpha + sum_j probs[j] * rows[j].
PAGEDKV_INT4_CLONES void accumulate_tile(float* acc, float alpha, const float* probs, const float* rows, int64_t n,
                                         int64_t D) {
  if (alpha != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float p = probs[j];
    const float* v = rows + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
  }
}

// One work item: the query heads of KV head kv_head for one query token of sequence seq.
struct Int4Item {
  int64_t seq, token, kv_head;
};

struct Int4Scratch {
  std::vector<float> q, acc, keys, values, scores, probs;
  std::vector<OnlineSoftmax> state;
};

// Causal attention of one item over its visible keys; only their rows are read.
template <typename scalar_t>
void attend_int4_item(const AttentionParams& a, int64_t group_size, const Int4Item& item, Int4Scratch& s) {
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads;
  const int64_t q_len = a.query_start_loc[item.seq + 1] - a.query_start_loc[item.seq];
  const int64_t pos = query_position(a.seq_lens[item.seq], q_len, item.token - a.query_start_loc[item.seq]);
  const KeyRange keys = visible_keys(pos, a.sliding_window);
  const int32_t* block_table = a.block_tables + item.seq * a.max_blocks;

  s.q.resize(G * D), s.acc.assign(G * D, 0.f), s.state.assign(G, OnlineSoftmax{});
  s.keys.resize(kKeyTile * D), s.values.resize(kKeyTile * D), s.scores.resize(kKeyTile), s.probs.resize(kKeyTile);
  const auto* query = static_cast<const scalar_t*>(a.query);
  const int64_t head0 = item.kv_head * G;
  for (int64_t h = 0; h < G; ++h) {
    const scalar_t* q = query + item.token * a.q_stride_token + (head0 + h) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) s.q[h * D + d] = static_cast<float>(q[d * a.q_stride_dim]) * a.scale;
  }
  const auto* kc = static_cast<const uint8_t*>(a.key_cache);
  const auto* vc = static_cast<const uint8_t*>(a.value_cache);
  const int64_t head_offset = item.kv_head * a.cache_strides.head;
  for (int64_t tile = keys.begin; tile < keys.end; tile += kKeyTile) {
    const int64_t n = std::min(kKeyTile, keys.end - tile);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = cache_position_offset(block_table, tile + j, a.block_size, a.cache_strides) + head_offset;
      decode_row(kc + off, D, group_size, s.keys.data() + j * D);
      decode_row(vc + off, D, group_size, s.values.data() + j * D);
    }
    for (int64_t h = 0; h < G; ++h) {
      score_tile(s.q.data() + h * D, s.keys.data(), n, D, s.scores.data());
      float tile_max = kNegInf;
      for (int64_t j = 0; j < n; ++j) {
        s.scores[j] = apply_softcap(s.scores[j], a.softcap);
        tile_max = std::max(tile_max, s.scores[j]);
      }
      OnlineSoftmax& st = s.state[h];
      const float alpha = st.rescale_to(tile_max);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        s.probs[j] = std::exp(s.scores[j] - st.m);
        sum += s.probs[j];
      }
      st.l += sum;
      accumulate_tile(s.acc.data() + h * D, alpha, s.probs.data(), s.values.data(), n, D);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const int64_t row = item.token * a.num_q_heads + head0 + h;
    const float inv = s.state[h].inv_sum();
    auto* out = static_cast<scalar_t*>(a.out) + row * D;
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(s.acc[h * D + d] * inv);
    if (a.lse != nullptr) a.lse[row] = s.state[h].lse();
  }
}

std::tuple<Tensor, Tensor> paged_attention_int4_cpu_impl(
    const Tensor& query_in, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables_in, const Tensor& seq_lens_in, const Tensor& query_start_loc_in,
    double scale, int64_t group_size, int64_t sliding_window, double softcap, bool want_lse) {
  const AttentionShape shape =
      check_paged_attention_int4(query_in, key_cache, value_cache, block_tables_in, seq_lens_in, query_start_loc_in,
                                 scale, group_size, sliding_window, softcap);
  // Private copies of the metadata: the values checked are the values used (no read outside the cache).
  const Tensor block_tables = contiguous_copy(block_tables_in);
  const Tensor seq_lens = contiguous_copy(seq_lens_in);
  const Tensor query_start_loc = contiguous_copy(query_start_loc_in);
  check_attention_metadata_values(shape, block_tables, seq_lens, query_start_loc, sliding_window);
  const Tensor& query = query_in;
  Tensor out = empty({shape.num_tokens, shape.num_q_heads, shape.head_dim}, query.scalar_type(), query);
  Tensor lse = want_lse ? empty({shape.num_tokens, shape.num_q_heads}, ScalarType::Float, query)
                            : Tensor();
  if (shape.num_tokens == 0) return {out, lse};
  const AttentionParams args = attention_params(shape, query, key_cache, value_cache, block_tables, seq_lens,
                                                query_start_loc, out, lse, scale, sliding_window, softcap);
  std::vector<Int4Item> items;
  items.reserve(shape.num_tokens * shape.num_kv_heads);
  for (int64_t b = 0; b < args.num_seqs; ++b) {
    for (int64_t t = args.query_start_loc[b]; t < args.query_start_loc[b + 1]; ++t) {
      for (int64_t h = 0; h < args.num_kv_heads; ++h) items.push_back({b, t, h});
    }
  }
  dispatch_float(query.scalar_type(), [&](auto type) {
    using scalar_t = decltype(type);
    parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      thread_local Int4Scratch scratch;  // grown once, reused by later calls on this thread
      for (int64_t i = begin; i < end; ++i) attend_int4_item<scalar_t>(args, group_size, items[i], scratch);
    });
  });
  return {out, lse};
}

Tensor paged_attention_int4_cpu(const Tensor& query, const Tensor& key_cache,
                                    const Tensor& value_cache, const Tensor& block_tables,
                                    const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
                                    int64_t group_size, int64_t max_seq_len, int64_t sliding_window, double softcap) {
  (void)max_seq_len;  // a CUDA launch hint; the CPU kernel reads seq_lens
  return std::get<0>(paged_attention_int4_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens,
                                                   query_start_loc, scale, group_size, sliding_window, softcap,
                                                   false));
}

std::tuple<Tensor, Tensor> paged_attention_int4_with_lse_cpu(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
    int64_t group_size, int64_t max_seq_len, int64_t sliding_window, double softcap) {
  (void)max_seq_len;
  return paged_attention_int4_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                       group_size, sliding_window, softcap, true);
}

}  // namespace
}  // namespace pagedkv

STABLE_TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("reshape_and_cache_int4", TORCH_BOX(&pagedkv::reshape_and_cache_int4_cpu));
  m.impl("paged_attention_int4", TORCH_BOX(&pagedkv::paged_attention_int4_cpu));
  m.impl("paged_attention_int4_with_lse", TORCH_BOX(&pagedkv::paged_attention_int4_with_lse_cpu));
}
