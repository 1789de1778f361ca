// Integer helpers shared by the core and the kernels (host and device code alike). Torch-free.
#pragma once
#include <cstdint>

namespace pagedkv {

// ceil(a / b) for a >= 0 and b > 0, without the overflow of (a + b - 1) / b.
#ifdef __CUDACC__
__host__ __device__
#endif
constexpr int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0);
}

}  // namespace pagedkv
