// The CPU paged attention kernels (csrc/ops/cpu/), every ISA copy this CPU runs, without libtorch (c10
// headers only): the work plan, the kernels on a few threads and the split-K merge against a float64
// reference. Decode and prefill over cached prefixes, GQA groups 1..20, block sizes that do and do not
// divide the kernels' tiles, head dims with and without a last 8 columns, sliding window, softcap,
// fp32 / fp16 / bf16 and float8 caches with per-head scales, contiguous caches and strided K/V views of
// one buffer (vLLM's interleaved cells, FlashInfer's HND pages). Cache rows the kernels must not read (the
// tail of each sequence's last block, blocks of no sequence) hold NaN and block tables are padded with
// -1. On x86-64 this runs the AVX2 / AVX-512 / AMX copies where the CPU has them; built for aarch64
// (make test-cpp-arm) it runs the NEON, NEON BF16 and SVE copies under qemu-user, the SVE one at every
// vector length from 128 to 2048 bits that the CPU offers (Linux's PR_SVE_SET_VL).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/prctl.h>
#endif

#include "ops/cpu/attention_cpu.h"

namespace {

using pagedkv::AttentionParams;
using pagedkv::KvScale;
namespace cpu = pagedkv::cpu;

struct Shape {
  int head_dim, group, block_size, num_kv_heads;
  std::vector<int> seq_lens, q_lens;  // KV length (this step's tokens included) and queries per sequence
  int64_t sliding_window;
  float softcap;
  int threads;
};

// Where K and V live: two contiguous caches, or views of one buffer with equal strides.
enum class Layout { kContiguous, kCells, kHndPages };

const char* layout_name(Layout l) {
  return l == Layout::kContiguous ? "contiguous" : l == Layout::kCells ? "cells" : "hnd_pages";
}

std::string shape_name(const Shape& s) {
  std::string lens;
  for (size_t b = 0; b < s.seq_lens.size(); ++b) lens += "_" + std::to_string(s.seq_lens[b]) + "q" + std::to_string(s.q_lens[b]);
  return "d" + std::to_string(s.head_dim) + "g" + std::to_string(s.group) + "bs" + std::to_string(s.block_size) + "kv" +
         std::to_string(s.num_kv_heads) + lens + "w" + std::to_string(s.sliding_window) + "t" + std::to_string(s.threads);
}

template <typename T>
constexpr bool is_fp8() {
  return std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;
}

// atol = rtol against the float64 reference (the Python tests' TOLERANCE; float8 caches are compared
// with the reference of their stored values, so the query dtype decides).
template <typename T>
double tolerance() {
  if constexpr (std::is_same_v<T, float>) return 2e-5;
  if constexpr (std::is_same_v<T, c10::Half>) return 3e-3;
  return 2e-2;
}

// One random batch over a shuffled paged cache, the kernels' inputs and the reference output.
template <typename scalar_t, typename cache_t>
struct Batch {
  Shape s;
  Layout layout;
  int num_q_heads, num_tokens, max_blocks, num_blocks;
  std::vector<int32_t> block_tables, seq_lens, query_start_loc;
  std::vector<scalar_t> query, out;
  std::vector<cache_t> kv;  // both caches: K at k_offset, V at v_offset, each with strides cs
  size_t k_offset = 0, v_offset = 0;
  pagedkv::CacheStrides cs{};
  std::vector<float> lse, k_scale, v_scale;

  size_t at(size_t base, int64_t block, int64_t token, int64_t head) const {
    return base + size_t(block * cs.block + token * cs.token + head * cs.head);
  }

