// CPU paged attention, torch glue: checks, the run of the plan's work items (ops/cpu/work_plan.cpp) by
// one ISA copy of the kernels (ops/cpu/) with at::parallel_for, the merge of split-K partitions, and
// the choice of copy.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
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
using cpu::WorkItem;

// The best copy allowed: set_cpu_attention_isa(), else PAGEDKV_CPU_BASELINE=1 at start-up (tests run
// each copy in one process).
Isa initial_isa_limit() { return std::getenv("PAGEDKV_CPU_BASELINE") != nullptr ? Isa::kBaseline : Isa::kAmx; }
std::atomic<Isa> isa_limit{initial_isa_limit()};

Isa active_isa() { return cpu::best_isa(isa_limit.load(std::memory_order_relaxed)); }

template <typename scalar_t, typename cache_t>
void run_work_items(Isa isa, const AttentionParams& a, const std::vector<WorkItem>& items) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local cpu::Scratch scratch;  // grown once, reused by later calls on this thread
    cpu::attend_work_items<scalar_t, cache_t>(isa, a, items, next, scratch);
  });
}

// Folds the partitions of every split item into the final output.
template <typename scalar_t>
void merge_partitions(const AttentionParams& a, const std::vector<WorkItem>& items) {
  std::vector<const WorkItem*> firsts;
  for (const WorkItem& item : items) {
    if (item.num_parts > 1 && item.part == 0) firsts.push_back(&item);
  }
  at::parallel_for(0, static_cast<int64_t>(firsts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(a.head_dim);
    for (int64_t i = begin; i < end; ++i) cpu::merge_partitions<scalar_t>(a, *firsts[i], acc.data());
  });
}

}  // namespace

void paged_attention_cpu_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& query_in,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in,
                              const at::Tensor& query_start_loc_in, double scale, int64_t sliding_window,
                              double softcap, KvScale k_scale, KvScale v_scale, const float* sinks) {
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

  AttentionParams args = attention_params(shape, query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, out, lse, scale, sliding_window, softcap);
  int64_t num_partial_rows = 0;
  const std::vector<WorkItem> items = cpu::plan_work(args, at::get_num_threads(), &num_partial_rows);
  std::vector<float> partial_out(num_partial_rows * shape.head_dim), partial_lse(num_partial_rows);
  args.partial_out = partial_out.data();
  args.partial_lse = partial_lse.data();
  args.k_scale = k_scale;
  args.v_scale = v_scale;
  args.sinks = sinks;

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
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks, bool want_lse) {
  check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, softcap, k_scale, v_scale, sinks);
  const auto [k_copy, k_s] = cpu_kv_scale(k_scale, "k_scale");
  const auto [v_copy, v_s] = cpu_kv_scale(v_scale, "v_scale");
  const at::Tensor sinks_copy = cpu_sinks(sinks);
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = want_lse ? at::empty({query.size(0), query.size(1)}, query.options().dtype(at::kFloat))
                            : at::Tensor();
  paged_attention_cpu_into(out, lse, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window, softcap, k_s, v_s,
                           sinks_copy.defined() ? sinks_copy.data_ptr<float>() : nullptr);
  return {out, lse};
}

// max_seq_len is a CUDA launch-shape hint; the CPU reads seq_lens directly.
at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens,
                               const at::Tensor& query_start_loc, double scale, int64_t /*max_seq_len*/,
                               int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks) {
  return std::get<0>(paged_attention_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                              scale, sliding_window, softcap, k_scale, v_scale, sinks, false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_with_lse_cpu(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t /*max_seq_len*/, int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks) {
  return paged_attention_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                  sliding_window, softcap, k_scale, v_scale, sinks, true);
}

}  // namespace
void set_cpu_attention_isa(const std::string& isa) {
  if (isa == "auto") {
    isa_limit.store(Isa::kAmx);
    return;
  }
  for (const Isa candidate : cpu::kAllIsas) {
    if (isa != cpu::isa_name(candidate)) continue;
    TORCH_CHECK_VALUE(cpu::cpu_supports(candidate), "cpu attention isa '", isa, "' is not supported by this CPU");
    isa_limit.store(candidate);
    return;
  }
  TORCH_CHECK_VALUE(false,
                    "cpu attention isa must be 'auto', 'amx', 'avx512', 'avx2', 'neon_bf16', 'sve', 'neon' or "
                    "'baseline', got '",
                    isa, "'");
}

std::string cpu_attention_isa() { return cpu::isa_name(active_isa()); }

std::vector<std::string> cpu_attention_isas() {
  std::vector<std::string> names;
  for (const Isa isa : cpu::kAllIsas) {
    if (cpu::cpu_supports(isa)) names.push_back(cpu::isa_name(isa));
  }
  return names;
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", &pagedkv::paged_attention_cpu);
  m.impl("paged_attention_with_lse", &pagedkv::paged_attention_with_lse_cpu);
}
