// torch tensors through DLPack (bindings_tensors.h): the exchange table or, without one, capsules.
#include "bindings_tensors.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/errors.h"

namespace pagedkv::bindings {

namespace {

// What this module needs of torch, looked up once (torch is imported by then: pagedkv imports it first).
struct Torch {
  PyTypeObject* tensor_type = nullptr;
  PyObject* from_dlpack = nullptr;        // torch.from_dlpack, for capsules
  const DLPackExchangeAPI* api = nullptr;  // null below torch 2.10, or when its DLPack major differs
};

const DLPackExchangeAPI* find_exchange_api(PyObject* tensor_type) {
  PyObject* capsule = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
  if (!capsule) {
    PyErr_Clear();
    return nullptr;
  }
  auto* header = static_cast<DLPackExchangeAPIHeader*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  Py_DECREF(capsule);  // the table is static in torch: it outlives the capsule
  if (!header) PyErr_Clear();
  while (header && header->version.major != DLPACK_MAJOR_VERSION) header = header->prev_api;
  return reinterpret_cast<const DLPackExchangeAPI*>(header);
}

const Torch& torch_module() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<Torch> storage;
  return storage
      .call_once_and_store_result([] {
        py::module_ torch = py::module_::import("torch");
        Torch t;
        py::object tensor = torch.attr("Tensor");
        t.tensor_type = reinterpret_cast<PyTypeObject*>(tensor.release().ptr());  // kept for the process
        t.from_dlpack = py::object(torch.attr("from_dlpack")).release().ptr();
        t.api = find_exchange_api(reinterpret_cast<PyObject*>(t.tensor_type));
        return t;
      })
      .get_stored();
}

std::atomic<bool> exchange_enabled{true};

const DLPackExchangeAPI* exchange_api() {
  return exchange_enabled.load(std::memory_order_relaxed) ? torch_module().api : nullptr;
}

std::string python_str(PyObject* obj, const char* attr) {
  PyObject* value = PyObject_GetAttrString(obj, attr);
  if (!value) {
    PyErr_Clear();
    return "?";
  }
  return std::string(py::str(py::reinterpret_steal<py::object>(value)));
}

// What a result tensor's memory holds: its DLPack descriptions, its shape, then (64-byte aligned) its data.
struct Allocation {
  DLManagedTensorVersioned managed;
  DLManagedTensor legacy;  // for torch.from_dlpack without the exchange table
  int64_t shape[2];
  int64_t strides[2];
};
constexpr size_t kAlign = 64;
constexpr size_t kDataOffset = (sizeof(Allocation) + kAlign - 1) / kAlign * kAlign;

void free_managed(DLManagedTensorVersioned* self) { std::free(self->manager_ctx); }
void free_legacy(DLManagedTensor* self) { std::free(self->manager_ctx); }

void free_unconsumed_capsule(PyObject* capsule) {
  // torch renames a capsule it consumed ("used_dltensor"); one never consumed still owns its tensor.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* legacy = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    legacy->deleter(legacy);
  }
}

}  // namespace

bool is_torch_tensor(PyObject* obj) { return PyObject_TypeCheck(obj, torch_module().tensor_type); }

void set_dlpack_exchange_enabled(bool enabled) { exchange_enabled.store(enabled, std::memory_order_relaxed); }
bool dlpack_exchange_enabled() { return exchange_api() != nullptr; }

TensorView::TensorView(PyObject* tensor, const char* name) : tensor_(py::reinterpret_borrow<py::object>(tensor)) {
  const DLPackExchangeAPI* api = exchange_api();
  if (api && api->dltensor_from_py_object_no_sync) {
    if (api->dltensor_from_py_object_no_sync(tensor, &dl_) == 0) {
      check_data(name);
      return;
    }
  } else if (api) {
    if (api->managed_tensor_from_py_object_no_sync(tensor, &managed_) == 0) {
      dl_ = managed_->dl_tensor;
      try {
        check_data(name);
      } catch (...) {  // the destructor does not run for a constructor that throws
        managed_->deleter(managed_);
        throw;
      }
      return;
    }
    managed_ = nullptr;
  } else if (PyObject* capsule = PyObject_CallMethod(tensor, "__dlpack__", nullptr)) {
    capsule_ = py::reinterpret_steal<py::object>(capsule);
    if (auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"))) {
      dl_ = m->dl_tensor;
      check_data(name);
      return;
    }
  }
  // torch cannot describe it (a meta or sparse tensor, ...): say what it is, as a Python error.
  const py::error_already_set cause;
  const std::string device = python_str(tensor, "device"), dtype = python_str(tensor, "dtype");
  if (device.rfind("cpu", 0) != 0 && device.rfind("cuda", 0) != 0)
    throw ValueError(std::string(name) + " must be a CPU or CUDA tensor, got device " + device);
  std::string why = cause.what();
  why = why.substr(0, why.find('\n'));  // torch's message, without its C++ backtrace
  throw ValueError(std::string(name) + ": torch cannot export this tensor (dtype " + dtype + ", device " + device +
                   ") through DLPack: " + why);
}

