// Model-layer ops for Llama-family decoders, fused so that a decode step costs one kernel each
// instead of a chain of small ATen ops: rms_norm, fused_add_rms_norm (residual add + norm, in
// place), silu_and_mul (SwiGLU) and rotary_embedding (half-split RoPE, in place). Argument checks and
// the CPU kernels; schemas are in ops.cpp with the others, the CUDA kernels in cuda/layer_ops.cu.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops/layer_math.h"
#include "ops/ops.h"

namespace pagedkv {
namespace {

void check_float(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, name,
              " must be float32, float16 or bfloat16, got ", dt);
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device(),
              "; all tensors must be on the same device");
}

// Rows a parallel chunk should hold so that small inputs run inline (no thread wake-up).
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

template <typename scalar_t>
float sum_squares(const scalar_t* x, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float v = static_cast<float>(x[i + j]);
      acc[j] += v * v;
    }
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return s;
}

template <typename Fn>
void dispatch_float(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: fn(c10::BFloat16{}); break;
  }
}

at::Tensor rms_norm_cpu(const at::Tensor& input_in, const at::Tensor& weight_in, double epsilon) {
  check_rms_norm(input_in, weight_in, epsilon);
  const at::Tensor input = input_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options());
  const int64_t hidden = input.size(-1), rows = hidden == 0 ? 0 : input.numel() / hidden;
  const float eps = static_cast<float>(epsilon);
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* x = static_cast<const scalar_t*>(input.data_ptr());
    const auto* w = static_cast<const scalar_t*>(weight.data_ptr());
    auto* y = static_cast<scalar_t*>(out.data_ptr());
    at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = x + r * hidden;
        const float inv = rms_inv(sum_squares(xr, hidden), hidden, eps);
        for (int64_t i = 0; i < hidden; ++i) y[r * hidden + i] = rms_scale(xr[i], w[i], inv);
      }
    });
  });
  return out;
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight_in, double epsilon) {
  check_fused_add_rms_norm(input, residual, weight_in, epsilon);
  const at::Tensor weight = weight_in.contiguous();
  const int64_t hidden = input.size(-1), rows = hidden == 0 ? 0 : input.numel() / hidden;
  const float eps = static_cast<float>(epsilon);
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    auto* x = static_cast<scalar_t*>(input.data_ptr());
    auto* res = static_cast<scalar_t*>(residual.data_ptr());
    const auto* w = static_cast<const scalar_t*>(weight.data_ptr());
    at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x + r * hidden;
        scalar_t* rr = res + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          rr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        }
        const float inv = rms_inv(sum_squares(rr, hidden), hidden, eps);
        for (int64_t i = 0; i < hidden; ++i) xr[i] = rms_scale(rr[i], w[i], inv);
      }
    });
  });
}

at::Tensor silu_and_mul_cpu(const at::Tensor& input_in) {
  check_silu_and_mul(input_in);
  const at::Tensor input = input_in.contiguous();
  const int64_t width = input.size(-1) / 2, rows = width == 0 ? 0 : input.numel() / (2 * width);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = width;
  at::Tensor out = at::empty(out_shape, input.options());
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* x = static_cast<const scalar_t*>(input.data_ptr());
    auto* y = static_cast<scalar_t*>(out.data_ptr());
    at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = x + r * 2 * width;
        const scalar_t* up = gate + width;
        for (int64_t i = 0; i < width; ++i) {
          const float g = static_cast<float>(static_cast<scalar_t>(silu(static_cast<float>(gate[i]))));
          y[r * width + i] = static_cast<scalar_t>(g * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

void rotary_embedding_cpu(const at::Tensor& positions_in, at::Tensor& x, const at::Tensor& cos_sin_cache_in) {
  check_rotary_embedding(positions_in, x, cos_sin_cache_in);
  const at::Tensor positions = positions_in.contiguous(), cache = cos_sin_cache_in.contiguous();
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  const int64_t max_position = cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {  // every position is checked before anything is written
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "positions[", t, "] = ", pos[t], " is outside [0, ",
                max_position, ") (cos_sin_cache has ", max_position, " rows)");
  }
  const int64_t st = x.stride(0), sh = x.stride(1);
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    auto* data = static_cast<scalar_t*>(x.data_ptr());
    dispatch_float(cache.scalar_type(), [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      const auto* table = static_cast<const cache_t*>(cache.data_ptr());
      at::parallel_for(0, num_tokens, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const cache_t* cos = table + pos[t] * head_dim;
          const cache_t* sin = cos + half;
          for (int64_t h = 0; h < num_heads; ++h) {
            scalar_t* row = data + t * st + h * sh;
            for (int64_t i = 0; i < half; ++i) {
              float y1, y2;
              rotate_pair(static_cast<float>(row[i]), static_cast<float>(row[i + half]), static_cast<float>(cos[i]),
                          static_cast<float>(sin[i]), &y1, &y2);
              row[i] = static_cast<scalar_t>(y1);
              row[i + half] = static_cast<scalar_t>(y2);
            }
          }
        }
      });
    });
  });
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Checks (shapes, dtypes, devices; shared with the CUDA kernels)

void check_rms_norm(const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_float(input, "input");
  TORCH_CHECK(input.dim() >= 1, "input must have at least one dimension, got a scalar");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1), "weight must be [hidden] = [", input.size(-1),
              "] (input's last dimension), got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), "weight dtype ", weight.scalar_type(),
              " must equal input dtype ", input.scalar_type());
  check_same_device(weight, "weight", input, "input");
  TORCH_CHECK(std::isfinite(epsilon) && epsilon >= 0, "epsilon must be finite and >= 0, got ", epsilon);
}

void check_fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                              double epsilon) {
  check_rms_norm(input, weight, epsilon);
  TORCH_CHECK(residual.sizes() == input.sizes(), "residual shape ", residual.sizes(), " must equal input shape ",
              input.sizes());
  TORCH_CHECK(residual.scalar_type() == input.scalar_type(), "residual dtype ", residual.scalar_type(),
              " must equal input dtype ", input.scalar_type());
  check_same_device(residual, "residual", input, "input");
  TORCH_CHECK(input.is_contiguous() && residual.is_contiguous(),
              "input and residual must be contiguous (both are updated in place)");
  TORCH_CHECK(input.numel() == 0 || input.data_ptr() != residual.data_ptr(), "input and residual must not alias");
}

void check_silu_and_mul(const at::Tensor& input) {
  check_float(input, "input");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0,
              "input must be [..., 2 * d] (gate then up), got shape ", input.sizes());
}

void check_rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos_sin_cache) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even, got ", x.size(2));
  TORCH_CHECK(x.size(2) <= 1 || x.stride(2) == 1, "x must have a contiguous head_dim (it is rotated in place)");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64, got ", positions.scalar_type());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0), "positions must be [num_tokens] = [",
              x.size(0), "], got shape ", positions.sizes());
  check_float(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == x.size(2),
              "cos_sin_cache must be [max_position, head_dim] = [*, ", x.size(2), "], got shape ",
              cos_sin_cache.sizes());
  check_same_device(positions, "positions", x, "x");
  check_same_device(cos_sin_cache, "cos_sin_cache", x, "x");
}

}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("rms_norm", &pagedkv::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &pagedkv::fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &pagedkv::silu_and_mul_cpu);
  m.impl("rotary_embedding", &pagedkv::rotary_embedding_cpu);
}
