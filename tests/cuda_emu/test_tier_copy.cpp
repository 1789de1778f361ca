// The CUDA host-tier copy kernel (csrc/ops/cuda/tier_copy.cuh) on the CPU emulator: offload (cache ->
// block-major host tier) and load (host tier -> cache) of one layer of a multi-layer tier, in 16-byte and
// byte chunks, bit-exact against a plain copy with every other byte of the caches and the tier compared,
// both schedules; out-of-range device blocks and host slots are skipped and reported with their column.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "kernel_test_util.h"
#include "ops/cuda/tier_copy.cuh"

namespace {

using namespace emu_test;
namespace tier = pagedkv::tier_cuda;
using pagedkv::HostTierLayout;
using pagedkv::TierDirection;

template <typename Chunk>
std::vector<Chunk> random_chunks(std::mt19937_64& rng, int64_t n) {
  std::vector<Chunk> v(n);
  auto* b = reinterpret_cast<unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(Chunk); ++i) b[i] = static_cast<unsigned char>(rng());
  return v;
}

template <typename Chunk>
void tier_copy_case(int64_t chunks_per_block, TierDirection direction, int bad_column) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    SCOPED_TRACE(std::string("chunk ") + std::to_string(sizeof(Chunk)) + ", " + schedule_name(schedule) +
                 (direction == TierDirection::kOffload ? ", offload" : ", load"));
    const ScheduleScope scope(schedule);
    std::mt19937_64 rng = make_rng();
    const int64_t num_blocks = 12, num_slots = 7, num_layers = 3, layer = int64_t(rng() % num_layers);
    const HostTierLayout layout{chunks_per_block, num_layers};
    std::vector<Chunk> key = random_chunks<Chunk>(rng, num_blocks * chunks_per_block);
    std::vector<Chunk> value = random_chunks<Chunk>(rng, num_blocks * chunks_per_block);
    std::vector<Chunk> host = random_chunks<Chunk>(rng, num_slots * num_layers * 2 * chunks_per_block);
    std::vector<int64_t> blocks(num_blocks), slots(num_slots);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    std::shuffle(slots.begin(), slots.end(), rng);
    const int pairs = 2 + int(rng() % 4);
    std::vector<int64_t> mapping;
    for (int i = 0; i < pairs; ++i) {
      if (direction == TierDirection::kOffload) {
        mapping.push_back(blocks[i]), mapping.push_back(slots[i]);
      } else {
        mapping.push_back(slots[i]), mapping.push_back(blocks[i]);
      }
    }
    int bad_pair = -1;
    if (bad_column >= 0) {
      bad_pair = int(rng() % pairs);
      mapping[2 * bad_pair + bad_column] = rng() % 2 ? -1 : 1000;
    }
    std::vector<Chunk> want_key = key, want_value = value, want_host = host;
    const auto bytes = [](const std::vector<Chunk>& v) { return reinterpret_cast<const unsigned char*>(v.data()); };
    for (int i = 0; i < pairs; ++i) {
      if (i == bad_pair) continue;
      const int64_t block = pagedkv::device_block_of(&mapping[2 * i], direction);
      const int64_t slot = pagedkv::host_slot_of(&mapping[2 * i], direction);
      for (int64_t kv = 0; kv < 2; ++kv) {
        std::vector<Chunk>& cache = kv == 0 ? key : value;
        std::vector<Chunk>& want_cache = kv == 0 ? want_key : want_value;
        const int64_t c = block * chunks_per_block, h = layout.offset(slot, layer, kv);
        if (direction == TierDirection::kOffload) {
          std::copy(cache.begin() + c, cache.begin() + c + chunks_per_block, want_host.begin() + h);
        } else {
          std::copy(host.begin() + h, host.begin() + h + chunks_per_block, want_cache.begin() + c);
        }
      }
    }
    pagedkv::IndexError error{};
    cuda_emu::launch(dim3(pairs, 2), dim3(tier::kThreads), 0, tier::tier_copy_kernel<Chunk>, key.data(),
                     value.data(), host.data(), mapping.data(), layout, layer, num_blocks, num_slots, direction,
                     &error);
    const size_t cache_bytes = key.size() * sizeof(Chunk), host_bytes = host.size() * sizeof(Chunk);
    EXPECT_TRUE(std::equal(bytes(key), bytes(key) + cache_bytes, bytes(want_key)));
    EXPECT_TRUE(std::equal(bytes(value), bytes(value) + cache_bytes, bytes(want_value)));
    EXPECT_TRUE(std::equal(bytes(host), bytes(host) + host_bytes, bytes(want_host)));
    EXPECT_EQ(error.claimed, bad_column >= 0 ? 1u : 0u);
    if (bad_column >= 0) {
      const int device_column = direction == TierDirection::kOffload ? 0 : 1;
      EXPECT_EQ(error.argument, bad_column == device_column ? 0 : 1);  // 0: device block, 1: host slot
      EXPECT_EQ(error.value, mapping[2 * bad_pair + bad_column]);
      EXPECT_EQ(error.where, 2 * bad_pair + bad_column);
    }
  }
}

TEST(CudaTierCopy, OffloadSixteenByteChunks) { tier_copy_case<uint4>(16 * 2 * 64 * 2 / 16, TierDirection::kOffload, -1); }
TEST(CudaTierCopy, LoadSixteenByteChunks) { tier_copy_case<uint4>(16 * 2 * 64 * 2 / 16, TierDirection::kLoad, -1); }
TEST(CudaTierCopy, ByteChunks) {  // odd-sized blocks (5 tokens x 3 heads x 12 bytes)
  tier_copy_case<uint8_t>(5 * 3 * 12, TierDirection::kOffload, -1);
  tier_copy_case<uint8_t>(5 * 3 * 12, TierDirection::kLoad, -1);
}
TEST(CudaTierCopy, OutOfRangeIdsSkippedAndReported) {
  for (const TierDirection d : {TierDirection::kOffload, TierDirection::kLoad}) {
    tier_copy_case<uint4>(64, d, 0);
    tier_copy_case<uint4>(64, d, 1);
    tier_copy_case<uint8_t>(60, d, 0);
    tier_copy_case<uint8_t>(60, d, 1);
  }
}

}  // namespace
