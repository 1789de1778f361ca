// The CUDA cache-op kernels (csrc/ops/cuda/cache_ops.cuh) on the CPU emulator: reshape_and_cache for
// 4-byte (float32) and 2-byte (float16/bfloat16) elements on the 16-byte and the scalar path, and into
// float8 and int4, on every cache layout (separate, vLLM's interleaved cells, [pages, 2, ...], HND) with int32
// and int64 slots; copy_blocks in 16-byte and byte chunks; bit-exact against a plain copy, both
// schedules, every untouched byte of the cache buffer compared too. Padding (slot < 0) writes nothing;
// out-of-range slots and block ids are skipped and reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

#include "kernel_test_util.h"
#include "ops/cuda/cache_ops.cuh"

namespace {

using namespace emu_test;
namespace cache = pagedkv::cache_cuda;

template <typename bits_t>
std::vector<bits_t> random_bits(std::mt19937_64& rng, size_t n) {
  std::vector<bits_t> v(n + 16);  // slack so a view may start one element in
  for (bits_t& x : v) x = bits_t(rng());
  return v;
}

// key/value input layouts: contiguous [T, H, D]; a slice of a packed qkv row; every other element (scalar).
enum class Layout { kContiguous, kQkvSlice, kInterleaved };

// Cache layouts: K and V views of one buffer of num_blocks * bs * H * D * 2 elements.
//   kSeparate:    two contiguous [blocks, bs, H, D] halves (K first)
//   kVllmCells:   [blocks, bs, H, 2D], K = x[..., :D], V = x[..., D:]
//   kPagesTwo:    [blocks, 2, bs, H, D], K = x[:, 0], V = x[:, 1] (FlashInfer)
//   kHnd:         [blocks, 2, H, bs, D] seen as [blocks, bs, H, D] (K = x[:, 0].transpose(1, 2))
//   kMixed:       K a contiguous first half, V the second half in HND order (K and V strides differ)
enum class CacheLayout { kSeparate, kVllmCells, kPagesTwo, kHnd, kMixed };
constexpr CacheLayout kCacheLayouts[] = {CacheLayout::kSeparate, CacheLayout::kVllmCells, CacheLayout::kPagesTwo,
                                         CacheLayout::kHnd, CacheLayout::kMixed};

const char* cache_layout_name(CacheLayout l) {
  switch (l) {
    case CacheLayout::kSeparate: return "separate";
    case CacheLayout::kVllmCells: return "vllm cells";
    case CacheLayout::kPagesTwo: return "pages x 2";
    case CacheLayout::kHnd: return "hnd";
    default: return "mixed";
  }
}

struct CacheViews {
  int64_t key_offset, value_offset;  // elements into the buffer
  pagedkv::CacheStrides key_strides, value_strides;
  int64_t buffer_elems;
};

CacheViews cache_views(CacheLayout layout, int64_t num_blocks, int64_t bs, int64_t H, int64_t D) {
  const int64_t half = num_blocks * bs * H * D;
  const pagedkv::CacheStrides nhd{bs * H * D, H * D, D}, hnd{H * bs * D, D, bs * D};
  switch (layout) {
    case CacheLayout::kSeparate: return {0, half, nhd, nhd, 2 * half};
    case CacheLayout::kVllmCells: {
      const pagedkv::CacheStrides cells{bs * H * 2 * D, H * 2 * D, 2 * D};
      return {0, D, cells, cells, 2 * half};
    }
    case CacheLayout::kPagesTwo: {
      const pagedkv::CacheStrides pages{2 * bs * H * D, H * D, D};
      return {0, bs * H * D, pages, pages, 2 * half};
    }
    case CacheLayout::kHnd: {
      const pagedkv::CacheStrides pages{2 * H * bs * D, D, bs * D};
      return {0, H * bs * D, pages, pages, 2 * half};
    }
    default: return {0, half, nhd, hnd, 2 * half};
  }
}

// Element offset of (slot, h, d) in a view, computed without the kernels' helpers.
int64_t element_at(const pagedkv::CacheStrides& s, int64_t view_offset, int64_t slot, int64_t bs, int64_t h,
                   int64_t d) {
  return view_offset + (slot / bs) * s.block + (slot % bs) * s.token + h * s.head + d;
}

// Distinct random slots, some -1 (padding); with bad_token given, the slot of a random token (stored
// there) is >= num_slots.
std::vector<int64_t> random_slots(std::mt19937_64& rng, int T, int64_t num_slots, int pad_every, int* bad_token) {
  std::vector<int64_t> all_slots(num_slots);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
  for (int t = 0; t < T; t += pad_every + int(rng() % 3)) slots[t] = -1;  // padding
  if (bad_token != nullptr) {
    *bad_token = int(rng() % uint64_t(T));
    slots[*bad_token] = num_slots + int64_t(rng() % 1000);
  }
  return slots;
}

template <typename slot_t>
const char* slot_type_name() {
  return sizeof(slot_t) == 4 ? "int32 slots" : "int64 slots";
}

template <typename bits_t, typename slot_t>
void reshape_and_cache_case(Layout layout, CacheLayout cache_layout, int H, int D, bool with_bad_slot) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string("elem bytes ") + std::to_string(sizeof(bits_t)) + ", layout " +
                 std::to_string(int(layout)) + ", cache " + cache_layout_name(cache_layout) + ", " +
                 slot_type_name<slot_t>() + ", D " + std::to_string(D) + ", " + schedule_name(schedule));
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int T = 5 + int(rng() % 20), num_blocks = 12, bs = 8;
    const int64_t num_slots = int64_t(num_blocks) * bs;
    cache::TokenStrides in{int64_t(H) * D, D, 1};
    if (layout == Layout::kQkvSlice) in.token = int64_t(3 * H) * D;
    if (layout == Layout::kInterleaved) in = {2 * int64_t(H) * D, 2 * int64_t(D), 2};
    const std::vector<bits_t> key = random_bits<bits_t>(rng, size_t(T) * in.token);
    const std::vector<bits_t> value = random_bits<bits_t>(rng, size_t(T) * in.token);
    const CacheViews views = cache_views(cache_layout, num_blocks, bs, H, D);
    std::vector<bits_t> buffer = random_bits<bits_t>(rng, size_t(views.buffer_elems));  // sentinels
    int bad_token = -1;
    const std::vector<int64_t> slots64 = random_slots(rng, T, num_slots, 3, with_bad_slot ? &bad_token : nullptr);
    const std::vector<slot_t> slots(slots64.begin(), slots64.end());
    std::vector<bits_t> want = buffer;
    for (int t = 0; t < T; ++t) {
      if (slots64[t] < 0 || slots64[t] >= num_slots) continue;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          const int64_t src = t * in.token + h * in.head + d * in.dim;
          want[element_at(views.key_strides, views.key_offset, slots64[t], bs, h, d)] = key[src];
          want[element_at(views.value_strides, views.value_offset, slots64[t], bs, h, d)] = value[src];
        }
      }
    }
    bits_t* key_cache = buffer.data() + views.key_offset;
    bits_t* value_cache = buffer.data() + views.value_offset;
    const bool vec = cache::rows_16b_aligned(key.data(), sizeof(bits_t), D, in) &&
                     cache::rows_16b_aligned(value.data(), sizeof(bits_t), D, in) &&
                     pagedkv::cache_rows_16b_aligned(key_cache, sizeof(bits_t), views.key_strides) &&
                     pagedkv::cache_rows_16b_aligned(value_cache, sizeof(bits_t), views.value_strides);
    // Every cache stride and view offset is a multiple of D: 16-byte rows iff D's bytes are.
    EXPECT_EQ(vec, layout != Layout::kInterleaved && (D * sizeof(bits_t)) % 16 == 0);
    const auto kernel = vec ? cache::reshape_and_cache_kernel<bits_t, true, slot_t>
                            : cache::reshape_and_cache_kernel<bits_t, false, slot_t>;
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(T), dim3(cache::kThreads), 0, kernel, key.data(), value.data(), key_cache, value_cache,
                     slots.data(), in, in, views.key_strides, views.value_strides, H, D, int64_t(bs), num_slots, &error);
    EXPECT_TRUE(buffer == want);  // the written rows, and every other element unchanged
    EXPECT_EQ(error.claimed, with_bad_slot ? 1u : 0u);
    if (with_bad_slot) {
      EXPECT_EQ(error.value, slots64[bad_token]);
      EXPECT_EQ(error.where, bad_token);
    }
  }
}

