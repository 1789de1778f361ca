// The CPU paged attention between its glue (ops/attention_cpu.cpp: checks, plan, merge) and its kernels
// (one file per kernel: decode.inc, prefill_rows.inc, prefill_gemm.inc), which are compiled once per
// instruction set (attention_<isa>.cpp) and chosen at run time: work items, per-thread scratch, the
// entry point of each ISA copy, and the row output shared by the kernels and the split-K merge.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // used by the x86 copies of the kernels only (PAGEDKV_CPU_AVX2)
#endif
#if defined(__aarch64__)
#include <arm_neon.h>  // used by the NEON copies only (PAGEDKV_CPU_NEON)
#endif

#include "ops/attention_plan.h"
#include "ops/fp8.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace cpu {

// Per-row kernel: keys gathered (and converted to fp32) per step, and query rows (query x GQA head)
// per work item (at least one GQA group).
constexpr int64_t kKeyTile = 32;
constexpr int64_t kRowsPerItem = 32;
// Prefill: sequences with more than one query and at least kGemmMinRows rows (queries x GQA group)
// run register-tiled micro-GEMMs (Q K^T and P V over fp32 tiles of kGemmKeyTile keys).
constexpr int64_t kGemmMinRows = 16;
constexpr int64_t kGemmKeyTile = 128;
// Rows per micro-GEMM item, computed in row blocks that share each staged K/V tile: blocks of
// kGemmRowBlock rows in prefill_gemm.inc, of 32 rows over kAmxGemmKeyTile-key tiles in prefill_amx.inc.
constexpr int64_t kGemmRowsPerItem = 512;
constexpr int64_t kGemmRowBlock = 64;
constexpr int64_t kAmxGemmKeyTile = 256;
constexpr int64_t kGemmRowAlign = 16;  // rows and head_dim padded to a multiple of this in the GEMM path
// Single-query (decode) kernel: head_dim must be a multiple of this.
constexpr int64_t kDecodeDimAlign = 8;
// Split-K partitions are planned so that there are this many items per thread; decode items are
// cut finer, so that a thread that another process delays holds back a smaller share of the call.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kDecodeItemsPerThread = 8;

enum class Kernel : int8_t {
  kDecode,       // one query: every row (GQA head) sees the same keys; may span several KV heads
  kPrefillRows,  // a few queries: per-row dot products
  kPrefillGemm,  // many rows: micro-GEMMs
};

inline bool use_gemm_path(int64_t q_len, int64_t group) { return q_len >= 2 && q_len * group >= kGemmMinRows; }

// The rows (queries q_begin.. x query heads of KV heads kv_head..) of one sequence over one range of
// keys. Row r is query q_begin + r / heads() and query head kv_head * group + r % heads().
struct WorkItem {
  int32_t seq, kv_head, q_begin, q_count;
  int32_t kv_head_count;  // > 1 only for unsplit decode items
  int32_t part, num_parts;
  int64_t partial_row;  // first partial row of partition 0 (split items only)
  KeyRange keys;        // keys this item attends to (one partition of the chunk's visible keys)
  Kernel kernel;

  int64_t heads(int64_t group) const { return int64_t(kv_head_count) * group; }
  int64_t rows(int64_t group) const { return int64_t(q_count) * heads(group); }
  int64_t row_token(const AttentionParams& a, int64_t r, int64_t group) const {
    return a.query_start_loc[seq] + q_begin + r / heads(group);
  }
  int64_t row_head(int64_t r, int64_t group) const { return int64_t(kv_head) * group + r % heads(group); }
};

