// Torch glue of the CUDA model-layer ops (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding): kernels in layer_ops.cuh, checks and schemas in ../ops.cpp and ../layer_ops.cpp.
// Current stream; no host sync (except to read the index flag under PAGEDKV_CHECK_INDICES=1).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <vector>

#include "ops/cuda/index_check.h"
#include "ops/cuda/layer_ops.cuh"
#include "ops/ops.h"

namespace pagedkv {
namespace {

using layer_cuda::kThreads;

int64_t rows_of(const at::Tensor& t, int64_t row_elems) { return row_elems == 0 ? 0 : t.numel() / row_elems; }

at::Tensor rms_norm_cuda(const at::Tensor& input_in, const at::Tensor& weight_in, double epsilon) {
  check_rms_norm(input_in, weight_in, epsilon);
  const c10::cuda::CUDAGuard guard(input_in.device());
  const at::Tensor input = input_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options());
  const int64_t hidden = input.size(-1), rows = rows_of(input, hidden);
  if (rows == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    layer_cuda::rms_norm_kernel<scalar_t, false><<<rows, kThreads, 0, stream>>>(
        static_cast<scalar_t*>(out.data_ptr()), nullptr, static_cast<const scalar_t*>(input.data_ptr()),
        static_cast<const scalar_t*>(weight.data_ptr()), hidden, static_cast<float>(epsilon));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight_in, double epsilon) {
  check_fused_add_rms_norm(input, residual, weight_in, epsilon);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor weight = weight_in.contiguous();
  const int64_t hidden = input.size(-1), rows = rows_of(input, hidden);
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    layer_cuda::rms_norm_kernel<scalar_t, true><<<rows, kThreads, 0, stream>>>(
        static_cast<scalar_t*>(input.data_ptr()), static_cast<scalar_t*>(residual.data_ptr()),
        static_cast<const scalar_t*>(input.data_ptr()), static_cast<const scalar_t*>(weight.data_ptr()), hidden,
        static_cast<float>(epsilon));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor silu_and_mul_cuda(const at::Tensor& input_in) {
  check_silu_and_mul(input_in);
  const c10::cuda::CUDAGuard guard(input_in.device());
  const at::Tensor input = input_in.contiguous();
  const int64_t width = input.size(-1) / 2, rows = rows_of(input, 2 * width);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = width;
  at::Tensor out = at::empty(out_shape, input.options());
  if (rows == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    layer_cuda::silu_and_mul_kernel<scalar_t><<<rows, kThreads, 0, stream>>>(
        static_cast<scalar_t*>(out.data_ptr()), static_cast<const scalar_t*>(input.data_ptr()), width);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void rotary_embedding_cuda(const at::Tensor& positions_in, at::Tensor& x, const at::Tensor& cos_sin_cache_in) {
  check_rotary_embedding(positions_in, x, cos_sin_cache_in);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor positions = positions_in.contiguous(), cache = cos_sin_cache_in.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DeviceIndexCheck index_check(x.device());
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_float(cache.scalar_type(), [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      layer_cuda::rotary_embedding_kernel<scalar_t, cache_t><<<x.size(0), kThreads, 0, stream>>>(
          static_cast<scalar_t*>(x.data_ptr()), positions.data_ptr<int64_t>(),
          static_cast<const cache_t*>(cache.data_ptr()), cache.size(0), x.stride(0), x.stride(1),
          static_cast<int>(x.size(1)), static_cast<int>(x.size(2) / 2),
          index_check.error());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const char* names[] = {"positions"};
  const int64_t bounds[] = {cache.size(0)};
  index_check.raise_if_any("rotary_embedding", names, bounds);
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("rms_norm", &pagedkv::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagedkv::fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &pagedkv::silu_and_mul_cuda);
  m.impl("rotary_embedding", &pagedkv::rotary_embedding_cuda);
}
