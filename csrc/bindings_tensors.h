// torch tensors across a module that never includes or links torch: arguments are read through DLPack
// (a borrowed DLTensor view), results are CPU tensors that C++ allocates and fills, handed to torch as a
// DLManagedTensorVersioned. Both go through torch's DLPack exchange table (torch.Tensor's
// __dlpack_c_exchange_api__, torch >= 2.10: C calls, no Python method per tensor); under an older torch
// they go through __dlpack__ capsules and torch.from_dlpack.
#pragma once
#include <pybind11/pybind11.h>

#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace pagedkv::bindings {

namespace py = pybind11;

// A Python object that is a torch.Tensor; typed so that signatures read "torch.Tensor".
class TorchTensor : public py::object {
 public:
  using py::object::object;
  TorchTensor(py::object&& o) : py::object(std::move(o)) {}
};

// Whether obj is a torch.Tensor (or a subclass). Imports torch on first use.
bool is_torch_tensor(PyObject* obj);

// A tensor's DLTensor, borrowed for the duration of a binding call (the object stays referenced).
class TensorView {
 public:
  // Raises ValueError naming `name` when torch cannot describe the tensor through DLPack (e.g. a meta or
  // sparse tensor).
  TensorView(PyObject* tensor, const char* name);
  ~TensorView();
  TensorView(const TensorView&) = delete;
  TensorView& operator=(const TensorView&) = delete;

  const DLTensor& dl() const { return dl_; }
  int ndim() const { return dl_.ndim; }
  int64_t size(int d) const { return dl_.shape[d]; }
  // Stride of dimension d in elements (a null strides array means a contiguous tensor).
  int64_t stride(int d) const;
  bool is_cpu() const { return dl_.device.device_type == kDLCPU || dl_.device.device_type == kDLCUDAHost; }
  bool is_cuda() const { return dl_.device.device_type == kDLCUDA || dl_.device.device_type == kDLCUDAManaged; }
  bool is_integer() const { return dl_.dtype.code == kDLInt || dl_.dtype.code == kDLUInt; }
  const char* data() const { return static_cast<const char*>(dl_.data) + dl_.byte_offset; }
  // "torch.float32", "torch.bool", ...: the tensor's dtype as Python prints it.
  std::string dtype_name() const;
  // "cuda:0", "meta", ...
  std::string device_name() const;

 private:
  void check_data(const char* name) const;

  py::object tensor_;
  DLTensor dl_{};
  DLManagedTensorVersioned* managed_ = nullptr;  // owned, when torch exported a managed tensor
  py::object capsule_;                           // owns the export, without the exchange table
};

// tensor.cpu(): a CUDA tensor's copy on the host.
py::object to_cpu(PyObject* tensor);

// A new CPU tensor of `dtype` that C++ fills before handing it to Python. The memory is owned by the
// tensor (freed when torch frees it) and 64-byte aligned.
class CpuTensor {
 public:
  CpuTensor(std::initializer_list<int64_t> shape, DLDataType dtype);
  ~CpuTensor();
  CpuTensor(const CpuTensor&) = delete;
  CpuTensor& operator=(const CpuTensor&) = delete;
  CpuTensor(CpuTensor&& other) noexcept : managed_(other.managed_) { other.managed_ = nullptr; }
  CpuTensor& operator=(CpuTensor&& other) noexcept;

  template <typename T>
  T* data() const {
    return static_cast<T*>(managed_->dl_tensor.data);
  }
  int64_t numel() const;
  // The torch.Tensor; this object is empty afterwards.
  TorchTensor release();

 private:
  DLManagedTensorVersioned* managed_;
};

inline constexpr DLDataType kInt64{kDLInt, 64, 1};
inline constexpr DLDataType kInt32{kDLInt, 32, 1};

// Turns off torch's exchange table, so the capsule path (what an older torch gets) is used: for tests.
void set_dlpack_exchange_enabled(bool enabled);
bool dlpack_exchange_enabled();

}  // namespace pagedkv::bindings

namespace pybind11::detail {
template <>
struct handle_type_name<pagedkv::bindings::TorchTensor> {
  static constexpr auto name = const_name("torch.Tensor");
};
}  // namespace pybind11::detail
