// Self-tests of the CUDA-on-CPU runtime (tests/cuda_emu): barriers, shared memory, warp-scoped
// collectives, both schedules, blocks on several OS threads, and the divergence checks.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "ops/cuda/device_compat.cuh"

namespace {

using cuda_emu::Schedule;

class Runtime : public ::testing::TestWithParam<Schedule> {
 protected:
  void SetUp() override { cuda_emu::set_schedule(GetParam()); }
  void TearDown() override { cuda_emu::set_schedule(Schedule::kForward); }
};

std::string launch_error(const std::function<void()>& launch) {
  try {
    launch();
  } catch (const cuda_emu::LaunchError& e) {
    return e.what();
  }
  return "";
}

// Each thread writes its slot, then reads its neighbour's: right only with the barrier.
__global__ void neighbour_kernel(const int* in, int* out, bool with_barrier) {
  PAGEDKV_DYNAMIC_SHARED(smem);
  int* s = reinterpret_cast<int*>(smem);
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = in[blockIdx.x * n + t];
  if (with_barrier) __syncthreads();
  out[blockIdx.x * n + t] = s[(t + 1) % n];
}

TEST_P(Runtime, BarrierOrdersSharedMemoryAcrossThreads) {
  std::mt19937 rng(std::random_device{}());
  const int blocks = 7, threads = 96;
  std::vector<int> in(blocks * threads), out(blocks * threads, 0);
  for (int& v : in) v = int(rng() % 100000);
  cuda_emu::launch(dim3(blocks), dim3(threads), threads * sizeof(int), neighbour_kernel, in.data(), out.data(), true);
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) ASSERT_EQ(out[b * threads + t], in[b * threads + (t + 1) % threads]);
  }
}

TEST_P(Runtime, MissingBarrierReadsPoisonedSharedMemory) {
  std::mt19937 rng(std::random_device{}());
  const int blocks = 3, threads = 64;
  std::vector<int> in(blocks * threads), out(blocks * threads, 0);
  for (int& v : in) v = int(rng() % 100000);
  cuda_emu::launch(dim3(blocks), dim3(threads), threads * sizeof(int), neighbour_kernel, in.data(), out.data(), false);
  int poisoned = 0;
  for (int v : out) poisoned += v == -1;  // 0xFFFFFFFF: read before its writer ran
  // Every block has a reader that runs before its neighbour's writer, whichever the schedule.
  EXPECT_GE(poisoned, blocks);
}

// Static shared variables are per block: each block stores its id, and after a barrier reads it back.
__global__ void static_shared_kernel(int* out) {
  PAGEDKV_SHARED(int, owner);
  PAGEDKV_SHARED_ARRAY(int, before, 128);
  before[threadIdx.x] = owner;  // poisoned: nobody wrote it yet in this block
  __syncthreads();
  if (threadIdx.x == 0) owner = int(blockIdx.x + gridDim.x * blockIdx.y);
  __syncthreads();
  out[2 * (blockIdx.x + gridDim.x * blockIdx.y) + (threadIdx.x % 2)] = threadIdx.x % 2 ? before[threadIdx.x] : owner;
}

TEST_P(Runtime, StaticSharedIsPerBlockAndPoisoned) {
  const dim3 grid(13, 5);
  std::vector<int> out(2 * 13 * 5, 0);
  cuda_emu::launch(grid, dim3(128), 0, static_shared_kernel, out.data());
  for (int b = 0; b < 13 * 5; ++b) {
    EXPECT_EQ(out[2 * b], b);
    EXPECT_EQ(out[2 * b + 1], -1);
  }
}

// Warp-scoped collectives: xor butterfly sum, broadcast, inclusive scan, shift down, ballot.
__global__ void warp_kernel(const int* in, int* out) {
  const int t = threadIdx.x, lane = t % 32;
  const int v = in[t];
  int sum = v;
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const int from7 = __shfl_sync(0xffffffffu, v, 7);
  int scan = v;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, scan, offset);
    if (lane >= offset) scan += other;
  }
  const int down3 = __shfl_down_sync(0xffffffffu, v, 3);
  const unsigned odd = __ballot_sync(0xffffffffu, v % 2 != 0);
  const int in_half = __shfl_sync(0xffffffffu, v, 2, 16);  // width 16: lane 2 of each half
  out[6 * t + 0] = sum;
  out[6 * t + 1] = from7;
  out[6 * t + 2] = scan;
  out[6 * t + 3] = down3;
  out[6 * t + 4] = int(odd);
  out[6 * t + 5] = in_half;
}

