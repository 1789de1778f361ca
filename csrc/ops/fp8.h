// 8-bit float KV storage (float8_e4m3fn, float8_e5m2), shared by the CPU and CUDA kernels: the format
// tag, the saturating store rule and the scale lookup. The bit conversions are c10's (header-only,
// host and device), so stored bytes equal torch's own `.to(torch.float8_*)` of the same fp32 value.
//
// Rule: stored = fp8(clamp(x / scale, -max, max)) with round-to-nearest-even; NaN stays NaN, +-inf and
// anything beyond the largest finite value saturate (e4m3fn has no inf; e5m2's is never produced).
// Read back: x' = float(stored) * scale.
#pragma once

#include <torch/headeronly/macros/Macros.h>
#include <torch/headeronly/util/Float8_e4m3fn.h>
#include <torch/headeronly/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

namespace pagedkv {

enum class KvFormat : int { kE4M3 = 0, kE5M2 = 1 };

template <KvFormat F>
struct Fp8Traits;

template <>
struct Fp8Traits<KvFormat::kE4M3> {
  using type = c10::Float8_e4m3fn;
  static constexpr float kMax = 448.0f;
  static C10_HOST_DEVICE uint8_t encode(float x) { return c10::detail::fp8e4m3fn_from_fp32_value(x); }
  static C10_HOST_DEVICE float decode(uint8_t b) { return c10::detail::fp8e4m3fn_to_fp32_value(b); }
};

template <>
struct Fp8Traits<KvFormat::kE5M2> {
  using type = c10::Float8_e5m2;
  static constexpr float kMax = 57344.0f;
  static C10_HOST_DEVICE uint8_t encode(float x) { return c10::detail::fp8e5m2_from_fp32_value(x); }
  static C10_HOST_DEVICE float decode(uint8_t b) { return c10::detail::fp8e5m2_to_fp32_value(b); }
};

// x is already divided by the scale. Comparisons leave NaN untouched (it encodes as NaN).
template <KvFormat F>
C10_HOST_DEVICE inline uint8_t fp8_saturating_encode(float x) {
  constexpr float kMax = Fp8Traits<F>::kMax;
  if (x > kMax) x = kMax;
  if (x < -kMax) x = -kMax;
  return Fp8Traits<F>::encode(x);
}

// A KV scale argument: one float per tensor (stride 0) or per KV head (stride 1); null means 1.
struct KvScale {
  const float* data = nullptr;
  int64_t head_stride = 0;

  C10_HOST_DEVICE float at(int64_t kv_head) const { return data == nullptr ? 1.0f : data[kv_head * head_stride]; }
};

// Calls fn with std::integral_constant<KvFormat, F> for the format.
template <typename Fn>
void dispatch_fp8(KvFormat format, Fn&& fn) {
  if (format == KvFormat::kE4M3) {
    fn(std::integral_constant<KvFormat, KvFormat::kE4M3>{});
  } else {
    fn(std::integral_constant<KvFormat, KvFormat::kE5M2>{});
  }
}

}  // namespace pagedkv
