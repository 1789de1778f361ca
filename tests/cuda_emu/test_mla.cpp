// The CUDA MLA kernels (csrc/ops/cuda/mla.cuh) on the CPU emulator: concat_and_cache_mla (every dtype, int32
// and int64 slots, padding, strided inputs, float8 with a scale, out-of-range slots skipped and reported) and
// paged_attention_mla against a float64 reference over the stored rows: decode and prefill over a cached
// prefix in one batch, DeepSeek's 512 + 64 latent and a small one, block sizes 1 and 16, float8 caches with
// a scale, both schedules. Every cache row nobody may read holds NaN; block table entries past a sequence's
// length are out of range; metadata pointing outside the cache is skipped and reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "kernel_test_util.h"
#include "ops/cuda/mla.cuh"

namespace {

using namespace emu_test;
namespace mla = pagedkv::mla_cuda;

const double kNaN = std::numeric_limits<double>::quiet_NaN();

template <typename C>
double stored_value(C x) {
  return to_double(x);
}

// ---------------------------------------------------------------------------------------------------
// concat_and_cache_mla

template <typename T, typename slot_t>
void concat_case(int rank, int rope, int bs) {
  std::mt19937_64 rng = make_rng();
  const int T_ = 7, W = rank + rope, num_blocks = 4;
  // kv_c and k_pe are slices of one fused row per token: [T, rank + rope + 3], k_pe strided by 1
  const int fused_w = W + 3;
  const std::vector<T> fused = random_vector<T>(rng, size_t(T_) * fused_w);
  std::vector<slot_t> slots(T_);
  std::vector<int64_t> all(num_blocks * bs);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  for (int t = 0; t < T_; ++t) slots[t] = slot_t(t == 2 || t >= int(all.size()) ? -1 : all[t]);  // 2: padding
  std::vector<T> cache(size_t(num_blocks) * bs * W, from_double<T>(kNaN));
  for (const auto schedule : schedules()) {
    const ScheduleScope scope(schedule);
    std::fill(cache.begin(), cache.end(), from_double<T>(kNaN));
    using bits_t = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
    mla::LatentInputStrides in{fused_w, 1, fused_w, 1};
    cuda_emu::launch(dim3(T_), dim3(mla::kWriteThreads), 0,
                     mla::concat_and_cache_mla_kernel<bits_t, bits_t, mla::CopyBits, slot_t>,
                     reinterpret_cast<const bits_t*>(fused.data()), reinterpret_cast<const bits_t*>(fused.data() + rank),
                     reinterpret_cast<bits_t*>(cache.data()), slots.data(), in,
                     pagedkv::contiguous_cache_strides(bs, 1, W), rank, rope, int64_t(bs), int64_t(num_blocks) * bs,
                     mla::CopyBits{}, static_cast<pagedkv::IndexError*>(nullptr));
    std::vector<bool> written(num_blocks * bs, false);
    for (int t = 0; t < T_; ++t) {
      if (slots[t] < 0) continue;
      written[slots[t]] = true;
      for (int d = 0; d < W; ++d) {
        ASSERT_EQ(to_double(cache[size_t(slots[t]) * W + d]), to_double(fused[size_t(t) * fused_w + d]))
            << dtype_name<T>() << " token " << t << " d " << d << " " << schedule_name(schedule);
      }
    }
    for (int s = 0; s < num_blocks * bs; ++s) {
      if (!written[s]) ASSERT_TRUE(std::isnan(to_double(cache[size_t(s) * W]))) << "slot " << s << " was written";
    }
  }
}

TEST(CudaConcatAndCacheMla, Float32Int64Slots) { concat_case<float, int64_t>(512, 64, 16); }
TEST(CudaConcatAndCacheMla, HalfInt32Slots) { concat_case<c10::Half, int32_t>(32, 16, 1); }
TEST(CudaConcatAndCacheMla, BFloat16Int64Slots) { concat_case<c10::BFloat16, int64_t>(32, 16, 4); }

TEST(CudaConcatAndCacheMla, Float8WithScaleAndOutOfRangeSlot) {
  std::mt19937_64 rng = make_rng();
  const int rank = 32, rope = 16, W = rank + rope, bs = 4, num_blocks = 2, T_ = 3;
  const std::vector<c10::BFloat16> kv_c = random_vector<c10::BFloat16>(rng, size_t(T_) * rank, -50, 50);
  const std::vector<c10::BFloat16> k_pe = random_vector<c10::BFloat16>(rng, size_t(T_) * rope, -50, 50);
  const std::vector<int64_t> slots = {5, 8, 1};  // 8 is past the cache's 8 slots
  std::vector<uint8_t> cache(size_t(num_blocks) * bs * W, 0x7f);
  const float scale = 0.125f;
  using Store = mla::Fp8Store<pagedkv::KvFormat::kE4M3>;
  pagedkv::IndexError error{};
  cuda_emu::launch(dim3(T_), dim3(mla::kWriteThreads), 0,
                   mla::concat_and_cache_mla_kernel<c10::BFloat16, uint8_t, Store, int64_t>, kv_c.data(), k_pe.data(),
                   cache.data(), slots.data(), mla::LatentInputStrides{rank, 1, rope, 1},
                   pagedkv::contiguous_cache_strides(bs, 1, W), rank, rope, int64_t(bs), int64_t(num_blocks) * bs,
                   Store{pagedkv::KvScale{&scale, 0}}, &error);
  EXPECT_EQ(error.claimed, 1u);
  EXPECT_EQ(error.value, 8);
  EXPECT_EQ(error.where, 1);
  for (int t : {0, 2}) {
    for (int d = 0; d < W; ++d) {
      const float x = static_cast<float>(d < rank ? kv_c[t * rank + d] : k_pe[t * rope + d - rank]);
      EXPECT_EQ(cache[size_t(slots[t]) * W + d], pagedkv::fp8_saturating_encode<pagedkv::KvFormat::kE4M3>(x / scale));
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// paged_attention_mla

template <typename T, typename C = T>
void attention_case(int rank, int rope, int bs, int H, std::vector<int> prefixes, std::vector<int> q_lens,
                    float kv_scale = 1.f) {
  std::mt19937_64 rng = make_rng();
  const int W = rank + rope, B = int(q_lens.size());
  std::vector<int32_t> seq_lens, qsl{0};
  int needed = 0;
  for (int b = 0; b < B; ++b) {
    seq_lens.push_back(prefixes[b] + q_lens[b]);
    qsl.push_back(qsl.back() + q_lens[b]);
    needed += int(pagedkv::ceil_div(seq_lens[b], bs));
  }
  const int T_ = qsl.back(), num_blocks = needed + 2;
  int max_blocks = 0;
  for (int b = 0; b < B; ++b) max_blocks = std::max(max_blocks, int(pagedkv::ceil_div(seq_lens[b], bs)) + 1);
  std::vector<int32_t> perm(num_blocks), tables(size_t(B) * max_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<C> cache(size_t(num_blocks) * bs * W, from_double<C>(kNaN));
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  int next = 0;
  for (int b = 0; b < B; ++b) {
    const int used = int(pagedkv::ceil_div(seq_lens[b], bs));
    for (int i = 0; i < max_blocks; ++i) tables[size_t(b) * max_blocks + i] = i < used ? perm[next++] : num_blocks + 7;
    for (int p = 0; p < seq_lens[b]; ++p) {
      const size_t row = (size_t(tables[size_t(b) * max_blocks + p / bs]) * bs + p % bs) * W;
      for (int d = 0; d < W; ++d) cache[row + d] = from_double<C>(unit(rng) / kv_scale);
    }
  }
  const std::vector<T> query = random_vector<T>(rng, size_t(T_) * H * W);
  const float scale = float(1.0 / std::sqrt(double(W)));

  // float64 reference over the stored rows times the scale
  std::vector<double> ref(size_t(T_) * H * rank), ref_lse(size_t(T_) * H);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < q_lens[b]; ++j) {
      const int t = qsl[b] + j, pos = seq_lens[b] - q_lens[b] + j;
      for (int h = 0; h < H; ++h) {
        std::vector<double> logits(pos + 1);
        double m = -INFINITY;
        for (int k = 0; k <= pos; ++k) {
          const size_t row = (size_t(tables[size_t(b) * max_blocks + k / bs]) * bs + k % bs) * W;
          double dot = 0;
          for (int d = 0; d < W; ++d) dot += to_double(query[(size_t(t) * H + h) * W + d]) * stored_value(cache[row + d]) * kv_scale;
          logits[k] = dot * scale;
          m = std::max(m, logits[k]);
        }
        double l = 0;
        std::vector<double> acc(rank, 0.0);
        for (int k = 0; k <= pos; ++k) {
          const double w = std::exp(logits[k] - m);
          l += w;
          const size_t row = (size_t(tables[size_t(b) * max_blocks + k / bs]) * bs + k % bs) * W;
          for (int d = 0; d < rank; ++d) acc[d] += w * stored_value(cache[row + d]) * kv_scale;
        }
        for (int d = 0; d < rank; ++d) ref[(size_t(t) * H + h) * rank + d] = acc[d] / l;
        ref_lse[size_t(t) * H + h] = m + std::log(l);
      }
    }
  }

  for (const auto schedule : schedules()) {
    const ScheduleScope scope(schedule);
    std::vector<T> out(size_t(T_) * H * rank, from_double<T>(kNaN));
    std::vector<float> lse(size_t(T_) * H, NAN);
    mla::MlaParams p{};
    p.query = query.data();
    p.q_stride_token = int64_t(H) * W, p.q_stride_head = W, p.q_stride_dim = 1;
    p.key_cache = p.value_cache = cache.data();
    p.cache_strides = pagedkv::contiguous_cache_strides(bs, 1, W);
    p.block_tables = tables.data(), p.seq_lens = seq_lens.data(), p.query_start_loc = qsl.data();
    p.out = out.data(), p.lse = lse.data();
    p.num_seqs = B, p.num_tokens = T_, p.num_q_heads = H, p.num_kv_heads = 1, p.head_dim = W, p.block_size = bs;
    p.max_blocks = max_blocks, p.num_blocks = num_blocks, p.sliding_window = -1, p.scale = scale;
    const float scale_value = kv_scale;
    if (kv_scale != 1.f) p.k_scale = pagedkv::KvScale{&scale_value, 0};
    p.kv_lora_rank = rank;
    pagedkv::IndexError error{};
    p.index_error = &error;
    cuda_emu::launch(dim3(T_, H), dim3(mla::kThreads), mla::mla_smem_bytes(W, rank),
                     mla::paged_attention_mla_kernel<T, C>, p);
    EXPECT_EQ(error.claimed, 0u);
    const double tol = 4 * eps_of<T>() + 1e-5;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(to_double(out[i]), ref[i], tol * (1 + std::abs(ref[i])))
          << dtype_name<T>() << "/" << dtype_name<C>() << " element " << i << " " << schedule_name(schedule);
    }
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-4 * (1 + std::abs(ref_lse[i])));
  }
}

TEST(CudaPagedAttentionMla, DeepSeekShapeDecodeAndPrefill) {
  attention_case<float>(512, 64, 16, 2, {37, 0}, {1, 5});
}
TEST(CudaPagedAttentionMla, SmallLatentBlockSizeOne) { attention_case<float>(32, 16, 1, 3, {5, 0, 40}, {1, 3, 2}); }
TEST(CudaPagedAttentionMla, Half) { attention_case<c10::Half>(32, 16, 16, 4, {20}, {2}); }
TEST(CudaPagedAttentionMla, BFloat16) { attention_case<c10::BFloat16>(64, 32, 16, 2, {70, 1}, {1, 1}); }
TEST(CudaPagedAttentionMla, Float8E4M3WithScale) {
  attention_case<c10::BFloat16, c10::Float8_e4m3fn>(32, 16, 16, 2, {33}, {3}, 0.05f);
}
TEST(CudaPagedAttentionMla, Float8E5M2) { attention_case<float, c10::Float8_e5m2>(32, 16, 4, 1, {9, 2}, {1, 4}); }

// A block table entry outside the cache: the row takes part in nothing, and the index check names it.
TEST(CudaPagedAttentionMla, OutOfRangeBlockSkippedAndReported) {
  const int rank = 8, rope = 8, W = 16, bs = 4, num_blocks = 2;
  std::vector<float> cache(size_t(num_blocks) * bs * W, 1.f);
  const std::vector<float> query(W, 1.f);
  const std::vector<int32_t> tables = {1, 9}, seq_lens = {6}, qsl = {0, 1};
  std::vector<float> out(rank, NAN), lse(1, NAN);
  mla::MlaParams p{};
  p.query = query.data(), p.q_stride_token = W, p.q_stride_head = W, p.q_stride_dim = 1;
  p.key_cache = p.value_cache = cache.data();
  p.cache_strides = pagedkv::contiguous_cache_strides(bs, 1, W);
  p.block_tables = tables.data(), p.seq_lens = seq_lens.data(), p.query_start_loc = qsl.data();
  p.out = out.data(), p.lse = lse.data();
  p.num_seqs = 1, p.num_tokens = 1, p.num_q_heads = 1, p.num_kv_heads = 1, p.head_dim = W, p.block_size = bs;
  p.max_blocks = 2, p.num_blocks = num_blocks, p.sliding_window = -1, p.scale = 1.f, p.kv_lora_rank = rank;
  pagedkv::IndexError error{};
  p.index_error = &error;
  cuda_emu::launch(dim3(1, 1), dim3(mla::kThreads), mla::mla_smem_bytes(W, rank),
                   mla::paged_attention_mla_kernel<float, float>, p);
  EXPECT_EQ(error.claimed, 1u);
  EXPECT_EQ(error.value, 9);
  for (float o : out) EXPECT_FLOAT_EQ(o, 1.f);           // the 4 rows of block 1 only
  EXPECT_NEAR(lse[0], 16.f + std::log(4.f), 1e-4);      // logits q . row = 16
}

}  // namespace
