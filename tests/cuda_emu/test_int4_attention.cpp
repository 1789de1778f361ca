// The CUDA paged attention kernel (csrc/ops/cuda/attention.cuh) over int4 caches (uint8 rows of ops/int4_kv.h,
// cache_t = Int4Rows: each row decoded to fp32 as it is staged) on the CPU emulator, against a float64 reference
// over the rows as they read back: every query dtype, both shared-memory read paths, both schedules; decode,
// prefill over a cached prefix, GQA, split-K, sliding window, softcap, group sizes 16 to 128, head sizes 32 to 256;
// K/V views of one buffer (interleaved cells, HND pages). Every byte nobody may read (unused blocks, the tail of a
// sequence's last block) is 0xff, whose steps and minima are fp16 NaN; masked keys hold infinite steps and NaN
// minima and must contribute nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "kernel_test_util.h"
#include "ops/cuda/attention.cuh"
#include "ops/int4_kv.h"

namespace {

using namespace emu_test;
namespace attn = pagedkv::attention_cuda;

struct Int4Case {
  const char* name;
  int num_q_heads, num_kv_heads, head_dim, group_size, block_size;
  std::vector<int> q_lens;
  int min_prefix, max_prefix;  // cached keys before each sequence's queries: random in [min, max]
  int64_t sliding_window = -1;
  float softcap = 0.f;
  int multiprocessors = 4;  // many: small grids are split over keys (split-K)
};

// Where K and V rows live: two contiguous caches, [blocks, bs, Hkv, 2 rows] cells (K | V), or
// [blocks, 2, Hkv, bs, row] pages seen as [blocks, bs, Hkv, row] (HND).
enum class Int4Layout { kSeparate, kCells, kPagesHnd };

template <typename T>
struct Int4Run {
  const Int4Case& c;
  int B, T_total, Hq, Hkv, D, bs, row, num_blocks, max_blocks;
  std::vector<int32_t> q_lens, seq_lens, query_start_loc, block_tables;
  std::vector<T> query;
  std::vector<uint8_t> kv;  // both caches' bytes
  int64_t v_offset = 0;
  pagedkv::CacheStrides cs{};
  std::vector<std::pair<int, int64_t>> planted;  // (seq, pos) with non-finite rows, masked for most queries
  float scale;
  unsigned splits = 1;

