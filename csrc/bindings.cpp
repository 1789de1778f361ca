// pybind11 bindings, the extension module pagedkv._C: block hashing and the build's facts here, the block
// manager in bindings_block_manager.cpp, Python argument conversion in bindings_args.h. The torch.ops.pagedkv
// operators live in their own library (csrc/ops, pagedkv/_ops*.so). No torch header or library: tensors
// cross through DLPack (bindings_tensors.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings_args.h"
#include "core/errors.h"
#include "core/hashing.h"

namespace py = pybind11;
using namespace pagedkv;
using namespace pagedkv::bindings;

namespace pagedkv::bindings {
void bind_block_manager(py::module_& m);  // bindings_block_manager.cpp
}  // namespace pagedkv::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv native module: the block manager and block hashing";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const KeyError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const OutOfBlocks& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (const InvariantError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def(
      "hash_block_tokens",
      [](const py::object& token_ids, std::optional<uint64_t> parent_hash, const std::string& algo,
         const std::optional<py::object>& cache_salt) {
        Int64Array tokens(token_ids, "token_ids");
        return hash_block_tokens(tokens.data, tokens.size, parent_hash, parse_hash_algo(algo), salt_bytes(cache_salt));
      },
      py::arg("token_ids"), py::arg("parent_hash") = py::none(), py::kw_only(), py::arg("algo") = "xxh64",
      py::arg("cache_salt") = py::none(),
      "Hash of one block: xxh64(seed=0, parent as 8 little-endian bytes + tokens as int64 little-endian).");
  m.def("sha256_available", &sha256_available);
  m.def("_set_dlpack_exchange", &set_dlpack_exchange_enabled, py::arg("enabled"),
        "Tests only: False makes tensors cross through __dlpack__ capsules and torch.from_dlpack, as under a\n"
        "torch without the DLPack exchange table (before 2.10).");
  m.def("_dlpack_exchange", &dlpack_exchange_enabled, "Whether tensors cross through torch's DLPack exchange table.");
  bind_block_manager(m);
}
