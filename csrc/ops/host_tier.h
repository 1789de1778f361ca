// Index math of the block-major host tier shared by the CPU (tier_ops.cpp) and CUDA (cuda/tier_copy.cuh)
// copies. Host slot s holds, for every layer l, the key block and then the value block of one physical block:
// [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], so a block moves as one region.
#pragma once

#include <cstdint>

#include "ops/host_device.h"

namespace pagedkv {

struct HostTierLayout {
  int64_t block_elems;  // block_size * num_kv_heads * head_dim: one layer's key (or value) block
  int64_t num_layers;   // layers in the host tier

  // Element offset of (slot, layer, kv) in the host tier; kv 0 = key, 1 = value.
  PAGEDKV_HD int64_t offset(int64_t slot, int64_t layer, int64_t kv) const {
    return ((slot * num_layers + layer) * 2 + kv) * block_elems;
  }
};

// Which side of a (src, dst) block_mapping pair is the device block: offload maps device -> host, load
// host -> device.
enum class TierDirection { kOffload, kLoad };

PAGEDKV_HD int64_t device_block_of(const int64_t* pair, TierDirection d) { return pair[d == TierDirection::kOffload ? 0 : 1]; }
PAGEDKV_HD int64_t host_slot_of(const int64_t* pair, TierDirection d) { return pair[d == TierDirection::kOffload ? 1 : 0]; }

}  // namespace pagedkv
