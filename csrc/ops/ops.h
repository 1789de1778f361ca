// Host-side contract of the pagedkv ops shared by the CPU and CUDA backends: argument checks
// (TORCH_CHECK messages name the offending argument) and the kernels each backend provides.
#pragma once

#include "ops/fp8.h"
#include "ops/torch_api.h"

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/attention_plan.h"

namespace pagedkv {

// Shapes of one paged_attention call, read off the (already checked) arguments.
struct AttentionShape {
  int64_t num_tokens;    // T: packed query tokens
  int64_t num_q_heads;   // Hq
  int64_t num_kv_heads;  // Hkv
  int64_t head_dim;      // D
  int64_t num_seqs;      // B
  int64_t max_blocks;    // M: block table width
  int64_t num_blocks;    // physical blocks in the cache
  int64_t block_size;
};

// Checks that work on shapes, dtypes and devices only (safe on any backend, never syncs). The caches
// of reshape_and_cache may be views with any block, token and head strides (head_dim contiguous), K and
// V views of one buffer when they share no element; slot_mapping is int32 or int64.
void check_reshape_and_cache(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                             const Tensor& value_cache, const Tensor& slot_mapping,
                             const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale);
// A float8 cache's optional scale: float32, shape [] or [num_kv_heads], on ref's device (ref_name: key
// or query); an error when the cache is not float8.
void check_kv_scale(const std::optional<Tensor>& scale, const char* name, const Tensor& cache,
                    const Tensor& ref, const char* ref_name = "key");
// The metadata of a paged attention call against query [T, Hq, D] (block_tables [B, M], seq_lens [B] and
// query_start_loc [B + 1] int32 on query's device; scale, sliding_window and softcap as paged_attention takes
// them); returns B. Shapes, dtypes and devices only.
int64_t check_attention_metadata(const Tensor& query, const Tensor& block_tables, const Tensor& seq_lens,
                                 const Tensor& query_start_loc, double scale, int64_t sliding_window,
                                 double softcap);
// The caches have query's dtype, or both one float8 dtype (then k_scale / v_scale may be given).
AttentionShape check_paged_attention(const Tensor& query, const Tensor& key_cache,
                                     const Tensor& value_cache, const Tensor& block_tables,
                                     const Tensor& seq_lens, const Tensor& query_start_loc,
                                     double scale, int64_t sliding_window, double softcap,
                                     const std::optional<Tensor>& k_scale = std::nullopt,
                                     const std::optional<Tensor>& v_scale = std::nullopt,
                                     const std::optional<Tensor>& sinks = std::nullopt);
void check_copy_blocks(const std::vector<Tensor>& key_caches, const std::vector<Tensor>& value_caches,
                       const Tensor& block_mapping);
void check_swap_blocks(const Tensor& src, const Tensor& dst, const Tensor& block_mapping);
// offload_blocks / load_blocks: caches as copy_blocks takes them (contiguous), the block-major host tier
// covering layers [first_layer, first_layer + layers); returns the number of layers.
int64_t check_host_tier_copy(const std::vector<Tensor>& key_caches, const std::vector<Tensor>& value_caches,
                             const Tensor& host_cache, const Tensor& block_mapping, int64_t first_layer);
// src and dst are the same tensor (blocks move within one pool).
bool swap_within_one_pool(const Tensor& src, const Tensor& dst);
bool is_fp8(ScalarType dtype);  // float8_e4m3fn or float8_e5m2
KvFormat kv_format(ScalarType fp8_dtype);

// Model-layer ops (kernels in layer_ops.cpp, cuda/layer_ops.cu): shape, dtype and device checks.
void check_rms_norm(const Tensor& input, const Tensor& weight, double epsilon);
void check_fused_add_rms_norm(const Tensor& input, const Tensor& residual, const Tensor& weight,
                              double epsilon);
void check_silu_and_mul(const Tensor& input);
void check_rotary_embedding(const Tensor& positions, const Tensor& x, const Tensor& cos_sin_cache);

// Checks that read tensor values; only for tensors that live on the CPU.
// A private contiguous copy of a CPU sinks argument, its values finite (checked values = read values).
Tensor cpu_sinks(const std::optional<Tensor>& sinks);
void check_kv_scale_values(const Tensor& scale, const char* name);  // finite and > 0
// A private contiguous copy of a CPU scale argument (checked values = read values) and its view.
std::pair<Tensor, KvScale> cpu_kv_scale(const std::optional<Tensor>& scale, const char* name);
// Slots (int32 or int64) below num_slots and, padding (< 0) aside, distinct.
void check_slot_values(const Tensor& slot_mapping, int64_t num_slots);
void check_attention_metadata_values(const AttentionShape& shape, const Tensor& block_tables,
                                     const Tensor& seq_lens, const Tensor& query_start_loc,
                                     int64_t sliding_window);
// Ids in range and destinations distinct; with same_pool (source and destination blocks in the same
// tensors) also no chains: no destination may be the source of another pair.
void check_block_mapping_values(const Tensor& block_mapping, int64_t num_src_blocks, int64_t num_dst_blocks,
                                bool same_pool = false);

// Strides (elements) of the block, token and head dimensions of a [num_blocks, block_size, Hkv, D] cache.
inline CacheStrides cache_strides(const Tensor& cache) {
  return {cache.stride(0), cache.stride(1), cache.stride(2)};
}

// The parameters of a paged_attention call (checked shapes; metadata tensors contiguous; lse may be
// undefined). Split-K buffers and the index check are the backend's to fill.
inline AttentionParams attention_params(const AttentionShape& shape, const Tensor& query, const Tensor& key_cache,
                                        const Tensor& value_cache, const Tensor& block_tables,
                                        const Tensor& seq_lens, const Tensor& query_start_loc,
                                        const Tensor& out, const Tensor& lse, double scale,
                                        int64_t sliding_window, double softcap) {
  AttentionParams p{};
  p.query = query.data_ptr();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.q_stride_dim = query.stride(2);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.cache_strides = cache_strides(key_cache);  // value_cache's too (checked)
  p.block_tables = block_tables.mutable_data_ptr<int32_t>();
  p.seq_lens = seq_lens.mutable_data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.mutable_data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.defined() ? lse.mutable_data_ptr<float>() : nullptr;
  p.num_seqs = int(shape.num_seqs);
  p.num_tokens = int(shape.num_tokens);
  p.num_q_heads = int(shape.num_q_heads);
  p.num_kv_heads = int(shape.num_kv_heads);
  p.head_dim = int(shape.head_dim);
  p.block_size = int(shape.block_size);
  p.max_blocks = int(shape.max_blocks);
  p.num_blocks = shape.num_blocks;
  p.sliding_window = sliding_window;
  p.scale = float(scale);
  p.softcap = float(softcap);
  return p;
}

// CPU paged attention (csrc/ops/attention_cpu.cpp): fills out [T, Hq, D] and, when defined, lse [T, Hq].
void paged_attention_cpu_into(const Tensor& out, const Tensor& lse, const Tensor& query,
                              const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor& block_tables, const Tensor& seq_lens,
                              const Tensor& query_start_loc, double scale, int64_t sliding_window,
                              double softcap, KvScale k_scale = {}, KvScale v_scale = {},
                              const float* sinks = nullptr);

// Calls fn with a value of the C++ type of a (checked) float32 / float16 / bfloat16 dtype.
template <typename Fn>
void dispatch_float(ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case ScalarType::Float: fn(float{}); break;
    case ScalarType::Half: fn(c10::Half{}); break;
    default: fn(c10::BFloat16{}); break;
  }
}

// Which copy of the CPU attention kernels runs: "auto" (the fastest this CPU has), or the best up to
// "avx512", "avx2" or "baseline" (the portable one; an ISA this CPU lacks is an error);
// cpu_attention_isa() says which runs now, cpu_attention_isas() lists those this CPU runs.
void set_cpu_attention_isa(const std::string& isa);
std::string cpu_attention_isa();
std::vector<std::string> cpu_attention_isas();

}  // namespace pagedkv
