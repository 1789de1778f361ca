// CPU kernels of the MLA ops: concat_and_cache_mla (each token's latent and rope key into its latent cache
// row) and paged_attention_mla(_with_lse). Attention runs one work item per (query token, chunk of heads):
// a tile of latent rows is converted to fp32 once for the chunk's heads, scored against every head's query
// over the whole row (K) and accumulated over the row's first kv_lora_rank elements (V), with an online
// softmax per head. The two inner loops have AVX-512 and AVX2 clones picked at load time (x86-64).
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops/fp8.h"
#include "ops/mla.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace {

// ---------------------------------------------------------------------------------------------------
// concat_and_cache_mla

// Writes row t of kv_c then row t of k_pe into each token's slot; store(x) maps an input element to a
// cache element (raw bits, or a float8 encoding).
template <typename in_t, typename cache_t, typename Store>
void write_latent_rows(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache,
                       const Tensor& slots, Store store) {
  const int64_t rank = kv_c.size(1), rope = k_pe.size(1), block_size = kv_cache.size(1);
  const int64_t* slot = slots.mutable_data_ptr<int64_t>();
  const auto* c = static_cast<const in_t*>(kv_c.data_ptr());
  const auto* pe = static_cast<const in_t*>(k_pe.data_ptr());
  auto* cache = static_cast<cache_t*>(kv_cache.data_ptr());
  const CacheStrides strides{kv_cache.stride(0), kv_cache.stride(1), 0};
  const int64_t cs0 = kv_c.stride(0), cs1 = kv_c.stride(1), ps0 = k_pe.stride(0), ps1 = k_pe.stride(1);
  parallel_for(0, kv_c.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding
      cache_t* row = cache + cache_slot_offset(slot[t], block_size, strides);
      for (int64_t d = 0; d < rank; ++d) row[d] = store(c[t * cs0 + d * cs1]);
      for (int64_t d = 0; d < rope; ++d) row[rank + d] = store(pe[t * ps0 + d * ps1]);
    }
  });
}

void concat_and_cache_mla_cpu(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache,
                              const Tensor& slot_mapping, const std::string& kv_cache_dtype,
                              const std::optional<Tensor>& scale) {
  check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, std::string(kv_cache_dtype), scale);
  // A private int64 copy: the kernel reads exactly the values checked, whatever another thread writes.
  const Tensor slots = contiguous_copy(slot_mapping, ScalarType::Long);
  check_slot_values(slots, kv_cache.size(0) * kv_cache.size(1));
  if (is_fp8(kv_cache.scalar_type())) {
    const auto [copy, s] = cpu_kv_scale(scale, "scale");
    const float scale_value = s.at(0);
    dispatch_float(kv_c.scalar_type(), [&](auto type_tag) {
      using scalar_t = decltype(type_tag);
      dispatch_fp8(kv_format(kv_cache.scalar_type()), [&](auto format) {
        constexpr KvFormat F = decltype(format)::value;
        write_latent_rows<scalar_t, uint8_t>(kv_c, k_pe, kv_cache, slots, [scale_value](scalar_t x) {
          return fp8_saturating_encode<F>(static_cast<float>(x) / scale_value);
        });
      });
    });
    return;
  }
  const auto copy = [](auto bits) { return bits; };
  if (kv_c.element_size() == 4) {
    write_latent_rows<uint32_t, uint32_t>(kv_c, k_pe, kv_cache, slots, copy);
  } else {
    write_latent_rows<uint16_t, uint16_t>(kv_c, k_pe, kv_cache, slots, copy);
  }
}

// ---------------------------------------------------------------------------------------------------
// paged_attention_mla: inner loops

#if defined(__x86_64__)
#define PAGEDKV_MLA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PAGEDKV_MLA_CLONES
#endif

constexpr int64_t kKeyTile = 16;       // latent rows converted to fp32 at a time
constexpr int64_t kMaxHeadChunk = 16;  // heads of one work item (they share each converted tile)

// scores[j] = q . rows[j] over width elements, for the n rows of a tile (rows row_stride apart).
PAGEDKV_MLA_CLONES void score_tile(const float* q, const float* rows, int64_t n, int64_t width, int64_t row_stride,
                                   float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const float* k = rows + j * row_stride;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < width; ++d) s += q[d] * k[d];
    scores[j] = s;
  }
}

// acc = acc * alpha + sum_j probs[j] * rows[j][:rank].
PAGEDKV_MLA_CLONES void accumulate_tile(float* acc, float alpha, const float* probs, const float* rows, int64_t n,
                                        int64_t rank, int64_t row_stride) {
  if (alpha != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < rank; ++d) acc[d] *= alpha;
  }
  for (int64_t j = 0; j < n; ++j) {
    const float p = probs[j];
    const float* v = rows + j * row_stride;
#pragma omp simd
    for (int64_t d = 0; d < rank; ++d) acc[d] += p * v[d];
  }
}

