// The CUDA cache-op kernels (csrc/ops/cuda/cache_ops.cuh) on the CPU emulator: reshape_and_cache for
// 4-byte (float32) and 2-byte (float16/bfloat16) elements on the 16-byte and the scalar path, and
// copy_blocks in 16-byte and byte chunks; bit-exact against a plain copy, both schedules. Padding
// (slot -1) writes nothing; out-of-range slots and block ids are skipped and reported.
#include <gtest/gtest.h>

#include <algorithm>
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

// key/value layouts: contiguous [T, H, D]; a slice of a packed qkv row; every other element (scalar).
enum class Layout { kContiguous, kQkvSlice, kInterleaved };

template <typename bits_t>
void reshape_and_cache_case(Layout layout, int H, int D, bool with_bad_slot) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string("elem bytes ") + std::to_string(sizeof(bits_t)) + ", layout " +
                 std::to_string(int(layout)) + ", D " + std::to_string(D) + ", " + schedule_name(schedule));
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int T = 5 + int(rng() % 20), num_blocks = 12, bs = 8;
    const int64_t num_slots = int64_t(num_blocks) * bs;
    int64_t stride_token = int64_t(H) * D, stride_head = D, stride_dim = 1;
    if (layout == Layout::kQkvSlice) stride_token = int64_t(3 * H) * D;
    if (layout == Layout::kInterleaved) stride_token = 2 * int64_t(H) * D, stride_head = 2 * D, stride_dim = 2;
    const std::vector<bits_t> key = random_bits<bits_t>(rng, size_t(T) * stride_token);
    const std::vector<bits_t> value = random_bits<bits_t>(rng, size_t(T) * stride_token);
    std::vector<bits_t> key_cache = random_bits<bits_t>(rng, size_t(num_slots) * H * D);
    std::vector<bits_t> value_cache = random_bits<bits_t>(rng, size_t(num_slots) * H * D);
    std::vector<int64_t> all_slots(num_slots);
    std::iota(all_slots.begin(), all_slots.end(), 0);
    std::shuffle(all_slots.begin(), all_slots.end(), rng);
    std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
    for (int t = 0; t < T; t += 3 + int(rng() % 3)) slots[t] = -1;  // padding
    int bad_token = -1;
    if (with_bad_slot) {
      bad_token = int(rng() % uint64_t(T));
      slots[bad_token] = num_slots + int64_t(rng() % 1000);
    }
    std::vector<bits_t> want_key = key_cache, want_value = value_cache;
    for (int t = 0; t < T; ++t) {
      if (slots[t] < 0 || slots[t] >= num_slots) continue;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          want_key[(size_t(slots[t]) * H + h) * D + d] = key[t * stride_token + h * stride_head + d * stride_dim];
          want_value[(size_t(slots[t]) * H + h) * D + d] = value[t * stride_token + h * stride_head + d * stride_dim];
        }
      }
    }
    const bool vec = cache::rows_16b_aligned(key.data(), sizeof(bits_t), D, stride_token, stride_head, stride_dim) &&
                     cache::rows_16b_aligned(value.data(), sizeof(bits_t), D, stride_token, stride_head, stride_dim);
    EXPECT_EQ(vec, layout != Layout::kInterleaved && (D * sizeof(bits_t)) % 16 == 0);
    const auto kernel = vec ? cache::reshape_and_cache_kernel<bits_t, true> : cache::reshape_and_cache_kernel<bits_t, false>;
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(T), dim3(cache::kThreads), 0, kernel, key.data(), value.data(), key_cache.data(),
                     value_cache.data(), slots.data(), stride_token, stride_head, stride_dim, stride_token,
                     stride_head, stride_dim, H, D, num_slots, &error);
    EXPECT_TRUE(key_cache == want_key);
    EXPECT_TRUE(value_cache == want_value);
    EXPECT_EQ(error.claimed, with_bad_slot ? 1u : 0u);
    if (with_bad_slot) {
      EXPECT_EQ(error.value, slots[bad_token]);
      EXPECT_EQ(error.where, bad_token);
    }
  }
}