// Every input layout on every cache layout, with both slot types.
template <typename bits_t>
void reshape_and_cache_all_layouts(Layout layout, int H, int D) {
  for (const CacheLayout cache_layout : kCacheLayouts) {
    reshape_and_cache_case<bits_t, int64_t>(layout, cache_layout, H, D, false);
    reshape_and_cache_case<bits_t, int32_t>(layout, cache_layout, H, D, false);
  }
}

TEST(CudaReshapeAndCache, Float32Vector) { reshape_and_cache_all_layouts<uint32_t>(Layout::kContiguous, 4, 64); }
TEST(CudaReshapeAndCache, Float32QkvSlice) { reshape_and_cache_all_layouts<uint32_t>(Layout::kQkvSlice, 2, 128); }
TEST(CudaReshapeAndCache, Float32Scalar) { reshape_and_cache_all_layouts<uint32_t>(Layout::kInterleaved, 3, 32); }
TEST(CudaReshapeAndCache, Float32OddHeadDim) { reshape_and_cache_all_layouts<uint32_t>(Layout::kContiguous, 2, 6); }
TEST(CudaReshapeAndCache, HalfWidthVector) { reshape_and_cache_all_layouts<uint16_t>(Layout::kContiguous, 4, 256); }
TEST(CudaReshapeAndCache, HalfWidthQkvSlice) { reshape_and_cache_all_layouts<uint16_t>(Layout::kQkvSlice, 2, 64); }
TEST(CudaReshapeAndCache, HalfWidthScalar) { reshape_and_cache_all_layouts<uint16_t>(Layout::kInterleaved, 2, 64); }
TEST(CudaReshapeAndCache, HalfWidthOddHeadDim) { reshape_and_cache_all_layouts<uint16_t>(Layout::kContiguous, 3, 12); }
TEST(CudaReshapeAndCache, OutOfRangeSlotSkippedAndReported) {
  reshape_and_cache_case<uint32_t, int64_t>(Layout::kContiguous, CacheLayout::kSeparate, 2, 32, true);
  reshape_and_cache_case<uint16_t, int64_t>(Layout::kInterleaved, CacheLayout::kVllmCells, 2, 16, true);
  reshape_and_cache_case<uint32_t, int32_t>(Layout::kContiguous, CacheLayout::kHnd, 2, 32, true);
  reshape_and_cache_case<uint16_t, int32_t>(Layout::kQkvSlice, CacheLayout::kPagesTwo, 2, 16, true);
}

