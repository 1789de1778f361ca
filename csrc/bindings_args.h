// Python arguments of the bindings: integers, batches of ids or tokens (Int64Array: a list, a tensor or
// any integer buffer, read in place when it already is contiguous int64) and salts. Tensors cross through
// DLPack (bindings_tensors.h): nothing here includes torch.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "bindings_tensors.h"
#include "core/errors.h"
#include "core/span.h"

namespace pagedkv::bindings {

namespace py = pybind11;

[[noreturn]] inline void raise_overflow(const std::string& msg) {
  PyErr_SetString(PyExc_OverflowError, msg.c_str());
  throw py::error_already_set();
}

// One Python int (or an object with __index__, e.g. a numpy integer) as int64: TypeError for anything
// else (floats, bools, str), OverflowError outside int64.
inline int64_t to_int64(py::handle obj, const char* name) {
  PyObject* o = obj.ptr();
  if (PyBool_Check(o) || !(PyLong_Check(o) || (PyIndex_Check(o) && !PyFloat_Check(o))))
    throw py::type_error(std::string(name) + " must be an int, got " + Py_TYPE(o)->tp_name);
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(o));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow) raise_overflow(std::string(name) + " = " + std::string(py::str(index)) + " does not fit in int64");
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Copies n integers of type T from a strided buffer, refusing values outside int64.
template <typename T>
void copy_strided(const char* base, Py_ssize_t stride, size_t n, int64_t* out, const char* name) {
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, base + static_cast<Py_ssize_t>(i) * stride, sizeof(T));
    if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8) {
      if (v > static_cast<T>(std::numeric_limits<int64_t>::max()))
        raise_overflow(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(v) + " does not fit in int64");
    }
    out[i] = static_cast<int64_t>(v);
  }
}

// Releases a buffer taken with PyObject_GetBuffer (the GIL is held: Int64Arrays live inside a binding).
struct BufferRelease {
  void operator()(Py_buffer* view) const {
    PyBuffer_Release(view);
    delete view;
  }
};

// A 1-D int64 view of the integers a caller passes: a list or tuple of ints, a 1-D integer tensor, or any
// 1-D integer buffer (numpy arrays, array.array, memoryview), the last two converted without a Python
// call per element. Contiguous native int64 arrays and CPU tensors are read in place (zero-copy, for the
// duration of the call: the core copies what it keeps); other dtypes and strided views are converted.
// Floats, bools and strings are a TypeError; values outside int64 an OverflowError.
struct Int64Array {
  std::vector<int64_t> storage;
  py::object owner;  // the tensor read in place, or its host copy
  std::unique_ptr<Py_buffer, BufferRelease> buffer;  // the caller's buffer, when read in place
  const int64_t* data = nullptr;
  size_t size = 0;

