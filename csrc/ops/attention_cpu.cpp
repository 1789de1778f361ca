// CPU paged attention: plans work items (sequence x KV head x query chunk, split over the keys when
// there are too few items for the threads), runs them with at::parallel_for, and merges split-K
// partials by log-sum-exp. The per-item kernel is attention_cpu_kernel.inc.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/ops.h"
#include "ops/paged_kv.h"

// The baseline copy of the kernel passes 32-byte vectors between inline helpers; no ABI boundary.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace pagedkv {
namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v8i_u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint16_t v8u16_u __attribute__((vector_size(16), aligned(2), may_alias));

constexpr int64_t kKeyTile = 32;     // keys gathered (and converted to fp32) per step
constexpr int64_t kRowsPerItem = 32;  // query rows (query x GQA head) per work item, at least one GQA group
constexpr int64_t kMinKeysPerPartition = 256;
// Prefill path: sequences with more than one query and at least kGemmMinRows rows (queries x GQA
// group) run their items through register-tiled micro-GEMMs (Q K^T and P V over fp32 tiles of
// kGemmKeyTile keys) instead of per-row dots. Decode (one query) always takes the per-row kernel.
constexpr int64_t kGemmMinRows = 16;
constexpr int64_t kGemmKeyTile = 128;
constexpr int64_t kGemmRowsPerItem = 64;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline bool use_gemm_path(int64_t q_len, int64_t group) { return q_len >= 2 && q_len * group >= kGemmMinRows; }

struct CpuAttentionArgs {
  at::ScalarType dtype;
  const void* query;
  int64_t q_stride_token, q_stride_head;  // elements; head_dim is contiguous
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  void* out;     // [T, Hq, D], query dtype
  float* lse;    // [T, Hq] or nullptr
  float* partial_out;  // split-K partials [rows, D]
  float* partial_lse;
  int64_t num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, sliding_window;
  float scale, softcap;
};

struct CpuWorkItem {
  int32_t seq, kv_head, q_begin, q_count;
  int32_t kv_head_count;  // consecutive KV heads from kv_head; > 1 only for unsplit single-query items,
                          // which only the single-query kernel runs
  int32_t part, num_parts;
  int64_t partial_row;  // first partial row of partition 0 (split items only)
  KeyRange keys;        // keys this item attends to (one partition of the chunk's visible keys)
};

struct CpuScratch {
  std::vector<float> q, acc, k_tile, v_tile, scores;
  std::vector<OnlineSoftmax> state;
  std::vector<KeyRange> row_keys;
  int64_t slot_rows[kKeyTile];  // element offset of each tile key's slot (head 0)
  const float* k_rows[kKeyTile];
  const float* v_rows[kKeyTile];
  // GEMM path: Qt [Dp][R] (scaled, transposed, zero-padded), K/V tiles [kGemmKeyTile][Dp], scores
  // St [kGemmKeyTile][R], accumulator [R][Dp], per-row visible key range and softmax state.
  std::vector<float> g_qt, g_k, g_v, g_st, g_acc, g_m, g_l, g_alpha;
  std::vector<int32_t> g_begin, g_end;

  void reserve_gemm(int64_t R, int64_t Dp) {
    if (static_cast<int64_t>(g_qt.size()) < R * Dp) {
      g_qt.resize(R * Dp);
      g_acc.resize(R * Dp);
      g_m.resize(R);
      g_l.resize(R);
      g_alpha.resize(R);
      g_begin.resize(R);
      g_end.resize(R);
      g_st.resize(kGemmKeyTile * R);
    }
    if (static_cast<int64_t>(g_k.size()) < kGemmKeyTile * Dp) {
      g_k.assign(kGemmKeyTile * Dp, 0.f);  // padding columns D..Dp stay zero
      g_v.assign(kGemmKeyTile * Dp, 0.f);
    }
  }

  void reserve(int64_t rows, int64_t head_dim) {
    if (static_cast<int64_t>(q.size()) < rows * head_dim) {
      q.resize(rows * head_dim);
      acc.resize(rows * head_dim);
      state.resize(rows);
      row_keys.resize(rows);
    }
    if (static_cast<int64_t>(k_tile.size()) < kKeyTile * head_dim) {
      k_tile.resize(kKeyTile * head_dim);
      v_tile.resize(kKeyTile * head_dim);
    }
    if (static_cast<int64_t>(scores.size()) < rows * (kKeyTile + 8)) scores.resize(rows * (kKeyTile + 8));
  }
};

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PAGEDKV_CPU_AVX2 1
#include "ops/attention_cpu_kernel.inc"
#undef PAGEDKV_CPU_AVX2
#pragma GCC pop_options
}  // namespace avx2