// An int32 slot mapping at the type's limits: INT32_MAX is out of range (skipped, reported as itself),
// INT32_MIN is padding; nothing wraps into the cache.
TEST(CudaReshapeAndCache, Int32SlotsAtTheTypeLimits) {
  const int H = 2, D = 8, bs = 4, num_blocks = 3;
  const CacheViews views = cache_views(CacheLayout::kVllmCells, num_blocks, bs, H, D);
  std::mt19937_64 rng = make_rng();
  const std::vector<uint32_t> key = random_bits<uint32_t>(rng, 3 * H * D);
  const std::vector<uint32_t> value = random_bits<uint32_t>(rng, 3 * H * D);
  std::vector<uint32_t> buffer = random_bits<uint32_t>(rng, size_t(views.buffer_elems));
  const std::vector<uint32_t> before = buffer;
  const std::vector<int32_t> slots = {INT32_MAX, INT32_MIN, -1};
  pagedkv::IndexError error{};
  cuda_emu::launch(dim3(3), dim3(cache::kThreads), 0, cache::reshape_and_cache_kernel<uint32_t, false, int32_t>,
                   key.data(), value.data(), buffer.data() + views.key_offset, buffer.data() + views.value_offset,
                   slots.data(), cache::TokenStrides{H * D, D, 1}, cache::TokenStrides{H * D, D, 1},
                   views.key_strides, views.value_strides, H, D, int64_t(bs), int64_t(num_blocks) * bs, &error);
  EXPECT_TRUE(buffer == before);
  EXPECT_EQ(error.claimed, 1u);
  EXPECT_EQ(error.value, INT32_MAX);
  EXPECT_EQ(error.where, 0);
}

