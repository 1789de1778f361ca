// CUDA kernels of the model-layer ops (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding); checks and schemas are in ../layer_ops.cpp, per-element math in
// ../layer_math.h. One CTA per row (token); fp32 math; current stream; no host sync.
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

#include "ops/layer_math.h"
#include "ops/ops.h"

namespace pagedkv {
namespace {

constexpr int kThreads = 256;

// Sum of v over the CTA (every thread gets it).
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total += warp_sums[w];
  __syncthreads();  // warp_sums may be reused by a later call
  return total;
}

template <typename scalar_t, bool kAddResidual>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(scalar_t* out, scalar_t* __restrict__ residual, const scalar_t* input,  // out may be input
                    const scalar_t* __restrict__ weight, int64_t hidden, float eps) {
  const int64_t row = blockIdx.x;
  const scalar_t* x = input + row * hidden;
  scalar_t* res = kAddResidual ? residual + row * hidden : nullptr;
  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    scalar_t v = x[i];
    if constexpr (kAddResidual) {
      v = static_cast<scalar_t>(static_cast<float>(v) + static_cast<float>(res[i]));
      res[i] = v;
    }
    squares += static_cast<float>(v) * static_cast<float>(v);
  }
  const float inv = rms_inv(block_sum(squares), hidden, eps);
  const scalar_t* src = kAddResidual ? res : x;  // each thread reads back only what it wrote
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[row * hidden + i] = rms_scale(src[i], weight[i], inv);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    silu_and_mul_kernel(scalar_t* __restrict__ out, const scalar_t* __restrict__ input, int64_t width) {
  const int64_t row = blockIdx.x;
  const scalar_t* gate = input + row * 2 * width;
  const scalar_t* up = gate + width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float g = static_cast<float>(static_cast<scalar_t>(silu(static_cast<float>(gate[i]))));
    out[row * width + i] = static_cast<scalar_t>(g * static_cast<float>(up[i]));
  }
}

// Out-of-range positions cannot raise on the device: such tokens are left unrotated.
template <typename scalar_t, typename cache_t>
__global__ void __launch_bounds__(kThreads)
    rotary_embedding_kernel(scalar_t* __restrict__ x, const int64_t* __restrict__ positions,
                            const cache_t* __restrict__ cache, int64_t max_position, int64_t stride_token,
                            int64_t stride_head, int num_heads, int half) {
  const int64_t token = blockIdx.x;
  const int64_t pos = positions[token];
  if (pos < 0 || pos >= max_position) return;
  const cache_t* cos = cache + pos * 2 * half;
  const cache_t* sin = cos + half;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int h = i / half, d = i % half;
    scalar_t* row = x + token * stride_token + h * stride_head;
    float y1, y2;
    rotate_pair(static_cast<float>(row[d]), static_cast<float>(row[d + half]), static_cast<float>(cos[d]),
                static_cast<float>(sin[d]), &y1, &y2);
    row[d] = static_cast<scalar_t>(y1);
    row[d + half] = static_cast<scalar_t>(y2);
  }
}

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
    rms_norm_kernel<scalar_t, false><<<rows, kThreads, 0, stream>>>(
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
    rms_norm_kernel<scalar_t, true><<<rows, kThreads, 0, stream>>>(
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
    silu_and_mul_kernel<scalar_t><<<rows, kThreads, 0, stream>>>(
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
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_float(cache.scalar_type(), [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      rotary_embedding_kernel<scalar_t, cache_t><<<x.size(0), kThreads, 0, stream>>>(
          static_cast<scalar_t*>(x.data_ptr()), positions.data_ptr<int64_t>(),
          static_cast<const cache_t*>(cache.data_ptr()), cache.size(0), x.stride(0), x.stride(1),
          static_cast<int>(x.size(1)), static_cast<int>(x.size(2) / 2));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("rms_norm", &pagedkv::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagedkv::fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &pagedkv::silu_and_mul_cuda);
  m.impl("rotary_embedding", &pagedkv::rotary_embedding_cuda);
}
