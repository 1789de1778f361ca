// The argument checks of the cache, block-move, attention and model-layer ops: shapes, dtypes, devices and
// the values of slots, block tables and block mappings, each failure naming the argument.
#include "ops/ops.h"

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


void check_kv_scale(const std::optional<Tensor>& scale, const char* name, const Tensor& cache,
                    const Tensor& ref, const char* ref_name) {
  if (!scale.has_value()) return;
  const Tensor& s = *scale;
  STD_TORCH_CHECK(is_fp8(cache.scalar_type()), name, " is given but the cache dtype is ", cache.scalar_type(),
              ": scales apply to float8_e4m3fn / float8_e5m2 caches only");
  STD_TORCH_CHECK(s.scalar_type() == ScalarType::Float, name, " must be float32, got ", s.scalar_type());
  STD_TORCH_CHECK(s.dim() == 0 || (s.dim() == 1 && s.size(0) == cache.size(2)), name,
              " must have shape [] (one scale) or [num_kv_heads] = [", cache.size(2), "], got ", shape_str(s));
  check_same_device(s, name, ref, ref_name);
}

void check_kv_scale_values(const Tensor& scale, const char* name) {
  const float* v = scale.mutable_data_ptr<float>();
  for (int64_t i = 0; i < scale.numel(); ++i) {
    STD_TORCH_CHECK(std::isfinite(v[i]) && v[i] > 0.f, name, " must hold finite numbers > 0, got ", v[i],
                scale.dim() ? " at kv head " + std::to_string(i) : std::string());
  }
}

std::pair<Tensor, KvScale> cpu_kv_scale(const std::optional<Tensor>& scale, const char* name) {
  if (!scale.has_value()) return {Tensor(), KvScale{}};
  Tensor copy = contiguous_copy(*scale);
  check_kv_scale_values(copy, name);
  return {copy, KvScale{copy.mutable_data_ptr<float>(), copy.dim() == 0 ? 0 : 1}};
}

bool is_fp8(ScalarType t) { return t == ScalarType::Float8_e4m3fn || t == ScalarType::Float8_e5m2; }

KvFormat kv_format(ScalarType cache_dtype) {
  return cache_dtype == ScalarType::Float8_e5m2 ? KvFormat::kE5M2 : KvFormat::kE4M3;
}

void check_reshape_and_cache(const Tensor& key, const Tensor& value, const Tensor& key_cache,
                             const Tensor& value_cache, const Tensor& slot_mapping,
                             const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  check_cache_view(key_cache, "key_cache");
  check_cache_view(value_cache, "value_cache");
  STD_TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "value_cache shape ", shape_str(value_cache),
              " must equal key_cache shape ", shape_str(key_cache));
  STD_TORCH_CHECK(key.dim() == 3, "key must be [num_tokens, num_kv_heads, head_dim], got shape ", shape_str(key));
  STD_TORCH_CHECK(value.sizes() == key.sizes(), "value shape ", shape_str(value), " must equal key shape ", shape_str(key));
  STD_TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), "key shape ", shape_str(key),
              " does not match key_cache [num_blocks, block_size, num_kv_heads, head_dim] = ", shape_str(key_cache));
  STD_TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "value_cache dtype ", value_cache.scalar_type(),
              " must equal key_cache dtype ", key_cache.scalar_type());
  if (is_fp8(key_cache.scalar_type())) {  // quantised on the way in: the inputs stay 16/32-bit floats
    check_float_dtype(key, "key");
    STD_TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value dtype ", value.scalar_type(),
                " must equal key dtype ", key.scalar_type());
  } else {
    STD_TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), "key dtype ", key.scalar_type(),
                " must equal key_cache dtype ", key_cache.scalar_type());
    STD_TORCH_CHECK(value.scalar_type() == value_cache.scalar_type(), "value dtype ", value.scalar_type(),
                " must equal value_cache dtype ", value_cache.scalar_type());
  }
  check_kv_scale(k_scale, "k_scale", key_cache, key);
  check_kv_scale(v_scale, "v_scale", value_cache, key);
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

