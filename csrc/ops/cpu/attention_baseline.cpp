// The portable copy of the CPU attention kernels: the compiler's baseline ISA, any CPU.
#pragma GCC diagnostic ignored "-Wpsabi"  // vectors wider than the baseline ISA between inline helpers
#include "ops/cpu/attention_cpu.h"

#define PAGEDKV_CPU_ISA baseline
#define PAGEDKV_CPU_AVX2 0
#define PAGEDKV_CPU_AVX512 0
#define PAGEDKV_CPU_AMX 0
#define PAGEDKV_CPU_NEON 0
#include "ops/cpu/kernels.inc"