namespace baseline {
#define PAGEDKV_CPU_AVX2 0
#include "ops/attention_cpu_kernel.inc"
#undef PAGEDKV_CPU_AVX2
}  // namespace baseline

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// The portable copy instead of the AVX2 one: PAGEDKV_CPU_BASELINE=1 at start-up, or
// set_cpu_attention_isa("baseline") (tests run both copies in one process).
std::atomic<bool> force_baseline{std::getenv("PAGEDKV_CPU_BASELINE") != nullptr};

// AVX2 + FMA + F16C when the CPU has them and the portable copy is not forced.
bool use_avx2_kernel() { return cpu_has_avx2() && !force_baseline.load(std::memory_order_relaxed); }

// Single-query items of one sequence fold into one item over all its KV heads when there are
// enough sequences to keep the threads busy (at least target_items of them).
std::vector<CpuWorkItem> merge_single_query_heads(std::vector<CpuWorkItem> items, const AttentionShape& shape,
                                                  int64_t target_items) {
  if (shape.num_kv_heads == 1 || shape.head_dim % 8 != 0 || shape.num_seqs < target_items) return items;
  std::vector<CpuWorkItem> merged;
  merged.reserve(items.size());
  for (const CpuWorkItem& item : items) {
    const bool fold = item.q_count == 1 && item.num_parts == 1;
    if (fold && !merged.empty() && merged.back().seq == item.seq && merged.back().q_begin == item.q_begin &&
        merged.back().q_count == 1 && merged.back().kv_head + merged.back().kv_head_count == item.kv_head) {
      ++merged.back().kv_head_count;
    } else {
      merged.push_back(item);
    }
  }
  return merged;
}

// Work items: one per (sequence, KV head, chunk of queries); when there are fewer items than a few
// per thread, long key ranges are split into partitions that are merged afterwards.
std::vector<CpuWorkItem> plan_work(const AttentionShape& shape, const int32_t* seq_lens, const int32_t* qsl,
                                   int64_t sliding_window, int64_t* num_partial_rows) {
  const int64_t G = shape.num_q_heads / shape.num_kv_heads;
  std::vector<CpuWorkItem> items;
  for (int64_t b = 0; b < shape.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    const int64_t q_chunk = std::max<int64_t>(1, (use_gemm_path(q_len, G) ? kGemmRowsPerItem : kRowsPerItem) / G);
    for (int64_t q0 = 0; q0 < q_len; q0 += q_chunk) {
      const int64_t q_count = std::min(q_chunk, q_len - q0);
      const KeyRange keys{visible_keys(query_position(seq_lens[b], q_len, q0), sliding_window).begin,
                          query_position(seq_lens[b], q_len, q0 + q_count - 1) + 1};
      for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
        items.push_back(CpuWorkItem{int32_t(b), int32_t(h), int32_t(q0), int32_t(q_count), 1, 0, 1, 0, keys});
      }
    }
  }
  *num_partial_rows = 0;
  const int64_t target_items = 4 * at::get_num_threads();
  if (items.empty() || static_cast<int64_t>(items.size()) * 2 > target_items) {
    return merge_single_query_heads(std::move(items), shape, target_items);
  }
  const int64_t want_parts = ceil_div(target_items, static_cast<int64_t>(items.size()));
  std::vector<CpuWorkItem> split;
  for (const CpuWorkItem& item : items) {
    const int64_t num_keys = item.keys.end - item.keys.begin;
    const int64_t parts = std::max<int64_t>(1, std::min(want_parts, num_keys / kMinKeysPerPartition));
    if (parts == 1) {
      split.push_back(item);
      continue;
    }
    const int64_t part_size = ceil_div(num_keys, parts);
    for (int64_t p = 0; p < parts; ++p) {
      CpuWorkItem piece = item;
      piece.part = int32_t(p);
      piece.num_parts = int32_t(parts);
      piece.partial_row = *num_partial_rows;
      piece.keys = partition_keys(item.keys, p, parts, part_size);
      split.push_back(piece);
    }
    *num_partial_rows += parts * item.q_count * G;
  }
  return split;
}

// Folds the partitions of every split item into the final output with the shared lse merge.
template <typename scalar_t>
void merge_partials(const CpuAttentionArgs& a, const std::vector<CpuWorkItem>& items) {
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads;
  std::vector<const CpuWorkItem*> heads;
  for (const CpuWorkItem& item : items) {
    if (item.num_parts > 1 && item.part == 0) heads.push_back(&item);
  }
  at::parallel_for(0, static_cast<int64_t>(heads.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t i = begin; i < end; ++i) {
      const CpuWorkItem& item = *heads[i];
      const int64_t rows = int64_t(item.q_count) * G;
      const int64_t q_start = a.query_start_loc[item.seq];
      for (int64_t r = 0; r < rows; ++r) {
        float max_lse = kNegInf;
        for (int64_t p = 0; p < item.num_parts; ++p) {
          max_lse = std::max(max_lse, a.partial_lse[item.partial_row + p * rows + r]);
        }
        std::fill(merged.begin(), merged.end(), 0.f);
        float weight_sum = 0.f;
        for (int64_t p = 0; p < item.num_parts; ++p) {
          const int64_t row = item.partial_row + p * rows + r;
          const float w = lse_merge_weight(a.partial_lse[row], max_lse);
          if (w == 0.f) continue;
          weight_sum += w;
          const float* o = a.partial_out + row * D;
          for (int64_t d = 0; d < D; ++d) merged[d] += w * o[d];
        }
        const int64_t token = q_start + item.q_begin + r / G, head = int64_t(item.kv_head) * G + r % G;
        const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
        auto* out = static_cast<scalar_t*>(a.out) + (token * a.num_q_heads + head) * D;
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(merged[d] * inv);
        if (a.lse != nullptr) a.lse[token * a.num_q_heads + head] = lse_merged(max_lse, weight_sum);
      }
    }
  });
}

}  // namespace