  Int4Run(const Int4Case& ic, std::mt19937_64& rng, Int4Layout layout) : c(ic) {
    B = int(c.q_lens.size());
    Hq = c.num_q_heads, Hkv = c.num_kv_heads, D = c.head_dim, bs = c.block_size;
    row = int(pagedkv::int4_row_bytes(D, c.group_size));
    q_lens.assign(c.q_lens.begin(), c.q_lens.end());
    query_start_loc.push_back(0);
    int needed = 0;
    for (int b = 0; b < B; ++b) {
      seq_lens.push_back(q_lens[b] + c.min_prefix + int(rng() % uint64_t(c.max_prefix - c.min_prefix + 1)));
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
        block_tables[size_t(b) * max_blocks + i] = i < used ? perm[next++] : int32_t(num_blocks + rng() % 100);
      }
    }
    const int64_t page = int64_t(bs) * Hkv * row;
    switch (layout) {
      case Int4Layout::kSeparate: cs = {page, int64_t(Hkv) * row, row}, v_offset = num_blocks * page; break;
      case Int4Layout::kCells: cs = {2 * page, 2 * int64_t(Hkv) * row, 2 * int64_t(row)}, v_offset = row; break;
      case Int4Layout::kPagesHnd: cs = {2 * page, row, int64_t(bs) * row}, v_offset = page; break;
    }
    kv.assign(size_t(2 * num_blocks * page), 0xff);
    // Rows of elements uniform in [-m, m], m per row in [0.1, 2]; a few rows constant (step 0).
    std::uniform_real_distribution<double> unit(-1.0, 1.0), mag(0.1, 2.0);
    std::vector<float> x(D);
    for (int b = 0; b < B; ++b) {
      for (int64_t pos = 0; pos < seq_lens[b]; ++pos) {
        for (int h = 0; h < Hkv; ++h) {
          for (const int64_t view : {int64_t(0), v_offset}) {
            const double m = mag(rng);
            const bool constant = rng() % 16 == 0;
            for (int d = 0; d < D; ++d) x[d] = float(constant ? m : unit(rng) * m);
            uint8_t* r = kv.data() + view + at(b, pos, h);
            for (int g = 0; g < D / c.group_size; ++g) {
              pagedkv::int4_encode_group(r, D, g, c.group_size, [&](int64_t i) { return x[g * c.group_size + i]; });
            }
          }
        }
      }
      // Masked keys with non-finite rows: the last key of a prefill (masked for all but its last query) and,
      // with a sliding window, the first key (outside the window of late queries).
      if (q_lens[b] >= 2) planted.push_back({b, seq_lens[b] - 1});
      if (c.sliding_window > 0 && seq_lens[b] > c.sliding_window + 1) planted.push_back({b, 0});
    }
    for (const auto& [b, pos] : planted) {
      for (int h = 0; h < Hkv; ++h) {
        for (int g = 0; g < D / c.group_size; ++g) {
          uint8_t* k_meta = kv.data() + at(b, pos, h) + D / 2 + pagedkv::kInt4GroupMetaBytes * g;
          pagedkv::int4_store_u16(k_meta, 0x7c00);      // step +inf
          pagedkv::int4_store_u16(k_meta + 2, 0xfc00);  // minimum -inf
          pagedkv::int4_store_u16(kv.data() + v_offset + (k_meta - kv.data()) + 2, 0x7e00);  // V minimum NaN
        }
      }
    }
    query = random_vector<T>(rng, size_t(T_total) * Hq * D);
    scale = float(1.0 / std::sqrt(double(D)));
  }

  // Byte offset of (pos, kv head) of sequence b's row in a view (from the view's first byte).
  size_t at(int b, int64_t pos, int h) const {
    const int64_t block = block_tables[size_t(b) * max_blocks + pos / bs];
    return size_t(block * cs.block + pos % bs * cs.token + h * cs.head);
  }

  // Element d of a stored row, read back by the documented rule.
  double element(int64_t view, int b, int64_t pos, int h, int d) const {
    const uint8_t* r = kv.data() + view + at(b, pos, h);
    const pagedkv::Int4Group g = pagedkv::int4_group(r, D, d / c.group_size);
    return double(pagedkv::int4_code(r, d)) * double(g.step) + double(g.lo);
  }

