// Torch glue of the CUDA cache ops: reshape_and_cache (strided cache views, int32 or int64 slots) and
// copy_blocks (kernels in cache_ops.cuh) and swap_blocks (cudaMemcpyAsync). All launch on the current
// stream and never sync the host (except to read the index flag under PAGEDKV_CHECK_INDICES=1).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "ops/cuda/cache_ops.cuh"
#include "ops/cuda/index_check.h"
#include "ops/int4.h"
#include "ops/ops.h"

namespace pagedkv {
namespace {

using cache_cuda::kThreads;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

cache_cuda::TokenStrides token_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

bool rows_16b_aligned(const at::Tensor& t) {
  return cache_cuda::rows_16b_aligned(t.data_ptr(), t.element_size(), t.size(2), token_strides(t));
}

bool cache_rows_16b_aligned(const at::Tensor& cache) {
  return pagedkv::cache_rows_16b_aligned(cache.data_ptr(), cache.element_size(), cache_strides(cache));
}

// Calls fn with a value of the slot type of a (checked) int32 / int64 slot mapping.
template <typename Fn>
void dispatch_slot_type(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kInt) {
    fn(int32_t{});
  } else {
    fn(int64_t{});
  }
}

template <typename bits_t, typename slot_t>
void launch_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slots, cudaStream_t stream,
                              IndexError* index_error) {
  const bool vec = rows_16b_aligned(key) && rows_16b_aligned(value) && cache_rows_16b_aligned(key_cache) &&
                   cache_rows_16b_aligned(value_cache);
  const auto kernel = vec ? cache_cuda::reshape_and_cache_kernel<bits_t, true, slot_t>
                          : cache_cuda::reshape_and_cache_kernel<bits_t, false, slot_t>;
  kernel<<<key.size(0), kThreads, 0, stream>>>(
      static_cast<const bits_t*>(key.data_ptr()), static_cast<const bits_t*>(value.data_ptr()),
      static_cast<bits_t*>(key_cache.data_ptr()), static_cast<bits_t*>(value_cache.data_ptr()),
      slots.data_ptr<slot_t>(), token_strides(key), token_strides(value), cache_strides(key_cache),
      cache_strides(value_cache), static_cast<int>(key.size(1)), static_cast<int>(key.size(2)), key_cache.size(1),
      key_cache.size(0) * key_cache.size(1), index_error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

KvScale device_kv_scale(const std::optional<at::Tensor>& scale) {
  if (!scale.has_value()) return KvScale{};
  return KvScale{scale->data_ptr<float>(), scale->dim() == 0 ? 0 : scale->stride(0)};
}

template <typename scalar_t, KvFormat F, typename slot_t>
void launch_reshape_and_cache_fp8(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& slots, KvScale k_scale,
                                  KvScale v_scale, cudaStream_t stream, IndexError* index_error) {
  cache_cuda::reshape_and_cache_fp8_kernel<scalar_t, F, slot_t><<<key.size(0), kThreads, 0, stream>>>(
      static_cast<const scalar_t*>(key.data_ptr()), static_cast<const scalar_t*>(value.data_ptr()),
      static_cast<uint8_t*>(key_cache.data_ptr()), static_cast<uint8_t*>(value_cache.data_ptr()),
      slots.data_ptr<slot_t>(), token_strides(key), token_strides(value), cache_strides(key_cache),
      cache_strides(value_cache), static_cast<int>(key.size(1)), static_cast<int>(key.size(2)), key_cache.size(1),
      key_cache.size(0) * key_cache.size(1), k_scale, v_scale, index_error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Scale values are not checked on the GPU (that would sync): a scale <= 0 or non-finite stores inf/NaN.
// The slot mapping is read as given (int32 or int64), without a conversion kernel.
void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  if (key.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor slots = slot_mapping.contiguous();
  DeviceIndexCheck index_check(key.device());
  dispatch_slot_type(slots.scalar_type(), [&](auto slot_tag) {
    using slot_t = decltype(slot_tag);
    if (is_fp8(key_cache.scalar_type())) {
      dispatch_float(key.scalar_type(), [&](auto type_tag) {
        dispatch_fp8(kv_format(key_cache.scalar_type()), [&](auto format) {
          launch_reshape_and_cache_fp8<decltype(type_tag), decltype(format)::value, slot_t>(
              key, value, key_cache, value_cache, slots, device_kv_scale(k_scale), device_kv_scale(v_scale), stream,
              index_check.error());
        });
      });
    } else if (key.element_size() == 4) {
      launch_reshape_and_cache<uint32_t, slot_t>(key, value, key_cache, value_cache, slots, stream,
                                                 index_check.error());
    } else {
      launch_reshape_and_cache<uint16_t, slot_t>(key, value, key_cache, value_cache, slots, stream,
                                                 index_check.error());
    }
  });
  const char* names[] = {"slot_mapping"};
  const int64_t bounds[] = {key_cache.size(0) * key_cache.size(1)};
  index_check.raise_if_any("reshape_and_cache", names, bounds);
}

void reshape_and_cache_int4_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                                 at::Tensor& value_cache, const at::Tensor& slot_mapping, int64_t group_size) {
  check_reshape_and_cache_int4(key, value, key_cache, value_cache, slot_mapping, group_size);
  if (key.size(0) == 0) return;
  TORCH_CHECK(key.is_cuda(), "key must be a CUDA tensor for the CUDA reshape_and_cache_int4");
  const c10::cuda::CUDAGuard guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor slots = slot_mapping.contiguous();
  DeviceIndexCheck index_check(key.device());
  dispatch_slot_type(slots.scalar_type(), [&](auto slot_tag) {
    using slot_t = decltype(slot_tag);
    dispatch_float(key.scalar_type(), [&](auto type_tag) {
      using scalar_t = decltype(type_tag);
      cache_cuda::reshape_and_cache_int4_kernel<scalar_t, slot_t><<<key.size(0), kThreads, 0, stream>>>(
          static_cast<const scalar_t*>(key.data_ptr()), static_cast<const scalar_t*>(value.data_ptr()),
          static_cast<uint8_t*>(key_cache.data_ptr()), static_cast<uint8_t*>(value_cache.data_ptr()),
          slots.data_ptr<slot_t>(), token_strides(key), token_strides(value), cache_strides(key_cache),
          cache_strides(value_cache), static_cast<int>(key.size(1)), static_cast<int>(key.size(2)),
          static_cast<int>(group_size), key_cache.size(1), key_cache.size(0) * key_cache.size(1),
          index_check.error());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const char* names[] = {"slot_mapping"};
  const int64_t bounds[] = {key_cache.size(0) * key_cache.size(1)};
  index_check.raise_if_any("reshape_and_cache_int4", names, bounds);
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
  DeviceIndexCheck index_check(keys[0].device());
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    const int64_t bytes = keys[layer].stride(0) * keys[layer].element_size();
    void* k = keys[layer].data_ptr();
    void* v = values[layer].data_ptr();
    if (bytes % 16 == 0 && aligned16(k) && aligned16(v)) {
      cache_cuda::copy_blocks_kernel<uint4><<<num_pairs, kThreads, 0, stream>>>(
          static_cast<uint4*>(k), static_cast<uint4*>(v), mapping.data_ptr<int64_t>(), bytes / 16, num_blocks,
          index_check.error());
    } else {
      cache_cuda::copy_blocks_kernel<uint8_t><<<num_pairs, kThreads, 0, stream>>>(
          static_cast<uint8_t*>(k), static_cast<uint8_t*>(v), mapping.data_ptr<int64_t>(), bytes, num_blocks,
          index_check.error());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const char* names[] = {"block_mapping"};
  const int64_t bounds[] = {num_blocks};
  index_check.raise_if_any("copy_blocks", names, bounds);
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
  m.impl("reshape_and_cache_int4", &pagedkv::reshape_and_cache_int4_cuda);
  m.impl("copy_blocks", &pagedkv::copy_blocks_cuda);
  m.impl("swap_blocks", &pagedkv::swap_blocks_cuda);
}
