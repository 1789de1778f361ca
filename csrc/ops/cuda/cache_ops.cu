// CUDA kernels of the cache ops: reshape_and_cache (16-byte vector stores when aligned), copy_blocks
// and swap_blocks (cudaMemcpyAsync). All launch on the current stream and never sync the host.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "ops/ops.h"
#include "ops/paged_kv.h"

namespace pagedkv {
namespace {

constexpr int kThreads = 256;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// One CTA per token. Elements move as raw bits (bits_t has the element's width); with kVec16 each
// thread moves 16-byte chunks (head_dim contiguous, rows and pointers 16-byte aligned).
template <typename bits_t, bool kVec16>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_kernel(const bits_t* __restrict__ key, const bits_t* __restrict__ value,
                             bits_t* __restrict__ key_cache, bits_t* __restrict__ value_cache,
                             const int64_t* __restrict__ slot_mapping, int64_t key_stride_token,
                             int64_t key_stride_head, int64_t key_stride_dim, int64_t value_stride_token,
                             int64_t value_stride_head, int64_t value_stride_dim, int num_heads, int head_dim,
                             int64_t num_slots) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // padding (or out of range: cannot raise on the device)
  const bits_t* k = key + token * key_stride_token;
  const bits_t* v = value + token * value_stride_token;
  if constexpr (kVec16) {
    constexpr int kPerVec = 16 / sizeof(bits_t);
    const int vecs_per_head = head_dim / kPerVec;
    for (int i = threadIdx.x; i < num_heads * vecs_per_head; i += blockDim.x) {
      const int h = i / vecs_per_head, c = (i % vecs_per_head) * kPerVec;
      const int64_t dst = cache_row_offset(slot, h, num_heads, head_dim) + c;
      *reinterpret_cast<uint4*>(key_cache + dst) = *reinterpret_cast<const uint4*>(k + h * key_stride_head + c);
      *reinterpret_cast<uint4*>(value_cache + dst) =
          *reinterpret_cast<const uint4*>(v + h * value_stride_head + c);
    }
  } else {
    for (int i = threadIdx.x; i < num_heads * head_dim; i += blockDim.x) {
      const int h = i / head_dim, d = i % head_dim;
      const int64_t dst = cache_row_offset(slot, h, num_heads, head_dim) + d;
      key_cache[dst] = k[h * key_stride_head + d * key_stride_dim];
      value_cache[dst] = v[h * value_stride_head + d * value_stride_dim];
    }
  }
}

bool rows_16b_aligned(const at::Tensor& t) {
  const int64_t per_vec = 16 / t.element_size();
  return t.stride(2) == 1 && t.size(2) % per_vec == 0 && t.stride(0) % per_vec == 0 && t.stride(1) % per_vec == 0 &&
         aligned16(t.data_ptr());
}

template <typename bits_t>
void launch_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slots, cudaStream_t stream) {
  const bool vec = rows_16b_aligned(key) && rows_16b_aligned(value) && aligned16(key_cache.data_ptr()) &&
                   aligned16(value_cache.data_ptr());
  const auto kernel = vec ? reshape_and_cache_kernel<bits_t, true> : reshape_and_cache_kernel<bits_t, false>;
  kernel<<<key.size(0), kThreads, 0, stream>>>(
      static_cast<const bits_t*>(key.data_ptr()), static_cast<const bits_t*>(value.data_ptr()),
      static_cast<bits_t*>(key_cache.data_ptr()), static_cast<bits_t*>(value_cache.data_ptr()),
      slots.data_ptr<int64_t>(), key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1),
      value.stride(2), static_cast<int>(key.size(1)), static_cast<int>(key.size(2)),
      key_cache.size(0) * key_cache.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  if (key.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor slots = slot_mapping.contiguous();
  if (key.element_size() == 4) {
    launch_reshape_and_cache<uint32_t>(key, value, key_cache, value_cache, slots, stream);
  } else {
    launch_reshape_and_cache<uint16_t>(key, value, key_cache, value_cache, slots, stream);
  }
}

// One CTA per (src, dst) pair of one layer: copies the key block and the value block in chunks of
// Chunk (uint4 = 16 bytes when the blocks are aligned, else bytes). Out-of-range ids (only possible with
// a device-side mapping) are skipped.
template <typename Chunk>
__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(Chunk* __restrict__ key_cache, Chunk* __restrict__ value_cache,
                       const int64_t* __restrict__ block_mapping, int64_t chunks_per_block, int64_t num_blocks) {
  const int64_t src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  for (int64_t i = threadIdx.x; i < chunks_per_block; i += blockDim.x) {
    key_cache[dst * chunks_per_block + i] = key_cache[src * chunks_per_block + i];
    value_cache[dst * chunks_per_block + i] = value_cache[src * chunks_per_block + i];
  }
}

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  const std::vector<at::Tensor> keys = key_caches.vec(), values = value_caches.vec();
  check_copy_blocks(keys, values, block_mapping);
  if (keys.empty() || block_mapping.size(0) == 0) return;
  const int64_t num_blocks = keys[0].size(0);
  TORCH_CHECK(keys[0].is_cuda(), "key_caches must be CUDA tensors for the CUDA copy_blocks");
  const c10::cuda::CUDAGuard guard(keys[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor mapping = block_mapping.contiguous();
  if (mapping.is_cpu()) {
    check_block_mapping_values(mapping, num_blocks, num_blocks, /*same_pool=*/true);
    mapping = mapping.to(keys[0].device(), /*non_blocking=*/true);
  }
  const int64_t num_pairs = mapping.size(0);
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    const int64_t bytes = keys[layer].stride(0) * keys[layer].element_size();
    void* k = keys[layer].data_ptr();
    void* v = values[layer].data_ptr();
    if (bytes % 16 == 0 && aligned16(k) && aligned16(v)) {
      copy_blocks_kernel<uint4><<<num_pairs, kThreads, 0, stream>>>(
          static_cast<uint4*>(k), static_cast<uint4*>(v), mapping.data_ptr<int64_t>(), bytes / 16, num_blocks);
    } else {
      copy_blocks_kernel<uint8_t><<<num_pairs, kThreads, 0, stream>>>(
          static_cast<uint8_t*>(k), static_cast<uint8_t*>(v), mapping.data_ptr<int64_t>(), bytes, num_blocks);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Whole blocks between any two of {this GPU, host}: one cudaMemcpyAsync per pair on the current stream
// (asynchronous w.r.t. the host when the CPU side is pinned).
void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  check_swap_blocks(src, dst, block_mapping);
  check_block_mapping_values(block_mapping, src.size(0), dst.size(0), swap_within_one_pool(src, dst));
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* m = mapping.data_ptr<int64_t>();
  const int64_t bytes = src.numel() == 0 ? 0 : src.stride(0) * src.element_size();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < mapping.size(0); ++i) {
    C10_CUDA_CHECK(cudaMemcpyAsync(d + m[2 * i + 1] * bytes, s + m[2 * i] * bytes, bytes, cudaMemcpyDefault, stream));
  }
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("reshape_and_cache", &pagedkv::reshape_and_cache_cuda);
  m.impl("copy_blocks", &pagedkv::copy_blocks_cuda);
  m.impl("swap_blocks", &pagedkv::swap_blocks_cuda);
}