  // Runs the kernels as attention.cu launches them (staged rows read 16 bytes at a time unless scalar_path).
  void run(bool scalar_path, pagedkv::IndexError* index_error, std::vector<double>* out, std::vector<float>* lse) {
    attn::KernelParams p{};
    p.query = query.data();
    p.q_stride_token = int64_t(Hq) * D, p.q_stride_head = D, p.q_stride_dim = 1;
    p.key_cache = kv.data();
    p.value_cache = kv.data() + v_offset;
    p.cache_strides = cs;
    p.block_tables = block_tables.data();
    p.seq_lens = seq_lens.data();
    p.query_start_loc = query_start_loc.data();
    std::vector<T> out_buf(size_t(T_total) * Hq * D);
    lse->assign(size_t(T_total) * Hq, std::nanf(""));
    p.out = out_buf.data();
    p.lse = lse->data();
    p.index_error = index_error;
    p.num_seqs = B, p.num_tokens = T_total, p.num_q_heads = Hq, p.num_kv_heads = Hkv, p.head_dim = D;
    p.block_size = bs, p.max_blocks = max_blocks, p.num_blocks = num_blocks;
    p.sliding_window = c.sliding_window;
    p.scale = scale;
    p.softcap = c.softcap;
    p.int4_group = c.group_size;
    const attn::AttentionLaunch launch =
        attn::plan_paged_attention(p, sizeof(float), !scalar_path, -1, c.multiprocessors);
    ASSERT_TRUE(launch.smem_fits);
    ASSERT_EQ(launch.vec16, !scalar_path && D % 4 == 0);
    std::vector<float> partial_out, partial_lse;
    if (launch.grid_z > 1) {
      partial_out.assign(size_t(launch.grid_z) * T_total * Hq * D, std::nanf(""));
      partial_lse.assign(size_t(launch.grid_z) * T_total * Hq, std::nanf(""));
      p.partial_out = partial_out.data();
      p.partial_lse = partial_lse.data();
    }
    const auto kernel = launch.vec16 ? attn::paged_attention_kernel<T, attn::Int4Rows, true>
                                     : attn::paged_attention_kernel<T, attn::Int4Rows, false>;
    cuda_emu::launch(dim3(launch.grid_x, launch.grid_y, launch.grid_z), dim3(attn::kThreads), launch.smem, kernel, p);
    if (launch.grid_z > 1) {
      const int64_t rows = int64_t(T_total) * Hq;
      cuda_emu::launch(dim3(unsigned(rows)), dim3(attn::kThreads), 0, attn::merge_partitions_kernel<T>,
                       p.partial_out, p.partial_lse, out_buf.data(), p.lse, p.sinks, int(launch.grid_z), rows, Hq, D);
    }
    out->resize(out_buf.size());
    for (size_t i = 0; i < out_buf.size(); ++i) (*out)[i] = to_double(out_buf[i]);
    splits = launch.grid_z;
  }

  // Compares every row that sees no planted key with the float64 reference; returns the rows compared.
  int check(const std::vector<double>& out, const std::vector<float>& lse) const {
    const double tol = 2 * (4 * eps_of<T>() + 3e-5);  // values up to 2 in magnitude
    int compared = 0;
    std::vector<double> ref;
    for (int b = 0; b < B; ++b) {
      for (int j = 0; j < q_lens[b]; ++j) {
        const int64_t pos = int64_t(seq_lens[b]) - q_lens[b] + j;
        const pagedkv::KeyRange vis = pagedkv::visible_keys(pos, c.sliding_window);
        bool sees_planted = false;
        for (const auto& [pb, ppos] : planted) sees_planted |= pb == b && ppos >= vis.begin && ppos < vis.end;
        if (sees_planted) continue;
        for (int h = 0; h < Hq; ++h) {
          const int kv_head = h / (Hq / Hkv);
          const size_t q_off = (size_t(query_start_loc[b] + j) * Hq + h) * D;
          const auto score = [&](int64_t k) {
            double s = 0;
            for (int d = 0; d < D; ++d) s += to_double(query[q_off + d]) * element(0, b, k, kv_head, d);
            return s;
          };
          const auto value = [&](int64_t k, int d) { return element(v_offset, b, k, kv_head, d); };
          const double ref_lse =
              reference_attention_row(vis.begin, vis.end, D, double(scale), c.softcap, nullptr, score, value, &ref);
          ++compared;
          for (int d = 0; d < D; ++d) {
            if (!(std::abs(out[q_off + d] - ref[d]) <= tol)) {
              ADD_FAILURE() << "seq " << b << " query " << j << " head " << h << " dim " << d << ": got "
                            << out[q_off + d] << ", float64 reference " << ref[d];
              return compared;
            }
          }
          const float got_lse = lse[size_t(query_start_loc[b] + j) * Hq + h];
          if (!(std::abs(got_lse - ref_lse) <= 1e-4 * std::max(1.0, std::abs(ref_lse)))) {
            ADD_FAILURE() << "seq " << b << " query " << j << " head " << h << ": lse " << got_lse
                          << ", float64 reference " << ref_lse;
            return compared;
          }
        }
      }
    }
    return compared;
  }
};