  Batch(const Shape& shape, Layout layout_, std::mt19937_64& rng) : s(shape), layout(layout_) {
    const int B = int(s.seq_lens.size()), D = s.head_dim, Hkv = s.num_kv_heads, bs = s.block_size;
    num_q_heads = Hkv * s.group;
    query_start_loc.assign(1, 0);
    for (int b = 0; b < B; ++b) query_start_loc.push_back(query_start_loc.back() + s.q_lens[b]);
    num_tokens = query_start_loc.back();
    seq_lens = s.seq_lens;
    max_blocks = 1;
    int used_blocks = 0;
    for (int len : s.seq_lens) max_blocks = std::max(max_blocks, (len + bs - 1) / bs), used_blocks += (len + bs - 1) / bs;
    num_blocks = used_blocks + 3;  // blocks of no sequence too
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    block_tables.assign(size_t(B) * max_blocks, -1);
    std::vector<bool> used(size_t(num_blocks) * bs, false);
    for (int b = 0, next = 0; b < B; ++b) {
      for (int i = 0; i < (s.seq_lens[b] + bs - 1) / bs; ++i) block_tables[size_t(b) * max_blocks + i] = ids[next++];
      for (int p = 0; p < s.seq_lens[b]; ++p) used[size_t(block_tables[size_t(b) * max_blocks + p / bs]) * bs + p % bs] = true;
    }
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> spread(-1.f, 1.f);
    // float8: stored values of a few units (within both formats' range) times a scale per KV head.
    const float stored = is_fp8<cache_t>() ? 8.f : 1.f;
    for (int h = 0; h < Hkv; ++h) {
      k_scale.push_back(is_fp8<cache_t>() ? std::pow(10.f, 0.5f * spread(rng)) / stored : 1.f);
      v_scale.push_back(is_fp8<cache_t>() ? std::pow(10.f, 0.5f * spread(rng)) / stored : 1.f);
    }
    query.resize(size_t(num_tokens) * num_q_heads * D);
    for (auto& x : query) x = scalar_t(normal(rng));
    const size_t cache_size = size_t(num_blocks) * bs * Hkv * D;
    if (layout == Layout::kContiguous) {
      cs = pagedkv::contiguous_cache_strides(bs, Hkv, D), k_offset = 0, v_offset = cache_size;
    } else if (layout == Layout::kCells) {  // [blocks, bs, Hkv, 2D]: K | V in each cell
      cs = {int64_t(bs) * Hkv * 2 * D, int64_t(Hkv) * 2 * D, 2 * int64_t(D)}, k_offset = 0, v_offset = D;
    } else {  // [pages, 2, Hkv, page, D]
      cs = {2 * int64_t(Hkv) * bs * D, D, int64_t(bs) * D}, k_offset = 0, v_offset = size_t(Hkv) * bs * D;
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    kv.assign(2 * cache_size, cache_t(nan));
    for (int64_t slot = 0; slot < int64_t(num_blocks) * bs; ++slot) {
      if (!used[slot]) continue;
      for (int h = 0; h < Hkv; ++h) {
        for (int d = 0; d < D; ++d) {
          kv[at(k_offset, slot / bs, slot % bs, h) + d] = cache_t(normal(rng) * stored);
          kv[at(v_offset, slot / bs, slot % bs, h) + d] = cache_t(normal(rng) * stored);
        }
      }
    }
    out.assign(query.size(), scalar_t(nan));
    lse.assign(size_t(num_tokens) * num_q_heads, nan);
  }

  AttentionParams params() {
    AttentionParams a{};
    a.query = query.data();
    a.q_stride_token = int64_t(num_q_heads) * s.head_dim;
    a.q_stride_head = s.head_dim;
    a.q_stride_dim = 1;
    a.key_cache = kv.data() + k_offset;
    a.value_cache = kv.data() + v_offset;
    a.cache_strides = cs;
    a.block_tables = block_tables.data();
    a.seq_lens = seq_lens.data();
    a.query_start_loc = query_start_loc.data();
    a.out = out.data();
    a.lse = lse.data();
    a.num_seqs = int(seq_lens.size());
    a.num_tokens = num_tokens;
    a.num_q_heads = num_q_heads;
    a.num_kv_heads = s.num_kv_heads;
    a.head_dim = s.head_dim;
    a.block_size = s.block_size;
    a.max_blocks = max_blocks;
    a.num_blocks = num_blocks;
    a.sliding_window = s.sliding_window;
    a.scale = float(1.0 / std::sqrt(double(s.head_dim)));
    a.softcap = s.softcap;
    if (is_fp8<cache_t>()) a.k_scale = KvScale{k_scale.data(), 1}, a.v_scale = KvScale{v_scale.data(), 1};
    return a;
  }

  // The whole call as the torch glue makes it: plan, kernels on s.threads threads, merge.
  void run(cpu::Isa isa) {
    AttentionParams a = params();
    int64_t num_partial_rows = 0;
    const std::vector<cpu::WorkItem> items = cpu::plan_work(a, s.threads, &num_partial_rows);
    std::vector<float> partial_out(size_t(num_partial_rows) * s.head_dim), partial_lse(num_partial_rows);
    a.partial_out = partial_out.data();
    a.partial_lse = partial_lse.data();
    std::atomic<int64_t> next{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < s.threads; ++t) {
      threads.emplace_back([&] {
        cpu::Scratch scratch;
        cpu::attend_work_items<scalar_t, cache_t>(isa, a, items, next, scratch);
      });
    }
    for (std::thread& t : threads) t.join();
    std::vector<float> acc(s.head_dim);
    for (const cpu::WorkItem& item : items) {
      if (item.num_parts > 1 && item.part == 0) cpu::merge_partitions<scalar_t>(a, item, acc.data());
    }
  }

  // Output row (token, head) and its lse in float64, from the stored values times their scales.
  void reference(int b, int token, int head, std::vector<double>& o, double& lse_out) const {
    const int D = s.head_dim, h = head / s.group, bs = s.block_size;
    const int q_len = s.q_lens[b], j = token - query_start_loc[b];
    const int64_t pos = pagedkv::query_position(s.seq_lens[b], q_len, j);
    const pagedkv::KeyRange keys = pagedkv::visible_keys(pos, s.sliding_window);
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> logits;
    for (int64_t p = keys.begin; p < keys.end; ++p) {
      const size_t row = at(k_offset, block_tables[size_t(b) * max_blocks + p / bs], p % bs, h);
      double dot = 0;
      for (int d = 0; d < D; ++d) {
        dot += double(float(query[(size_t(token) * num_q_heads + head) * D + d])) * float(kv[row + d]) * k_scale[h];
      }
      double x = dot * scale;
      if (s.softcap > 0) x = s.softcap * std::tanh(x / s.softcap);
      logits.push_back(x);
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double& x : logits) sum += (x = std::exp(x - m));
    o.assign(D, 0.0);
    for (int64_t p = keys.begin; p < keys.end; ++p) {
      const size_t row = at(v_offset, block_tables[size_t(b) * max_blocks + p / bs], p % bs, h);
      const double w = logits[p - keys.begin] / sum;
      for (int d = 0; d < D; ++d) o[d] += w * float(kv[row + d]) * v_scale[h];
    }
    lse_out = m + std::log(sum);
  }

  // The reference of every output row, [token][head][head_dim], and of every lse.
  struct Expected {
    std::vector<double> out, lse;
  };
  Expected expected_outputs() const {
    Expected e;
    e.out.reserve(out.size());
    std::vector<double> o;
    double row_lse = 0;
    for (int b = 0; b < int(seq_lens.size()); ++b) {
      for (int t = query_start_loc[b]; t < query_start_loc[b + 1]; ++t) {
        for (int h = 0; h < num_q_heads; ++h) {
          reference(b, t, h, o, row_lse);
          e.out.insert(e.out.end(), o.begin(), o.end());
          e.lse.push_back(row_lse);
        }
      }
    }
    return e;
  }

  // The outputs of the last run against the reference; the outputs are then NaN again for the next run.
  void expect_matches(const Expected& e, const std::string& isa) {
    const double tol = tolerance<scalar_t>();
    int failures = 0;
    for (int b = 0; b < int(seq_lens.size()); ++b) {
      for (int t = query_start_loc[b]; t < query_start_loc[b + 1]; ++t) {
        for (int h = 0; h < num_q_heads; ++h) {
          const size_t row = size_t(t) * num_q_heads + h;
          const double* o = e.out.data() + row * s.head_dim;
          const double ref_lse = e.lse[row];
          for (int d = 0; d < s.head_dim && failures < 5; ++d) {
            const double got = float(out[row * s.head_dim + d]);
            if (!(std::abs(got - o[d]) <= tol + tol * std::abs(o[d]))) {
              ADD_FAILURE() << isa << " " << layout_name(layout) << " " << shape_name(s) << ": out[token " << t
                            << ", head " << h << ", " << d
                            << "] = " << got << ", reference " << o[d];
              ++failures;
            }
          }
          if (failures < 5 && !(std::abs(lse[row] - ref_lse) <= 1e-4 + 1e-4 * std::abs(ref_lse))) {
            ADD_FAILURE() << isa << " " << layout_name(layout) << " " << shape_name(s) << ": lse[token " << t
                          << ", head " << h << "] = " << lse[row]
                          << ", reference " << ref_lse;
            ++failures;
          }
        }
      }
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(out.begin(), out.end(), scalar_t(nan));
    std::fill(lse.begin(), lse.end(), nan);
  }
};

std::vector<int> decode(int n) { return std::vector<int>(n, 1); }

// head_dim, group, block_size, KV heads, KV lengths, queries, window, softcap, threads.
const std::vector<Shape> kShapes = {
    // decode: single sequences split over the keys (split-K) and over KV heads, many short ones whole
    {128, 4, 16, 2, {1000, 5}, decode(2), -1, 0.f, 2},
    {64, 1, 16, 4, {1, 17, 300}, decode(3), -1, 0.f, 2},
    {128, 8, 32, 1, {2049}, decode(1), -1, 0.f, 3},
    {40, 3, 3, 2, {1, 19, 260}, decode(3), -1, 0.f, 2},
    {72, 6, 16, 2, {300, 33}, decode(2), -1, 0.f, 1},
    {24, 7, 16, 1, {129}, decode(1), 20, 1.5f, 2},
    {80, 2, 5, 3, {1, 77, 600}, decode(3), 50, 0.f, 2},
    {48, 16, 16, 1, {531}, decode(1), 7, 0.f, 2},
    {64, 20, 16, 1, {100, 2}, decode(2), -1, 0.f, 2},
    {96, 5, 2, 2, {1, 2, 3, 4, 40, 41, 42, 43, 44, 45}, decode(10), -1, 2.f, 2},
    {256, 4, 8, 2, {33, 129}, decode(2), -1, 5.f, 1},
    {136, 3, 16, 2, {70, 300}, decode(2), -1, 0.f, 1},  // register blocks of every width, a last 8 columns
    {152, 2, 16, 1, {33, 250}, decode(2), -1, 0.f, 2},
    {200, 1, 16, 2, {40}, decode(1), -1, 0.f, 1},
    {36, 2, 16, 2, {50, 7}, decode(2), -1, 0.f, 2},  // head_dim % 8 != 0: the per-row kernel
    // prefill over cached prefixes: per-row (few rows) and micro-GEMM (many) kernels
    {64, 4, 16, 2, {37, 300}, {3, 40}, -1, 0.f, 2},
    {128, 1, 16, 2, {700}, {200}, 64, 0.f, 2},
    {40, 8, 3, 1, {90, 20}, {90, 1}, -1, 3.f, 2},
    {96, 2, 32, 3, {1, 2, 260}, {1, 2, 7}, -1, 0.f, 1},
    // micro-GEMM tails: row blocks of 64, 32 and 16 rows, key blocks and key pairs cut anywhere by the
    // causal edge and the last tile, column blocks of 64, 32 and 16, GQA 1..8, windows, softcap, split-K
    {64, 4, 16, 1, {701}, {101}, -1, 0.f, 1},
    {48, 8, 16, 1, {300}, {40}, -1, 0.f, 1},
    {80, 2, 16, 2, {400, 130}, {70, 130}, 100, 0.f, 2},
    {32, 4, 8, 2, {259}, {37}, -1, 30.f, 1},
    {16, 2, 16, 1, {45}, {45}, -1, 0.f, 1},
    {96, 8, 32, 1, {1000}, {64}, -1, 0.f, 3},
    {112, 1, 16, 1, {129, 300}, {129, 23}, 33, 0.f, 1},
};

std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : cpu::kAllIsas) {
    if (cpu::cpu_supports(isa)) out.push_back(isa);
  }
  return out;
}

// The SVE vector length in bytes, and a new one (the length the CPU gives, at most the one asked for);
// 0 without SVE.
int sve_vector_bytes() {
#if defined(__aarch64__) && defined(__linux__)
  const int vl = prctl(PR_SVE_GET_VL);
  return vl < 0 ? 0 : vl & PR_SVE_VL_LEN_MASK;
#else
  return 0;
#endif
}
int set_sve_vector_bytes(int bytes) {
#if defined(__aarch64__) && defined(__linux__)
  const int vl = prctl(PR_SVE_SET_VL, bytes);
  return vl < 0 ? 0 : vl & PR_SVE_VL_LEN_MASK;
#else
  (void)bytes;
  return 0;
#endif
}

// One run of the kernels: a copy, and for the SVE copy the vector length its threads run at (the
// threads that Batch::run starts inherit the main thread's).
struct KernelRun {
  cpu::Isa isa;
  int sve_bytes;  // 0: the length as it is
  std::string name;
};

std::vector<KernelRun> runs() {
  std::vector<KernelRun> out;
  for (cpu::Isa isa : isas()) {
    if (isa != cpu::Isa::kSve) {
      out.push_back({isa, 0, cpu::isa_name(isa)});
      continue;
    }
    const int initial = sve_vector_bytes();
    std::vector<int> lengths;
    for (int bytes : {16, 32, 64, 256}) {
      const int got = set_sve_vector_bytes(bytes);
      if (got != 0 && std::find(lengths.begin(), lengths.end(), got) == lengths.end()) lengths.push_back(got);
    }
    set_sve_vector_bytes(initial);
    for (int bytes : lengths) out.push_back({isa, bytes, "sve" + std::to_string(bytes * 8)});
  }
  return out;
}

template <typename scalar_t, typename cache_t>
void check_every_isa_and_shape() {
  std::mt19937_64 rng(std::hash<std::string>{}(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  const std::vector<KernelRun> all = runs();
  const int initial_sve_bytes = sve_vector_bytes();
  for (size_t i = 0; i < kShapes.size(); ++i) {
    // Every shape contiguous, and each in one of the strided layouts (alternating).
    for (Layout layout : {Layout::kContiguous, i % 2 ? Layout::kCells : Layout::kHndPages}) {
      Batch<scalar_t, cache_t> batch(kShapes[i], layout, rng);
      const auto expected = batch.expected_outputs();
      for (const KernelRun& run : all) {
        if (run.sve_bytes != 0) {
          ASSERT_EQ(set_sve_vector_bytes(run.sve_bytes), run.sve_bytes);
        }
        batch.run(run.isa);
        if (run.sve_bytes != 0) set_sve_vector_bytes(initial_sve_bytes);
        batch.expect_matches(expected, run.name);
      }
    }
  }
}

// The copy chosen at run time: PAGEDKV_EXPECT_CPU_ATTENTION_ISA names it where the test is run on a
// known CPU (make test-cpp-arm runs it under qemu-user's models with and without SVE and BF16).
TEST(CpuAttention, RunsTheCopiesThisCpuHas) {
  const std::vector<cpu::Isa> found = isas();
  ASSERT_FALSE(found.empty());
  EXPECT_EQ(found.back(), cpu::Isa::kBaseline);
  EXPECT_EQ(cpu::best_isa(cpu::Isa::kAmx), found.front());
#if defined(__aarch64__)
  EXPECT_NE(std::find(found.begin(), found.end(), cpu::Isa::kNeon), found.end());
#endif
  if (const char* expected = std::getenv("PAGEDKV_EXPECT_CPU_ATTENTION_ISA")) {
    EXPECT_STREQ(cpu::isa_name(found.front()), expected);
  }
  for (const KernelRun& run : runs()) std::printf("cpu attention copy: %s\n", run.name.c_str());
}

TEST(CpuAttention, Float32) { check_every_isa_and_shape<float, float>(); }
TEST(CpuAttention, Float16) { check_every_isa_and_shape<c10::Half, c10::Half>(); }
TEST(CpuAttention, BFloat16) { check_every_isa_and_shape<c10::BFloat16, c10::BFloat16>(); }
TEST(CpuAttention, Float8E4m3CacheBFloat16Query) { check_every_isa_and_shape<c10::BFloat16, c10::Float8_e4m3fn>(); }
TEST(CpuAttention, Float8E5m2CacheFloat32Query) { check_every_isa_and_shape<float, c10::Float8_e5m2>(); }

}  // namespace