TEST(CudaReshapeAndCache, Float32Vector) { reshape_and_cache_case<uint32_t>(Layout::kContiguous, 4, 64, false); }
TEST(CudaReshapeAndCache, Float32QkvSlice) { reshape_and_cache_case<uint32_t>(Layout::kQkvSlice, 2, 128, false); }
TEST(CudaReshapeAndCache, Float32Scalar) { reshape_and_cache_case<uint32_t>(Layout::kInterleaved, 3, 32, false); }
TEST(CudaReshapeAndCache, Float32OddHeadDim) { reshape_and_cache_case<uint32_t>(Layout::kContiguous, 2, 6, false); }
TEST(CudaReshapeAndCache, HalfWidthVector) { reshape_and_cache_case<uint16_t>(Layout::kContiguous, 4, 256, false); }
TEST(CudaReshapeAndCache, HalfWidthQkvSlice) { reshape_and_cache_case<uint16_t>(Layout::kQkvSlice, 2, 64, false); }
TEST(CudaReshapeAndCache, HalfWidthScalar) { reshape_and_cache_case<uint16_t>(Layout::kInterleaved, 2, 64, false); }
TEST(CudaReshapeAndCache, HalfWidthOddHeadDim) { reshape_and_cache_case<uint16_t>(Layout::kContiguous, 3, 12, false); }
TEST(CudaReshapeAndCache, OutOfRangeSlotSkippedAndReported) {
  reshape_and_cache_case<uint32_t>(Layout::kContiguous, 2, 32, true);
  reshape_and_cache_case<uint16_t>(Layout::kInterleaved, 2, 16, true);
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

template <typename scalar_t, pagedkv::KvFormat F>
void reshape_and_cache_fp8_case(int H, int D, int scale_kind /* 0 none, 1 per tensor, 2 per head */) {
  using Traits = pagedkv::Fp8Traits<F>;
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string(dtype_name<scalar_t>()) + (F == pagedkv::KvFormat::kE4M3 ? " e4m3" : " e5m2") +
                 ", scales " + std::to_string(scale_kind) + ", " + schedule_name(schedule));
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
    std::vector<uint8_t> key_cache(size_t(num_slots) * H * D), value_cache(key_cache.size());
    for (auto* c : {&key_cache, &value_cache}) for (uint8_t& b : *c) b = uint8_t(rng());
    std::vector<int64_t> all_slots(num_slots);
    std::iota(all_slots.begin(), all_slots.end(), 0);
    std::shuffle(all_slots.begin(), all_slots.end(), rng);
    std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
    slots[rng() % uint64_t(T)] = -1;  // padding
    std::vector<uint8_t> want_key = key_cache, want_value = value_cache;
    for (int t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          const size_t src = (size_t(t) * H + h) * D + d, dst = (size_t(slots[t]) * H + h) * D + d;
          want_key[dst] = nearest_fp8<F>(static_cast<float>(key[src]) / scale.at(h));
          want_value[dst] = nearest_fp8<F>(static_cast<float>(value[src]) / scale.at(h));
        }
      }
    }
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(T), dim3(cache::kThreads), 0, cache::reshape_and_cache_fp8_kernel<scalar_t, F>, key.data(),
                     value.data(), key_cache.data(), value_cache.data(), slots.data(), int64_t(H) * D, int64_t(D),
                     int64_t(1), int64_t(H) * D, int64_t(D), int64_t(1), H, D, num_slots, scale, scale, &error);
    EXPECT_EQ(error.claimed, 0u);
    for (size_t i = 0; i < key_cache.size(); ++i) {
      for (const auto& [got, want] : {std::pair{key_cache[i], want_key[i]}, std::pair{value_cache[i], want_value[i]}}) {
        if (std::isnan(Traits::decode(want))) {
          EXPECT_TRUE(std::isnan(Traits::decode(got))) << "element " << i;
        } else {
          ASSERT_EQ(int(got), int(want)) << "element " << i << ": got " << Traits::decode(got) << ", want "
                                         << Traits::decode(want);
        }
      }
    }
  }
}

TEST(CudaReshapeAndCacheFp8, E4M3AllInputDtypesAndScales) {
  using pagedkv::KvFormat;
  for (int kind = 0; kind < 3; ++kind) {
    reshape_and_cache_fp8_case<float, KvFormat::kE4M3>(3, 16, kind);
    reshape_and_cache_fp8_case<c10::Half, KvFormat::kE4M3>(2, 8, kind);
    reshape_and_cache_fp8_case<c10::BFloat16, KvFormat::kE4M3>(2, 12, kind);
  }
}

TEST(CudaReshapeAndCacheFp8, E5M2AllInputDtypesAndScales) {
  using pagedkv::KvFormat;
  for (int kind = 0; kind < 3; ++kind) {
    reshape_and_cache_fp8_case<float, KvFormat::kE5M2>(3, 16, kind);
    reshape_and_cache_fp8_case<c10::Half, KvFormat::kE5M2>(2, 8, kind);
    reshape_and_cache_fp8_case<c10::BFloat16, KvFormat::kE5M2>(1, 32, kind);
  }
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
