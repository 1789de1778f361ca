// Torch glue of the CUDA host-tier copies (kernel in tier_copy.cuh): one launch per layer on the current
// stream, the host tier in pinned memory read or written in place; never syncs the host (except to read the
// index flag under PAGEDKV_CHECK_INDICES=1). Loading layer by layer (first_layer) on a side stream lets the
// next layer's blocks arrive while this one computes.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "ops/cuda/index_check.h"
#include "ops/cuda/tier_copy.cuh"
#include "ops/ops.h"

namespace pagedkv {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void tier_copy_cuda(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                    const at::Tensor& host_cache, const at::Tensor& block_mapping, int64_t first_layer,
                    TierDirection direction, const char* op) {
  const int64_t num_layers = check_host_tier_copy(keys, values, host_cache, block_mapping, first_layer);
  if (num_layers == 0 || block_mapping.size(0) == 0) return;
  TORCH_CHECK(keys[0].is_cuda(), "key_caches must be CUDA tensors for the CUDA ", op);
  const int64_t num_device = keys[0].size(0), num_host = host_cache.size(0);
  if (direction == TierDirection::kOffload) {
    check_block_mapping_values(block_mapping, num_device, num_host);
  } else {
    check_block_mapping_values(block_mapping, num_host, num_device);
  }
  const c10::cuda::CUDAGuard guard(keys[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor mapping = block_mapping.contiguous().to(keys[0].device(), /*non_blocking=*/true);
  const int64_t elem = keys[0].element_size();
  const HostTierLayout layout{keys[0].stride(0), host_cache.size(1)};
  bool vec = (layout.block_elems * elem) % 16 == 0 && aligned16(host_cache.data_ptr());
  for (int64_t l = 0; l < num_layers; ++l) vec = vec && aligned16(keys[l].data_ptr()) && aligned16(values[l].data_ptr());
  const HostTierLayout chunked{layout.block_elems * elem / (vec ? 16 : 1), layout.num_layers};
  DeviceIndexCheck index_check(keys[0].device());
  const dim3 grid(static_cast<unsigned>(mapping.size(0)), 2);
  for (int64_t l = 0; l < num_layers; ++l) {
    if (vec) {
      tier_cuda::tier_copy_kernel<uint4><<<grid, tier_cuda::kThreads, 0, stream>>>(
          static_cast<uint4*>(keys[l].data_ptr()), static_cast<uint4*>(values[l].data_ptr()),
          static_cast<uint4*>(host_cache.data_ptr()), mapping.data_ptr<int64_t>(), chunked, first_layer + l,
          num_device, num_host, direction, index_check.error());
    } else {
      tier_cuda::tier_copy_kernel<uint8_t><<<grid, tier_cuda::kThreads, 0, stream>>>(
          static_cast<uint8_t*>(keys[l].data_ptr()), static_cast<uint8_t*>(values[l].data_ptr()),
          static_cast<uint8_t*>(host_cache.data_ptr()), mapping.data_ptr<int64_t>(), chunked, first_layer + l,
          num_device, num_host, direction, index_check.error());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const char* names[] = {"block_mapping's device block", "block_mapping's host slot"};
  const int64_t bounds[] = {num_device, num_host};
  index_check.raise_if_any(op, names, bounds);
}

void offload_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, at::Tensor& host_cache,
                         const at::Tensor& block_mapping, int64_t first_layer) {
  tier_copy_cuda(key_caches.vec(), value_caches.vec(), host_cache, block_mapping, first_layer,
                 TierDirection::kOffload, "offload_blocks");
}

void load_blocks_cuda(const at::Tensor& host_cache, at::TensorList key_caches, at::TensorList value_caches,
                      const at::Tensor& block_mapping, int64_t first_layer) {
  tier_copy_cuda(key_caches.vec(), value_caches.vec(), host_cache, block_mapping, first_layer,
                 TierDirection::kLoad, "load_blocks");
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("offload_blocks", &pagedkv::offload_blocks_cuda);
  m.impl("load_blocks", &pagedkv::load_blocks_cuda);
}
