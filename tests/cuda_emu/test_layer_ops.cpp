// The CUDA model-layer kernels (csrc/ops/cuda/layer_ops.cuh) on the CPU emulator against float64
// references that round where Hugging Face's Llama rounds: rms_norm, fused_add_rms_norm, silu_and_mul
// and rotary_embedding, for float32 / float16 / bfloat16 (rotary also with each cos/sin cache dtype),
// both schedules, hidden sizes below, at and above the CTA's 256 threads.
#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"
#include "ops/cuda/layer_ops.cuh"

namespace {

using namespace emu_test;
namespace layer = pagedkv::layer_cuda;

template <typename T>
class CudaLayerOps : public ::testing::Test {};
using Dtypes = ::testing::Types<float, c10::Half, c10::BFloat16>;
struct DtypeNames {
  template <typename T>
  static std::string GetName(int) {
    return dtype_name<T>();
  }
};
TYPED_TEST_SUITE(CudaLayerOps, Dtypes, DtypeNames);

// |got - want| within `ulps` units of T's precision at want's magnitude (plus a float32 floor).
template <typename T>
bool close(double got, double want, double ulps = 2.0) {
  return std::abs(got - want) <= ulps * eps_of<T>() * std::max(std::abs(want), 1e-3) + 1e-6;
}

// Tolerance 4 units: the float32 sum of squares may move a rounding of x * inv_rms by one unit.
template <typename T>
double rms_reference(const T* x, const T* w, int64_t hidden, double eps, int64_t i) {
  double ss = 0;
  for (int64_t k = 0; k < hidden; ++k) ss += to_double(x[k]) * to_double(x[k]);
  const double inv = 1.0 / std::sqrt(ss / double(hidden) + eps);
  return round_to<T>(to_double(w[i]) * round_to<T>(to_double(x[i]) * inv));
}

TYPED_TEST(CudaLayerOps, RmsNorm) {
  using T = TypeParam;
  for (const cuda_emu::Schedule schedule : schedules()) {
    for (const int64_t hidden : {64, 1000, 4096}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + " hidden " + std::to_string(hidden));
      const ScheduleScope scope(schedule);
      std::mt19937_64 rng = make_rng();
      const int rows = 1 + int(rng() % 5);
      const std::vector<T> x = random_vector<T>(rng, rows * hidden, -3, 3);
      const std::vector<T> w = random_vector<T>(rng, hidden, 0.5, 1.5);
      std::vector<T> out = random_vector<T>(rng, rows * hidden);
      const float eps = 1e-5f;
      cuda_emu::launch(dim3(rows), dim3(layer::kThreads), 0, layer::rms_norm_kernel<T, false>, out.data(),
                       static_cast<T*>(nullptr), x.data(), w.data(), hidden, eps);
      for (int r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < hidden; ++i) {
          const double want = rms_reference(x.data() + r * hidden, w.data(), hidden, eps, i);
          ASSERT_TRUE(close<T>(to_double(out[r * hidden + i]), want, 4.0)) << r << "," << i << ": " << to_double(out[r * hidden + i]) << " vs " << want;
        }
      }
    }
  }
}

TYPED_TEST(CudaLayerOps, FusedAddRmsNormInPlace) {
  using T = TypeParam;
  for (const cuda_emu::Schedule schedule : schedules()) {
    for (const int64_t hidden : {96, 1000, 2048}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + " hidden " + std::to_string(hidden));
      const ScheduleScope scope(schedule);
      std::mt19937_64 rng = make_rng();
      const int rows = 1 + int(rng() % 4);
      std::vector<T> x = random_vector<T>(rng, rows * hidden, -2, 2);
      std::vector<T> residual = random_vector<T>(rng, rows * hidden, -2, 2);
      const std::vector<T> w = random_vector<T>(rng, hidden, 0.5, 1.5);
      std::vector<T> want_residual(rows * hidden);
      for (size_t i = 0; i < want_residual.size(); ++i) {
        want_residual[i] = from_double<T>(to_double(x[i]) + to_double(residual[i]));
      }
      const float eps = 1e-6f;
      cuda_emu::launch(dim3(rows), dim3(layer::kThreads), 0, layer::rms_norm_kernel<T, true>, x.data(),
                       residual.data(), static_cast<const T*>(x.data()), w.data(), hidden, eps);
      for (int r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < hidden; ++i) {
          ASSERT_EQ(to_double(residual[r * hidden + i]), to_double(want_residual[r * hidden + i]));
          const double want = rms_reference(want_residual.data() + r * hidden, w.data(), hidden, eps, i);
          ASSERT_TRUE(close<T>(to_double(x[r * hidden + i]), want, 4.0)) << r << "," << i;
        }
      }
    }
  }
}

