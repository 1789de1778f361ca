// The CUDA paged attention kernels (csrc/ops/cuda/attention.cuh) run on the CPU emulator against a
// float64 reference: every dtype, the 16-byte and the scalar staging paths, both schedules; decode,
// prefill over a cached prefix, GQA up to 32, more than 32 sequences, split-K, sliding window,
// softcap, head sizes up to 256, strided queries; K/V cache views of one buffer (vLLM's interleaved
// cells, FlashInfer's NHD and HND pages) on both staging paths; float8 caches (e4m3fn, e5m2) under every query dtype
// with no, per-tensor and per-head scales, against the reference of the stored bytes times the scale. Cache entries that must never be read (unused
// blocks, the tail of a sequence's last block) hold NaN; masked keys hold inf/NaN and must contribute
// nothing; metadata pointing outside the cache is skipped and reported under the index check.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <set>

#include "kernel_test_util.h"
#include "ops/cuda/attention.cuh"

namespace {

using namespace emu_test;
namespace attn = pagedkv::attention_cuda;

// A 64-byte aligned array (so the 16-byte path's alignment does not depend on the allocator).
template <typename T>
struct Buffer {
  std::unique_ptr<T[], void (*)(T*)> data{nullptr, [](T* p) { ::operator delete(p, std::align_val_t(64)); }};
  size_t size = 0;
  explicit Buffer(size_t n = 0) : size(n) {
    data.reset(static_cast<T*>(::operator new(std::max<size_t>(n, 1) * sizeof(T), std::align_val_t(64))));
  }
  T& operator[](size_t i) { return data[i]; }
  T* get() { return data.get(); }
};

struct AttnCase {
  const char* name;
  int num_q_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> q_lens;
  int min_prefix, max_prefix;  // cached keys before each sequence's queries: random in [min, max]
  int64_t sliding_window = -1;
  float softcap = 0.f;
  double query_range = 1.0;  // queries uniform in [-query_range, query_range]
  bool strided_query = false;
  int multiprocessors = 4;  // many: small grids are split over keys (split-K)
  bool sinks = false;       // attention sinks (gpt-oss): one more logit per head, carrying no value
};

// Float8 caches: how the scales are given.
enum class Scales { kNone, kTensor, kHead };

// Where K and V live: two contiguous caches, or views of one buffer with equal strides: vLLM's
// [blocks, bs, Hkv, 2D] cells (K | V), FlashInfer's [pages, 2, page, Hkv, D] and [pages, 2, Hkv, page, D].
enum class Layout { kContiguous, kCells, kPagesNhd, kPagesHnd };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kCells: return "cells";
    case Layout::kPagesNhd: return "pages_nhd";
    default: return "pages_hnd";
  }
}

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// T: query and output type; C: the caches' (T, or a float8 type written as fp8(x / scale)).
template <typename T, typename C = T>
struct AttnRun {
  const AttnCase& c;
  int B, T_total, Hq, Hkv, D, bs, num_blocks, max_blocks, q_token_stride;
  std::vector<int32_t> q_lens, seq_lens, query_start_loc, block_tables;
  Buffer<T> query;
  Layout layout;
  Buffer<C> kv;  // both caches: K's view at k_offset, V's at v_offset, each with strides cs
  size_t k_offset = 0, v_offset = 0;
  pagedkv::CacheStrides cs{};
  std::vector<std::pair<int, int64_t>> planted;  // (seq, pos) holding inf K / NaN V, masked for most rows
  float scale;
  Scales scales;
  std::vector<float> k_scale, v_scale;  // one per KV head (all equal for kTensor; 1 for kNone)
  std::vector<float> sinks;             // one per query head (c.sinks)