// Per-thread buffers, grown on demand and reused across items and calls.
struct Scratch {
  std::vector<float> q, acc, k_tile, v_tile, scores;
  std::vector<OnlineSoftmax> state;
  std::vector<KeyRange> row_keys;
  std::vector<const float*> row_q;  // decode: the query rows and accumulators of one KV head's group
  std::vector<float*> row_acc;
  std::vector<const c10::BFloat16*> row_q16;  // decode by bf16 dot products: the group's bf16 query rows
  int64_t slot_rows[kKeyTile];  // element offset of each tile key's slot (head 0)
  const float* k_rows[kKeyTile];
  const float* v_rows[kKeyTile];
  // GEMM path: Qt [Dp][R] (scaled, transposed, zero-padded), K/V tiles [kGemmKeyTile][Dp], scores
  // St [kGemmKeyTile][R], accumulator [R][Dp], per-row alpha and visible key range.
  std::vector<float> g_qt, g_k, g_v, g_st, g_acc, g_alpha;
  std::vector<int32_t> g_begin, g_end;
  const float* g_k_rows[kGemmKeyTile];  // K/V row of each tile key, in g_k/g_v
  const float* g_v_rows[kGemmKeyTile];
  // GEMM path with bf16 pair products (AVX-512 BF16): query rows as dimension pairs [D/2][R], K rows as
  // stored [kGemmKeyTile][D], V as key pairs [kGemmKeyTile/2][D], probabilities as key pairs [.../2][R].
  std::vector<uint32_t> g_qw, g_vw, g_pw;
  std::vector<uint16_t> g_k16;
  const uint16_t* g_k16_rows[kGemmKeyTile];  // K row of each tile key (in g_k16), V row (in the cache)
  const uint16_t* g_v16_rows[kGemmKeyTile];
  // AMX GEMM path (bf16, kAmxGemmKeyTile keys per tile): the query rows [R][D], probabilities [R][<=tile]
  // (row-major, as the P V operand), V as key-pair words [tile/2][D], K as VNNI words [tile/16][D/32][16][16].
  std::vector<uint32_t> g_vp, g_kw;
  std::vector<uint16_t> g_q16, g_pb;
  std::vector<uint16_t> zero_row;  // bf16 decode and AMX prefill: a row of zeros (padding keys' K and V)

  void reserve(int64_t rows, int64_t head_dim) {
    grow(q, rows * head_dim);
    grow(acc, rows * head_dim);
    grow(state, rows);
    grow(row_keys, rows);
    grow(k_tile, kKeyTile * head_dim);
    grow(v_tile, kKeyTile * head_dim);
    grow(scores, rows * (kKeyTile + 8));
  }

  void reserve_gemm(int64_t R, int64_t Dp) {
    grow(g_qt, R * Dp);
    grow(g_acc, R * Dp);
    grow(g_alpha, R);
    grow(g_begin, R);
    grow(g_end, R);
    grow(g_st, kGemmKeyTile * R);
    grow(state, R);
    grow(g_k, kGemmKeyTile * Dp);
    grow(g_v, kGemmKeyTile * Dp);
  }

  void reserve_gemm_pairs(int64_t R, int64_t D) {
    grow(g_qw, R * D / 2);
    grow(g_vw, kGemmKeyTile / 2 * D);
    grow(g_pw, kGemmKeyTile / 2 * R);
    grow(g_k16, kGemmKeyTile * D);
  }

  // With 64 bytes to spare in each buffer, so that the kernel can start it on a cache line (aligned64).
  void reserve_gemm_amx(int64_t R, int64_t D) {
    grow(g_q16, R * D + 32);
    grow(g_vp, kAmxGemmKeyTile / 2 * D + 16);
    grow(g_pb, R * kAmxGemmKeyTile + 32);
    grow(g_kw, kAmxGemmKeyTile / 2 * D + 16);
    grow(g_st, kAmxGemmKeyTile * R + 16);
    grow(g_acc, R * D + 16);
    grow(g_v, kAmxGemmKeyTile * D);  // the exact P V's fp32 values
  }