TYPED_TEST(CudaLayerOps, SiluAndMul) {
  using T = TypeParam;
  for (const cuda_emu::Schedule schedule : schedules()) {
    for (const int64_t width : {32, 700}) {
      SCOPED_TRACE(std::string(schedule_name(schedule)) + " width " + std::to_string(width));
      const ScheduleScope scope(schedule);
      std::mt19937_64 rng = make_rng();
      const int rows = 1 + int(rng() % 4);
      const std::vector<T> in = random_vector<T>(rng, rows * 2 * width, -6, 6);
      std::vector<T> out = random_vector<T>(rng, rows * width);
      cuda_emu::launch(dim3(rows), dim3(layer::kThreads), 0, layer::silu_and_mul_kernel<T>, out.data(), in.data(),
                       width);
      for (int r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < width; ++i) {
          const double g = to_double(in[r * 2 * width + i]), u = to_double(in[r * 2 * width + width + i]);
          const double want = round_to<T>(round_to<T>(g / (1 + std::exp(-g))) * u);
          ASSERT_TRUE(close<T>(to_double(out[r * width + i]), want, 3.0)) << r << "," << i;
        }
      }
    }
  }
}

// x is the query part of a packed [T, Hq + 2 Hkv, D] row, so the other heads must stay untouched.
template <typename T, typename C>
void rotary_case(bool with_bad_position) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string(schedule_name(schedule)) + " cache " + dtype_name<C>());
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int T_tokens = 1 + int(rng() % 6), H = 3, packed_heads = 7, D = 64, half = D / 2, max_pos = 40;
    const int64_t stride_token = int64_t(packed_heads) * D, stride_head = D;
    std::vector<T> x = random_vector<T>(rng, size_t(T_tokens) * stride_token, -4, 4);
    const std::vector<T> before = x;
    std::vector<int64_t> positions(T_tokens);
    for (int64_t& p : positions) p = int64_t(rng() % max_pos);
    int bad_token = -1;
    if (with_bad_position) {
      bad_token = int(rng() % uint64_t(T_tokens));
      positions[bad_token] = rng() % 2 ? max_pos + int64_t(rng() % 9) : -1 - int64_t(rng() % 9);
    }
    std::vector<C> cache(size_t(max_pos) * D);
    for (int p = 0; p < max_pos; ++p) {
      for (int i = 0; i < half; ++i) {
        const double angle = p * std::pow(10000.0, -2.0 * i / D);
        cache[p * D + i] = from_double<C>(std::cos(angle));
        cache[p * D + half + i] = from_double<C>(std::sin(angle));
      }
    }
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(T_tokens), dim3(layer::kThreads), 0, layer::rotary_embedding_kernel<T, C>, x.data(),
                     positions.data(), cache.data(), int64_t(max_pos), stride_token, stride_head, H, half, &error);
    for (int t = 0; t < T_tokens; ++t) {
      for (int h = 0; h < packed_heads; ++h) {
        for (int i = 0; i < half; ++i) {
          const size_t a = t * stride_token + h * stride_head + i, b = a + half;
          if (h >= H || t == bad_token) {  // not rotated: bit-identical
            ASSERT_EQ(to_double(x[a]), to_double(before[a]));
            ASSERT_EQ(to_double(x[b]), to_double(before[b]));
            continue;
          }
          // Hugging Face, in T: cos/sin rounded to T, each product rounded, then the sum.
          const double c = round_to<T>(to_double(cache[positions[t] * D + i]));
          const double s = round_to<T>(to_double(cache[positions[t] * D + half + i]));
          const double x1 = to_double(before[a]), x2 = to_double(before[b]);
          const double y1 = round_to<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
          const double y2 = round_to<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
          ASSERT_TRUE(close<T>(to_double(x[a]), y1)) << t << "," << h << "," << i << ": " << to_double(x[a]) << " vs " << y1;
          ASSERT_TRUE(close<T>(to_double(x[b]), y2)) << t << "," << h << "," << i;
        }
      }
    }
    EXPECT_EQ(error.claimed, with_bad_position ? 1u : 0u);
    if (with_bad_position) {
      EXPECT_EQ(error.value, positions[bad_token]);
      EXPECT_EQ(error.where, bad_token);
    }
  }
}

TYPED_TEST(CudaLayerOps, RotaryEmbeddingEveryCacheDtype) {
  rotary_case<TypeParam, float>(false);
  rotary_case<TypeParam, c10::Half>(false);
  rotary_case<TypeParam, c10::BFloat16>(false);
}

TYPED_TEST(CudaLayerOps, RotaryOutOfRangePositionSkippedAndReported) { rotary_case<TypeParam, float>(true); }

}  // namespace
