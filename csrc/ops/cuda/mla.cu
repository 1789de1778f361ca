// Torch glue of the CUDA MLA ops (kernels in mla.cuh): argument checks, output allocation, launches on the
// current stream. No host sync (except to read the index flag under PAGEDKV_CHECK_INDICES=1).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "ops/cuda/index_check.h"
#include "ops/cuda/mla.cuh"
#include "ops/mla.h"

namespace pagedkv {
namespace {

template <typename slot_t, typename in_t, typename cache_t, typename Store>
void launch_concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                                 const at::Tensor& slots, Store store, cudaStream_t stream, IndexError* index_error) {
  const mla_cuda::LatentInputStrides in{kv_c.stride(0), kv_c.stride(1), k_pe.stride(0), k_pe.stride(1)};
  mla_cuda::concat_and_cache_mla_kernel<in_t, cache_t, Store, slot_t>
      <<<unsigned(kv_c.size(0)), mla_cuda::kWriteThreads, 0, stream>>>(
          static_cast<const in_t*>(kv_c.data_ptr()), static_cast<const in_t*>(k_pe.data_ptr()),
          static_cast<cache_t*>(kv_cache.data_ptr()), slots.data_ptr<slot_t>(), in,
          CacheStrides{kv_cache.stride(0), kv_cache.stride(1), 0}, int(kv_c.size(1)), int(k_pe.size(1)),
          kv_cache.size(1), kv_cache.size(0) * kv_cache.size(1), store, index_error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The scale is not checked on the GPU (that would sync): a scale <= 0 or non-finite stores inf/NaN.
void concat_and_cache_mla_cuda(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, c10::string_view kv_cache_dtype,
                               const std::optional<at::Tensor>& scale_in) {
  check_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, std::string(kv_cache_dtype), scale_in);
  if (kv_c.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(kv_c.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor slots = slot_mapping.contiguous();
  DeviceIndexCheck index_check(kv_c.device());
  const auto launch = [&](auto slot_tag) {
    using slot_t = decltype(slot_tag);
    if (is_fp8(kv_cache.scalar_type())) {
      const at::Tensor scale = scale_in.has_value() ? scale_in->contiguous() : at::Tensor();
      const KvScale s = scale.defined() ? KvScale{scale.data_ptr<float>(), 0} : KvScale{};
      dispatch_float(kv_c.scalar_type(), [&](auto type_tag) {
        using scalar_t = decltype(type_tag);
        dispatch_fp8(kv_format(kv_cache.scalar_type()), [&](auto format) {
          launch_concat_and_cache_mla<slot_t, scalar_t, uint8_t>(
              kv_c, k_pe, kv_cache, slots, mla_cuda::Fp8Store<decltype(format)::value>{s}, stream,
              index_check.error());
        });
      });
    } else if (kv_c.element_size() == 4) {
      launch_concat_and_cache_mla<slot_t, uint32_t, uint32_t>(kv_c, k_pe, kv_cache, slots, mla_cuda::CopyBits{},
                                                              stream, index_check.error());
    } else {
      launch_concat_and_cache_mla<slot_t, uint16_t, uint16_t>(kv_c, k_pe, kv_cache, slots, mla_cuda::CopyBits{},
                                                              stream, index_check.error());
    }
  };
  if (slots.scalar_type() == at::kInt) {
    launch(int32_t{});
  } else {
    launch(int64_t{});
  }
  const char* names[] = {"slot_mapping"};
  const int64_t bounds[] = {kv_cache.size(0) * kv_cache.size(1)};
  index_check.raise_if_any("concat_and_cache_mla", names, bounds);
}

template <typename scalar_t, typename cache_t>
void launch_paged_attention_mla(const mla_cuda::MlaParams& p, cudaStream_t stream) {
  const auto kernel = mla_cuda::paged_attention_mla_kernel<scalar_t, cache_t>;
  const size_t smem = mla_cuda::mla_smem_bytes(p.head_dim, p.kv_lora_rank);
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  kernel<<<dim3(unsigned(p.num_tokens), unsigned(p.num_q_heads)), mla_cuda::kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> paged_attention_mla_cuda_impl(
    const at::Tensor& query_in, const at::Tensor& kv_cache, const at::Tensor& block_tables_in,
    const at::Tensor& seq_lens_in, const at::Tensor& query_start_loc_in, double scale, int64_t kv_lora_rank,
    const std::optional<at::Tensor>& kv_scale_in, bool want_lse) {
  const AttentionShape shape = check_paged_attention_mla(query_in, kv_cache, block_tables_in, seq_lens_in,
                                                         query_start_loc_in, scale, kv_lora_rank, kv_scale_in);
  TORCH_CHECK(query_in.is_cuda(), "query must be a CUDA tensor for the CUDA paged_attention_mla");
  const c10::cuda::CUDAGuard guard(query_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = at::empty({shape.num_tokens, shape.num_q_heads, kv_lora_rank}, query_in.options());
  at::Tensor lse = want_lse ? at::empty({shape.num_tokens, shape.num_q_heads}, query_in.options().dtype(at::kFloat))
                            : at::Tensor();
  if (shape.num_tokens == 0 || shape.num_seqs == 0) return {out, lse};
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  const at::Tensor block_tables = block_tables_in.contiguous();
  const at::Tensor seq_lens = seq_lens_in.contiguous();
  const at::Tensor query_start_loc = query_start_loc_in.contiguous();
  const at::Tensor kv_scale = kv_scale_in.has_value() ? kv_scale_in->contiguous() : at::Tensor();  // stays on the GPU
  const at::Tensor cache = mla_cache_as_kv_view(kv_cache);
  DeviceIndexCheck index_check(query.device());
  mla_cuda::MlaParams p{};
  static_cast<AttentionParams&>(p) = attention_params(shape, query, cache, cache, block_tables, seq_lens,
                                                      query_start_loc, out, lse, scale, -1, 0.0);
  p.kv_lora_rank = int(kv_lora_rank);
  p.index_error = index_check.error();
  if (kv_scale.defined()) p.k_scale = KvScale{kv_scale.data_ptr<float>(), 0};
  dispatch_float(query.scalar_type(), [&](auto type) {
    using scalar_t = decltype(type);
    if (is_fp8(kv_cache.scalar_type())) {
      dispatch_fp8(kv_format(kv_cache.scalar_type()), [&](auto format) {
        launch_paged_attention_mla<scalar_t, typename Fp8Traits<decltype(format)::value>::type>(p, stream);
      });
    } else {
      launch_paged_attention_mla<scalar_t, scalar_t>(p, stream);
    }
  });
  const char* names[] = {"block_tables", "seq_lens"};
  const int64_t bounds[] = {shape.num_blocks, shape.max_blocks * shape.block_size + 1};
  index_check.raise_if_any("paged_attention_mla", names, bounds);
  return {out, lse};
}

at::Tensor paged_attention_mla_cuda(const at::Tensor& query, const at::Tensor& kv_cache,
                                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                    const at::Tensor& query_start_loc, double scale, int64_t kv_lora_rank,
                                    const std::optional<at::Tensor>& kv_scale) {
  return std::get<0>(paged_attention_mla_cuda_impl(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                                   kv_lora_rank, kv_scale, false));
}

std::tuple<at::Tensor, at::Tensor> paged_attention_mla_with_lse_cuda(
    const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale, int64_t kv_lora_rank, const std::optional<at::Tensor>& kv_scale) {
  return paged_attention_mla_cuda_impl(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_lora_rank,
                                       kv_scale, true);
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("concat_and_cache_mla", &pagedkv::concat_and_cache_mla_cuda);
  m.impl("paged_attention_mla", &pagedkv::paged_attention_mla_cuda);
  m.impl("paged_attention_mla_with_lse", &pagedkv::paged_attention_mla_with_lse_cuda);
}
