// Torch glue of the CUDA paged attention (float, float8 and int4 caches): argument checks, output allocation,
// launch on the current stream. Kernels and launch planning are in attention.cuh.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/index_check.h"
#include "ops/fp8.h"
#include "ops/int4.h"
#include "ops/ops.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace {

using attention_cuda::AttentionLaunch;
using attention_cuda::KernelParams;

int multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// cache_t: the caches' element type, or attention_cuda::Int4Rows (rows staged as fp32: any alignment).
template <typename scalar_t, typename cache_t>
void launch_paged_attention(KernelParams p, int64_t max_seq_len, int device, cudaStream_t stream,
                            const at::TensorOptions& float_options) {
  constexpr bool kInt4 = std::is_same_v<cache_t, attention_cuda::Int4Rows>;
  constexpr int kStaged = sizeof(typename attention_cuda::Staged<cache_t>::type);
  const bool aligned = kInt4 || (cache_rows_16b_aligned(p.key_cache, kStaged, p.cache_strides) &&
                                 cache_rows_16b_aligned(p.value_cache, kStaged, p.cache_strides));
  const AttentionLaunch launch =
      attention_cuda::plan_paged_attention(p, kStaged, aligned, max_seq_len, multiprocessor_count(device));
  TORCH_CHECK(launch.smem_fits, "paged_attention: head_dim ", p.head_dim, " needs too much shared memory");
  at::Tensor partial_out, partial_lse;
  if (launch.grid_z > 1) {
    partial_out = at::empty({int64_t(launch.grid_z), p.num_tokens, p.num_q_heads, p.head_dim}, float_options);
    partial_lse = at::empty({int64_t(launch.grid_z), p.num_tokens, p.num_q_heads}, float_options);
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  const auto kernel = launch.vec16 ? attention_cuda::paged_attention_kernel<scalar_t, cache_t, true>
                                   : attention_cuda::paged_attention_kernel<scalar_t, cache_t, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(launch.smem)));
  const dim3 grid(launch.grid_x, launch.grid_y, launch.grid_z);
  kernel<<<grid, attention_cuda::kThreads, launch.smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (launch.grid_z > 1) {
    const int64_t num_rows = int64_t(p.num_tokens) * p.num_q_heads;
    attention_cuda::merge_partitions_kernel<scalar_t><<<unsigned(num_rows), attention_cuda::kThreads, 0, stream>>>(
        p.partial_out, p.partial_lse, static_cast<scalar_t*>(p.out), p.lse, p.sinks, int(launch.grid_z), num_rows,
        p.num_q_heads, p.head_dim);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Attention over checked arguments: float caches (scalar_t), float8 ones (with their scales), or int4 rows
// (int4_group > 0).
std::tuple<at::Tensor, at::Tensor> attend_checked(
    const AttentionShape& shape, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables_in, const at::Tensor& seq_lens_in, const at::Tensor& query_start_loc_in,
    double scale, int64_t max_seq_len, int64_t sliding_window, double softcap,
    const std::optional<at::Tensor>& k_scale_in, const std::optional<at::Tensor>& v_scale_in,
    const std::optional<at::Tensor>& sinks_in, bool want_lse, int64_t int4_group, const char* op) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor for the CUDA ", op);
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = at::empty(query.sizes(), query.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = want_lse ? at::empty({shape.num_tokens, shape.num_q_heads}, query.options().dtype(at::kFloat))
                            : at::Tensor();
  if (shape.num_tokens == 0 || shape.num_seqs == 0) return {out, lse};
  const at::Tensor block_tables = block_tables_in.contiguous();
  const at::Tensor seq_lens = seq_lens_in.contiguous();
  const at::Tensor query_start_loc = query_start_loc_in.contiguous();
  // Scales stay on the device (reading them here would sync); null means 1.
  const at::Tensor k_scale = k_scale_in.has_value() ? k_scale_in->contiguous() : at::Tensor();
  const at::Tensor v_scale = v_scale_in.has_value() ? v_scale_in->contiguous() : at::Tensor();
  const at::Tensor sinks = sinks_in.has_value() ? sinks_in->contiguous() : at::Tensor();
  DeviceIndexCheck index_check(query.device());

  KernelParams p{};
  static_cast<AttentionParams&>(p) = attention_params(shape, query, key_cache, value_cache, block_tables, seq_lens,
                                                      query_start_loc, out, lse, scale, sliding_window, softcap);
  p.index_error = index_check.error();
  p.int4_group = int(int4_group);
  if (k_scale.defined()) p.k_scale = KvScale{k_scale.data_ptr<float>(), k_scale.dim() == 0 ? 0 : 1};
  if (v_scale.defined()) p.v_scale = KvScale{v_scale.data_ptr<float>(), v_scale.dim() == 0 ? 0 : 1};
  if (sinks.defined()) p.sinks = sinks.data_ptr<float>();
  const at::TensorOptions float_options = query.options().dtype(at::kFloat);
  const int device = query.get_device();
  dispatch_float(query.scalar_type(), [&](auto type) {
    using scalar_t = decltype(type);
    if (int4_group > 0) {
      launch_paged_attention<scalar_t, attention_cuda::Int4Rows>(p, max_seq_len, device, stream, float_options);
    } else if (is_fp8(key_cache.scalar_type())) {
      dispatch_fp8(kv_format(key_cache.scalar_type()), [&](auto format) {
        using cache_t = typename Fp8Traits<decltype(format)::value>::type;
        launch_paged_attention<scalar_t, cache_t>(p, max_seq_len, device, stream, float_options);
      });
    } else {
      launch_paged_attention<scalar_t, scalar_t>(p, max_seq_len, device, stream, float_options);
    }
  });
  const char* names[] = {"block_tables", "seq_lens"};
  const int64_t bounds[] = {shape.num_blocks, shape.max_blocks * shape.block_size + 1};
  index_check.raise_if_any(op, names, bounds);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cuda_impl(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t max_seq_len, int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks, bool want_lse) {
  const AttentionShape shape = check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                                     query_start_loc, scale, sliding_window, softcap, k_scale,
                                                     v_scale, sinks);
  return attend_checked(shape, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        max_seq_len, sliding_window, softcap, k_scale, v_scale, sinks, want_lse, 0,
                        "paged_attention");
}

std::tuple<at::Tensor, at::Tensor> paged_attention_int4_cuda_impl(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t group_size, int64_t max_seq_len, int64_t sliding_window, double softcap, bool want_lse) {
  const AttentionShape shape = check_paged_attention_int4(query, key_cache, value_cache, block_tables, seq_lens,
                                                          query_start_loc, scale, group_size, sliding_window, softcap);
  return attend_checked(shape, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        max_seq_len, sliding_window, softcap, std::nullopt, std::nullopt, std::nullopt, want_lse,
                        group_size, "paged_attention_int4");
}

at::Tensor paged_attention_int4_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                     int64_t group_size, int64_t max_seq_len, int64_t sliding_window, double softcap) {
  return std::get<0>(paged_attention_int4_cuda_impl(query, key_cache, value_cache, block_tables, seq_lens,
                                                    query_start_loc, scale, group_size, max_seq_len, sliding_window,
                                                    softcap, false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_int4_with_lse_cuda(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t group_size, int64_t max_seq_len, int64_t sliding_window, double softcap) {
  return paged_attention_int4_cuda_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                        group_size, max_seq_len, sliding_window, softcap, true);
}

at::Tensor paged_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, double scale, int64_t max_seq_len,
                                int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks) {
  return std::get<0>(paged_attention_cuda_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                               scale, max_seq_len, sliding_window, softcap, k_scale, v_scale, sinks,
                                               false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_with_lse_cuda(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
    int64_t max_seq_len, int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& sinks) {
  return paged_attention_cuda_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                   max_seq_len, sliding_window, softcap, k_scale, v_scale, sinks, true);
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_attention", &pagedkv::paged_attention_cuda);
  m.impl("paged_attention_with_lse", &pagedkv::paged_attention_with_lse_cuda);
  m.impl("paged_attention_int4", &pagedkv::paged_attention_int4_cuda);
  m.impl("paged_attention_int4_with_lse", &pagedkv::paged_attention_int4_with_lse_cuda);
}