 private:
  template <typename T>
  static void grow(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
};

// The first cache-line boundary at or after p.
template <typename T>
T* aligned64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// Final output of one row: out = acc / l (rounded to the query dtype) and, when asked, its lse; the
// head's sink, if any, joins the normaliser here, once per row (after the split-K merge for split rows,
// whose partials carry none), so every kernel copy has it.
template <typename scalar_t>
void write_output_row(const AttentionParams& a, int64_t token, int64_t head, const float* acc,
                      const OnlineSoftmax& state) {
  const int64_t D = a.head_dim, row = token * a.num_q_heads + head;
  OnlineSoftmax final_state = state;
  float inv = state.inv_sum();
  if (a.sinks != nullptr) inv *= final_state.add_sink(a.sinks[head]);
  auto* out = static_cast<scalar_t*>(a.out) + row * D;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(acc[d] * inv);
  if (a.lse != nullptr) a.lse[row] = final_state.lse();
}

// Row r of an item: the final output when the item is whole, else its partition's normalised partial
// output and lse (partial rows of an item: partition-major, then row).
template <typename scalar_t>
void write_item_row(const AttentionParams& a, const WorkItem& item, int64_t r, const float* acc,
                    const OnlineSoftmax& state) {
  const int64_t G = a.num_q_heads / a.num_kv_heads;
  if (item.num_parts == 1) {
    write_output_row<scalar_t>(a, item.row_token(a, r, G), item.row_head(r, G), acc, state);
    return;
  }
  const int64_t p = item.partial_row + item.part * item.rows(G) + r;
  const float inv = state.inv_sum();
  float* out = a.partial_out + p * a.head_dim;
  for (int64_t d = 0; d < a.head_dim; ++d) out[d] = acc[d] * inv;
  a.partial_lse[p] = state.lse();
}

// The copies of the kernels, best first; only the first that this CPU runs and that is not above a
// forced choice is used (x86-64: AMX, AVX-512, AVX2; aarch64: NEON with the BF16 extension, SVE,
// NEON; any CPU: the portable one).
enum class Isa : int8_t { kAmx, kAvx512, kAvx2, kNeonBf16, kSve, kNeon, kBaseline };
constexpr Isa kAllIsas[] = {Isa::kAmx, Isa::kAvx512, Isa::kAvx2, Isa::kNeonBf16, Isa::kSve, Isa::kNeon, Isa::kBaseline};

const char* isa_name(Isa isa);
bool cpu_supports(Isa isa);  // whether this CPU runs the copy (and this build has it)
Isa best_isa(Isa limit);     // the best copy this CPU runs that is not above limit

// The work items of one call (work_plan.cpp), cut for num_threads threads; split items leave
// *num_partial_rows partial rows for merge_partitions.
std::vector<WorkItem> plan_work(const AttentionParams& a, int64_t num_threads, int64_t* num_partial_rows);

// Entry point of each ISA copy: runs items[next++] until none is left (items differ in cost, so the
// threads pull them from a shared counter). scalar_t: query/output type; cache_t: the cache's (scalar_t
// or a float8 type).
#define PAGEDKV_CPU_ATTENTION_ENTRY(isa)                                                           \
  namespace isa {                                                                                   \
  template <typename scalar_t, typename cache_t>                                                   \
  void attend_work_items(const AttentionParams& a, const std::vector<WorkItem>& items,              \
                         std::atomic<int64_t>& next, Scratch& scratch);                             \
  }
PAGEDKV_CPU_ATTENTION_ENTRY(baseline)
#if defined(__x86_64__)
PAGEDKV_CPU_ATTENTION_ENTRY(avx2)
PAGEDKV_CPU_ATTENTION_ENTRY(avx512)
PAGEDKV_CPU_ATTENTION_ENTRY(amx)
#endif
#if defined(__aarch64__)
PAGEDKV_CPU_ATTENTION_ENTRY(neon_bf16)
PAGEDKV_CPU_ATTENTION_ENTRY(sve)
PAGEDKV_CPU_ATTENTION_ENTRY(neon)
#endif
#undef PAGEDKV_CPU_ATTENTION_ENTRY

// Runs items[next++] until none is left in the copy `isa` (one that cpu_supports).
template <typename scalar_t, typename cache_t>
void attend_work_items(Isa isa, const AttentionParams& a, const std::vector<WorkItem>& items,
                       std::atomic<int64_t>& next, Scratch& scratch) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::kAmx: return amx::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
    case Isa::kAvx512: return avx512::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
    case Isa::kAvx2: return avx2::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
#endif
#if defined(__aarch64__)
    case Isa::kNeonBf16: return neon_bf16::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
    case Isa::kSve: return sve::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
    case Isa::kNeon: return neon::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
#endif
    default: return baseline::attend_work_items<scalar_t, cache_t>(a, items, next, scratch);
  }
}

// Folds the partitions of a split item (its part 0) into the final output (OnlineSoftmax::add_partial);
// acc holds head_dim floats.
template <typename scalar_t>
void merge_partitions(const AttentionParams& a, const WorkItem& item, float* acc) {
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads, rows = item.rows(G);
  for (int64_t r = 0; r < rows; ++r) {
    OnlineSoftmax state;
    std::fill(acc, acc + D, 0.f);
    for (int64_t p = 0; p < item.num_parts; ++p) {
      const int64_t row = item.partial_row + p * rows + r;
      const SoftmaxStep step = state.add_partial(a.partial_lse[row]);
      if (step.weight == 0.f) continue;
      const float* o = a.partial_out + row * D;
      for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * step.alpha + step.weight * o[d];
    }
    write_output_row<scalar_t>(a, item.row_token(a, r, G), item.row_head(r, G), acc, state);
  }
}

}  // namespace cpu
}  // namespace pagedkv
