// Per-element math of the model-layer ops (rms_norm, fused_add_rms_norm, silu_and_mul,
// rotary_embedding) shared by the CPU (layer_ops.cpp) and CUDA (cuda/layer_ops.cu) kernels, so both
// backends round the same way: everything is computed in fp32 and rounded to the tensor's dtype
// where Hugging Face's Llama rounds. Templates on the scalar type (float, c10::Half, c10::BFloat16).
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/host_device.h"

namespace pagedkv {

// 1 / sqrt(mean of squares + eps) from a row's sum of squares.
PAGEDKV_HD float rms_inv(float sum_squares, int64_t hidden, float eps) {
  return 1.f / sqrtf(sum_squares / static_cast<float>(hidden) + eps);
}

// weight * (x * inv_rms), the normalised value rounded to the dtype first (as HF: weight * x.to(dtype)).
template <typename scalar_t>
PAGEDKV_HD scalar_t rms_scale(scalar_t x, scalar_t weight, float inv_rms) {
  const float normalised = static_cast<float>(static_cast<scalar_t>(static_cast<float>(x) * inv_rms));
  return static_cast<scalar_t>(static_cast<float>(weight) * normalised);
}

PAGEDKV_HD float silu(float x) { return x / (1.f + expf(-x)); }

// Product of two floats rounded once (no fused multiply-add: nvcc would otherwise contract a * b + c).
PAGEDKV_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// Half-split (GPT-NeoX / HF Llama) rotation of the pair (x, y) = (row[i], row[i + D/2]) in place,
// rounded where HF's apply_rotary_pos_emb rounds in the tensor's dtype T: cos and sin are cast to T
// first, then x * cos and rotate_half(x) * sin are each rounded to T, then their sum is.
template <typename T>
PAGEDKV_HD void rope_rotate(T& x, T& y, float cos, float sin) {
  const float c = static_cast<float>(static_cast<T>(cos)), s = static_cast<float>(static_cast<T>(sin));
  const float xf = static_cast<float>(x), yf = static_cast<float>(y);
  const float x_c = static_cast<float>(static_cast<T>(mul_rn(xf, c)));
  const float neg_y_s = static_cast<float>(static_cast<T>(mul_rn(-yf, s)));
  const float y_c = static_cast<float>(static_cast<T>(mul_rn(yf, c)));
  const float x_s = static_cast<float>(static_cast<T>(mul_rn(xf, s)));
  x = static_cast<T>(x_c + neg_y_s);
  y = static_cast<T>(y_c + x_s);
}

}  // namespace pagedkv
