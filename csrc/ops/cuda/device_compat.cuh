// What the kernel headers (*.cuh) need beyond plain CUDA C++ so that they compile both with nvcc and
// with pagedkv's CUDA-on-CPU runtime (tests/cuda_emu, which defines PAGEDKV_CUDA_EMU): shared-memory
// declarations through macros, and the device-side record of an out-of-range index
// (PAGEDKV_CHECK_INDICES=1). Torch-free.
#pragma once

#include <cstdint>
#include <string>

#ifdef PAGEDKV_CUDA_EMU
#include "cuda_emu.h"
// Static __shared__ variables and the dynamic (extern) buffer live in the emulated block's arena.
#define PAGEDKV_SHARED(type, name) \
  static const char name##_shared_tag = 0;          \
  type& name = *static_cast<type*>(::cuda_emu::static_shared(&name##_shared_tag, sizeof(type), alignof(type)))
#define PAGEDKV_SHARED_ARRAY(type, name, count)                                                       \
  static const char name##_shared_tag = 0;                                                            \
  type* name = static_cast<type*>(                                                                    \
      ::cuda_emu::static_shared(&name##_shared_tag, sizeof(type) * (count), alignof(type)))
#define PAGEDKV_DYNAMIC_SHARED(name) unsigned char* name = ::cuda_emu::dynamic_shared()
#else
#define PAGEDKV_SHARED(type, name) __shared__ type name
#define PAGEDKV_SHARED_ARRAY(type, name, count) __shared__ type name[count]
#define PAGEDKV_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace pagedkv {

// The first out-of-range index a kernel met (under PAGEDKV_CHECK_INDICES=1): `claimed` is 0 until a
// thread records one; `argument` says which of the op's index arguments held it (the op's own
// numbering), `value` is the bad index and `where` its flat position in that argument.
struct IndexError {
  unsigned long long claimed;
  long long argument;
  long long value;
  long long where;
};

// Records the error unless another thread got there first. No-op when checking is off (null).
__device__ __forceinline__ void report_bad_index(IndexError* error, int argument, int64_t value, int64_t where) {
  if (error != nullptr && atomicCAS(&error->claimed, 0ull, 1ull) == 0ull) {
    error->argument = argument;
    error->value = value;
    error->where = where;
  }
}

// The host's message for a recorded error ("" when none): `op` names the op; argument i of the
// error is called names[i] and its valid range is [0, bounds[i]).
inline std::string index_error_message(const IndexError& error, const char* op, const char* const* names,
                                       const int64_t* bounds) {
  if (error.claimed == 0) return "";
  return std::string(op) + ": " + names[error.argument] + " holds " + std::to_string(error.value) +
         " at flat index " + std::to_string(error.where) + ", outside [0, " +
         std::to_string(bounds[error.argument]) +
         ") (found by PAGEDKV_CHECK_INDICES=1; without it the kernel skips such entries)";
}

}  // namespace pagedkv
