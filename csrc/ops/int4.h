// Host-side contract of the int4 KV ops shared by the CPU (int4_cpu.cpp) and CUDA (cuda/int4.cu) backends: the
// argument checks of reshape_and_cache_int4 and paged_attention_int4(_with_lse). An int4 cache is uint8
// [num_blocks, block_size, num_kv_heads, int4_row_bytes(head_dim, group_size)] (rows as ops/int4_kv.h lays out).
#pragma once

#include "ops/ops.h"

namespace pagedkv {

// key/value [T, Hkv, D] float32 / float16 / bfloat16 (any strides) into uint8 caches with rows of
// int4_row_bytes(D, group_size) bytes (any block, token and head strides, rows contiguous).
void check_reshape_and_cache_int4(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                                  const Tensor& value_cache, const Tensor& slot_mapping, int64_t group_size);

// query [T, Hq, D] against int4 caches of the same geometry; the metadata as paged_attention's.
AttentionShape check_paged_attention_int4(const Tensor& query, const Tensor& key_cache,
                                          const Tensor& value_cache, const Tensor& block_tables,
                                          const Tensor& seq_lens, const Tensor& query_start_loc, double scale,
                                          int64_t group_size, int64_t sliding_window, double softcap);

}  // namespace pagedkv