void TensorView::check_data(const char* name) const {
  // A FakeTensor (or another subclass without storage) exports a null pointer on a real device.
  int64_t numel = 1;
  for (int d = 0; d < dl_.ndim; ++d) numel *= dl_.shape[d];
  if (!dl_.data && numel != 0)
    throw ValueError(std::string(name) + " has no data (a fake tensor, or another tensor without storage): " +
                     python_str(tensor_.ptr(), "__class__"));
}

TensorView::~TensorView() {
  if (managed_ && managed_->deleter) managed_->deleter(managed_);
}

int64_t TensorView::stride(int d) const {
  if (dl_.strides) return dl_.strides[d];
  int64_t s = 1;  // no strides (DLPack before 1.2): contiguous
  for (int i = d + 1; i < dl_.ndim; ++i) s *= dl_.shape[i];
  return s;
}

std::string TensorView::dtype_name() const { return python_str(tensor_.ptr(), "dtype"); }
std::string TensorView::device_name() const { return python_str(tensor_.ptr(), "device"); }

py::object to_cpu(PyObject* tensor) {
  PyObject* cpu = PyObject_CallMethod(tensor, "cpu", nullptr);
  if (!cpu) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(cpu);
}

CpuTensor::CpuTensor(std::initializer_list<int64_t> shape, DLDataType dtype) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * (dtype.bits / 8);
  const size_t total = (kDataOffset + bytes + kAlign - 1) / kAlign * kAlign;
  void* memory = std::aligned_alloc(kAlign, total);
  if (!memory) throw std::bad_alloc();
  auto* a = new (memory) Allocation{};
  int i = 0;
  for (int64_t s : shape) a->shape[i++] = s;
  const int ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    a->strides[d] = stride;
    stride *= a->shape[d];
  }
  DLTensor& t = a->managed.dl_tensor;
  t.data = static_cast<char*>(memory) + kDataOffset;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = a->shape;
  t.strides = a->strides;
  t.byte_offset = 0;
  a->managed.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  a->managed.manager_ctx = memory;
  a->managed.deleter = free_managed;
  a->managed.flags = 0;
  managed_ = &a->managed;
}

CpuTensor::~CpuTensor() {
  if (managed_) managed_->deleter(managed_);
}

CpuTensor& CpuTensor::operator=(CpuTensor&& other) noexcept {
  if (this != &other) {
    if (managed_) managed_->deleter(managed_);
    managed_ = other.managed_;
    other.managed_ = nullptr;
  }
  return *this;
}

int64_t CpuTensor::numel() const {
  int64_t n = 1;
  for (int d = 0; d < managed_->dl_tensor.ndim; ++d) n *= managed_->dl_tensor.shape[d];
  return n;
}

TorchTensor CpuTensor::release() {
  if (const DLPackExchangeAPI* api = exchange_api()) {
    void* out = nullptr;
    // Handed over before the call: after a failure torch may have taken it already, and a leak on that
    // rare path is safer than a double free.
    DLManagedTensorVersioned* managed = managed_;
    managed_ = nullptr;
    if (api->managed_tensor_to_py_object_no_sync(managed, &out) != 0) throw py::error_already_set();
    return TorchTensor(py::reinterpret_steal<py::object>(static_cast<PyObject*>(out)));
  }
  auto* a = static_cast<Allocation*>(managed_->manager_ctx);
  a->legacy.dl_tensor = a->managed.dl_tensor;
  a->legacy.manager_ctx = a;
  a->legacy.deleter = free_legacy;
  PyObject* capsule = PyCapsule_New(&a->legacy, "dltensor", free_unconsumed_capsule);
  if (!capsule) throw py::error_already_set();
  managed_ = nullptr;  // the capsule owns it now
  py::object owner = py::reinterpret_steal<py::object>(capsule);
  PyObject* tensor = PyObject_CallOneArg(torch_module().from_dlpack, capsule);
  if (!tensor) throw py::error_already_set();
  return TorchTensor(py::reinterpret_steal<py::object>(tensor));
}

}  // namespace pagedkv::bindings
