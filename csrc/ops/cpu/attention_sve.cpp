// The SVE copy of the CPU attention kernels (aarch64 only, chosen at run time where Linux reports SVE):
// the grouped decode in vector-length-agnostic SVE, the other kernels as in the NEON copy.
#include "ops/cpu/attention_cpu.h"

#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+sve")
#include <arm_sve.h>
#define PAGEDKV_CPU_ISA sve
#define PAGEDKV_CPU_AVX2 0
#define PAGEDKV_CPU_AVX512 0
#define PAGEDKV_CPU_AMX 0
#define PAGEDKV_CPU_NEON 1
#define PAGEDKV_CPU_NEON_BF16 0
#define PAGEDKV_CPU_SVE 1
#include "ops/cpu/kernels.inc"
#endif
