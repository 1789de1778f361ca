// CPU kernels of the host-tier copies: offload_blocks (paged caches -> block-major host tier) and load_blocks
// (host tier -> paged caches), whole blocks of every given layer, one memcpy per (pair, layer, K or V).
#include <torch/csrc/stable/library.h>

#include <cstring>
#include <vector>

#include "ops/host_tier.h"
#include "ops/ops.h"

namespace pagedkv {
namespace {

void tier_copy_cpu(const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                   const Tensor& host_cache, const Tensor& block_mapping, int64_t first_layer,
                   TierDirection direction) {
  const int64_t num_layers = check_host_tier_copy(keys, values, host_cache, block_mapping, first_layer);
  if (num_layers == 0 || block_mapping.size(0) == 0) return;
  STD_TORCH_CHECK(keys[0].is_cpu(), "key_caches must be CPU tensors for the CPU kernel, got ", device_str(keys[0]));
  const Tensor mapping = contiguous_copy(block_mapping);  // checked values = read values
  const int64_t num_device = keys[0].size(0), num_host = host_cache.size(0);
  if (direction == TierDirection::kOffload) {
    check_block_mapping_values(mapping, num_device, num_host);
  } else {
    check_block_mapping_values(mapping, num_host, num_device);
  }
  const int64_t* m = mapping.mutable_data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  const HostTierLayout layout{keys[0].stride(0), host_cache.size(1)};
  const int64_t elem = keys[0].element_size(), block_bytes = layout.block_elems * elem;
  auto* host = static_cast<char*>(host_cache.data_ptr());
  // One work unit = one (pair, layer, K or V) block.
  parallel_for(0, num_pairs * num_layers * 2, 16, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t pair = u / (num_layers * 2), layer = u / 2 % num_layers, kv = u % 2;
      const Tensor& cache = kv == 0 ? keys[layer] : values[layer];
      char* device_block = static_cast<char*>(cache.data_ptr()) + device_block_of(m + 2 * pair, direction) * block_bytes;
      char* host_block = host + layout.offset(host_slot_of(m + 2 * pair, direction), first_layer + layer, kv) * elem;
      if (direction == TierDirection::kOffload) {
        std::memcpy(host_block, device_block, block_bytes);
      } else {
        std::memcpy(device_block, host_block, block_bytes);
      }
    }
  });
}

void offload_blocks_cpu(const std::vector<Tensor>& key_caches, const std::vector<Tensor>& value_caches, Tensor& host_cache,
                        const Tensor& block_mapping, int64_t first_layer) {
  tier_copy_cpu(key_caches, value_caches, host_cache, block_mapping, first_layer,
                TierDirection::kOffload);
}

void load_blocks_cpu(const Tensor& host_cache, const std::vector<Tensor>& key_caches, const std::vector<Tensor>& value_caches,
                     const Tensor& block_mapping, int64_t first_layer) {
  tier_copy_cpu(key_caches, value_caches, host_cache, block_mapping, first_layer, TierDirection::kLoad);
}

}  // namespace
}  // namespace pagedkv

STABLE_TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("offload_blocks", TORCH_BOX(&pagedkv::offload_blocks_cpu));
  m.impl("load_blocks", TORCH_BOX(&pagedkv::load_blocks_cpu));
}