int64_t check_attention_metadata(const Tensor& query, const Tensor& block_tables, const Tensor& seq_lens,
                                 const Tensor& query_start_loc, double scale, int64_t sliding_window,
                                 double softcap) {
  check_index_tensor(block_tables, "block_tables", ScalarType::Int, 2);
  check_index_tensor(seq_lens, "seq_lens", ScalarType::Int, 1);
  check_index_tensor(query_start_loc, "query_start_loc", ScalarType::Int, 1);
  const int64_t num_seqs = seq_lens.size(0);
  STD_TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables has ", block_tables.size(0),
              " rows but seq_lens has ", num_seqs, " sequences");
  STD_TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc must have num_seqs + 1 = ", num_seqs + 1,
              " entries, got ", query_start_loc.size(0));
  // The kernels compute in fp32: the values must survive the cast.
  STD_TORCH_CHECK(std::isfinite(static_cast<float>(scale)) && static_cast<float>(scale) > 0.f,
              "scale must be a finite number > 0 (as a float32), got ", scale);
  STD_TORCH_CHECK(softcap == 0.0 || (std::isfinite(static_cast<float>(softcap)) && static_cast<float>(softcap) > 0.f),
              "softcap must be a finite number >= 0 (0 disables it), got ", softcap);
  STD_TORCH_CHECK(sliding_window > 0 || sliding_window == -1, "sliding_window must be positive or -1 (disabled), got ",
              sliding_window);
  check_same_device(block_tables, "block_tables", query, "query");
  check_same_device(seq_lens, "seq_lens", query, "query");
  check_same_device(query_start_loc, "query_start_loc", query, "query");
  return num_seqs;
}

AttentionShape check_paged_attention(const Tensor& query, const Tensor& key_cache,
                                     const Tensor& value_cache, const Tensor& block_tables,
                                     const Tensor& seq_lens, const Tensor& query_start_loc,
                                     double scale, int64_t sliding_window, double softcap,
                                     const std::optional<Tensor>& k_scale,
                                     const std::optional<Tensor>& v_scale,
                                     const std::optional<Tensor>& sinks) {
  STD_TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_q_heads, head_dim], got shape ", shape_str(query));
  check_float_dtype(query, "query");
  constexpr const char* kRead = "each cache element holds one value";
  check_cache_view(key_cache, "key_cache", kRead);
  check_cache_view(value_cache, "value_cache", kRead);
  STD_TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "value_cache shape ", shape_str(value_cache),
              " must equal key_cache shape ", shape_str(key_cache));
  STD_TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  (key_cache.scalar_type() == query.scalar_type() || is_fp8(key_cache.scalar_type())),
              "key_cache/value_cache dtype (", key_cache.scalar_type(), "/", value_cache.scalar_type(),
              ") must equal query dtype ", query.scalar_type(), " or both be float8_e4m3fn or float8_e5m2");
  check_kv_scale(k_scale, "k_scale", key_cache, query, "query");
  check_kv_scale(v_scale, "v_scale", value_cache, query, "query");
  STD_TORCH_CHECK(query.size(2) == key_cache.size(3), "query head_dim ", query.size(2),
              " must equal key_cache head_dim ", key_cache.size(3));
  const int64_t num_kv_heads = key_cache.size(2);
  STD_TORCH_CHECK(query.size(1) > 0 && query.size(1) % num_kv_heads == 0, "query num_q_heads ", query.size(1),
              " must be a positive multiple of key_cache num_kv_heads ", num_kv_heads);
  const int64_t num_seqs =
      check_attention_metadata(query, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap);
  check_same_device(key_cache, "key_cache", query, "query");
  check_same_device(value_cache, "value_cache", query, "query");
  check_kv_cache_views(key_cache, value_cache);
  if (sinks.has_value()) {
    STD_TORCH_CHECK(sinks->scalar_type() == ScalarType::Float && sinks->dim() == 1 && sinks->size(0) == query.size(1),
                "sinks must be a float32 tensor of shape [num_q_heads] = [", query.size(1), "], got ",
                sinks->scalar_type(), " of shape ", shape_str(*sinks));
    check_same_device(*sinks, "sinks", query, "query");
  }
  return AttentionShape{query.size(0),     query.size(1),         num_kv_heads,      query.size(2),
                        num_seqs,          block_tables.size(1),  key_cache.size(0), key_cache.size(1)};
}