TEST_P(Runtime, WarpShufflesAreWarpScoped) {
  std::mt19937 rng(std::random_device{}());
  const int threads = 128;
  std::vector<int> in(threads), out(6 * threads);
  for (int& v : in) v = int(rng() % 1000);
  cuda_emu::launch(dim3(1), dim3(threads), 0, warp_kernel, in.data(), out.data());
  for (int t = 0; t < threads; ++t) {
    const int base = t / 32 * 32, lane = t % 32;
    int sum = 0, scan = 0;
    unsigned odd = 0;
    for (int l = 0; l < 32; ++l) {
      sum += in[base + l];
      if (l <= lane) scan += in[base + l];
      if (in[base + l] % 2) odd |= 1u << l;
    }
    EXPECT_EQ(out[6 * t + 0], sum) << t;
    EXPECT_EQ(out[6 * t + 1], in[base + 7]) << t;
    EXPECT_EQ(out[6 * t + 2], scan) << t;
    EXPECT_EQ(out[6 * t + 3], lane + 3 < 32 ? in[t + 3] : in[t]) << t;
    EXPECT_EQ(unsigned(out[6 * t + 4]), odd) << t;
    EXPECT_EQ(out[6 * t + 5], in[base + lane / 16 * 16 + 2]) << t;
  }
}

// Only warp 1 shuffles (as find_query_tile does with warp 0); a half-warp mask meets only its lanes.
__global__ void partial_warp_kernel(const float* in, float* out) {
  const int t = threadIdx.x, lane = t % 32;
  float v = in[t];
  if (t >= 32 && t < 64) {
    for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (t >= 64 && t < 96 && lane < 16) {
    for (int offset = 8; offset > 0; offset /= 2) v += __shfl_down_sync(0x0000ffffu, v, offset, 16);
  }
  __syncthreads();
  out[t] = v;
}

TEST_P(Runtime, OnlyNamedLanesMeet) {
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-10.f, 10.f);
  std::vector<float> in(128), out(128);
  for (float& v : in) v = dist(rng);
  cuda_emu::launch(dim3(1), dim3(128), 0, partial_warp_kernel, in.data(), out.data());
  float max1 = in[32], sum2 = 0.f;
  for (int l = 0; l < 32; ++l) max1 = std::max(max1, in[32 + l]);
  for (int l = 0; l < 16; ++l) sum2 += in[64 + l];
  for (int t = 0; t < 128; ++t) {
    if (t >= 32 && t < 64) EXPECT_EQ(out[t], max1);
    else if (t == 64) EXPECT_NEAR(out[t], sum2, 1e-4);
    else if (t >= 96 || t < 32 || (t >= 80 && t < 96)) EXPECT_EQ(out[t], in[t]);
  }
}

// Blocks run in parallel on several OS threads: atomics see every thread of every block.
__global__ void atomic_kernel(unsigned long long* total, int* max_block, float* fsum, unsigned* per_block) {
  atomicAdd(total, 1ull);
  atomicMax(max_block, int(blockIdx.x + gridDim.x * blockIdx.z));
  atomicAdd(fsum, 0.5f);
  atomicAdd(per_block + blockIdx.x + gridDim.x * blockIdx.z, 1u);
}

TEST_P(Runtime, AtomicsAcrossParallelBlocks) {
  cuda_emu::set_num_workers(4);
  unsigned long long total = 0;
  int max_block = -1;
  float fsum = 0.f;
  std::vector<unsigned> per_block(40 * 3, 0);
  cuda_emu::launch(dim3(40, 1, 3), dim3(64), 0, atomic_kernel, &total, &max_block, &fsum, per_block.data());
  cuda_emu::set_num_workers(0);
  EXPECT_EQ(total, 40ull * 3 * 64);
  EXPECT_EQ(max_block, 40 * 3 - 1);
  EXPECT_EQ(fsum, 40.f * 3 * 64 * 0.5f);
  for (unsigned n : per_block) EXPECT_EQ(n, 64u);
}

TEST(RuntimeTypes, VectorTypesHaveCudaAlignment) {
  EXPECT_EQ(alignof(uint4), 16u);
  EXPECT_EQ(alignof(float4), 16u);
  EXPECT_EQ(alignof(int4), 16u);
  EXPECT_EQ(alignof(float2), 8u);
  EXPECT_EQ(sizeof(uint4), 16u);
}

