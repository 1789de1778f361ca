// The AVX2 + FMA + F16C copy of the CPU attention kernels (x86-64 only; chosen at run time).
#include "ops/cpu/attention_cpu.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#define PAGEDKV_CPU_ISA avx2
#define PAGEDKV_CPU_AVX2 1
#define PAGEDKV_CPU_AVX512 0
#define PAGEDKV_CPU_AMX 0
#define PAGEDKV_CPU_NEON 0
#include "ops/cpu/kernels.inc"
#endif