void check_copy_blocks(const std::vector<Tensor>& key_caches, const std::vector<Tensor>& value_caches,
                       const Tensor& block_mapping) {
  STD_TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
              " layers but value_caches has ", value_caches.size());
  check_block_mapping_shape(block_mapping);
  for (size_t i = 0; i < key_caches.size(); ++i) {
    const std::string key_name = "key_caches[" + std::to_string(i) + "]";
    const std::string value_name = "value_caches[" + std::to_string(i) + "]";
    check_cache(key_caches[i], key_name);
    check_cache(value_caches[i], value_name);
    STD_TORCH_CHECK(key_caches[i].sizes() == value_caches[i].sizes() &&
                    key_caches[i].scalar_type() == value_caches[i].scalar_type(),
                "value_caches[", i, "] must match key_caches[", i, "] in shape and dtype");
    check_same_device(key_caches[i], key_name, key_caches[0], "key_caches[0]");
    check_same_device(value_caches[i], value_name, key_caches[0], "key_caches[0]");
    STD_TORCH_CHECK(key_caches[i].size(0) == key_caches[0].size(0), key_name, " has ", key_caches[i].size(0),
                " blocks but key_caches[0] has ", key_caches[0].size(0), ": all layers must have the same num_blocks");
  }
  if (!key_caches.empty() && !block_mapping.is_cpu()) {
    check_same_device(block_mapping, "block_mapping", key_caches[0], "key_caches[0]");
  }
  // Every cache is written: no two may share memory (contiguous, so sorting by start finds any overlap).
  std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, size_t>> spans;  // (byte range, 2 * layer + is_value)
  for (size_t i = 0; i < 2 * key_caches.size(); ++i) {
    const Tensor& cache = i % 2 == 0 ? key_caches[i / 2] : value_caches[i / 2];
    if (cache.numel() > 0) spans.push_back({memory_span(cache), i});
  }
  std::sort(spans.begin(), spans.end());
  auto name = [](size_t i) { return (i % 2 == 0 ? "key_caches[" : "value_caches[") + std::to_string(i / 2) + "]"; };
  for (size_t i = 1; i < spans.size(); ++i) {
    STD_TORCH_CHECK(spans[i].first != spans[i - 1].first, name(spans[i - 1].second), " and ", name(spans[i].second),
                " are the same tensor (they share memory); every cache is written in place, so each must be a "
                "distinct tensor");
    STD_TORCH_CHECK(spans[i].first.first >= spans[i - 1].first.second, name(spans[i - 1].second), " and ",
                name(spans[i].second), " share memory; every cache is written in place, so they must be distinct");
  }
}

bool swap_within_one_pool(const Tensor& src, const Tensor& dst) {
  return src.numel() > 0 && same_device(src, dst) && src.data_ptr() == dst.data_ptr() && src.sizes() == dst.sizes();
}

void check_swap_blocks(const Tensor& src, const Tensor& dst, const Tensor& block_mapping) {
  STD_TORCH_CHECK(src.dim() >= 1 && src.dim() == dst.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
              "src shape ", shape_str(src), " and dst shape ", shape_str(dst),
              " must agree in every dimension but the first (num_blocks)");
  STD_TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "src dtype ", src.scalar_type(), " must equal dst dtype ",
              dst.scalar_type());
  STD_TORCH_CHECK(src.is_contiguous(), "src must be contiguous");
  STD_TORCH_CHECK(dst.is_contiguous(), "dst must be contiguous");
  check_block_mapping_shape(block_mapping);
  STD_TORCH_CHECK(block_mapping.is_cpu(), "block_mapping must be on the CPU, got ", device_str(block_mapping));
  STD_TORCH_CHECK(src.is_cpu() || src.is_cuda(), "src must be a CPU or CUDA tensor, got ", device_str(src));
  STD_TORCH_CHECK(dst.is_cpu() || dst.is_cuda(), "dst must be a CPU or CUDA tensor, got ", device_str(dst));
  if (src.is_cuda() && dst.is_cuda()) check_same_device(dst, "dst", src, "src");
  // The same tensor on both sides is a swap within one pool (block_mapping must then not chain);
  // any other sharing of memory is rejected.
  STD_TORCH_CHECK(swap_within_one_pool(src, dst) || !may_overlap(src, dst),
              "src and dst share memory but are not the same tensor; dst is written in place, so they must "
              "not overlap");
}