// --- divergence checks

__global__ void half_barrier_kernel() {
  if (threadIdx.x < 64) __syncthreads();
}

__global__ void two_barriers_kernel() {
  if (threadIdx.x % 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void missing_lane_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x != 37) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void outside_mask_kernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_sync(0x0000ffffu, v, 20);
  out[threadIdx.x] = v;
}

__global__ void own_lane_outside_mask_kernel(int* out) { out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 0); }

TEST_P(Runtime, BarrierReachedByPartOfTheBlockFails) {
  const std::string error = launch_error([] { cuda_emu::launch(dim3(2), dim3(128), 0, half_barrier_kernel); });
  EXPECT_NE(error.find("divergent __syncthreads"), std::string::npos) << error;
  EXPECT_NE(error.find("threads 0-63 waits at __syncthreads"), std::string::npos) << error;
  EXPECT_NE(error.find("threads 64-127 has exited"), std::string::npos) << error;
}

TEST_P(Runtime, DifferentBarriersFail) {
  const std::string error = launch_error([] { cuda_emu::launch(dim3(1), dim3(64), 0, two_barriers_kernel); });
  EXPECT_NE(error.find("divergent __syncthreads"), std::string::npos) << error;
  EXPECT_NE(error.find("threads 0,2,4"), std::string::npos) << error;
  EXPECT_NE(error.find("threads 1,3,5"), std::string::npos) << error;
}

TEST_P(Runtime, ShuffleMissingALaneFails) {
  std::vector<int> out(64);
  const std::string error =
      launch_error([&] { cuda_emu::launch(dim3(1), dim3(64), 0, missing_lane_kernel, out.data()); });
  EXPECT_NE(error.find("divergent warp collective"), std::string::npos) << error;
  EXPECT_NE(error.find("37 has exited"), std::string::npos) << error;
}

TEST_P(Runtime, ShuffleReadingOutsideItsMaskFails) {
  std::vector<int> out(32);
  const std::string error =
      launch_error([&] { cuda_emu::launch(dim3(1), dim3(32), 0, outside_mask_kernel, out.data()); });
  EXPECT_NE(error.find("shuffle reads a lane outside its mask"), std::string::npos) << error;
  const std::string own =
      launch_error([&] { cuda_emu::launch(dim3(1), dim3(32), 0, own_lane_outside_mask_kernel, out.data()); });
  EXPECT_NE(own.find("whose own bit is not in mask"), std::string::npos) << own;
}

// The IndexError record used by the kernels under PAGEDKV_CHECK_INDICES=1: one winner, host message.
__global__ void index_error_kernel(pagedkv::IndexError* error, const int* values, int bound) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (values[i] >= bound) pagedkv::report_bad_index(error, 1, values[i], i);
}

TEST_P(Runtime, IndexErrorRecordsOneBadIndex) {
  std::mt19937 rng(std::random_device{}());
  std::vector<int> values(8 * 64);
  for (int& v : values) v = int(rng() % 50);
  const int bad_at = int(rng() % values.size());
  values[bad_at] = 50 + int(rng() % 10);
  pagedkv::IndexError error{};
  cuda_emu::launch(dim3(8), dim3(64), 0, index_error_kernel, &error, values.data(), 50);
  const char* names[] = {"first", "slot_mapping"};
  const int64_t bounds[] = {1, 50};
  const std::string message = pagedkv::index_error_message(error, "op", names, bounds);
  EXPECT_NE(message.find("op: slot_mapping holds " + std::to_string(values[bad_at]) + " at flat index " +
                         std::to_string(bad_at) + ", outside [0, 50)"),
            std::string::npos)
      << message;
  pagedkv::IndexError none{};
  values[bad_at] = 0;
  cuda_emu::launch(dim3(8), dim3(64), 0, index_error_kernel, &none, values.data(), 50);
  EXPECT_EQ(pagedkv::index_error_message(none, "op", names, bounds), "");
}

INSTANTIATE_TEST_SUITE_P(Schedules, Runtime, ::testing::Values(Schedule::kForward, Schedule::kReverse),
                         [](const auto& info) { return info.param == Schedule::kForward ? "forward" : "reverse"; });

}  // namespace
