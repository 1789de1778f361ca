// CPU paged attention, torch glue: checks, the plan of work items (a decode sequence over all its KV
// heads, a prefill sequence per KV head x query chunk; split over the keys or the heads when there are
// too few items for the threads), the run of one ISA copy of the kernels (ops/cpu/) with
// at::parallel_for, and the merge of split-K partitions.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <string>
#include <tuple>
#include <vector>

#include "ops/attention_plan.h"
#include "ops/cpu/attention_cpu.h"
#include "ops/ops.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace {

using cpu::Isa;
using cpu::Kernel;
using cpu::WorkItem;

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and Linux's permission for this process
// to use the tile data state (asked once: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_bf16_usable() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// Whether this CPU runs a copy (and this build has it).
bool cpu_supports(Isa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAmx: {
      static const bool has = cpu_supports(Isa::kAvx512) && amx_bf16_usable();
      return has;
    }
    case Isa::kAvx512: {
      static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                              __builtin_cpu_supports("avx512bf16") && cpu_supports(Isa::kAvx2);
      return has;
    }
    case Isa::kAvx2: {
      static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                              __builtin_cpu_supports("f16c");
      return has;
    }
    default: return true;
  }
#else
  return isa == Isa::kBaseline;
#endif
}

// The best copy allowed: set_cpu_attention_isa(), else PAGEDKV_CPU_BASELINE=1 at start-up (tests run
// each copy in one process).
Isa initial_isa_limit() { return std::getenv("PAGEDKV_CPU_BASELINE") != nullptr ? Isa::kBaseline : Isa::kAmx; }
std::atomic<Isa> isa_limit{initial_isa_limit()};

Isa active_isa() {
  for (Isa isa = isa_limit.load(std::memory_order_relaxed); isa != Isa::kBaseline; isa = Isa(int(isa) + 1)) {
    if (cpu_supports(isa)) return isa;
  }
  return Isa::kBaseline;
}

template <typename scalar_t, typename cache_t>
void run_work_items(Isa isa, const AttentionParams& a, const std::vector<WorkItem>& items) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local cpu::Scratch scratch;  // grown once, reused by later calls on this thread
    switch (isa) {
#if defined(__x86_64__)
      case Isa::kAmx: cpu::amx::attend_work_items<scalar_t, cache_t>(a, items, next, scratch); break;
      case Isa::kAvx512: cpu::avx512::attend_work_items<scalar_t, cache_t>(a, items, next, scratch); break;
      case Isa::kAvx2: cpu::avx2::attend_work_items<scalar_t, cache_t>(a, items, next, scratch); break;
#endif
      default: cpu::baseline::attend_work_items<scalar_t, cache_t>(a, items, next, scratch); break;
    }
  });
}

// Work items. A decode sequence is one item over all its KV heads (a block's rows for those heads are
// adjacent in memory); a prefill sequence gives one item per (KV head, chunk of queries; micro-GEMM
// chunks of kGemmRowsPerItem rows, whose row blocks share each staged K/V tile). With fewer
// items than kItemsPerThread (decode: kDecodeItemsPerThread) per thread, long key ranges are split into
// partitions merged afterwards (split-K), and decode sequences too short to split are divided over
// their KV heads instead.
std::vector<WorkItem> plan_work(const AttentionShape& shape, const int32_t* seq_lens, const int32_t* qsl,
                                int64_t sliding_window, int64_t* num_partial_rows) {
  const int64_t G = shape.num_q_heads / shape.num_kv_heads, Hkv = shape.num_kv_heads;
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < shape.num_seqs; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    const bool gemm = cpu::use_gemm_path(q_len, G);
    const int64_t q_chunk = std::max<int64_t>(1, (gemm ? cpu::kGemmRowsPerItem : cpu::kRowsPerItem) / G);
    for (int64_t q0 = 0; q0 < q_len; q0 += q_chunk) {
      const int64_t q_count = std::min(q_chunk, q_len - q0);
      const KeyRange keys{visible_keys(query_position(seq_lens[b], q_len, q0), sliding_window).begin,
                          query_position(seq_lens[b], q_len, q0 + q_count - 1) + 1};
      if (q_count == 1 && shape.head_dim % cpu::kDecodeDimAlign == 0) {
        items.push_back(WorkItem{int32_t(b), 0, int32_t(q0), 1, int32_t(Hkv), 0, 1, 0, keys, Kernel::kDecode});
        continue;
      }
      const Kernel kernel = gemm ? Kernel::kPrefillGemm : Kernel::kPrefillRows;
      for (int64_t h = 0; h < Hkv; ++h) {
        items.push_back(WorkItem{int32_t(b), int32_t(h), int32_t(q0), int32_t(q_count), 1, 0, 1, 0, keys, kernel});
      }
    }
  }
  *num_partial_rows = 0;
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<WorkItem> split;
  for (const WorkItem& item : items) {
    const int64_t target_items =
        (item.kernel == Kernel::kDecode ? cpu::kDecodeItemsPerThread : cpu::kItemsPerThread) * at::get_num_threads();
    const int64_t num_keys = item.keys.end - item.keys.begin;
    const int64_t parts = num_partitions(num_keys, num_items, target_items);
    // Head groups for decode items that key splitting leaves short of the target.
    const int64_t head_groups =
        item.kernel == Kernel::kDecode && num_items * parts < target_items
            ? std::min<int64_t>(item.kv_head_count, ceil_div(target_items, num_items * parts))
            : 1;
    for (int64_t hg = 0; hg < head_groups; ++hg) {
      WorkItem group = item;
      group.kv_head = int32_t(item.kv_head + hg * item.kv_head_count / head_groups);
      group.kv_head_count = int32_t(item.kv_head + (hg + 1) * item.kv_head_count / head_groups - group.kv_head);
      if (parts == 1) {
        split.push_back(group);
        continue;
      }
      const int64_t part_size = partition_size(num_keys, parts);
      for (int64_t p = 0; p < parts; ++p) {
        WorkItem piece = group;
        piece.part = int32_t(p);
        piece.num_parts = int32_t(parts);
        piece.partial_row = *num_partial_rows;
        piece.keys = partition_keys(group.keys, p, parts, part_size);
        split.push_back(piece);
      }
      *num_partial_rows += parts * group.rows(G);
    }
  }
  return split;
}