// The float8 rule, written independently of the kernels: the code whose value is nearest to x after
// saturation, ties to the even code, the sign of x kept (also for zero); NaN maps to a NaN code.
template <pagedkv::KvFormat F>
uint8_t nearest_fp8(float x) {
  using Traits = pagedkv::Fp8Traits<F>;
  if (std::isnan(x)) return 0x7F;  // compared as "is NaN" below
  x = std::min(std::max(x, -Traits::kMax), Traits::kMax);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  int best = -1;
  double best_err = 0;
  for (int c = 0; c < 128; ++c) {
    const float v = Traits::decode(uint8_t(c | sign));
    if (!std::isfinite(v)) continue;
    const double err = std::fabs(double(v) - double(x));
    if (best < 0 || err < best_err || (err == best_err && (c & 1) == 0)) best = c, best_err = err;
  }
  return uint8_t(best | sign);
}

template <typename scalar_t, pagedkv::KvFormat F, typename slot_t>
void reshape_and_cache_fp8_case(CacheLayout cache_layout, int H, int D,
                                int scale_kind /* 0 none, 1 per tensor, 2 per head */) {
  using Traits = pagedkv::Fp8Traits<F>;
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string(dtype_name<scalar_t>()) + (F == pagedkv::KvFormat::kE4M3 ? " e4m3" : " e5m2") +
                 ", scales " + std::to_string(scale_kind) + ", cache " + cache_layout_name(cache_layout) + ", " +
                 slot_type_name<slot_t>() + ", " + schedule_name(schedule));
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int T = 3 + int(rng() % 12), num_blocks = 6, bs = 4;
    const int64_t num_slots = int64_t(num_blocks) * bs;
    std::vector<float> scales(H);
    for (float& s : scales) s = std::ldexp(1.0f + float(rng() % 1000) / 1000.f, int(rng() % 9) - 4);
    pagedkv::KvScale scale{scale_kind ? scales.data() : nullptr, scale_kind == 2 ? 1 : 0};
    // Values across the format's whole range and beyond (saturation), tiny ones (subnormals), inf, NaN.
    std::vector<scalar_t> key(size_t(T) * H * D), value(size_t(T) * H * D);
    for (auto* v : {&key, &value}) {
      for (scalar_t& x : *v) {
        const uint64_t r = rng() % 100;
        double mag = std::ldexp(1.0 + double(rng() % 4096) / 4096.0, int(rng() % 40) - 24) * Traits::kMax / 256;
        if (r == 0) mag = INFINITY;
        x = from_double<scalar_t>(r == 1 ? NAN : (rng() & 1 ? mag : -mag));
      }
    }
    const CacheViews views = cache_views(cache_layout, num_blocks, bs, H, D);
    std::vector<uint8_t> buffer = random_bits<uint8_t>(rng, size_t(views.buffer_elems));  // sentinels
    const std::vector<int64_t> slots64 = random_slots(rng, T, num_slots, 4, nullptr);
    const std::vector<slot_t> slots(slots64.begin(), slots64.end());
    std::vector<uint8_t> want = buffer;
    for (int t = 0; t < T; ++t) {
      if (slots64[t] < 0) continue;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          const size_t src = (size_t(t) * H + h) * D + d;
          want[element_at(views.key_strides, views.key_offset, slots64[t], bs, h, d)] =
              nearest_fp8<F>(static_cast<float>(key[src]) / scale.at(h));
          want[element_at(views.value_strides, views.value_offset, slots64[t], bs, h, d)] =
              nearest_fp8<F>(static_cast<float>(value[src]) / scale.at(h));
        }
      }
    }
    const cache::TokenStrides in{int64_t(H) * D, D, 1};
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(T), dim3(cache::kThreads), 0, cache::reshape_and_cache_fp8_kernel<scalar_t, F, slot_t>,
                     key.data(), value.data(), buffer.data() + views.key_offset, buffer.data() + views.value_offset,
                     slots.data(), in, in, views.key_strides, views.value_strides, H, D, int64_t(bs), num_slots, scale, scale,
                     &error);
    EXPECT_EQ(error.claimed, 0u);
    for (size_t i = 0; i < buffer.size(); ++i) {  // sentinel bytes compare exactly; NaN codes as NaN
      if (std::isnan(Traits::decode(want[i])) && want[i] != buffer[i]) {
        EXPECT_TRUE(std::isnan(Traits::decode(buffer[i]))) << "element " << i;
      } else {
        ASSERT_EQ(int(buffer[i]), int(want[i])) << "element " << i << ": got " << Traits::decode(buffer[i])
                                                << ", want " << Traits::decode(want[i]);
      }
    }
  }
}