  AttnRun(const AttnCase& ac, std::mt19937_64& rng, Scales sc = Scales::kNone, Layout lay = Layout::kContiguous)
      : c(ac), scales(sc), layout(lay) {
    B = int(c.q_lens.size());
    Hq = c.num_q_heads, Hkv = c.num_kv_heads, D = c.head_dim, bs = c.block_size;
    q_lens = std::vector<int32_t>(c.q_lens.begin(), c.q_lens.end());
    query_start_loc.push_back(0);
    int needed = 0;
    for (int b = 0; b < B; ++b) {
      const int prefix = c.min_prefix + int(rng() % uint64_t(c.max_prefix - c.min_prefix + 1));
      seq_lens.push_back(q_lens[b] + prefix);
      query_start_loc.push_back(query_start_loc.back() + q_lens[b]);
      needed += int(pagedkv::ceil_div(seq_lens[b], bs));
    }
    T_total = query_start_loc.back();
    num_blocks = needed + 3;
    max_blocks = 2;
    for (int b = 0; b < B; ++b) max_blocks = std::max(max_blocks, int(pagedkv::ceil_div(seq_lens[b], bs)) + 1);
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    block_tables.assign(size_t(B) * max_blocks, 0);
    int next = 0;
    for (int b = 0; b < B; ++b) {
      const int used = int(pagedkv::ceil_div(seq_lens[b], bs));
      for (int i = 0; i < max_blocks; ++i) {  // unused entries point anywhere: they must not be read
        block_tables[size_t(b) * max_blocks + i] = i < used ? perm[next++] : int32_t(num_blocks + rng() % 100) * (i % 2 ? -1 : 1);
      }
    }
    // Scales in [0.01, 4) (kTensor: one for all heads); keys and values uniform in [-1, 1] stored as
    // x / scale; every row nobody may read is NaN.
    std::uniform_real_distribution<double> log_scale(std::log(0.01), std::log(4.0));
    const float k_all = float(std::exp(log_scale(rng))), v_all = float(std::exp(log_scale(rng)));
    for (int h = 0; h < Hkv; ++h) {
      k_scale.push_back(scales == Scales::kNone ? 1.f : scales == Scales::kTensor ? k_all : float(std::exp(log_scale(rng))));
      v_scale.push_back(scales == Scales::kNone ? 1.f : scales == Scales::kTensor ? v_all : float(std::exp(log_scale(rng))));
    }
    // Sinks around log(keys): about as heavy as the keys' mass, so they move the answer.
    std::normal_distribution<double> sink_dist(std::log(double(c.max_prefix) + 8.0), 2.0);
    for (int h = 0; c.sinks && h < Hq; ++h) sinks.push_back(float(sink_dist(rng)));
    const size_t cache_elems = size_t(num_blocks) * bs * Hkv * D;
    const int64_t page = int64_t(bs) * Hkv * D;
    switch (layout) {
      case Layout::kContiguous: cs = pagedkv::contiguous_cache_strides(bs, Hkv, D), v_offset = cache_elems; break;
      case Layout::kCells: cs = {2 * page, 2 * int64_t(Hkv) * D, 2 * int64_t(D)}, v_offset = D; break;
      case Layout::kPagesNhd: cs = {2 * page, int64_t(Hkv) * D, D}, v_offset = page; break;
      case Layout::kPagesHnd: cs = {2 * page, D, int64_t(bs) * D}, v_offset = page; break;
    }
    kv = Buffer<C>(2 * cache_elems);
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    for (size_t i = 0; i < kv.size; ++i) kv[i] = from_double<C>(kNaN);
    for (int b = 0; b < B; ++b) {
      for (int64_t pos = 0; pos < seq_lens[b]; ++pos) {
        for (int h = 0; h < Hkv; ++h) {
          for (int d = 0; d < D; ++d) {
            const size_t at = cache_at(b, pos, h, d);
            kv[k_offset + at] = from_double<C>(unit(rng) / k_scale[h]);
            kv[v_offset + at] = from_double<C>(unit(rng) / v_scale[h]);
          }
        }
      }
      // Masked keys with non-finite K and V: the last key of a prefill (masked for all but its last
      // query) and, with a sliding window, the first key (outside the window of late queries).
      if (q_lens[b] >= 2) planted.push_back({b, seq_lens[b] - 1});
      if (c.sliding_window > 0 && seq_lens[b] > c.sliding_window + 1) planted.push_back({b, 0});
    }
    for (const auto& [b, pos] : planted) {
      for (int h = 0; h < Hkv; ++h) {
        for (int d = 0; d < D; ++d) {
          const size_t at = cache_at(b, pos, h, d);
          kv[k_offset + at] = from_double<C>(d % 2 ? kInf : -kInf);
          kv[v_offset + at] = from_double<C>(d % 3 ? kNaN : kInf);
        }
      }
    }
    q_token_stride = (c.strided_query ? Hq + 2 * Hkv : Hq) * D;
    query = Buffer<T>(size_t(T_total) * q_token_stride);
    for (size_t i = 0; i < query.size; ++i) {
      query[i] = from_double<T>(std::uniform_real_distribution<double>(-c.query_range, c.query_range)(rng));
    }
    scale = float(1.0 / std::sqrt(double(D)));
  }

