// Argument checks of the MLA ops: concat_and_cache_mla (vLLM's op of that name: the latent and
// the rope key of each token into one latent cache row) and paged_attention_mla(_with_lse) (absorbed-form
// attention over the latent cache). Schemas in ops.cpp, CPU kernels in mla_cpu.cpp, CUDA kernels in cuda/mla.cu.
#include "ops/mla.h"

#include <string>

#include "ops/tensor_checks.h"

namespace pagedkv {
namespace {

constexpr const char* kLatentShape = "[num_blocks, block_size, kv_lora_rank + rope_dim]";

// The latent cache's own shape and layout rules, with its own names, before the shared cache checks run on
// its [num_blocks, block_size, 1, width] view.
void check_latent_cache(const Tensor& kv_cache) {
  STD_TORCH_CHECK(kv_cache.dim() == 3, "kv_cache must be ", kLatentShape, " (one latent row per token), got shape ",
              shape_str(kv_cache));
  STD_TORCH_CHECK(kv_cache.scalar_type() != ScalarType::Byte,
              "kv_cache is uint8; pass kv_cache.view(torch.float8_e4m3fn) (or float8_e5m2) so that the float8 "
              "format is the tensor's dtype");
  STD_TORCH_CHECK(kv_cache.size(1) > 0 && kv_cache.size(2) > 0, "kv_cache must have a positive block_size and row "
              "width, got shape ", shape_str(kv_cache));
  STD_TORCH_CHECK(kv_cache.size(2) == 1 || kv_cache.stride(2) == 1,
              "kv_cache must have contiguous rows (last stride 1), got strides ", strides_str(kv_cache));
}

}  // namespace

void check_concat_and_cache_mla(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache,
                                const Tensor& slot_mapping, const std::string& kv_cache_dtype,
                                const std::optional<Tensor>& scale) {
  check_latent_cache(kv_cache);
  const Tensor cache = mla_cache_as_kv_view(kv_cache);
  check_cache_view(cache, "kv_cache");
  STD_TORCH_CHECK(kv_c.dim() == 2, "kv_c must be [num_tokens, kv_lora_rank], got shape ", shape_str(kv_c));
  STD_TORCH_CHECK(k_pe.dim() == 2, "k_pe must be [num_tokens, rope_dim] (squeeze a [num_tokens, 1, rope_dim] k_pe), "
              "got shape ", shape_str(k_pe));
  STD_TORCH_CHECK(k_pe.size(0) == kv_c.size(0), "k_pe has ", k_pe.size(0), " tokens but kv_c has ", kv_c.size(0));
  STD_TORCH_CHECK(kv_c.size(1) > 0 && kv_c.size(1) + k_pe.size(1) == kv_cache.size(2), "kv_c's kv_lora_rank ",
              kv_c.size(1), " + k_pe's rope_dim ", k_pe.size(1), " must equal kv_cache's row width ",
              kv_cache.size(2), " (kv_cache is ", kLatentShape, ")");
  const bool fp8 = is_fp8(kv_cache.scalar_type());
  if (fp8) {  // quantised on the way in: the inputs stay 16/32-bit floats
    check_float_dtype(kv_c, "kv_c");
  } else {
    STD_TORCH_CHECK(kv_c.scalar_type() == kv_cache.scalar_type(), "kv_c dtype ", kv_c.scalar_type(),
                " must equal kv_cache dtype ", kv_cache.scalar_type(), " (or kv_cache be float8)");
  }
  STD_TORCH_CHECK(k_pe.scalar_type() == kv_c.scalar_type(), "k_pe dtype ", k_pe.scalar_type(), " must equal kv_c dtype ",
              kv_c.scalar_type());
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3" || kv_cache_dtype == "fp8_e5m2") {
    const ScalarType wanted = kv_cache_dtype == "fp8_e5m2" ? ScalarType::Float8_e5m2 : ScalarType::Float8_e4m3fn;
    STD_TORCH_CHECK(kv_cache.scalar_type() == wanted, "kv_cache_dtype '", kv_cache_dtype, "' needs a ", wanted,
                " kv_cache, got ", kv_cache.scalar_type());
  } else {
    STD_TORCH_CHECK(kv_cache_dtype == "auto", "kv_cache_dtype must be 'auto' (the format is kv_cache's dtype), 'fp8', "
                "'fp8_e4m3' or 'fp8_e5m2', got '", kv_cache_dtype, "'");
  }
  if (fp8) check_kv_scale(scale, "scale", cache, kv_c, "kv_c");  // 16/32-bit caches ignore it, as vLLM's op does
  check_slot_mapping(slot_mapping, kv_c.size(0), "kv_c");
  check_same_device(k_pe, "k_pe", kv_c, "kv_c");
  check_same_device(kv_cache, "kv_cache", kv_c, "kv_c");
  check_same_device(slot_mapping, "slot_mapping", kv_c, "kv_c");
  check_no_overlap(kv_cache, "kv_cache", kv_c, "kv_c");
  check_no_overlap(kv_cache, "kv_cache", k_pe, "k_pe");
  check_no_overlap(kv_cache, "kv_cache", slot_mapping, "slot_mapping");
}

AttentionShape check_paged_attention_mla(const Tensor& query, const Tensor& kv_cache,
                                         const Tensor& block_tables, const Tensor& seq_lens,
                                         const Tensor& query_start_loc, double scale, int64_t kv_lora_rank,
                                         const std::optional<Tensor>& kv_scale) {
  STD_TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, kv_lora_rank + rope_dim], got shape ",
              shape_str(query));
  check_float_dtype(query, "query");
  check_latent_cache(kv_cache);
  STD_TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() || is_fp8(kv_cache.scalar_type()), "kv_cache dtype ",
              kv_cache.scalar_type(), " must equal query dtype ", query.scalar_type(),
              " or be float8_e4m3fn or float8_e5m2");
  STD_TORCH_CHECK(query.size(2) == kv_cache.size(2), "query's last dimension ", query.size(2),
              " must equal kv_cache's row width ", kv_cache.size(2), " (kv_lora_rank + rope_dim: the absorbed query)");
  STD_TORCH_CHECK(kv_lora_rank > 0 && kv_lora_rank <= kv_cache.size(2), "kv_lora_rank must be in [1, ",
              kv_cache.size(2), "] (the latent part of kv_cache's rows, read as V), got ", kv_lora_rank);
  STD_TORCH_CHECK(query.size(1) > 0, "query must have at least one head, got shape ", shape_str(query));
  check_same_device(kv_cache, "kv_cache", query, "query");
  const Tensor cache = mla_cache_as_kv_view(kv_cache);
  check_kv_scale(kv_scale, "kv_scale", cache, query, "query");
  // The rest (metadata, scale, devices) as paged_attention with the latent as one KV head, K and V alike.
  return check_paged_attention(query, cache, cache, block_tables, seq_lens, query_start_loc, scale,
                               /*sliding_window=*/-1, /*softcap=*/0.0);
}

}  // namespace pagedkv