template <typename scalar_t, pagedkv::KvFormat F>
void reshape_and_cache_fp8_all(int H, int D) {
  for (int kind = 0; kind < 3; ++kind) {
    for (const CacheLayout cache_layout : kCacheLayouts) {
      reshape_and_cache_fp8_case<scalar_t, F, int64_t>(cache_layout, H, D, kind);
      reshape_and_cache_fp8_case<scalar_t, F, int32_t>(cache_layout, H, D, kind);
    }
  }
}

TEST(CudaReshapeAndCacheFp8, E4M3AllInputDtypesScalesAndLayouts) {
  using pagedkv::KvFormat;
  reshape_and_cache_fp8_all<float, KvFormat::kE4M3>(3, 16);
  reshape_and_cache_fp8_all<c10::Half, KvFormat::kE4M3>(2, 8);
  reshape_and_cache_fp8_all<c10::BFloat16, KvFormat::kE4M3>(2, 12);
}

TEST(CudaReshapeAndCacheFp8, E5M2AllInputDtypesScalesAndLayouts) {
  using pagedkv::KvFormat;
  reshape_and_cache_fp8_all<float, KvFormat::kE5M2>(3, 16);
  reshape_and_cache_fp8_all<c10::Half, KvFormat::kE5M2>(2, 8);
  reshape_and_cache_fp8_all<c10::BFloat16, KvFormat::kE5M2>(1, 32);
}

// The int4 row rule of ops/int4_kv.h, written independently of the kernels: per group, step = fp16((max - min) /
// 15) and minimum = fp16(min) as stored; each element's code is round-half-even((x - minimum) / step) clamped to
// [0, 15] (0 when the step is 0); element 2i in the low nibble of byte i.
std::vector<uint8_t> int4_reference_row(const std::vector<float>& x, int group) {
  const int D = int(x.size());
  std::vector<uint8_t> row(D / 2 + 4 * (D / group), 0);
  for (int g = 0; g < D / group; ++g) {
    const auto first = x.begin() + g * group;
    const float lo = *std::min_element(first, first + group), hi = *std::max_element(first, first + group);
    const c10::Half step_h((hi - lo) / 15.f), lo_h(lo);
    const float step = float(step_h), lo_s = float(lo_h);
    for (int i = 0; i < group; ++i) {
      const float q = step > 0.f ? std::nearbyint((first[i] - lo_s) / step) : 0.f;
      const int code = int(std::min(15.f, std::max(0.f, q)));
      row[(g * group + i) / 2] |= uint8_t(code << ((i % 2) * 4));
    }
    std::memcpy(row.data() + D / 2 + 4 * g, &step_h.x, 2);
    std::memcpy(row.data() + D / 2 + 4 * g + 2, &lo_h.x, 2);
  }
  return row;
}

