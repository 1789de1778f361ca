// Host-side contract of the MLA ops (multi-head latent attention: DeepSeek V2/V3, Kimi K2) shared by the
// CPU (mla_cpu.cpp) and CUDA (cuda/mla.cu) backends: the latent cache's argument checks and the shapes of
// one paged_attention_mla call. The latent cache is [num_blocks, block_size, kv_lora_rank + rope_dim]: one
// row per token (the normalised latent, then the rope key), one "head".
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "ops/fp8.h"
#include "ops/ops.h"

namespace pagedkv {

// The latent cache as the [num_blocks, block_size, 1, width] cache view the shared checks and index math
// take (one KV head).
inline at::Tensor mla_cache_as_kv_view(const at::Tensor& kv_cache) { return kv_cache.unsqueeze(2); }

// concat_and_cache_mla: kv_c [T, kv_lora_rank] and k_pe [T, rope_dim] (any strides) into a latent cache view
// (any block and token strides, the row contiguous); kv_cache_dtype "auto" or the name of kv_cache's float8
// format; scale float32 [] or [1], used by float8 caches only. Shapes, dtypes and devices only (never syncs).
void check_concat_and_cache_mla(const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
                                const at::Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                const std::optional<at::Tensor>& scale);

// paged_attention_mla: query [T, Hq, width] against the latent rows (K: all width elements, V: the first
// kv_lora_rank); the metadata as paged_attention's. Returns the call's shapes (num_kv_heads 1, head_dim width).
AttentionShape check_paged_attention_mla(const at::Tensor& query, const at::Tensor& kv_cache,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc, double scale, int64_t kv_lora_rank,
                                         const std::optional<at::Tensor>& kv_scale);

}  // namespace pagedkv
