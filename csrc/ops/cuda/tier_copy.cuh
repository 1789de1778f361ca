// Device code of the host-tier copies (torch-free; included by tier_ops.cu and by tests/cuda_emu): whole
// key and value blocks of one layer between a paged cache on the GPU and the block-major host tier in pinned
// host memory, which the kernel reads or writes in place (unified addressing), so one launch moves every
// pair of a layer on the current stream.
#pragma once

#include <cstdint>

#include "ops/cuda/device_compat.cuh"
#include "ops/host_tier.h"

namespace pagedkv {
namespace tier_cuda {

constexpr int kThreads = 256;

// Grid (pairs, 2): CTA (i, kv) moves pair i's key (kv 0) or value (kv 1) block of `layer` in chunks of Chunk
// (uint4 when every block is 16-byte aligned, else bytes); chunks_per_block and the layout are in Chunk units.
// A device block or host slot out of range (only possible with a device-side mapping) is skipped and
// recorded in index_error (argument 0: a device block, 1: a host slot; at the flat index of the mapping
// entry) when checking is on.
template <typename Chunk>
__global__ void __launch_bounds__(kThreads)
    tier_copy_kernel(Chunk* __restrict__ key_cache, Chunk* __restrict__ value_cache, Chunk* __restrict__ host,
                     const int64_t* __restrict__ block_mapping, HostTierLayout layout, int64_t layer,
                     int64_t num_device_blocks, int64_t num_host_blocks, TierDirection direction,
                     IndexError* index_error) {
  const int64_t* pair = block_mapping + 2 * int64_t(blockIdx.x);
  const int64_t device_block = device_block_of(pair, direction), host_slot = host_slot_of(pair, direction);
  const bool device_bad = device_block < 0 || device_block >= num_device_blocks;
  if (device_bad || host_slot < 0 || host_slot >= num_host_blocks) {
    if (threadIdx.x == 0 && blockIdx.y == 0) {
      const int64_t device_column = direction == TierDirection::kOffload ? 0 : 1;
      const int64_t column = device_bad ? device_column : 1 - device_column;
      report_bad_index(index_error, device_bad ? 0 : 1, pair[column], 2 * int64_t(blockIdx.x) + column);
    }
    return;
  }
  const int64_t kv = blockIdx.y;
  Chunk* cache = (kv == 0 ? key_cache : value_cache) + device_block * layout.block_elems;
  Chunk* tier = host + layout.offset(host_slot, layer, kv);
  Chunk* dst = direction == TierDirection::kOffload ? tier : cache;
  const Chunk* src = direction == TierDirection::kOffload ? cache : tier;
  for (int64_t i = threadIdx.x; i < layout.block_elems; i += blockDim.x) dst[i] = src[i];
}

}  // namespace tier_cuda
}  // namespace pagedkv