// reshape_and_cache_int4: every written row equals the reference rule on every cache layout (row strides in
// bytes), with both slot types and strided inputs; every other byte of the buffer unchanged; padding skipped;
// an out-of-range slot skipped and reported.
template <typename scalar_t, typename slot_t>
void reshape_and_cache_int4_case(Layout layout, CacheLayout cache_layout, int H, int D, int group, bool with_bad_slot) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string(dtype_name<scalar_t>()) + ", layout " + std::to_string(int(layout)) + ", cache " +
                 cache_layout_name(cache_layout) + ", " + slot_type_name<slot_t>() + ", D " + std::to_string(D) +
                 ", group " + std::to_string(group) + ", " + schedule_name(schedule));
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int T = 4 + int(rng() % 16), num_blocks = 8, bs = 4, R = D / 2 + 4 * (D / group);
    const int64_t num_slots = int64_t(num_blocks) * bs;
    cache::TokenStrides in{int64_t(H) * D, D, 1};
    if (layout == Layout::kQkvSlice) in.token = int64_t(3 * H) * D;
    if (layout == Layout::kInterleaved) in = {2 * int64_t(H) * D, 2 * int64_t(D), 2};
    // Rows of different magnitudes, some constant (step 0).
    std::vector<scalar_t> key(size_t(T) * in.token), value(size_t(T) * in.token);
    for (auto* v : {&key, &value}) {
      for (size_t i = 0; i < v->size(); i += D) {
        const double m = std::ldexp(1.0, int(rng() % 12) - 6);
        const bool constant = rng() % 8 == 0;
        for (size_t j = i; j < std::min(v->size(), i + D); ++j) {
          (*v)[j] = from_double<scalar_t>(constant ? m : m * (double(rng() % 20001) / 10000.0 - 1.0));
        }
      }
    }
    const CacheViews views = cache_views(cache_layout, num_blocks, bs, H, R);
    std::vector<uint8_t> buffer = random_bits<uint8_t>(rng, size_t(views.buffer_elems));  // sentinels
    int bad_token = -1;
    const std::vector<int64_t> slots64 = random_slots(rng, T, num_slots, 3, with_bad_slot ? &bad_token : nullptr);
    const std::vector<slot_t> slots(slots64.begin(), slots64.end());
    std::vector<uint8_t> want = buffer;
    for (int t = 0; t < T; ++t) {
      if (slots64[t] < 0 || slots64[t] >= num_slots) continue;
      for (int h = 0; h < H; ++h) {
        for (const bool is_value : {false, true}) {
          std::vector<float> x(D);
          for (int d = 0; d < D; ++d) x[d] = float((is_value ? value : key)[t * in.token + h * in.head + d * in.dim]);
          const std::vector<uint8_t> row = int4_reference_row(x, group);
          const int64_t at = is_value ? element_at(views.value_strides, views.value_offset, slots64[t], bs, h, 0)
                                      : element_at(views.key_strides, views.key_offset, slots64[t], bs, h, 0);
          std::copy(row.begin(), row.end(), want.begin() + at);
        }
      }
    }
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(T), dim3(cache::kThreads), 0, cache::reshape_and_cache_int4_kernel<scalar_t, slot_t>,
                     key.data(), value.data(), buffer.data() + views.key_offset, buffer.data() + views.value_offset,
                     slots.data(), in, in, views.key_strides, views.value_strides, H, D, group, int64_t(bs), num_slots,
                     &error);
    size_t first_diff = 0;
    while (first_diff < want.size() && buffer[first_diff] == want[first_diff]) ++first_diff;
    EXPECT_EQ(first_diff, want.size()) << "first differing byte";  // the rows, and every other byte unchanged
    EXPECT_EQ(error.claimed, with_bad_slot ? 1u : 0u);
    if (with_bad_slot) {
      EXPECT_EQ(error.value, slots64[bad_token]);
      EXPECT_EQ(error.where, bad_token);
    }
  }
}

template <typename scalar_t>
void reshape_and_cache_int4_all(Layout layout, int H, int D, int group) {
  for (const CacheLayout cache_layout : kCacheLayouts) {
    reshape_and_cache_int4_case<scalar_t, int64_t>(layout, cache_layout, H, D, group, false);
    reshape_and_cache_int4_case<scalar_t, int32_t>(layout, cache_layout, H, D, group, false);
  }
}