// The host tier: [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (block-major: slot
// s holds the K and V of every layer of one block in one contiguous region), on the CPU, contiguous, the
// caches' dtype; pinned when the caches are on a GPU (the copy kernels read or write it in place).
int64_t check_host_tier_copy(const std::vector<Tensor>& key_caches, const std::vector<Tensor>& value_caches,
                             const Tensor& host_cache, const Tensor& block_mapping, int64_t first_layer) {
  check_copy_blocks(key_caches, value_caches, block_mapping);
  STD_TORCH_CHECK(block_mapping.is_cpu(), "block_mapping must be on the CPU, got ", device_str(block_mapping));
  STD_TORCH_CHECK(host_cache.dim() == 6 && host_cache.size(2) == 2,
              "host_cache must be [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], got shape ",
              shape_str(host_cache));
  STD_TORCH_CHECK(host_cache.is_cpu(), "host_cache must be a CPU tensor, got ", device_str(host_cache));
  STD_TORCH_CHECK(host_cache.is_contiguous(), "host_cache must be contiguous, got strides ", strides_str(host_cache));
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  STD_TORCH_CHECK(first_layer >= 0 && first_layer + num_layers <= host_cache.size(1), "layers [", first_layer, ", ",
              first_layer + num_layers, ") are outside host_cache's ", host_cache.size(1), " layers");
  for (int64_t i = 0; i < num_layers; ++i) {
    const Tensor& k = key_caches[i];
    STD_TORCH_CHECK(k.is_contiguous() && value_caches[i].is_contiguous(), "key_caches[", i, "] and value_caches[", i,
                "] must be contiguous: the host tier moves whole blocks");
    STD_TORCH_CHECK(k.scalar_type() == host_cache.scalar_type(), "host_cache dtype ", host_cache.scalar_type(),
                " must equal the caches' dtype ", k.scalar_type());
    STD_TORCH_CHECK(host_cache.sizes().slice(3) == k.sizes().slice(1), "key_caches[", i, "] blocks are ",
                dims_str(k.sizes().slice(1)), " but host_cache blocks are ", dims_str(host_cache.sizes().slice(3)),
                " (block_size, num_kv_heads, head_dim)");
    if (k.is_cuda()) {
      STD_TORCH_CHECK(in_pinned_memory(host_cache), "host_cache must be in pinned memory when the caches are on ", device_str(k),
                  " (allocate it with pagedkv.allocate_host_tier(..., pin_memory=True))");
    } else {
      const auto host = memory_span(host_cache);
      for (const Tensor* cache : {&k, &value_caches[i]}) {
        const auto span = memory_span(*cache);
        STD_TORCH_CHECK(cache->numel() == 0 || host_cache.numel() == 0 || span.second <= host.first ||
                        host.second <= span.first,
                    "host_cache and the caches of layer ", i, " share memory; one is written, so they must not");
      }
    }
  }
  return num_layers;
}

// Model-layer ops

void check_rms_norm(const Tensor& input, const Tensor& weight, double epsilon) {
  check_float_dtype(input, "input");
  STD_TORCH_CHECK(input.dim() >= 1, "input must have at least one dimension, got a scalar");
  STD_TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1), "weight must be [hidden] = [", input.size(-1),
              "] (input's last dimension), got shape ", shape_str(weight));
  STD_TORCH_CHECK(weight.scalar_type() == input.scalar_type(), "weight dtype ", weight.scalar_type(),
              " must equal input dtype ", input.scalar_type());
  check_same_device(weight, "weight", input, "input");
  STD_TORCH_CHECK(std::isfinite(epsilon) && epsilon >= 0, "epsilon must be finite and >= 0, got ", epsilon);
}