// Element -> fp32: float8 through a 256-entry table (its decode has branches), the rest by conversion.
template <KvFormat F>
struct Fp8Table {
  std::array<float, 256> value;
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = Fp8Traits<F>::decode(static_cast<uint8_t>(b));
  }
};

template <KvFormat F>
float fp8_to_float(typename Fp8Traits<F>::type x) {
  static const Fp8Table<F> table;
  return table.value[x.x];
}

template <typename cache_t>
float to_float(cache_t x) {
  if constexpr (std::is_same_v<cache_t, c10::Float8_e4m3fn>) {
    return fp8_to_float<KvFormat::kE4M3>(x);
  } else if constexpr (std::is_same_v<cache_t, c10::Float8_e5m2>) {
    return fp8_to_float<KvFormat::kE5M2>(x);
  } else {
    return static_cast<float>(x);
  }
}

// One work item: the heads [head, head + num_heads) of one query token of sequence seq.
struct MlaItem {
  int64_t seq, token, head, num_heads;
};

struct MlaScratch {
  std::vector<float> q, acc, rows, scores, probs;
  std::vector<OnlineSoftmax> state;
};

// The work items of a call: every query token, its heads cut into chunks small enough that the items
// keep num_threads threads busy (4 items each) and no larger than kMaxHeadChunk.
std::vector<MlaItem> plan_mla_items(const AttentionParams& a, int64_t num_threads) {
  int64_t chunk = std::min<int64_t>(a.num_q_heads, kMaxHeadChunk);
  while (chunk > 1 && a.num_tokens * ceil_div(a.num_q_heads, chunk) < 4 * num_threads) chunk = ceil_div(chunk, 2);
  std::vector<MlaItem> items;
  items.reserve(a.num_tokens * ceil_div(a.num_q_heads, chunk));
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    for (int64_t t = a.query_start_loc[b]; t < a.query_start_loc[b + 1]; ++t) {
      for (int64_t h = 0; h < a.num_q_heads; h += chunk) {
        items.push_back({b, t, h, std::min(chunk, a.num_q_heads - h)});
      }
    }
  }
  return items;
}

// Causal attention of one item over its visible latent rows [0, pos]; only those rows are read.
template <typename scalar_t, typename cache_t>
void attend_mla_item(const AttentionParams& a, int64_t rank, const MlaItem& item, MlaScratch& s) {
  const int64_t W = a.head_dim, H = item.num_heads;
  const int64_t q_len = a.query_start_loc[item.seq + 1] - a.query_start_loc[item.seq];
  const int64_t seq_len = a.seq_lens[item.seq];
  const int64_t pos = query_position(seq_len, q_len, item.token - a.query_start_loc[item.seq]);
  const KeyRange keys = visible_keys(pos, -1);
  const int32_t* block_table = a.block_tables + item.seq * a.max_blocks;
  const float kv_scale = a.k_scale.at(0);  // K and V are the same bytes: one scale

  s.q.resize(H * W), s.acc.assign(H * rank, 0.f), s.state.assign(H, OnlineSoftmax{});
  s.rows.resize(kKeyTile * W), s.scores.resize(kKeyTile), s.probs.resize(kKeyTile);
  const auto* query = static_cast<const scalar_t*>(a.query);
  const float q_scale = a.scale * kv_scale;  // the cache scale folded into the query (K) and the output (V)
  for (int64_t h = 0; h < H; ++h) {
    const scalar_t* q = query + item.token * a.q_stride_token + (item.head + h) * a.q_stride_head;
    for (int64_t d = 0; d < W; ++d) s.q[h * W + d] = static_cast<float>(q[d]) * q_scale;
  }
  const auto* cache = static_cast<const cache_t*>(a.key_cache);
  for (int64_t tile = keys.begin; tile < keys.end; tile += kKeyTile) {
    const int64_t n = std::min(kKeyTile, keys.end - tile);
    for (int64_t j = 0; j < n; ++j) {
      const cache_t* row = cache + cache_position_offset(block_table, tile + j, a.block_size, a.cache_strides);
      float* dst = s.rows.data() + j * W;
      for (int64_t d = 0; d < W; ++d) dst[d] = to_float(row[d]);
    }
    for (int64_t h = 0; h < H; ++h) {
      score_tile(s.q.data() + h * W, s.rows.data(), n, W, W, s.scores.data());
      float tile_max = kNegInf;
      for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, s.scores[j]);
      OnlineSoftmax& st = s.state[h];
      const float alpha = st.rescale_to(tile_max);
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        s.probs[j] = std::exp(s.scores[j] - st.m);
        sum += s.probs[j];
      }
      st.l += sum;
      accumulate_tile(s.acc.data() + h * rank, alpha, s.probs.data(), s.rows.data(), n, rank, W);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const int64_t row = item.token * a.num_q_heads + item.head + h;
    const float inv = s.state[h].inv_sum() * kv_scale;
    auto* out = static_cast<scalar_t*>(a.out) + row * rank;
    for (int64_t d = 0; d < rank; ++d) out[d] = static_cast<scalar_t>(s.acc[h * rank + d] * inv);
    if (a.lse != nullptr) a.lse[row] = s.state[h].lse();
  }
}

