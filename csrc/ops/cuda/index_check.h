// Host side of PAGEDKV_CHECK_INDICES=1 for the CUDA ops: a zeroed device IndexError per call when the
// environment variable is set (else nothing: the kernels skip bad indices silently), read back after
// the launch (this syncs the stream) and turned into a RuntimeError naming the bad index.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/cuda/device_compat.cuh"

namespace pagedkv {

inline bool check_indices_enabled() {
  const char* flag = std::getenv("PAGEDKV_CHECK_INDICES");
  return flag != nullptr && flag[0] != '\0' && std::strcmp(flag, "0") != 0;
}

class DeviceIndexCheck {
 public:
  explicit DeviceIndexCheck(const at::Device& device) {
    if (check_indices_enabled()) {
      static_assert(sizeof(IndexError) % sizeof(int64_t) == 0, "IndexError is a whole number of int64");
      buffer_ = at::zeros({int64_t(sizeof(IndexError) / sizeof(int64_t))},
                          at::TensorOptions().dtype(at::kLong).device(device));
    }
  }
  IndexError* error() const {
    return buffer_.defined() ? reinterpret_cast<IndexError*>(buffer_.data_ptr<int64_t>()) : nullptr;
  }
  void raise_if_any(const char* op, const char* const* names, const int64_t* bounds) const {
    if (!buffer_.defined()) return;
    const at::Tensor host = buffer_.cpu();
    IndexError error{};
    std::memcpy(&error, host.data_ptr<int64_t>(), sizeof(error));
    const std::string message = index_error_message(error, op, names, bounds);
    TORCH_CHECK(message.empty(), message);
  }

 private:
  at::Tensor buffer_;
};

}  // namespace pagedkv