  // Element (pos, kv head, d) of sequence b in a cache view (from its first element).
  size_t cache_at(int b, int64_t pos, int h, int d) const {
    const int64_t block = block_tables[size_t(b) * max_blocks + pos / bs];
    return size_t(block * cs.block + pos % bs * cs.token + h * cs.head + d);
  }

  // Runs the kernels as attention.cu launches them; returns out [T, Hq, D] and lse [T, Hq].
  void run(bool scalar_path, int64_t max_seq_len, pagedkv::IndexError* index_error, std::vector<double>* out,
           std::vector<float>* lse) {
    attn::KernelParams p{};
    p.query = query.get();
    p.q_stride_token = q_token_stride;
    p.q_stride_head = D;
    p.q_stride_dim = 1;
    // The scalar path: a copy of the caches one element off 16-byte alignment.
    Buffer<C> shifted(kv.size + 1);
    std::copy(kv.get(), kv.get() + kv.size, shifted.get() + 1);
    const C* base = scalar_path ? shifted.get() + 1 : kv.get();
    p.key_cache = base + k_offset;
    p.value_cache = base + v_offset;
    p.cache_strides = cs;
    p.block_tables = block_tables.data();
    p.seq_lens = seq_lens.data();
    p.query_start_loc = query_start_loc.data();
    Buffer<T> out_buf(size_t(T_total) * Hq * D);
    lse->assign(size_t(T_total) * Hq, std::nanf(""));
    p.out = out_buf.get();
    p.lse = lse->data();
    p.index_error = index_error;
    p.num_seqs = B, p.num_tokens = T_total, p.num_q_heads = Hq, p.num_kv_heads = Hkv, p.head_dim = D;
    p.block_size = bs, p.max_blocks = max_blocks, p.num_blocks = num_blocks;
    p.sliding_window = c.sliding_window;
    p.scale = scale;
    p.softcap = c.softcap;
    p.sinks = c.sinks ? sinks.data() : nullptr;
    if (scales != Scales::kNone) {
      p.k_scale = pagedkv::KvScale{k_scale.data(), scales == Scales::kHead ? 1 : 0};
      p.v_scale = pagedkv::KvScale{v_scale.data(), scales == Scales::kHead ? 1 : 0};
    }
    const bool aligned = pagedkv::cache_rows_16b_aligned(p.key_cache, sizeof(C), cs) &&
                         pagedkv::cache_rows_16b_aligned(p.value_cache, sizeof(C), cs);
    const attn::AttentionLaunch launch = attn::plan_paged_attention(p, sizeof(C), aligned, max_seq_len, c.multiprocessors);
    ASSERT_TRUE(launch.smem_fits);
    ASSERT_EQ(launch.vec16, !scalar_path && (D * sizeof(C)) % 16 == 0);
    std::vector<float> partial_out, partial_lse;
    if (launch.grid_z > 1) {
      partial_out.assign(size_t(launch.grid_z) * T_total * Hq * D, std::nanf(""));
      partial_lse.assign(size_t(launch.grid_z) * T_total * Hq, std::nanf(""));
      p.partial_out = partial_out.data();
      p.partial_lse = partial_lse.data();
    }
    const auto kernel =
        launch.vec16 ? attn::paged_attention_kernel<T, C, true> : attn::paged_attention_kernel<T, C, false>;
    cuda_emu::launch(dim3(launch.grid_x, launch.grid_y, launch.grid_z), dim3(attn::kThreads), launch.smem, kernel, p);
    if (launch.grid_z > 1) {
      const int64_t rows = int64_t(T_total) * Hq;
      cuda_emu::launch(dim3(unsigned(rows)), dim3(attn::kThreads), 0, attn::merge_partitions_kernel<T>,
                       p.partial_out, p.partial_lse, out_buf.get(), p.lse, p.sinks, int(launch.grid_z), rows, Hq, D);
    }
    out->resize(out_buf.size);
    for (size_t i = 0; i < out_buf.size; ++i) (*out)[i] = to_double(out_buf[i]);
    splits = launch.grid_z;
  }
  unsigned splits = 1;

