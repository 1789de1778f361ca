// The AVX-512 (F, BW, VL, DQ, BF16) copy of the CPU attention kernels (x86-64 only; chosen at run time).
#include "ops/cpu/attention_cpu.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define PAGEDKV_CPU_ISA avx512
#define PAGEDKV_CPU_AVX2 1
#define PAGEDKV_CPU_AVX512 1
#include "ops/cpu/kernels.inc"
#endif
