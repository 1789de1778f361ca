// Shape, dtype, device and memory-overlap checks of tensors (tensor_checks.h).
#include "ops/tensor_checks.h"

#include "ops/ops.h"

#include <string>
#include <utility>

namespace pagedkv {

bool is_supported_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

void check_float_dtype(const Tensor& t, const std::string& name) {
  STD_TORCH_CHECK(is_supported_float(t.scalar_type()), name, " must be float32, float16 or bfloat16, got ",
              t.scalar_type());
}

void check_same_device(const Tensor& t, const std::string& name, const Tensor& ref, const char* ref_name) {
  STD_TORCH_CHECK(same_device(t, ref), name, " is on ", device_str(t), " but ", ref_name, " is on ", device_str(ref),
              "; all tensors must be on the same device");
}

void check_cache_shape_and_dtype(const Tensor& cache, const std::string& name, bool bytes_ok) {
  STD_TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              shape_str(cache));
  STD_TORCH_CHECK(is_supported_float(cache.scalar_type()) || is_fp8(cache.scalar_type()) ||
                  (bytes_ok && cache.scalar_type() == ScalarType::Byte),
              name, " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2",
              bytes_ok ? " (or uint8: int4 rows)" : "", ", got ", cache.scalar_type());
  // A dimension of size 0 would leave a block with no bytes but a nonzero stride: copies from null.
  STD_TORCH_CHECK(cache.size(1) > 0 && cache.size(2) > 0 && cache.size(3) > 0, name,
              " must have positive block_size, num_kv_heads and head_dim, got shape ", shape_str(cache));
}

void check_index_tensor(const Tensor& t, const char* name, ScalarType dtype, int64_t dim) {
  STD_TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  STD_TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimension(s), got shape ", shape_str(t));
}

// Byte range [begin, end) that a tensor's elements span (strides are never negative in torch).
std::pair<uintptr_t, uintptr_t> memory_span(const Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

ByteView byte_view(const Tensor& t) {
  ByteView v{static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())), t.element_size(), t.sizes().vec(),
             t.strides().vec()};
  for (int64_t& stride : v.strides) stride *= v.elem_size;
  return v;
}

// Whether a and b share a byte, exactly (view_overlap.h); views too irregular to decide within the search
// budget count as sharing one. The stable ABI has no is_alias_of: two tensors of one device whose byte
// spans intersect are views of one storage (live allocations never share an address).
Overlap overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !same_device(a, b)) return Overlap::kDisjoint;
  const auto sa = memory_span(a), sb = memory_span(b);
  if (sa.second <= sb.first || sb.second <= sa.first) return Overlap::kDisjoint;
  return views_overlap(byte_view(a), byte_view(b));
}

bool may_overlap(const Tensor& a, const Tensor& b) { return overlap(a, b) != Overlap::kDisjoint; }

// The same elements in the same order: one tensor passed twice, or a view that equals it (the stable ABI
// has no is_same: an empty tensor counts only when it has a data pointer).
bool same_tensor(const Tensor& a, const Tensor& b) {
  return same_device(a, b) && a.data_ptr() != nullptr && a.data_ptr() == b.data_ptr() &&
         a.element_size() == b.element_size() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

void check_no_overlap(const Tensor& written, const std::string& written_name, const Tensor& other,
                      const std::string& other_name) {
  STD_TORCH_CHECK(!same_tensor(written, other), written_name, " and ", other_name, " are the same tensor (they share "
              "memory); ", written_name, " is written in place while ", other_name, " is read, so pass two distinct "
              "tensors (clone one)");
  const Overlap o = overlap(written, other);
  STD_TORCH_CHECK(o != Overlap::kShared, written_name, " and ", other_name, " share memory (an element of one is in "
              "the other); ", written_name, " is written in place, so they must not overlap (clone one)");
  STD_TORCH_CHECK(o != Overlap::kUnknown, written_name, " and ", other_name, " may share memory: views of one buffer "
              "whose strides are too irregular to prove them disjoint (strides ", strides_str(written), " and ",
              strides_str(other), "); ", written_name, " is written in place, so pass views with the same strides, or "
              "separate tensors");
}

// An output whose elements alias each other (an expand()ed or as_strided view) would be updated twice;
// `why` says why the tensor needs elements of its own.
void check_no_internal_overlap(const Tensor& t, const std::string& name,
                               const char* why) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the dimensions so far
  for (const auto& [stride, size] : dims) {
    STD_TORCH_CHECK(stride >= extent, name, " has elements that share memory (strides ", strides_str(t), ", shape ",
                shape_str(t), "), e.g. an expand()ed view; ", why, ", so pass a tensor without overlapping elements");
    extent = stride * (size - 1) + extent;
  }
}

