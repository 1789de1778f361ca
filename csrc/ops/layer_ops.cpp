// Model-layer ops for Llama-family decoders, fused so that a decode step costs one kernel each
// instead of a chain of small ATen ops: rms_norm, fused_add_rms_norm (residual add + norm, in
// place), silu_and_mul (SwiGLU) and rotary_embedding (half-split RoPE, in place). The CPU kernels;
// schemas and argument checks are in ops.cpp with the others, the CUDA kernels in cuda/layer_ops.cu.
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <vector>

#include "ops/layer_math.h"
#include "ops/ops.h"

namespace pagedkv {
namespace {

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

Tensor rms_norm_cpu(const Tensor& input_in, const Tensor& weight_in, double epsilon) {
  check_rms_norm(input_in, weight_in, epsilon);
  const Tensor input = as_contiguous(input_in), weight = as_contiguous(weight_in);
  Tensor out = empty(input.sizes().vec(), input.scalar_type(), input);
  const int64_t hidden = input.size(-1), rows = hidden == 0 ? 0 : input.numel() / hidden;
  const float eps = static_cast<float>(epsilon);
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* x = static_cast<const scalar_t*>(input.data_ptr());
    const auto* w = static_cast<const scalar_t*>(weight.data_ptr());
    auto* y = static_cast<scalar_t*>(out.data_ptr());
    parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = x + r * hidden;
        const float inv = rms_inv(sum_squares(xr, hidden), hidden, eps);
        for (int64_t i = 0; i < hidden; ++i) y[r * hidden + i] = rms_scale(xr[i], w[i], inv);
      }
    });
  });
  return out;
}

void fused_add_rms_norm_cpu(Tensor& input, Tensor& residual, const Tensor& weight_in, double epsilon) {
  check_fused_add_rms_norm(input, residual, weight_in, epsilon);
  const Tensor weight = as_contiguous(weight_in);
  const int64_t hidden = input.size(-1), rows = hidden == 0 ? 0 : input.numel() / hidden;
  const float eps = static_cast<float>(epsilon);
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    auto* x = static_cast<scalar_t*>(input.data_ptr());
    auto* res = static_cast<scalar_t*>(residual.data_ptr());
    const auto* w = static_cast<const scalar_t*>(weight.data_ptr());
    parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
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

Tensor silu_and_mul_cpu(const Tensor& input_in) {
  check_silu_and_mul(input_in);
  const Tensor input = as_contiguous(input_in);
  const int64_t width = input.size(-1) / 2, rows = width == 0 ? 0 : input.numel() / (2 * width);
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape.back() = width;
  Tensor out = empty(out_shape, input.scalar_type(), input);
  dispatch_float(input.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* x = static_cast<const scalar_t*>(input.data_ptr());
    auto* y = static_cast<scalar_t*>(out.data_ptr());
    parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
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

void rotary_embedding_cpu(const Tensor& positions_in, Tensor& x, const Tensor& cos_sin_cache_in) {
  check_rotary_embedding(positions_in, x, cos_sin_cache_in);
  // positions: a private copy, so the positions checked below are the ones used (another thread may
  // write the caller's tensor meanwhile).
  const Tensor positions = contiguous_copy(positions_in);
  const Tensor cache = as_contiguous(cos_sin_cache_in);
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  const int64_t max_position = cache.size(0);
  const int64_t* pos = positions.mutable_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {  // every position is checked before anything is written
    STD_TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "positions[", t, "] = ", pos[t], " is outside [0, ",
                max_position, ") (cos_sin_cache has ", max_position, " rows)");
  }
  const int64_t st = x.stride(0), sh = x.stride(1);
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    auto* data = static_cast<scalar_t*>(x.data_ptr());
    dispatch_float(cache.scalar_type(), [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      const auto* table = static_cast<const cache_t*>(cache.data_ptr());
      parallel_for(0, num_tokens, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const cache_t* cos = table + pos[t] * head_dim;
          const cache_t* sin = cos + half;
          for (int64_t h = 0; h < num_heads; ++h) {
            scalar_t* row = data + t * st + h * sh;
            for (int64_t i = 0; i < half; ++i) {
              rope_rotate(row[i], row[i + half], static_cast<float>(cos[i]), static_cast<float>(sin[i]));
            }
          }
        }
      });
    });
  });
}

}  // namespace

}  // namespace pagedkv

STABLE_TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&pagedkv::rms_norm_cpu));
  m.impl("fused_add_rms_norm", TORCH_BOX(&pagedkv::fused_add_rms_norm_cpu));
  m.impl("silu_and_mul", TORCH_BOX(&pagedkv::silu_and_mul_cpu));
  m.impl("rotary_embedding", TORCH_BOX(&pagedkv::rotary_embedding_cpu));
}
