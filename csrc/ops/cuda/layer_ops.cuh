// Device code of the CUDA model-layer ops (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding); torch-free, included by layer_ops.cu and by tests/cuda_emu. One CTA per row
// (token); fp32 math, rounded to the tensor's dtype where Hugging Face's Llama rounds.
#pragma once

#include <cstdint>

#include "ops/cuda/device_compat.cuh"
#include "ops/layer_math.h"

namespace pagedkv {
namespace layer_cuda {

constexpr int kThreads = 256;

// Sum of v over the CTA (every thread gets it).
__device__ inline float block_sum(float v) {
  PAGEDKV_SHARED_ARRAY(float, warp_sums, kThreads / 32);
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < int((blockDim.x + 31) / 32); ++w) total += warp_sums[w];
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

// Out-of-range positions cannot raise on the device: such tokens are left unrotated, and recorded in
// index_error (argument 0, at the token) when checking is on.
template <typename scalar_t, typename cache_t>
__global__ void __launch_bounds__(kThreads)
    rotary_embedding_kernel(scalar_t* __restrict__ x, const int64_t* __restrict__ positions,
                            const cache_t* __restrict__ cache, int64_t max_position, int64_t stride_token,
                            int64_t stride_head, int num_heads, int half, IndexError* index_error) {
  const int64_t token = blockIdx.x;
  const int64_t pos = positions[token];
  if (pos < 0 || pos >= max_position) {
    if (threadIdx.x == 0) report_bad_index(index_error, 0, pos, token);
    return;
  }
  const cache_t* cos = cache + pos * 2 * half;
  const cache_t* sin = cos + half;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int h = i / half, d = i % half;
    scalar_t* row = x + token * stride_token + h * stride_head;
    rope_rotate<scalar_t>(row[d], row[d + half], static_cast<float>(cos[d]), static_cast<float>(sin[d]));
  }
}

}  // namespace layer_cuda
}  // namespace pagedkv
