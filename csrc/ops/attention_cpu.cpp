// CPU paged attention, torch glue: checks, the run of the plan's work items (ops/cpu/work_plan.cpp) by
// one ISA copy of the kernels (ops/cpu/) with torch's parallel_for, the merge of split-K partitions, and
// the choice of copy.
#include <torch/csrc/stable/library.h>

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
  parallel_for(0, num_threads(), 1, [&](int64_t, int64_t) {
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
  parallel_for(0, static_cast<int64_t>(firsts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(a.head_dim);
    for (int64_t i = begin; i < end; ++i) cpu::merge_partitions<scalar_t>(a, *firsts[i], acc.data());
  });
}

}  // namespace

void paged_attention_cpu_into(const Tensor& out, const Tensor& lse, const Tensor& query_in,
                              const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor& block_tables_in, const Tensor& seq_lens_in,
                              const Tensor& query_start_loc_in, double scale, int64_t sliding_window,
                              double softcap, KvScale k_scale, KvScale v_scale, const float* sinks) {
  const AttentionShape shape = check_paged_attention(query_in, key_cache, value_cache, block_tables_in, seq_lens_in,
                                                     query_start_loc_in, scale, sliding_window, softcap);
  // The kernel reads private copies of the metadata, so the values checked are the values used even
  // if another thread writes the caller's tensors meanwhile (no read outside the cache, ever).
  const Tensor block_tables = contiguous_copy(block_tables_in);
  const Tensor seq_lens = contiguous_copy(seq_lens_in);
  const Tensor query_start_loc = contiguous_copy(query_start_loc_in);
  check_attention_metadata_values(shape, block_tables, seq_lens, query_start_loc, sliding_window);
  const Tensor query = query_in.stride(2) == 1 ? query_in : as_contiguous(query_in);
  if (shape.num_tokens == 0) return;

  AttentionParams args = attention_params(shape, query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, out, lse, scale, sliding_window, softcap);
  int64_t num_partial_rows = 0;
  const std::vector<WorkItem> items = cpu::plan_work(args, num_threads(), &num_partial_rows);
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
std::tuple<Tensor, Tensor> paged_attention_cpu_impl(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
    int64_t sliding_window, double softcap, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, const std::optional<Tensor>& sinks, bool want_lse) {
  check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window, softcap, k_scale, v_scale, sinks);
  const auto [k_copy, k_s] = cpu_kv_scale(k_scale, "k_scale");
  const auto [v_copy, v_s] = cpu_kv_scale(v_scale, "v_scale");
  const Tensor sinks_copy = cpu_sinks(sinks);
  Tensor out = empty(query.sizes().vec(), query.scalar_type(), query);
  Tensor lse = want_lse ? empty({query.size(0), query.size(1)}, ScalarType::Float, query)
                            : Tensor();
  paged_attention_cpu_into(out, lse, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window, softcap, k_s, v_s,
                           sinks_copy.defined() ? sinks_copy.mutable_data_ptr<float>() : nullptr);
  return {out, lse};
}

// max_seq_len is a CUDA launch-shape hint; the CPU reads seq_lens directly.
Tensor paged_attention_cpu(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                               const Tensor& block_tables, const Tensor& seq_lens,
                               const Tensor& query_start_loc, double scale, int64_t /*max_seq_len*/,
                               int64_t sliding_window, double softcap, const std::optional<Tensor>& k_scale,
                               const std::optional<Tensor>& v_scale, const std::optional<Tensor>& sinks) {
  return std::get<0>(paged_attention_cpu_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                              scale, sliding_window, softcap, k_scale, v_scale, sinks, false));
}

std::tuple<Tensor, Tensor> paged_attention_with_lse_cpu(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
    int64_t /*max_seq_len*/, int64_t sliding_window, double softcap, const std::optional<Tensor>& k_scale,
    const std::optional<Tensor>& v_scale, const std::optional<Tensor>& sinks) {
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
    STD_TORCH_CHECK(cpu::cpu_supports(candidate), "cpu attention isa '", isa, "' is not supported by this CPU");
    isa_limit.store(candidate);
    return;
  }
  STD_TORCH_CHECK(false,
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

STABLE_TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", TORCH_BOX(&pagedkv::paged_attention_cpu));
  m.impl("paged_attention_with_lse", TORCH_BOX(&pagedkv::paged_attention_with_lse_cpu));
}
