// The tensor API the ops are written against. pagedkv/_ops*.so compiles with TORCH_STABLE_ONLY: Tensor is
// torch::stable::Tensor and every call into torch goes through its stable C ABI (aoti_torch_* / torch_*
// shims), so one binary loads under every torch release from TORCH_TARGET_VERSION on. The CUDA kernels
// (pagedkv/_C_cuda*.so) still build against ATen and compile the same argument checks with
// Tensor = at::Tensor; the helpers below are where the two differ.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

#ifdef TORCH_STABLE_ONLY
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#else
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#endif

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace pagedkv {

using ScalarType = torch::headeronly::ScalarType;  // c10::ScalarType itself

#ifdef TORCH_STABLE_ONLY
using Tensor = torch::stable::Tensor;
#else
using Tensor = at::Tensor;
#endif

// "[2, 3, 4]": a shape or strides in an error message.
template <typename Dims>
std::string dims_str(const Dims& dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}
inline std::string shape_str(const Tensor& t) { return dims_str(t.sizes()); }
inline std::string strides_str(const Tensor& t) { return dims_str(t.strides()); }

// "cpu", "cuda:0": as torch prints a device.
inline std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device());
  return "device type " + std::to_string(static_cast<int>(t.device().type()));
}

inline bool same_device(const Tensor& a, const Tensor& b) { return a.device() == b.device(); }

// A fresh contiguous copy (never a view of t): the values a kernel checks are then the values it reads.
inline Tensor contiguous_copy(const Tensor& t, ScalarType dtype) {
#ifdef TORCH_STABLE_ONLY
  return torch::stable::to(t, dtype, std::nullopt, std::nullopt, std::nullopt, /*non_blocking=*/false,
                           /*copy=*/true, torch::headeronly::MemoryFormat::Contiguous);
#else
  return t.to(dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
#endif
}
inline Tensor contiguous_copy(const Tensor& t) { return contiguous_copy(t, t.scalar_type()); }

// t itself when contiguous, else a contiguous copy.
inline Tensor as_contiguous(const Tensor& t) {
#ifdef TORCH_STABLE_ONLY
  return torch::stable::contiguous(t);
#else
  return t.contiguous();
#endif
}

// An uninitialised contiguous tensor on like's device.
inline Tensor empty(const std::vector<int64_t>& sizes, ScalarType dtype, const Tensor& like) {
#ifdef TORCH_STABLE_ONLY
  return torch::stable::empty(sizes, dtype, std::nullopt, like.device());
#else
  return at::empty(sizes, like.options().dtype(dtype));
#endif
}

inline Tensor unsqueeze_view(const Tensor& t, int64_t dim) {
#ifdef TORCH_STABLE_ONLY
  return torch::stable::unsqueeze(t, dim);
#else
  return t.unsqueeze(dim);
#endif
}

inline bool in_pinned_memory(const Tensor& t) {
#ifdef TORCH_STABLE_ONLY
  return torch::stable::is_pinned(t);
#else
  return t.is_pinned();
#endif
}

// torch's intra-op thread count and its parallel loop (at::parallel_for: OpenMP in torch's build).
inline int64_t num_threads() {
#ifdef TORCH_STABLE_ONLY
  return static_cast<int64_t>(torch::stable::get_num_threads());
#else
  return at::get_num_threads();
#endif
}

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain_size, const F& f) {
#ifdef TORCH_STABLE_ONLY
  torch::stable::parallel_for(begin, end, grain_size, f);
#else
  at::parallel_for(begin, end, grain_size, f);
#endif
}

}  // namespace pagedkv
