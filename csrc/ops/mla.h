// Host-side contract of the MLA ops (multi-head latent attention: DeepSeek V2/V3, Kimi K2) shared by the
// CPU (mla_cpu.cpp) and CUDA (cuda/mla.cu) backends: the latent cache's argument checks and the shapes of
// one paged_attention_mla call. The latent cache is [num_blocks, block_size, kv_lora_rank + rope_dim]: one
// row per token (the normalised latent, then the rope key), one "head".
#pragma once

#include <optional>
#include <string>

#include "ops/fp8.h"
#include "ops/ops.h"

namespace pagedkv {

// The latent cache as the [num_blocks, block_size, 1, width] cache view the shared checks and index math
// take (one KV head).
inline Tensor mla_cache_as_kv_view(const Tensor& kv_cache) { return unsqueeze_view(kv_cache, 2); }

// concat_and_cache_mla: kv_c [T, kv_lora_rank] and k_pe [T, rope_dim] (any strides) into a latent cache view
// (any block and token strides, the row contiguous); kv_cache_dtype "auto" or the name of kv_cache's float8
// format; scale float32 [] or [1], used by float8 caches only. Shapes, dtypes and devices only (never syncs).
void check_concat_and_cache_mla(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache,
                                const Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                const std::optional<Tensor>& scale);

// paged_attention_mla: query [T, Hq, width] against the latent rows (K: all width elements, V: the first
// kv_lora_rank); the metadata as paged_attention's. Returns the call's shapes (num_kv_heads 1, head_dim width).
AttentionShape check_paged_attention_mla(const Tensor& query, const Tensor& kv_cache,
                                         const Tensor& block_tables, const Tensor& seq_lens,
                                         const Tensor& query_start_loc, double scale, int64_t kv_lora_rank,
                                         const std::optional<Tensor>& kv_scale);

}  // namespace pagedkv