void check_fused_add_rms_norm(const Tensor& input, const Tensor& residual, const Tensor& weight,
                              double epsilon) {
  check_rms_norm(input, weight, epsilon);
  STD_TORCH_CHECK(residual.sizes() == input.sizes(), "residual shape ", shape_str(residual), " must equal input shape ",
              shape_str(input));
  STD_TORCH_CHECK(residual.scalar_type() == input.scalar_type(), "residual dtype ", residual.scalar_type(),
              " must equal input dtype ", input.scalar_type());
  check_same_device(residual, "residual", input, "input");
  STD_TORCH_CHECK(input.is_contiguous() && residual.is_contiguous(),
              "input and residual must be contiguous (both are updated in place)");
  check_no_overlap(input, "input", residual, "residual");
  check_no_overlap(input, "input", weight, "weight");
  check_no_overlap(residual, "residual", weight, "weight");
}

void check_silu_and_mul(const Tensor& input) {
  check_float_dtype(input, "input");
  STD_TORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0,
              "input must be [..., 2 * d] (gate then up), got shape ", shape_str(input));
}

void check_rotary_embedding(const Tensor& positions, const Tensor& x, const Tensor& cos_sin_cache) {
  check_float_dtype(x, "x");
  STD_TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_dim], got shape ", shape_str(x));
  STD_TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even, got ", x.size(2));
  STD_TORCH_CHECK(x.size(2) <= 1 || x.stride(2) == 1, "x must have a contiguous head_dim (it is rotated in place)");
  STD_TORCH_CHECK(positions.scalar_type() == ScalarType::Long, "positions must be int64, got ", positions.scalar_type());
  STD_TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0), "positions must be [num_tokens] = [",
              x.size(0), "], got shape ", shape_str(positions));
  check_float_dtype(cos_sin_cache, "cos_sin_cache");
  STD_TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == x.size(2),
              "cos_sin_cache must be [max_position, head_dim] = [*, ", x.size(2), "], got shape ",
              shape_str(cos_sin_cache));
  check_same_device(positions, "positions", x, "x");
  check_same_device(cos_sin_cache, "cos_sin_cache", x, "x");
  check_no_internal_overlap(x, "x");
  check_no_overlap(x, "x", positions, "positions");
  check_no_overlap(x, "x", cos_sin_cache, "cos_sin_cache");
}

void check_slot_values(const Tensor& slot_mapping, int64_t num_slots) {
  const Tensor slots = contiguous_copy(slot_mapping, ScalarType::Long);
  const int64_t* s = slots.mutable_data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> used;  // (slot, token): tokens are written in parallel
  used.reserve(slots.numel());
  for (int64_t t = 0; t < slots.numel(); ++t) {
    STD_TORCH_CHECK(s[t] < num_slots, "slot_mapping[", t, "] = ", s[t], " is out of range: the cache has ", num_slots,
                " slots (num_blocks * block_size); use a negative slot for padding");
    if (s[t] >= 0) used.emplace_back(s[t], t);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    STD_TORCH_CHECK(used[i].first != used[i - 1].first, "slot_mapping[", used[i - 1].second, "] and slot_mapping[",
                used[i].second, "] are both slot ", used[i].first, ": each slot takes one token per call");
  }
}

