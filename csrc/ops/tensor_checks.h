// Shape, dtype, device and memory-overlap checks of tensors, shared by the ops' argument checks
// (checks.cpp) and kernels. Every failed check raises a RuntimeError naming the argument.
#pragma once

#include "ops/torch_api.h"

#include <cstdint>
#include <string>
#include <utility>

#include "ops/view_overlap.h"

namespace pagedkv {

bool is_supported_float(ScalarType t);
void check_float_dtype(const Tensor& t, const std::string& name);
void check_same_device(const Tensor& t, const std::string& name, const Tensor& ref, const char* ref_name);
// bytes_ok: uint8 caches (int4 rows: reshape_and_cache_int4) are accepted too, by the ops that move bytes.
void check_cache_shape_and_dtype(const Tensor& cache, const std::string& name, bool bytes_ok = false);
void check_index_tensor(const Tensor& t, const char* name, ScalarType dtype, int64_t dim);
std::pair<uintptr_t, uintptr_t> memory_span(const Tensor& t);
ByteView byte_view(const Tensor& t);
Overlap overlap(const Tensor& a, const Tensor& b);
bool may_overlap(const Tensor& a, const Tensor& b);
bool same_tensor(const Tensor& a, const Tensor& b);
void check_no_overlap(const Tensor& written, const std::string& written_name, const Tensor& other,
                      const std::string& other_name);
void check_no_internal_overlap(const Tensor& t, const std::string& name,
                               const char* why = "it is written in place");
void check_cache(const Tensor& cache, const std::string& name);
void check_cache_view(const Tensor& cache, const std::string& name, const char* why = "it is written in place");
void check_kv_cache_views(const Tensor& key_cache, const Tensor& value_cache);
void check_block_mapping_shape(const Tensor& block_mapping);
void check_slot_mapping(const Tensor& slot_mapping, int64_t num_tokens, const char* tokens_of);

}  // namespace pagedkv
