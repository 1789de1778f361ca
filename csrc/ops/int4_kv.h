// The int4 KV row (one token's head of keys or values, head_dim elements in groups of group_size), shared by the
// CPU and CUDA kernels. Torch-free apart from c10's header-only fp16 conversions (host and device).
//
// Bytes of a row: head_dim / 2 code bytes (element 2i in the low nibble of byte i, 2i + 1 in the high one), then
// per group its fp16 step and its fp16 minimum (4 bytes). Element x of a group with minimum lo and maximum hi is
// stored as code q = clamp(round_half_even((x - lo') / step'), 0, 15), where step' = fp16((hi - lo) / 15) and
// lo' = fp16(lo) are the stored values (so the codes fit what is read back); it reads back as q * step' + lo'.
#pragma once

#include <torch/headeronly/macros/Macros.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>

#include "ops/paged_kv.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace pagedkv {

constexpr int kInt4Levels = 15;           // codes 0..15: 15 steps from a group's minimum to its maximum
constexpr int kInt4GroupMetaBytes = 4;    // fp16 step, fp16 minimum

// Bytes of one row. head_dim and group_size are checked by the ops: group_size even and dividing head_dim.
C10_HOST_DEVICE inline int64_t int4_row_bytes(int64_t head_dim, int64_t group_size) {
  return head_dim / 2 + kInt4GroupMetaBytes * (head_dim / group_size);
}

C10_HOST_DEVICE inline uint16_t int4_load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));  // little-endian, any alignment
}

C10_HOST_DEVICE inline void int4_store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xff);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// fp16 bits of x, rounded to nearest even (c10's conversion is host-only; the device's intrinsic rounds alike).
C10_HOST_DEVICE inline uint16_t int4_fp16_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(x));
#else
  return c10::detail::fp16_ieee_from_fp32_value(x);
#endif
}

// One group's read-back rule: x = code * step + lo.
struct Int4Group {
  float step;
  float lo;
};

C10_HOST_DEVICE inline Int4Group int4_group(const uint8_t* row, int64_t head_dim, int64_t group) {
  const uint8_t* meta = row + head_dim / 2 + kInt4GroupMetaBytes * group;
  return {c10::detail::fp16_ieee_to_fp32_value(int4_load_u16(meta)),
          c10::detail::fp16_ieee_to_fp32_value(int4_load_u16(meta + 2))};
}

C10_HOST_DEVICE inline int int4_code(const uint8_t* row, int64_t d) {
  return (row[d >> 1] >> ((d & 1) * 4)) & 0xf;
}

// Elements 2c and 2c + 1 of a row (code byte c), read back.
struct Int4Pair {
  float first, second;
};

C10_HOST_DEVICE inline Int4Pair int4_decode_pair(const uint8_t* row, int64_t head_dim, int64_t group_size, int64_t c) {
  const Int4Group g = int4_group(row, head_dim, 2 * c / group_size);
  const int byte = row[c];
  return {static_cast<float>(byte & 0xf) * g.step + g.lo, static_cast<float>(byte >> 4) * g.step + g.lo};
}

// Quantises one group of g elements (x(i) gives element i as float) into the row: codes of elements
// [first, first + g), the group's step and minimum. Non-finite inputs store unspecified codes, never UB.
template <typename Get>
C10_HOST_DEVICE inline void int4_encode_group(uint8_t* row, int64_t head_dim, int64_t group, int64_t g, Get x) {
  float lo = x(0), hi = x(0);
  for (int64_t i = 1; i < g; ++i) {
    const float v = x(i);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const uint16_t lo_bits = int4_fp16_bits(lo);
  const uint16_t step_bits = int4_fp16_bits(div_rn(hi - lo, kInt4Levels));
  uint8_t* meta = row + head_dim / 2 + kInt4GroupMetaBytes * group;
  int4_store_u16(meta, step_bits);
  int4_store_u16(meta + 2, lo_bits);
  const float step = c10::detail::fp16_ieee_to_fp32_value(step_bits);
  const float lo_stored = c10::detail::fp16_ieee_to_fp32_value(lo_bits);
  const int64_t first = group * g;
  for (int64_t i = 0; i < g; i += 2) {
    int codes[2];
    for (int j = 0; j < 2; ++j) {
      float q = step > 0.f ? rintf(div_rn(x(i + j) - lo_stored, step)) : 0.f;
      q = q > kInt4Levels ? float(kInt4Levels) : (q >= 0.f ? q : 0.f);  // NaN -> 0
      codes[j] = static_cast<int>(q);
    }
    row[(first + i) >> 1] = static_cast<uint8_t>(codes[0] | (codes[1] << 4));
  }
}

}  // namespace pagedkv