  Int64Array(const py::handle& obj, const char* name) {
    if (is_torch_tensor(obj.ptr())) {
      from_tensor(obj.ptr(), name);
    } else if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || PyByteArray_Check(obj.ptr())) {
      throw py::type_error(std::string(name) + " must be a sequence of ints, an integer array or tensor, got " +
                           Py_TYPE(obj.ptr())->tp_name);
    } else if (PyObject_CheckBuffer(obj.ptr())) {
      from_buffer(obj, name);
    } else if (py::isinstance<py::sequence>(obj)) {
      from_sequence(obj, name);
    } else {
      throw py::type_error(std::string(name) + " must be a sequence of ints, an integer array or tensor, got " +
                           Py_TYPE(obj.ptr())->tp_name);
    }
  }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(data, data + size); }
  pagedkv::Span<int64_t> span() const { return {data, size}; }

 private:
  // A 1-D integer tensor of any device: a CPU one is read through DLPack (in place when it is contiguous
  // int64), a CUDA one is copied to the host first.
  void from_tensor(PyObject* t, const char* name) {
    const TensorView view(t, name);
    if (view.ndim() != 1)
      throw ValueError(std::string(name) + " must be 1-D, got a tensor with " + std::to_string(view.ndim()) + " dimensions");
    if (!view.is_integer())
      throw py::type_error(std::string(name) + " must hold integers, got dtype " + view.dtype_name());
    if (view.is_cuda()) {
      from_tensor(to_cpu(t).ptr(), name);  // read in place, the copy is kept as the owner
      return;
    }
    if (!view.is_cpu())
      throw ValueError(std::string(name) + " must be a CPU or CUDA tensor, got device " + view.device_name());
    const DLDataType dtype = view.dl().dtype;
    const size_t n = static_cast<size_t>(view.size(0));
    const int64_t stride = view.stride(0);
    const char* base = view.data();
    if (dtype.code == kDLInt && dtype.bits == 64 && dtype.lanes == 1 && (stride == 1 || n <= 1) &&
        reinterpret_cast<uintptr_t>(base) % alignof(int64_t) == 0) {  // in place: the hot path
      owner = py::reinterpret_borrow<py::object>(t);
      data = reinterpret_cast<const int64_t*>(base);
      size = n;
      return;
    }
    storage.resize(n);
    const Py_ssize_t step = static_cast<Py_ssize_t>(stride) * (dtype.bits / 8);
    int64_t* out = storage.data();
    switch (dtype.lanes == 1 ? dtype.bits * (dtype.code == kDLInt ? 1 : -1) : 0) {
      case 8: copy_strided<int8_t>(base, step, n, out, name); break;
      case 16: copy_strided<int16_t>(base, step, n, out, name); break;
      case 32: copy_strided<int32_t>(base, step, n, out, name); break;
      case 64: copy_strided<int64_t>(base, step, n, out, name); break;
      case -8: copy_strided<uint8_t>(base, step, n, out, name); break;
      case -16: copy_strided<uint16_t>(base, step, n, out, name); break;
      case -32: copy_strided<uint32_t>(base, step, n, out, name); break;
      case -64: copy_strided<uint64_t>(base, step, n, out, name); break;
      default: throw py::type_error(std::string(name) + " must hold integers, got dtype " + view.dtype_name());
    }
    data = storage.data();
    size = n;
  }

  void from_buffer(const py::handle& obj, const char* name) {
    std::unique_ptr<Py_buffer> taken(new Py_buffer);
    if (PyObject_GetBuffer(obj.ptr(), taken.get(), PyBUF_RECORDS_RO) != 0) throw py::error_already_set();
    buffer.reset(taken.release());
    const Py_buffer& view = *buffer;
    if (view.ndim != 1)
      throw ValueError(std::string(name) + " must be 1-D, got an array with " + std::to_string(view.ndim) + " dimensions");
    std::string_view fmt = view.format ? view.format : "B";
    if (!fmt.empty() && (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<')) fmt.remove_prefix(1);
    const bool is_signed = fmt.size() == 1 && std::string_view("bhilqn").find(fmt[0]) != std::string_view::npos;
    const bool is_unsigned = fmt.size() == 1 && std::string_view("BHILQN").find(fmt[0]) != std::string_view::npos;
    if (!is_signed && !is_unsigned)
      throw py::type_error(std::string(name) + " must hold native-endian integers, got an array of format '" +
                           std::string(view.format ? view.format : "B") + "'");
    const char* base = static_cast<const char*>(view.buf);
    const Py_ssize_t stride = view.strides ? view.strides[0] : view.itemsize;
    if (is_signed && view.itemsize == 8 && stride == 8 && reinterpret_cast<uintptr_t>(base) % alignof(int64_t) == 0) {
      data = reinterpret_cast<const int64_t*>(base);  // native int64, contiguous: read in place
      size = static_cast<size_t>(view.shape[0]);
      return;
    }
    storage.resize(static_cast<size_t>(view.shape[0]));
    int64_t* out = storage.data();
    const size_t n = storage.size();
    switch (view.itemsize * (is_signed ? 1 : -1)) {
      case 1: copy_strided<int8_t>(base, stride, n, out, name); break;
      case 2: copy_strided<int16_t>(base, stride, n, out, name); break;
      case 4: copy_strided<int32_t>(base, stride, n, out, name); break;
      case 8: copy_strided<int64_t>(base, stride, n, out, name); break;
      case -1: copy_strided<uint8_t>(base, stride, n, out, name); break;
      case -2: copy_strided<uint16_t>(base, stride, n, out, name); break;
      case -4: copy_strided<uint32_t>(base, stride, n, out, name); break;
      case -8: copy_strided<uint64_t>(base, stride, n, out, name); break;
      default: throw py::type_error(std::string(name) + ": unsupported integer size " + std::to_string(view.itemsize));
    }
    data = storage.data();
    size = storage.size();
    buffer.reset();  // converted: the caller's buffer is no longer needed
  }

  void from_sequence(const py::handle& obj, const char* name) {
    // Direct CPython access: several times faster than pybind11's generic list caster.
    py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), name));
    if (!seq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    storage.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      int overflow = 0;
      if (PyLong_CheckExact(item)) {
        storage[i] = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow)
          raise_overflow(std::string(name) + "[" + std::to_string(i) + "] = " + std::string(py::str(item)) +
                         " does not fit in int64");
      } else {
        if (PyBool_Check(item) || !(PyLong_Check(item) || (PyIndex_Check(item) && !PyFloat_Check(item))))
          throw py::type_error(std::string(name) + " must contain only ints, found " + Py_TYPE(item)->tp_name +
                               " at index " + std::to_string(i));
        storage[i] = to_int64(item, name);
      }
    }
    data = storage.data();
    size = storage.size();
  }
};

inline std::string salt_bytes(const std::optional<py::object>& salt) {
  if (!salt || salt->is_none()) return {};
  if (py::isinstance<py::bytes>(*salt)) return salt->cast<std::string>();
  if (py::isinstance<py::str>(*salt)) return salt->cast<std::string>();  // UTF-8
  throw py::type_error("cache_salt must be bytes, str or None");
}

// A single integer (a Python int, a numpy integer, ...), as opposed to a sequence or array of them.
inline bool is_int_scalar(const py::handle& obj) {
  PyObject* o = obj.ptr();
  return PyLong_Check(o) || (PyIndex_Check(o) && !PySequence_Check(o) && !is_torch_tensor(o));
}


// obj as a list or tuple (itself when it is one), whose items stay alive as long as the result.
inline py::object fast_sequence(const py::handle& obj, const char* name) {
  if (!PySequence_Check(obj.ptr()) || py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj))
    throw py::type_error(std::string(name) + " must be a list or tuple, got " + Py_TYPE(obj.ptr())->tp_name);
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), name));
  if (!seq) throw py::error_already_set();
  return seq;
}

}  // namespace pagedkv::bindings
