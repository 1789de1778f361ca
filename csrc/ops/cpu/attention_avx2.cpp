// The AVX2 + FMA + F16C copy of the CPU attention kernels (x86-64 only; chosen at run time).
#include "ops/cpu/attention_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define PAGEDKV_CPU_AVX2 1
#define PAGEDKV_CPU_AVX512 0
#pragma GCC target("avx2,fma,f16c")

namespace pagedkv::cpu::avx2 {
#include "ops/cpu/kernels.inc"
}  // namespace pagedkv::cpu::avx2
#endif
