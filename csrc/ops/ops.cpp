// Schemas of every torch.ops.pagedkv.* op and the CPU kernels of the cache ops (reshape_and_cache,
// copy_blocks, swap_blocks). Their argument checks live in checks.cpp, CPU paged attention in
// attention_cpu.cpp, the model-layer ops in layer_ops.cpp.
#include "ops/ops.h"

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "ops/fp8.h"
#include "ops/paged_kv.h"
#include "ops/view_overlap.h"
#include "ops/tensor_checks.h"

namespace pagedkv {


namespace {

// Writes each token's [Hkv, D] rows (any strides) into its cache slot (cache views with any block, token
// and head strides): cache element d of head h of token t becomes store(element, h) for the input
// elements of that row. in_t / cache_t are the element types; slots are int64 (a checked private copy).
template <typename in_t, typename cache_t, typename Store>
void write_cache_rows(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                      const Tensor& value_cache, const Tensor& slots, Store k_store, Store v_store) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t* slot = slots.mutable_data_ptr<int64_t>();
  const auto* k = static_cast<const in_t*>(key.data_ptr());
  const auto* v = static_cast<const in_t*>(value.data_ptr());
  auto* kc = static_cast<cache_t*>(key_cache.data_ptr());
  auto* vc = static_cast<cache_t*>(value_cache.data_ptr());
  const auto ks = key.strides(), vs = value.strides();
  const CacheStrides kcs = cache_strides(key_cache), vcs = cache_strides(value_cache);
  parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding
      cache_t* k_dst = kc + cache_slot_offset(slot[t], block_size, kcs);
      cache_t* v_dst = vc + cache_slot_offset(slot[t], block_size, vcs);
      for (int64_t h = 0; h < num_heads; ++h) {
        const in_t* k_row = k + t * ks[0] + h * ks[1];
        const in_t* v_row = v + t * vs[0] + h * vs[1];
        cache_t* k_out = k_dst + h * kcs.head;
        cache_t* v_out = v_dst + h * vcs.head;
        for (int64_t d = 0; d < head_dim; ++d) {
          k_out[d] = k_store(k_row[d * ks[2]], h);
          v_out[d] = v_store(v_row[d * vs[2]], h);
        }
      }
    }
  });
}

// Same-dtype caches: elements are moved as raw bits.
template <typename bits_t>
void reshape_and_cache_cpu_typed(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                                 const Tensor& value_cache, const Tensor& slots) {
  const auto copy = [](bits_t x, int64_t) { return x; };
  write_cache_rows<bits_t, bits_t>(key, value, key_cache, value_cache, slots, copy, copy);
}

// Float8 caches: each element divided by its head's scale, saturated and rounded (fp8.h's rule).
template <typename scalar_t, KvFormat F>
void reshape_and_cache_fp8_cpu_typed(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                                     const Tensor& value_cache, const Tensor& slots, KvScale k_scale,
                                     KvScale v_scale) {
  const auto quantiser = [](KvScale scale) {
    return [scale](scalar_t x, int64_t h) { return fp8_saturating_encode<F>(static_cast<float>(x) / scale.at(h)); };
  };
  write_cache_rows<scalar_t, uint8_t>(key, value, key_cache, value_cache, slots, quantiser(k_scale),
                                      quantiser(v_scale));
}

void reshape_and_cache_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache,
                           Tensor& value_cache, const Tensor& slot_mapping,
                           const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  // A private int64 copy: the kernel reads exactly the values checked, whatever another thread writes.
  const Tensor slots = contiguous_copy(slot_mapping, ScalarType::Long);
  check_slot_values(slots, key_cache.size(0) * key_cache.size(1));
  if (is_fp8(key_cache.scalar_type())) {
    const auto [k_copy, k_s] = cpu_kv_scale(k_scale, "k_scale");
    const auto [v_copy, v_s] = cpu_kv_scale(v_scale, "v_scale");
    dispatch_float(key.scalar_type(), [&](auto type_tag) {
      dispatch_fp8(kv_format(key_cache.scalar_type()), [&](auto format) {
        reshape_and_cache_fp8_cpu_typed<decltype(type_tag), decltype(format)::value>(key, value, key_cache,
                                                                                      value_cache, slots, k_s, v_s);
      });
    });
    return;
  }
  if (key.element_size() == 4) {
    reshape_and_cache_cpu_typed<uint32_t>(key, value, key_cache, value_cache, slots);
  } else {
    reshape_and_cache_cpu_typed<uint16_t>(key, value, key_cache, value_cache, slots);
  }
}

