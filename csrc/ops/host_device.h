// PAGEDKV_HD: marks the small helpers shared by the CPU (g++) and CUDA (nvcc) kernels; host and device
// functions under nvcc, plain inline functions elsewhere. Torch-free.
#pragma once

#ifdef __CUDACC__
#define PAGEDKV_HD __host__ __device__ __forceinline__
#else
#define PAGEDKV_HD inline
#endif
