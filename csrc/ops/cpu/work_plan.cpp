// Torch-free parts of the CPU paged attention around its kernels: which ISA copies this CPU runs, the
// plan of work items and the merge of split-K partitions (the torch glue, ops/attention_cpu.cpp, and
// the C++ kernel tests both use them).
#include <algorithm>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "ops/cpu/attention_cpu.h"

namespace pagedkv {
namespace cpu {
#if defined(__x86_64__)
namespace {

// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and Linux's permission for this process
// to use the tile data state (asked once: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_bf16_usable() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace
#endif
#if defined(__aarch64__)
namespace {

// Linux's hardware capability bits (asm/hwcap.h): SVE in AT_HWCAP, the Advanced SIMD BF16 instructions
// (FEAT_BF16: bfdot, bfmmla, bfcvt) in AT_HWCAP2.
constexpr unsigned long kHwcapSve = 1ul << 22, kHwcap2Bf16 = 1ul << 14;

// The AT_HWCAP (second: AT_HWCAP2) word; none where the kernel reports none.
unsigned long hwcaps(bool second) {
#if defined(__linux__)
  return getauxval(second ? AT_HWCAP2 : AT_HWCAP);
#else
  (void)second;
  return 0;
#endif
}

}  // namespace
#endif

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kNeonBf16: return "neon_bf16";
    case Isa::kSve: return "sve";
    case Isa::kNeon: return "neon";
    default: return "baseline";
  }
}

bool cpu_supports(Isa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case Isa::kAmx: {
      static const bool has = cpu_supports(Isa::kAvx512) && amx_bf16_usable();
      return has;
    }
    case Isa::kAvx512: {
      static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                              __builtin_cpu_supports("avx512bf16") && cpu_supports(Isa::kAvx2);
      return has;
    }
    case Isa::kAvx2: {
      static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                              __builtin_cpu_supports("f16c");
      return has;
    }
    case Isa::kNeonBf16:
    case Isa::kSve:
    case Isa::kNeon: return false;
    default: return true;
  }
#elif defined(__aarch64__)
  switch (isa) {
    case Isa::kNeonBf16: {
      static const bool has = (hwcaps(true) & kHwcap2Bf16) != 0;
      return has;
    }
    case Isa::kSve: {
      static const bool has = (hwcaps(false) & kHwcapSve) != 0;
      return has;
    }
    case Isa::kNeon:  // Advanced SIMD is part of every AArch64 CPU
    case Isa::kBaseline: return true;
    default: return false;
  }
#else
  return isa == Isa::kBaseline;
#endif
}

Isa best_isa(Isa limit) {
  for (Isa isa = limit; isa != Isa::kBaseline; isa = Isa(int(isa) + 1)) {
    if (cpu_supports(isa)) return isa;
  }
  return Isa::kBaseline;
}

// A decode sequence is one item over all its KV heads (one walk over its block table serves them all,
// and in an NHD cache a slot's rows for those heads are adjacent); a prefill sequence gives one item
// per (KV head, chunk of queries; micro-GEMM chunks of kGemmRowsPerItem rows, whose row blocks share
// each staged K/V tile). With fewer items than
// kItemsPerThread (decode: kDecodeItemsPerThread) per thread, long key ranges are split into
// partitions merged afterwards (split-K), and decode sequences too short to split are divided over
// their KV heads instead.
std::vector<WorkItem> plan_work(const AttentionParams& a, int64_t num_threads, int64_t* num_partial_rows) {
  const int64_t G = a.num_q_heads / a.num_kv_heads, Hkv = a.num_kv_heads;
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < a.num_seqs; ++b) {
    const int64_t q_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    const bool gemm = use_gemm_path(q_len, G);
    const int64_t q_chunk = std::max<int64_t>(1, (gemm ? kGemmRowsPerItem : kRowsPerItem) / G);
    for (int64_t q0 = 0; q0 < q_len; q0 += q_chunk) {
      const int64_t q_count = std::min(q_chunk, q_len - q0);
      const KeyRange keys{visible_keys(query_position(a.seq_lens[b], q_len, q0), a.sliding_window).begin,
                          query_position(a.seq_lens[b], q_len, q0 + q_count - 1) + 1};
      if (q_count == 1 && a.head_dim % kDecodeDimAlign == 0) {
        items.push_back(WorkItem{int32_t(b), 0, int32_t(q0), 1, int32_t(Hkv), 0, 1, 0, keys, Kernel::kDecode});
        continue;
      }
      const Kernel kernel = gemm ? Kernel::kPrefillGemm : Kernel::kPrefillRows;
      for (int64_t h = 0; h < Hkv; ++h) {
        items.push_back(WorkItem{int32_t(b), int32_t(h), int32_t(q0), int32_t(q_count), 1, 0, 1, 0, keys, kernel});
      }
    }
  }
  *num_partial_rows = 0;
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<WorkItem> split;
  for (const WorkItem& item : items) {
    const int64_t target_items = (item.kernel == Kernel::kDecode ? kDecodeItemsPerThread : kItemsPerThread) * num_threads;
    const int64_t num_keys = item.keys.end - item.keys.begin;
    const int64_t parts = num_partitions(num_keys, num_items, target_items);
    // Head groups for decode items that key splitting leaves short of the target.
    const int64_t head_groups =
        item.kernel == Kernel::kDecode && num_items * parts < target_items
            ? std::min<int64_t>(item.kv_head_count, ceil_div(target_items, num_items * parts))
            : 1;
    for (int64_t hg = 0; hg < head_groups; ++hg) {
      WorkItem group = item;
      group.kv_head = int32_t(item.kv_head + hg * item.kv_head_count / head_groups);
      group.kv_head_count = int32_t(item.kv_head + (hg + 1) * item.kv_head_count / head_groups - group.kv_head);
      if (parts == 1) {
        split.push_back(group);
        continue;
      }
      const int64_t part_size = partition_size(num_keys, parts);
      for (int64_t p = 0; p < parts; ++p) {
        WorkItem piece = group;
        piece.part = int32_t(p);
        piece.num_parts = int32_t(parts);
        piece.partial_row = *num_partial_rows;
        piece.keys = partition_keys(group.keys, p, parts, part_size);
        split.push_back(piece);
      }
      *num_partial_rows += parts * group.rows(G);
    }
  }
  return split;
}

}  // namespace cpu
}  // namespace pagedkv