void paged_attention_cpu_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& query_in,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                              const at::Tensor& query_start_loc_in, double scale, int64_t sliding_window,
                              double softcap) {
  const AttentionShape shape = check_paged_attention(query_in, key_cache, value_cache, block_tables_in, seq_lens_in,
                                                     query_start_loc_in, scale, sliding_window, softcap);
  // The kernel reads private copies of the metadata, so the values checked are the values used even
  // if another thread writes the caller's tensors meanwhile (no read outside the cache, ever).
  const at::Tensor block_tables = block_tables_in.clone(at::MemoryFormat::Contiguous);
  const at::Tensor seq_lens = seq_lens_in.clone(at::MemoryFormat::Contiguous);
  const at::Tensor query_start_loc = query_start_loc_in.clone(at::MemoryFormat::Contiguous);
  check_attention_metadata_values(shape, block_tables, seq_lens, query_start_loc, sliding_window);
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  if (shape.num_tokens == 0) return;

  int64_t num_partial_rows = 0;
  const std::vector<CpuWorkItem> items =
      plan_work(shape, seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), sliding_window,
                &num_partial_rows);
  std::vector<float> partial_out(num_partial_rows * shape.head_dim), partial_lse(num_partial_rows);

  CpuAttentionArgs args{};
  args.dtype = query.scalar_type();
  args.query = query.data_ptr();
  args.q_stride_token = query.stride(0);
  args.q_stride_head = query.stride(1);
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  args.out = out.data_ptr();
  args.lse = lse.defined() ? lse.data_ptr<float>() : nullptr;
  args.partial_out = partial_out.data();
  args.partial_lse = partial_lse.data();
  args.num_q_heads = shape.num_q_heads;
  args.num_kv_heads = shape.num_kv_heads;
  args.head_dim = shape.head_dim;
  args.block_size = shape.block_size;
  args.max_blocks = shape.max_blocks;
  args.sliding_window = sliding_window;
  args.scale = static_cast<float>(scale);
  args.softcap = static_cast<float>(softcap);

  // Dynamic scheduling: each thread pulls items from a shared counter (items differ in cost).
  std::atomic<int64_t> next{0};
  const bool use_avx2 = use_avx2_kernel();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    CpuScratch scratch;
    if (use_avx2) {
      avx2::attend_work_items(args, items, next, scratch);
    } else {
      baseline::attend_work_items(args, items, next, scratch);
    }
  });
  if (num_partial_rows > 0) {
    switch (args.dtype) {
      case at::kFloat: merge_partials<float>(args, items); break;
      case at::kHalf: merge_partials<c10::Half>(args, items); break;
      default: merge_partials<c10::BFloat16>(args, items); break;
    }
  }
}

namespace {

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start_loc, double scale, int64_t max_seq_len,
                               int64_t sliding_window, double softcap) {
  (void)max_seq_len;  // a CUDA launch-shape hint; the CPU reads seq_lens directly
  check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, softcap);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  paged_attention_cpu_into(out, at::Tensor(), query, key_cache, value_cache, block_tables, seq_lens,
                           query_start_loc, scale, sliding_window, softcap);
  return out;
}

std::tuple<at::Tensor, at::Tensor> paged_attention_with_lse_cpu(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t max_seq_len, int64_t sliding_window, double softcap) {
  (void)max_seq_len;
  check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, softcap);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({query.size(0), query.size(1)}, query.options().dtype(at::kFloat));
  paged_attention_cpu_into(out, lse, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                           scale, sliding_window, softcap);
  return {out, lse};
}

}  // namespace
void set_cpu_attention_isa(const std::string& isa) {
  TORCH_CHECK_VALUE(isa == "auto" || isa == "baseline", "cpu attention isa must be 'auto' or 'baseline', got '", isa, "'");
  force_baseline.store(isa == "baseline");
}

std::string cpu_attention_isa() { return use_avx2_kernel() ? "avx2" : "baseline"; }

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", &pagedkv::paged_attention_cpu);
  m.impl("paged_attention_with_lse", &pagedkv::paged_attention_with_lse_cpu);
}