void copy_blocks_cpu(const std::vector<Tensor>& keys, const std::vector<Tensor>& values, const Tensor& block_mapping) {
  check_copy_blocks(keys, values, block_mapping);
  if (keys.empty() || block_mapping.size(0) == 0) return;
  const int64_t num_blocks = keys[0].size(0);
  const Tensor mapping = contiguous_copy(block_mapping);  // checked values = read values
  check_block_mapping_values(mapping, num_blocks, num_blocks, /*same_pool=*/true);
  const int64_t* m = mapping.mutable_data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  const int64_t num_layers = static_cast<int64_t>(keys.size());
  // One work unit = one (layer, pair); each moves a key block and a value block.
  parallel_for(0, num_layers * num_pairs, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tensor& kc = keys[i / num_pairs];
      const Tensor& vc = values[i / num_pairs];
      const int64_t src = m[2 * (i % num_pairs)], dst = m[2 * (i % num_pairs) + 1];
      const int64_t block_bytes = kc.stride(0) * kc.element_size();
      auto* kb = static_cast<char*>(kc.data_ptr());
      auto* vb = static_cast<char*>(vc.data_ptr());
      std::memmove(kb + dst * block_bytes, kb + src * block_bytes, block_bytes);
      std::memmove(vb + dst * block_bytes, vb + src * block_bytes, block_bytes);
    }
  });
}

void swap_blocks_cpu(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  check_swap_blocks(src, dst, block_mapping);
  const Tensor mapping = contiguous_copy(block_mapping);  // checked values = read values
  check_block_mapping_values(mapping, src.size(0), dst.size(0), swap_within_one_pool(src, dst));
  const int64_t* m = mapping.mutable_data_ptr<int64_t>();
  const int64_t block_bytes = src.numel() == 0 ? 0 : src.stride(0) * src.element_size();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  parallel_for(0, mapping.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memmove(d + m[2 * i + 1] * block_bytes, s + m[2 * i] * block_bytes, block_bytes);
    }
  });
}

}  // namespace
}  // namespace pagedkv

STABLE_TORCH_LIBRARY(pagedkv, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, *, int max_seq_len=-1, int sliding_window=-1, "
      "float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_attention_with_lse(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, *, int max_seq_len=-1, int sliding_window=-1, "
      "float softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // The host tier (tier_ops.cpp, cuda/tier_ops.cu): whole blocks between the paged caches and a block-major
  // host cache; block_mapping pairs are (device block, host slot) for offload, (host slot, device block) for load.
  m.def("offload_blocks(Tensor[] key_caches, Tensor[] value_caches, Tensor(a!) host_cache, Tensor block_mapping, "
        "int first_layer=0) -> ()");
  m.def("load_blocks(Tensor host_cache, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping, "
        "int first_layer=0) -> ()");
  // Model-layer ops (layer_ops.cpp, cuda/layer_ops.cu).
  m.def("rms_norm(Tensor input, Tensor weight, float epsilon) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def("silu_and_mul(Tensor input) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) x, Tensor cos_sin_cache) -> ()");
  // MLA (mla.cpp, mla_cpu.cpp, cuda/mla.cu).
  // vLLM's concat_and_cache_mla(kv_c, k_pe, kv_cache!, slot_mapping, kv_cache_dtype, scale), with the last
  // two optional: "auto" reads the format off kv_cache's dtype; no scale on a float8 cache means 1.
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "str kv_cache_dtype=\"auto\", Tensor? scale=None) -> ()");
  m.def(
      "paged_attention_mla(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int kv_lora_rank, *, Tensor? kv_scale=None) "
      "-> Tensor");
  m.def(
      "paged_attention_mla_with_lse(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int kv_lora_rank, *, Tensor? kv_scale=None) "
      "-> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("reshape_and_cache", TORCH_BOX(&pagedkv::reshape_and_cache_cpu));
  m.impl("copy_blocks", TORCH_BOX(&pagedkv::copy_blocks_cpu));
  m.impl("swap_blocks", TORCH_BOX(&pagedkv::swap_blocks_cpu));
}