TEST(CudaReshapeAndCacheInt4, Float32AllLayouts) {
  reshape_and_cache_int4_all<float>(Layout::kContiguous, 4, 64, 32);
  reshape_and_cache_int4_all<float>(Layout::kInterleaved, 2, 32, 16);
}
TEST(CudaReshapeAndCacheInt4, HalfQkvSlice) { reshape_and_cache_int4_all<c10::Half>(Layout::kQkvSlice, 2, 128, 64); }
TEST(CudaReshapeAndCacheInt4, BFloat16OddGroups) {
  reshape_and_cache_int4_all<c10::BFloat16>(Layout::kContiguous, 3, 36, 18);
  reshape_and_cache_int4_all<c10::BFloat16>(Layout::kInterleaved, 1, 256, 128);
}
TEST(CudaReshapeAndCacheInt4, OutOfRangeSlotSkippedAndReported) {
  reshape_and_cache_int4_case<float, int64_t>(Layout::kContiguous, CacheLayout::kSeparate, 2, 32, 32, true);
  reshape_and_cache_int4_case<c10::Half, int32_t>(Layout::kInterleaved, CacheLayout::kHnd, 2, 64, 32, true);
}

template <typename Chunk>
void copy_blocks_case(int64_t block_bytes, bool with_bad_id) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string("chunk ") + std::to_string(sizeof(Chunk)) + ", " + schedule_name(schedule));
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int64_t num_blocks = 16, chunks = block_bytes / int64_t(sizeof(Chunk));
    std::vector<Chunk> key_cache(num_blocks * chunks), value_cache(num_blocks * chunks);
    auto* kb = reinterpret_cast<unsigned char*>(key_cache.data());
    auto* vb = reinterpret_cast<unsigned char*>(value_cache.data());
    for (int64_t i = 0; i < num_blocks * block_bytes; ++i) kb[i] = (unsigned char)rng(), vb[i] = (unsigned char)rng();
    // Sources and destinations disjoint, destinations distinct (the op's contract).
    std::vector<int64_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int pairs = 3 + int(rng() % 5);
    std::vector<int64_t> mapping;
    for (int i = 0; i < pairs; ++i) {
      mapping.push_back(ids[rng() % 8]);   // sources among the first 8 (may repeat)
      mapping.push_back(ids[8 + i]);       // distinct destinations among the last 8
    }
    int bad_entry = -1;
    if (with_bad_id) {
      bad_entry = int(rng() % mapping.size());
      mapping[bad_entry] = rng() % 2 ? -1 - int64_t(rng() % 5) : num_blocks + int64_t(rng() % 5);
    }
    std::vector<unsigned char> want_k(kb, kb + num_blocks * block_bytes), want_v(vb, vb + num_blocks * block_bytes);
    for (int i = 0; i < pairs; ++i) {
      const int64_t src = mapping[2 * i], dst = mapping[2 * i + 1];
      if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) continue;
      std::copy(kb + src * block_bytes, kb + (src + 1) * block_bytes, want_k.begin() + dst * block_bytes);
      std::copy(vb + src * block_bytes, vb + (src + 1) * block_bytes, want_v.begin() + dst * block_bytes);
    }
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(pairs), dim3(cache::kThreads), 0, cache::copy_blocks_kernel<Chunk>, key_cache.data(),
                     value_cache.data(), mapping.data(), chunks, num_blocks, &error);
    EXPECT_TRUE(std::equal(want_k.begin(), want_k.end(), kb));
    EXPECT_TRUE(std::equal(want_v.begin(), want_v.end(), vb));
    EXPECT_EQ(error.claimed, with_bad_id ? 1u : 0u);
    if (with_bad_id) {
      EXPECT_EQ(error.value, mapping[bad_entry]);
      EXPECT_EQ(error.where, bad_entry);
    }
  }
}

TEST(CudaCopyBlocks, SixteenByteChunks) { copy_blocks_case<uint4>(16 * 4 * 2 * 64, false); }
TEST(CudaCopyBlocks, ByteChunks) { copy_blocks_case<uint8_t>(8 * 3 * 2 * 6, false); }  // odd-sized rows
TEST(CudaCopyBlocks, OutOfRangeIdSkippedAndReported) {
  copy_blocks_case<uint4>(16 * 64, true);
  copy_blocks_case<uint8_t>(8 * 6, true);
}

}  // namespace
