// The AVX-512 (F, BW, VL, DQ, BF16) copy of the CPU attention kernels (x86-64 only; chosen at run time).
#include "ops/cpu/attention_cpu.h"

#if defined(__x86_64__)
// GCC 12's avx512fintrin.h trips (maybe-)uninitialized warnings on its own _mm512_undefined_* values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define PAGEDKV_CPU_ISA avx512
#define PAGEDKV_CPU_AVX2 1
#define PAGEDKV_CPU_AVX512 1
#define PAGEDKV_CPU_AMX 0
#define PAGEDKV_CPU_NEON 0
#include "ops/cpu/kernels.inc"
#endif
