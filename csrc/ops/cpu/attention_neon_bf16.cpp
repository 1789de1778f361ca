// The NEON copy of the CPU attention kernels with the BF16 extension (FEAT_BF16; aarch64 only, chosen at
// run time where Linux reports it): bf16 queries over bf16 caches score by bfdot.
#include "ops/cpu/attention_cpu.h"

#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+bf16")
#define PAGEDKV_CPU_ISA neon_bf16
#define PAGEDKV_CPU_AVX2 0
#define PAGEDKV_CPU_AVX512 0
#define PAGEDKV_CPU_AMX 0
#define PAGEDKV_CPU_NEON 1
#define PAGEDKV_CPU_NEON_BF16 1
#define PAGEDKV_CPU_SVE 0
#include "ops/cpu/kernels.inc"
#endif