  // What the kernel must read: the stored element times its head's scale.
  double kv_value(size_t view_offset, const std::vector<float>& sc, int b, int64_t pos, int h, int d) const {
    return to_double(kv.data[view_offset + cache_at(b, pos, h, d)]) * double(sc[h]);
  }

  // float64 reference of row (token of sequence b, query j, head h); false when the row sees a
  // planted non-finite key (no reference then).
  bool reference(int b, int j, int h, std::vector<double>* out, double* lse) const {
    const int64_t pos = int64_t(seq_lens[b]) - q_lens[b] + j;
    const pagedkv::KeyRange vis = pagedkv::visible_keys(pos, c.sliding_window);
    for (const auto& [pb, ppos] : planted) {
      if (pb == b && ppos >= vis.begin && ppos < vis.end) return false;
    }
    const int kv_head = h / (Hq / Hkv);
    const size_t q_off = size_t(query_start_loc[b] + j) * q_token_stride + size_t(h) * D;
    const auto score = [&](int64_t k) {
      double s = 0;
      for (int d = 0; d < D; ++d) s += to_double(query.data[q_off + d]) * kv_value(k_offset, k_scale, b, k, kv_head, d);
      return s;
    };
    const auto value = [&](int64_t k, int d) { return kv_value(v_offset, v_scale, b, k, kv_head, d); };
    *lse = reference_attention_row(vis.begin, vis.end, D, double(scale), c.softcap, c.sinks ? &sinks[h] : nullptr,
                                   score, value, out);
    return true;
  }

  // Compares every row of sequences not in `skip` with the reference; returns rows compared.
  int check(const std::vector<double>& out, const std::vector<float>& lse, const std::set<int>& skip = {}) const {
    const double tol = 4 * eps_of<T>() + 3e-5;
    int compared = 0;
    std::vector<double> ref;
    for (int b = 0; b < B; ++b) {
      if (skip.count(b)) continue;
      for (int j = 0; j < q_lens[b]; ++j) {
        for (int h = 0; h < Hq; ++h) {
          double ref_lse;
          const size_t row = size_t(query_start_loc[b] + j) * Hq + h;
          if (!reference(b, j, h, &ref, &ref_lse)) continue;
          ++compared;
          for (int d = 0; d < D; ++d) {
            const double got = out[row * D + d];
            if (!(std::abs(got - ref[d]) <= tol)) {
              ADD_FAILURE() << "seq " << b << " query " << j << " head " << h << " dim " << d << ": got " << got
                            << ", float64 reference " << ref[d];
              return compared;
            }
          }
          if (!(std::abs(lse[row] - ref_lse) <= 1e-4 * std::max(1.0, std::abs(ref_lse)))) {
            ADD_FAILURE() << "seq " << b << " query " << j << " head " << h << ": lse " << lse[row]
                          << ", float64 reference " << ref_lse;
            return compared;
          }
        }
      }
    }
    return compared;
  }
};

template <typename T, typename C = T>
void run_all_variants(const AttnCase& c, bool expect_split, Scales scales = Scales::kNone,
                      Layout layout = Layout::kContiguous) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    for (const bool scalar_path : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name<T>()) + " query, " + dtype_name<C>() + " cache (" + layout_name(layout) +
                   "), scales " + std::to_string(int(scales)) + (scalar_path ? ", scalar" : ", 16-byte") + " path, " +
                   schedule_name(schedule) + " schedule");
      const ScheduleScope scope(schedule);
      std::mt19937_64 rng = make_rng();
      AttnRun<T, C> run(c, rng, scales, layout);
      pagedkv::IndexError error{};
      std::vector<double> out;
      std::vector<float> lse;
      run.run(scalar_path, -1, &error, &out, &lse);
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_EQ(error.claimed, 0u) << "index check fired on valid metadata: value " << error.value;
      EXPECT_EQ(run.splits > 1, expect_split) << "partitions: " << run.splits;
      const int compared = run.check(out, lse);
      EXPECT_GT(compared, 0);
      for (double o : out) ASSERT_TRUE(std::isfinite(o) || !run.planted.empty());
    }
  }
}

