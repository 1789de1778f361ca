// The Advanced SIMD (NEON) copy of the CPU attention kernels (aarch64 only, where every CPU has it).
#include "ops/cpu/attention_cpu.h"

#if defined(__aarch64__)
#define PAGEDKV_CPU_ISA neon
#define PAGEDKV_CPU_AVX2 0
#define PAGEDKV_CPU_AVX512 0
#define PAGEDKV_CPU_AMX 0
#define PAGEDKV_CPU_NEON 1
#define PAGEDKV_CPU_NEON_BF16 0
#define PAGEDKV_CPU_SVE 0
#include "ops/cpu/kernels.inc"
#endif
