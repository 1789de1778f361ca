// Schemas and argument checks of the int4 KV ops: reshape_and_cache_int4 (each token's K and V heads quantised
// into int4 rows with a step and a minimum per group) and paged_attention_int4(_with_lse) (attention reading
// them). CPU kernels in int4_cpu.cpp, CUDA kernels in cuda/int4.cu.
#include "ops/int4.h"

#if !defined(PAGEDKV_WITH_CUDA)
#include <torch/csrc/stable/library.h>
#endif

#include "ops/int4_kv.h"
#include "ops/tensor_checks.h"

namespace pagedkv {
namespace {

void check_group_size(int64_t head_dim, int64_t group_size, const char* dim_of) {
  STD_TORCH_CHECK(group_size >= 2 && group_size % 2 == 0, "group_size must be even and >= 2 (two codes per byte), got ",
              group_size);
  STD_TORCH_CHECK(head_dim > 0 && head_dim % group_size == 0, "group_size ", group_size, " must divide ", dim_of,
              "'s head_dim ", head_dim);
}

// An int4 cache: uint8, 4-d, rows of int4_row_bytes(head_dim, group_size) contiguous bytes, no byte twice.
void check_int4_cache(const Tensor& cache, const char* name, int64_t num_kv_heads, int64_t head_dim,
                      int64_t group_size, const char* why) {
  STD_TORCH_CHECK(cache.scalar_type() == ScalarType::Byte, name, " must be uint8 (int4 rows), got ", cache.scalar_type());
  STD_TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, row_bytes], got shape ",
              shape_str(cache));
  const int64_t row = int4_row_bytes(head_dim, group_size);
  STD_TORCH_CHECK(cache.size(1) > 0 && cache.size(2) == num_kv_heads && cache.size(3) == row, name,
              " must be [num_blocks, block_size > 0, num_kv_heads = ", num_kv_heads, ", ", row,
              "] (head_dim ", head_dim, " / 2 code bytes + 4 bytes per group of ", group_size, "), got shape ",
              shape_str(cache));
  STD_TORCH_CHECK(cache.stride(3) == 1, name, " must have contiguous rows (last stride 1), got strides ",
              strides_str(cache));
  check_no_internal_overlap(cache, name, why);
}

}  // namespace

void check_reshape_and_cache_int4(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                                  const Tensor& value_cache, const Tensor& slot_mapping, int64_t group_size) {
  STD_TORCH_CHECK(key.dim() == 3, "key must be [num_tokens, num_kv_heads, head_dim], got shape ", shape_str(key));
  STD_TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", shape_str(value), " must equal key shape ", shape_str(key));
  check_float_dtype(key, "key");
  STD_TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value dtype ", value.scalar_type(), " must equal key dtype ",
              key.scalar_type());
  check_group_size(key.size(2), group_size, "key");
  check_int4_cache(key_cache, "key_cache", key.size(1), key.size(2), group_size, "it is written in place");
  check_int4_cache(value_cache, "value_cache", key.size(1), key.size(2), group_size, "it is written in place");
  STD_TORCH_CHECK(key_cache.size(0) == value_cache.size(0) && key_cache.size(1) == value_cache.size(1),
              "value_cache shape ", shape_str(value_cache), " must equal key_cache shape ", shape_str(key_cache));
  check_slot_mapping(slot_mapping, key.size(0), "key");
  check_same_device(value, "value", key, "key");
  check_same_device(key_cache, "key_cache", key, "key");
  check_same_device(value_cache, "value_cache", key, "key");
  check_same_device(slot_mapping, "slot_mapping", key, "key");
  check_no_overlap(value_cache, "value_cache", key_cache, "key_cache");
  for (const Tensor* cache : {&key_cache, &value_cache}) {
    const char* name = cache == &key_cache ? "key_cache" : "value_cache";
    check_no_overlap(*cache, name, key, "key");
    check_no_overlap(*cache, name, value, "value");
    check_no_overlap(*cache, name, slot_mapping, "slot_mapping");
  }
}

AttentionShape check_paged_attention_int4(const Tensor& query, const Tensor& key_cache,
                                          const Tensor& value_cache, const Tensor& block_tables,
                                          const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
                                          int64_t group_size, int64_t sliding_window, double softcap) {
  STD_TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_q_heads, head_dim], got shape ", shape_str(query));
  check_float_dtype(query, "query");
  check_group_size(query.size(2), group_size, "query");
  STD_TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, num_kv_heads, row_bytes], got shape ",
              shape_str(key_cache));
  const int64_t num_kv_heads = key_cache.size(2);
  constexpr const char* kRead = "each byte holds one part of one row";
  check_int4_cache(key_cache, "key_cache", num_kv_heads, query.size(2), group_size, kRead);
  check_int4_cache(value_cache, "value_cache", num_kv_heads, query.size(2), group_size, kRead);
  STD_TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "value_cache shape ", shape_str(value_cache),
              " must equal key_cache shape ", shape_str(key_cache));
  STD_TORCH_CHECK(query.size(1) > 0 && query.size(1) % num_kv_heads == 0, "query num_q_heads ", query.size(1),
              " must be a positive multiple of key_cache num_kv_heads ", num_kv_heads);
  const int64_t num_seqs =
      check_attention_metadata(query, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap);
  check_same_device(key_cache, "key_cache", query, "query");
  check_same_device(value_cache, "value_cache", query, "query");
  check_kv_cache_views(key_cache, value_cache);
  return AttentionShape{query.size(0), query.size(1),        num_kv_heads,      query.size(2),
                        num_seqs,      block_tables.size(1), key_cache.size(0), key_cache.size(1)};
}

}  // namespace pagedkv

#if !defined(PAGEDKV_WITH_CUDA)  // pagedkv._C_cuda compiles these checks too; the schemas live in _C
STABLE_TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def(
      "reshape_and_cache_int4(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, int group_size) -> ()");
  m.def(
      "paged_attention_int4(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int group_size, *, int max_seq_len=-1, "
      "int sliding_window=-1, float softcap=0.0) -> Tensor");
  m.def(
      "paged_attention_int4_with_lse(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int group_size, *, int max_seq_len=-1, "
      "int sliding_window=-1, float softcap=0.0) -> (Tensor, Tensor)");
}
#endif