void run_case(const AttnCase& c, bool expect_split = false, Layout layout = Layout::kContiguous) {
  run_all_variants<float>(c, expect_split, Scales::kNone, layout);
  run_all_variants<c10::Half>(c, expect_split, Scales::kNone, layout);
  run_all_variants<c10::BFloat16>(c, expect_split, Scales::kNone, layout);
}

TEST(CudaAttention, DecodeGqa) { run_case({"decode", 8, 2, 64, 16, {1, 1, 1}, 0, 90}); }

TEST(CudaAttention, PrefillOverCachedPrefix) { run_case({"prefill", 4, 4, 32, 8, {5, 17, 1}, 0, 30}); }

TEST(CudaAttention, Gqa32HeadChunks) { run_case({"gqa32", 32, 1, 64, 16, {1, 3}, 1, 40}); }

TEST(CudaAttention, ManySequencesAndEmptyQueries) {
  std::vector<int> q_lens(40, 1);
  q_lens[3] = 0;  // a sequence with no query this step
  q_lens[37] = 2;
  run_case({"many", 2, 1, 16, 4, q_lens, 0, 12});
}

TEST(CudaAttention, SplitKDecode) { run_case({"splitk", 4, 1, 128, 16, {1}, 700, 900, -1, 0.f, 1.0, false, 132}, true); }

TEST(CudaAttention, SlidingWindowPrefill) { run_case({"window", 4, 2, 32, 8, {20, 1}, 10, 30, 7}); }

TEST(CudaAttention, SlidingWindowSplitK) {
  run_case({"window_splitk", 2, 1, 64, 16, {1, 4}, 600, 700, 300, 0.f, 1.0, false, 132}, true);
}

TEST(CudaAttention, Softcap) { run_case({"softcap", 4, 2, 64, 16, {6, 1}, 0, 40, -1, 20.f, 12.0}); }

TEST(CudaAttention, Sinks) { run_case({"sinks", 4, 2, 64, 16, {1, 6, 1}, 0, 60, -1, 0.f, 1.0, false, 4, true}); }

TEST(CudaAttention, SinksWindowSoftcapSplitK) {
  run_case({"sinks_splitk", 4, 1, 64, 16, {1, 3}, 600, 700, 200, 8.f, 4.0, false, 132, true}, true);
}

TEST(CudaAttention, HeadDim256) { run_case({"d256", 2, 1, 256, 16, {1, 3}, 60, 100}); }

TEST(CudaAttention, OddHeadDimStridedQuery) { run_case({"d36_strided", 6, 2, 36, 8, {4, 1}, 0, 20, -1, 0.f, 1.0, true}); }

// K/V views of one buffer: decode (GQA) and prefill over a cached prefix in each layout, split-K decode
// and a float8 cache with per-head scales in the interleaved cells.
const Layout kStridedLayouts[] = {Layout::kCells, Layout::kPagesNhd, Layout::kPagesHnd};

TEST(CudaAttentionStrided, DecodeGqa) {
  for (const Layout layout : kStridedLayouts) {
    run_case({"strided_decode", 8, 2, 64, 16, {1, 1, 1}, 0, 90}, false, layout);
  }
}

TEST(CudaAttentionStrided, PrefillOverCachedPrefix) {
  for (const Layout layout : kStridedLayouts) {
    run_case({"strided_prefill", 4, 2, 32, 8, {5, 17, 1}, 0, 30}, false, layout);
  }
}

TEST(CudaAttentionStrided, SplitKDecodeOddHeadDim) {
  run_case({"strided_splitk", 4, 2, 40, 16, {1}, 600, 700, -1, 0.f, 1.0, false, 132}, true, Layout::kCells);
}

TEST(CudaAttentionStrided, Float8CellsWithHeadScales) {
  for (const Layout layout : {Layout::kCells, Layout::kPagesHnd}) {
    run_all_variants<c10::BFloat16, c10::Float8_e4m3fn>({"strided_fp8", 8, 2, 64, 16, {1, 6, 1}, 0, 40}, false,
                                                        Scales::kHead, layout);
  }
}

// Float8 caches: every query dtype x both formats x three kinds of scales.
template <typename C>
void run_fp8_case(const AttnCase& c, bool expect_split = false) {
  for (const Scales scales : {Scales::kNone, Scales::kTensor, Scales::kHead}) {
    run_all_variants<float, C>(c, expect_split, scales);
    run_all_variants<c10::Half, C>(c, expect_split, scales);
    run_all_variants<c10::BFloat16, C>(c, expect_split, scales);
  }
}

