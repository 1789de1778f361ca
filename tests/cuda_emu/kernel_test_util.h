// Helpers of the emulated CUDA kernel tests: dtypes as test parameters, fresh random inputs each run
// (the seed is printed on failure), rounding to a dtype in float64 references, tolerances.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_emu.h"

namespace emu_test {

// A fresh seed per test (logged so a failure can be replayed by hand).
inline std::mt19937_64 make_rng() {
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

template <typename T>
T from_double(double x) {
  return static_cast<T>(static_cast<float>(x));
}
template <typename T>
double to_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
// x rounded to T, as a double.
template <typename T>
double round_to(double x) {
  return to_double(from_double<T>(x));
}

// Relative precision of T (one unit in the last place at 1.0).
template <typename T>
double eps_of() {
  if constexpr (std::is_same_v<T, float>) return 1.2e-7;
  if constexpr (std::is_same_v<T, c10::Half>) return 9.8e-4;
  return 7.9e-3;  // bfloat16
}

template <typename T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, c10::Half>) return "float16";
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) return "float8_e4m3fn";
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) return "float8_e5m2";
  return "bfloat16";
}

template <typename T>
std::vector<T> random_vector(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<T> v(n);
  for (T& x : v) x = from_double<T>(dist(rng));
  return v;
}

// float64 attention of one query row over keys [begin, end): score(k) = q . key k (unscaled), value(k, d)
// element d of value k; scale and softcap as the kernels apply them; sink: the row's sink logit or null. Writes
// out[0, D) and returns the log-sum-exp.
template <typename Score, typename Value>
double reference_attention_row(int64_t begin, int64_t end, int D, double scale, double softcap, const float* sink,
                               Score score, Value value, std::vector<double>* out) {
  std::vector<double> logits;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t k = begin; k < end; ++k) {
    double s = score(k) * scale;
    if (softcap > 0) s = softcap * std::tanh(s / softcap);
    logits.push_back(s);
    m = std::max(m, s);
  }
  if (sink != nullptr) m = std::max(m, double(*sink));
  out->assign(D, 0.0);
  double l = sink != nullptr ? std::exp(double(*sink) - m) : 0.0;
  for (int64_t k = begin; k < end; ++k) {
    const double w = std::exp(logits[k - begin] - m);
    l += w;
    for (int d = 0; d < D; ++d) (*out)[d] += w * value(k, d);
  }
  for (double& o : *out) o /= l;
  return m + std::log(l);
}

// The schedules every kernel test runs under.
inline std::vector<cuda_emu::Schedule> schedules() {
  return {cuda_emu::Schedule::kForward, cuda_emu::Schedule::kReverse};
}

struct ScheduleScope {
  explicit ScheduleScope(cuda_emu::Schedule s) { cuda_emu::set_schedule(s); }
  ~ScheduleScope() { cuda_emu::set_schedule(cuda_emu::Schedule::kForward); }
};

inline const char* schedule_name(cuda_emu::Schedule s) {
  return s == cuda_emu::Schedule::kForward ? "forward" : "reverse";
}

}  // namespace emu_test