template <typename T>
void run_variants(const Int4Case& c, bool expect_split, Int4Layout layout) {
  for (const cuda_emu::Schedule schedule : schedules()) {
    for (const bool scalar_path : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + ": " + dtype_name<T>() + " query, layout " + std::to_string(int(layout)) +
                   (scalar_path ? ", scalar" : ", 16-byte") + " reads, " + schedule_name(schedule) + " schedule");
      const ScheduleScope scope(schedule);
      std::mt19937_64 rng = make_rng();
      Int4Run<T> run(c, rng, layout);
      pagedkv::IndexError error{};
      std::vector<double> out;
      std::vector<float> lse;
      run.run(scalar_path, &error, &out, &lse);
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_EQ(error.claimed, 0u) << "index check fired on valid metadata: value " << error.value;
      EXPECT_EQ(run.splits > 1, expect_split) << "partitions: " << run.splits;
      EXPECT_GT(run.check(out, lse), 0);
    }
  }
}

void run_int4_case(const Int4Case& c, bool expect_split = false, Int4Layout layout = Int4Layout::kSeparate) {
  run_variants<float>(c, expect_split, layout);
  run_variants<c10::Half>(c, expect_split, layout);
  run_variants<c10::BFloat16>(c, expect_split, layout);
}

TEST(CudaAttentionInt4, DecodeGqa) { run_int4_case({"decode", 8, 2, 64, 32, 16, {1, 1, 1}, 0, 90}); }

TEST(CudaAttentionInt4, PrefillOverCachedPrefix) { run_int4_case({"prefill", 4, 4, 32, 16, 8, {5, 17, 1}, 0, 30}); }

TEST(CudaAttentionInt4, SplitKDecode) {
  run_int4_case({"splitk", 4, 1, 128, 64, 16, {1}, 700, 900, -1, 0.f, 132}, true);
}

TEST(CudaAttentionInt4, SlidingWindowSoftcap) {
  run_int4_case({"window_softcap", 4, 2, 64, 32, 8, {20, 1}, 10, 30, 7, 20.f});
}

TEST(CudaAttentionInt4, HeadDim256Group128) { run_int4_case({"d256", 2, 1, 256, 128, 16, {1, 3}, 60, 100}); }

TEST(CudaAttentionInt4, HeadDim36ScalarReads) { run_int4_case({"d36", 6, 2, 36, 18, 8, {4, 1}, 0, 20}); }

TEST(CudaAttentionInt4, ViewsOfOneBuffer) {
  for (const Int4Layout layout : {Int4Layout::kCells, Int4Layout::kPagesHnd}) {
    run_int4_case({"views", 8, 2, 64, 32, 16, {1, 6, 1}, 0, 40}, false, layout);
  }
}

// Metadata pointing outside the cache: the key is skipped (never read: ASan would see it) and recorded.
TEST(CudaAttentionInt4, BadBlockIdIsSkippedAndReported) {
  std::mt19937_64 rng = make_rng();
  const Int4Case c{"bad", 4, 2, 32, 16, 8, {1, 1}, 10, 30};
  Int4Run<float> run(c, rng, Int4Layout::kSeparate);
  const int32_t bad = int32_t(run.num_blocks + 1000 + rng() % 1000);
  run.block_tables[size_t(run.max_blocks) + 0] = bad;  // sequence 1's first block
  pagedkv::IndexError error{};
  std::vector<double> out;
  std::vector<float> lse;
  run.run(false, &error, &out, &lse);
  EXPECT_EQ(error.claimed, 1u);
  EXPECT_EQ(error.argument, attn::kBadBlockId);
  EXPECT_EQ(error.value, bad);
  for (int d = 0; d < run.D * run.Hq; ++d) EXPECT_TRUE(std::isfinite(out[d])) << d;  // sequence 0 unharmed
}

}  // namespace