// The cache of copy_blocks and the host tier: one contiguous tensor, moved as bytes (int4 rows included).
void check_cache(const Tensor& cache, const std::string& name) {
  check_cache_shape_and_dtype(cache, name, /*bytes_ok=*/true);
  STD_TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous, got strides ", strides_str(cache), " for shape ",
              shape_str(cache), " (reshape_and_cache and paged_attention take strided cache views, copy_blocks "
              "does not)");
}

// The cache of reshape_and_cache and paged_attention: any strides on the block, token and head
// dimensions (a view of a larger buffer), a contiguous head_dim, no two elements at one address.
void check_cache_view(const Tensor& cache, const std::string& name, const char* why) {
  check_cache_shape_and_dtype(cache, name);
  STD_TORCH_CHECK(cache.size(3) == 1 || cache.stride(3) == 1, name,
              " must have a contiguous head_dim (stride 1), got strides ", strides_str(cache), " for shape ",
              shape_str(cache));
  check_no_internal_overlap(cache, name, why);
}

// paged_attention reads K and V through one set of row offsets: their views must have the same strides
// (those of a dimension of size 1 never matter). Both are only read, so they may overlap: transformers'
// page views of one buffer do (V's view starts one page into K's; the block tables address K pages).
void check_kv_cache_views(const Tensor& key_cache, const Tensor& value_cache) {
  bool same_strides = true;
  for (int64_t d = 0; d < 3; ++d) {
    same_strides = same_strides && (key_cache.size(d) <= 1 || key_cache.stride(d) == value_cache.stride(d));
  }
  STD_TORCH_CHECK(same_strides, "key_cache strides ", strides_str(key_cache), " and value_cache strides ",
              strides_str(value_cache), " must be equal: paged_attention reads K and V at the same offsets (the K "
              "and V views of vLLM's interleaved cells, FlashInfer's [pages, 2, ...] and the HND layout have "
              "equal strides); pass views of one layout, or contiguous caches");
}

// slot_mapping: int32 or int64, one entry per token of the input named tokens_of.
void check_slot_mapping(const Tensor& slot_mapping, int64_t num_tokens, const char* tokens_of) {
  STD_TORCH_CHECK(slot_mapping.scalar_type() == ScalarType::Int || slot_mapping.scalar_type() == ScalarType::Long,
              "slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  STD_TORCH_CHECK(slot_mapping.dim() == 1, "slot_mapping must have 1 dimension(s), got shape ", shape_str(slot_mapping));
  STD_TORCH_CHECK(slot_mapping.size(0) == num_tokens, "slot_mapping has ", slot_mapping.size(0), " entries but ",
              tokens_of, " has ", num_tokens, " tokens");
}

void check_block_mapping_shape(const Tensor& block_mapping) {
  check_index_tensor(block_mapping, "block_mapping", ScalarType::Long, 2);
  STD_TORCH_CHECK(block_mapping.size(1) == 2, "block_mapping must be [n, 2] (src, dst) pairs, got shape ",
              shape_str(block_mapping));
}


}  // namespace pagedkv