TEST(CudaAttentionFp8, E4M3DecodeAndPrefillGqa) { run_fp8_case<c10::Float8_e4m3fn>({"fp8_mixed", 8, 2, 64, 16, {1, 6, 1}, 0, 40}); }

TEST(CudaAttentionFp8, E5M2DecodeAndPrefillGqa) { run_fp8_case<c10::Float8_e5m2>({"fp8_mixed", 8, 2, 64, 16, {1, 6, 1}, 0, 40}); }

TEST(CudaAttentionFp8, E4M3SlidingWindowSoftcapSplitK) {
  run_fp8_case<c10::Float8_e4m3fn>({"fp8_window_splitk", 4, 2, 64, 16, {1, 3}, 600, 700, 300, 20.f, 4.0, false, 132},
                                   true);
}

TEST(CudaAttentionFp8, E5M2OddHeadDimBlockSize1) { run_fp8_case<c10::Float8_e5m2>({"fp8_d12_bs1", 4, 1, 12, 1, {3, 1}, 0, 20}); }

// PAGEDKV_CHECK_INDICES: a block id outside the cache, or seq_lens beyond the block table, is skipped
// (never read: ASan would see it) and recorded; the other sequences are still right.
template <typename T>
void bad_metadata_is_reported() {
  for (const bool scalar_path : {false, true}) {
    SCOPED_TRACE(std::string(dtype_name<T>()) + (scalar_path ? " scalar" : " 16-byte"));
    std::mt19937_64 rng = make_rng();
    const AttnCase c{"bad", 4, 2, 32, 8, {1, 3, 1}, 10, 30};
    {
      AttnRun<T> run(c, rng);
      const int col = int(rng() % uint64_t(pagedkv::ceil_div(run.seq_lens[1], run.bs)));
      const int32_t bad = int32_t(run.num_blocks + 1000 + rng() % 1000);
      run.block_tables[size_t(run.max_blocks) + col] = bad;
      pagedkv::IndexError error{};
      std::vector<double> out;
      std::vector<float> lse;
      run.run(scalar_path, -1, &error, &out, &lse);
      EXPECT_GT(run.check(out, lse, {1}), 0);
      const char* names[] = {"block_tables", "seq_lens"};
      const int64_t bounds[] = {run.num_blocks, int64_t(run.max_blocks) * run.bs + 1};
      const std::string message = pagedkv::index_error_message(error, "paged_attention", names, bounds);
      EXPECT_NE(message.find("paged_attention: block_tables holds " + std::to_string(bad) + " at flat index " +
                             std::to_string(run.max_blocks + col)),
                std::string::npos)
          << message;
      pagedkv::IndexError* unchecked = nullptr;  // checking off: skipped silently, same results elsewhere
      run.run(scalar_path, -1, unchecked, &out, &lse);
      EXPECT_GT(run.check(out, lse, {1}), 0);
    }
    {
      AttnRun<T> run(c, rng);
      const int32_t too_long = run.max_blocks * run.bs + 1 + int32_t(rng() % 50);
      run.seq_lens[2] = too_long;  // q_len 1: its keys run past the block table, whose padding is valid
      for (int i = 0; i < run.max_blocks; ++i) {
        int32_t& entry = run.block_tables[size_t(2) * run.max_blocks + i];
        if (entry < 0 || entry >= run.num_blocks) entry = 0;
      }
      pagedkv::IndexError error{};
      std::vector<double> out;
      std::vector<float> lse;
      run.run(scalar_path, -1, &error, &out, &lse);
      EXPECT_GT(run.check(out, lse, {2}), 0);
      EXPECT_EQ(error.claimed, 1u);
      EXPECT_EQ(error.argument, attn::kBadSeqLen);
      EXPECT_EQ(error.value, too_long);
      EXPECT_EQ(error.where, 2);
    }
  }
}

TEST(CudaAttention, BadMetadataIsSkippedAndReported) {
  bad_metadata_is_reported<float>();
  bad_metadata_is_reported<c10::Half>();
  bad_metadata_is_reported<c10::BFloat16>();
}

}  // namespace