// Folds the partitions of every split item into the final output (OnlineSoftmax::add_partial).
template <typename scalar_t>
void merge_partitions(const AttentionParams& a, const std::vector<WorkItem>& items) {
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads;
  std::vector<const WorkItem*> firsts;
  for (const WorkItem& item : items) {
    if (item.num_parts > 1 && item.part == 0) firsts.push_back(&item);
  }
  at::parallel_for(0, static_cast<int64_t>(firsts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = *firsts[i];
      const int64_t rows = item.rows(G);
      for (int64_t r = 0; r < rows; ++r) {
        OnlineSoftmax state;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < item.num_parts; ++p) {
          const int64_t row = item.partial_row + p * rows + r;
          const SoftmaxStep step = state.add_partial(a.partial_lse[row]);
          if (step.weight == 0.f) continue;
          const float* o = a.partial_out + row * D;
          for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * step.alpha + step.weight * o[d];
        }
        cpu::write_output_row<scalar_t>(a, item.row_token(a, r, G), item.row_head(r, G), acc.data(), state);
      }
    }
  });
}

}  // namespace

void paged_attention_cpu_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& query_in,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                              const at::Tensor& query_start_loc_in, double scale, int64_t sliding_window,
                              double softcap, KvScale k_scale, KvScale v_scale) {
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
  const std::vector<WorkItem> items =
      plan_work(shape, seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), sliding_window,
                &num_partial_rows);
  std::vector<float> partial_out(num_partial_rows * shape.head_dim), partial_lse(num_partial_rows);

  AttentionParams args = attention_params(shape, query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, out, lse, scale, sliding_window, softcap);
  args.partial_out = partial_out.data();
  args.partial_lse = partial_lse.data();
  args.k_scale = k_scale;
  args.v_scale = v_scale;

  const Isa isa = active_isa();
  dispatch_float(query.scalar_type(), [&](auto type) {
    using scalar_t = decltype(type);
    if (is_fp8(key_cache.scalar_type())) {
      dispatch_fp8(kv_format(key_cache.scalar_type()), [&](auto format) {
        run_work_items<scalar_t, typename Fp8Traits<decltype(format)::value>::type>(isa, args, items);
      });
    } else {
      run_work_items<scalar_t, scalar_t>(isa, args, items);
    }
    if (num_partial_rows > 0) merge_partitions<scalar_t>(args, items);
  });
}

namespace {

// Checks every argument, copies the scales (checked values = read values), then runs the kernels.
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu_impl(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, bool want_lse) {
  check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, softcap, k_scale, v_scale);
  const auto [k_copy, k_s] = cpu_kv_scale(k_scale, "k_scale");
  const auto [v_copy, v_s] = cpu_kv_scale(v_scale, "v_scale");
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = want_lse ? at::empty({query.size(0), query.size(1)}, query.options().dtype(at::kFloat))
                            : at::Tensor();
  paged_attention_cpu_into(out, lse, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window, softcap, k_s, v_s);
  return {out, lse};
}

// max_seq_len is a CUDA launch-shape hint; the CPU reads seq_lens directly.
at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start_loc, double scale, int64_t /*max_seq_len*/,
                               int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& v_scale) {
  return std::get<0>(paged_attention_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                              scale, sliding_window, softcap, k_scale, v_scale, false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_with_lse_cpu(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t /*max_seq_len*/, int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  return paged_attention_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                  sliding_window, softcap, k_scale, v_scale, true);
}

}  // namespace
void set_cpu_attention_isa(const std::string& isa) {
  if (isa == "auto") {
    isa_limit.store(Isa::kAmx);
    return;
  }
  for (const Isa candidate : {Isa::kAmx, Isa::kAvx512, Isa::kAvx2, Isa::kBaseline}) {
    if (isa != isa_name(candidate)) continue;
    TORCH_CHECK_VALUE(cpu_supports(candidate), "cpu attention isa '", isa, "' is not supported by this CPU");
    isa_limit.store(candidate);
    return;
  }
  TORCH_CHECK_VALUE(false, "cpu attention isa must be 'auto', 'amx', 'avx512', 'avx2' or 'baseline', got '", isa, "'");
}

std::string cpu_attention_isa() { return isa_name(active_isa()); }

std::vector<std::string> cpu_attention_isas() {
  std::vector<std::string> names;
  for (const Isa isa : {Isa::kAmx, Isa::kAvx512, Isa::kAvx2, Isa::kBaseline}) {
    if (cpu_supports(isa)) names.push_back(isa_name(isa));
  }
  return names;
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", &pagedkv::paged_attention_cpu);
  m.impl("paged_attention_with_lse", &pagedkv::paged_attention_with_lse_cpu);
}