template <typename scalar_t, typename cache_t>
void run_mla_items(const AttentionParams& a, int64_t rank, const std::vector<MlaItem>& items) {
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local MlaScratch scratch;  // grown once, reused by later calls on this thread
    for (int64_t i = begin; i < end; ++i) attend_mla_item<scalar_t, cache_t>(a, rank, items[i], scratch);
  });
}

std::tuple<Tensor, Tensor> paged_attention_mla_cpu_impl(
    const Tensor& query_in, const Tensor& kv_cache, const Tensor& block_tables_in,
    const Tensor& seq_lens_in, const Tensor& query_start_loc_in, double scale, int64_t kv_lora_rank,
    const std::optional<Tensor>& kv_scale, bool want_lse) {
  const AttentionShape shape = check_paged_attention_mla(query_in, kv_cache, block_tables_in, seq_lens_in,
                                                         query_start_loc_in, scale, kv_lora_rank, kv_scale);
  const auto [scale_copy, kv_s] = cpu_kv_scale(kv_scale, "kv_scale");
  // Private copies of the metadata: the values checked are the values used (no read outside the cache).
  const Tensor block_tables = contiguous_copy(block_tables_in);
  const Tensor seq_lens = contiguous_copy(seq_lens_in);
  const Tensor query_start_loc = contiguous_copy(query_start_loc_in);
  check_attention_metadata_values(shape, block_tables, seq_lens, query_start_loc, /*sliding_window=*/-1);
  const Tensor query = query_in.stride(2) == 1 ? query_in : as_contiguous(query_in);
  Tensor out = empty({shape.num_tokens, shape.num_q_heads, kv_lora_rank}, query.scalar_type(), query);
  Tensor lse = want_lse ? empty({shape.num_tokens, shape.num_q_heads}, ScalarType::Float, query)
                            : Tensor();
  if (shape.num_tokens == 0) return {out, lse};
  const Tensor cache = mla_cache_as_kv_view(kv_cache);
  AttentionParams args = attention_params(shape, query, cache, cache, block_tables, seq_lens, query_start_loc, out,
                                          lse, scale, /*sliding_window=*/-1, /*softcap=*/0.0);
  args.k_scale = kv_s;
  const std::vector<MlaItem> items = plan_mla_items(args, num_threads());
  dispatch_float(query.scalar_type(), [&](auto type) {
    using scalar_t = decltype(type);
    if (is_fp8(kv_cache.scalar_type())) {
      dispatch_fp8(kv_format(kv_cache.scalar_type()), [&](auto format) {
        run_mla_items<scalar_t, typename Fp8Traits<decltype(format)::value>::type>(args, kv_lora_rank, items);
      });
    } else {
      run_mla_items<scalar_t, scalar_t>(args, kv_lora_rank, items);
    }
  });
  return {out, lse};
}

Tensor paged_attention_mla_cpu(const Tensor& query, const Tensor& kv_cache, const Tensor& block_tables,
                                   const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
                                   int64_t kv_lora_rank, const std::optional<Tensor>& kv_scale) {
  return std::get<0>(paged_attention_mla_cpu_impl(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                                  kv_lora_rank, kv_scale, false));
}

std::tuple<Tensor, Tensor> paged_attention_mla_with_lse_cpu(
    const Tensor& query, const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
    const Tensor& query_start_loc, double scale, int64_t kv_lora_rank, const std::optional<Tensor>& kv_scale) {
  return paged_attention_mla_cpu_impl(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank,
                                      kv_scale, true);
}

}  // namespace
}  // namespace pagedkv

STABLE_TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("concat_and_cache_mla", TORCH_BOX(&pagedkv::concat_and_cache_mla_cpu));
  m.impl("paged_attention_mla", TORCH_BOX(&pagedkv::paged_attention_mla_cpu));
  m.impl("paged_attention_mla_with_lse", TORCH_BOX(&pagedkv::paged_attention_mla_with_lse_cpu));
}