void check_attention_metadata_values(const AttentionShape& shape, const Tensor& block_tables,
                                     const Tensor& seq_lens, const Tensor& query_start_loc,
                                     int64_t sliding_window) {
  const Tensor tables = as_contiguous(block_tables);
  const int32_t* bt = tables.mutable_data_ptr<int32_t>();
  const Tensor lens = as_contiguous(seq_lens);
  const int32_t* sl = lens.mutable_data_ptr<int32_t>();
  const Tensor qsl_t = as_contiguous(query_start_loc);
  const int32_t* qsl = qsl_t.mutable_data_ptr<int32_t>();
  STD_TORCH_CHECK(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  STD_TORCH_CHECK(qsl[shape.num_seqs] == shape.num_tokens, "query_start_loc[-1] = ", qsl[shape.num_seqs],
              " must equal the number of query tokens ", shape.num_tokens);
  for (int64_t b = 0; b < shape.num_seqs; ++b) {
    const int64_t q_len = int64_t(qsl[b + 1]) - qsl[b];
    STD_TORCH_CHECK(q_len >= 0, "query_start_loc must be non-decreasing, but query_start_loc[", b + 1,
                "] < query_start_loc[", b, "]");
    STD_TORCH_CHECK(sl[b] >= q_len, "seq_lens[", b, "] = ", sl[b], " is smaller than the sequence's ", q_len,
                " query tokens (seq_lens counts this step's tokens too)");
    STD_TORCH_CHECK(sl[b] <= shape.max_blocks * shape.block_size, "seq_lens[", b, "] = ", sl[b],
                " needs more blocks than block_tables has columns (", shape.max_blocks, ")");
    if (q_len == 0 || sl[b] == 0) continue;
    // Only the blocks that some query of this sequence can see must be valid.
    const int64_t first_key = visible_keys(query_position(sl[b], q_len, 0), sliding_window).begin;
    for (int64_t i = first_key / shape.block_size; i < ceil_div(sl[b], shape.block_size); ++i) {
      const int32_t block = bt[b * shape.max_blocks + i];
      STD_TORCH_CHECK(block >= 0 && block < shape.num_blocks, "block_tables[", b, ", ", i, "] = ", block,
                  " is out of range [0, ", shape.num_blocks, ")");
    }
  }
}

void check_block_mapping_values(const Tensor& block_mapping, int64_t num_src_blocks, int64_t num_dst_blocks,
                                bool same_pool) {
  const Tensor mapping = as_contiguous(block_mapping);
  const int64_t* m = mapping.mutable_data_ptr<int64_t>();
  const int64_t n = mapping.size(0);
  std::vector<std::pair<int64_t, int64_t>> dsts(n);  // (destination, pair index), sorted
  for (int64_t i = 0; i < n; ++i) {
    STD_TORCH_CHECK(m[2 * i] >= 0 && m[2 * i] < num_src_blocks, "block_mapping[", i, ", 0] = ", m[2 * i],
                " is out of range [0, ", num_src_blocks, ")");
    STD_TORCH_CHECK(m[2 * i + 1] >= 0 && m[2 * i + 1] < num_dst_blocks, "block_mapping[", i, ", 1] = ", m[2 * i + 1],
                " is out of range [0, ", num_dst_blocks, ")");
    dsts[i] = {m[2 * i + 1], i};
  }
  // Pairs run in parallel, so their order must not matter: one writer per block, no write to a block
  // another pair reads.
  std::sort(dsts.begin(), dsts.end());
  for (int64_t i = 1; i < n; ++i) {
    STD_TORCH_CHECK(dsts[i].first != dsts[i - 1].first, "block_mapping[", dsts[i - 1].second, ", 1] and block_mapping[",
                dsts[i].second, ", 1] are both block ", dsts[i].first, ": destinations must be distinct");
  }
  if (!same_pool) return;
  for (int64_t j = 0; j < n; ++j) {
    const auto it = std::lower_bound(dsts.begin(), dsts.end(), std::pair<int64_t, int64_t>{m[2 * j], 0});
    STD_TORCH_CHECK(it == dsts.end() || it->first != m[2 * j] || it->second == j, "block_mapping[", j, ", 0] = ",
                m[2 * j], " is also the destination of block_mapping[", it == dsts.end() ? 0 : it->second,
                "]: a block copied in one call must not also be written by it (no chains)");
  }
}

Tensor cpu_sinks(const std::optional<Tensor>& sinks) {
  if (!sinks.has_value()) return Tensor();
  const Tensor copy = contiguous_copy(*sinks);
  const float* v = copy.mutable_data_ptr<float>();
  for (int64_t h = 0; h < copy.numel(); ++h)
    STD_TORCH_CHECK(std::isfinite(v[h]), "sinks must be finite, got ", v[h], " for head ", h);
  return copy;
}

}  // namespace pagedkv
