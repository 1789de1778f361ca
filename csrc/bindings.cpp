// pybind11 bindings of the block manager, in the extension module pagedkv._C (which also registers the
// torch.ops.pagedkv operators from csrc/ops). Token ids and sequence ids are accepted as Python
// sequences of ints or as 1-D integer tensors; batched results come back as CPU tensors.
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/block_manager.h"
#include "core/errors.h"
#include "core/hashing.h"

namespace py = pybind11;
using namespace pagedkv;

namespace {

// A 1-D int64 view of a Python list/tuple of ints or of an integer tensor.
struct Int64Array {
  std::vector<int64_t> storage;
  torch::Tensor tensor;
  const int64_t* data = nullptr;
  size_t size = 0;

  Int64Array(const py::handle& obj, const char* name) {
    if (THPVariable_Check(obj.ptr())) {
      torch::Tensor t = THPVariable_Unpack(obj.ptr());
      if (t.dim() != 1) throw ValueError(std::string(name) + " must be 1-D, got a tensor with " + std::to_string(t.dim()) + " dimensions");
      if (at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool || at::isComplexType(t.scalar_type()))
        throw ValueError(std::string(name) + " must hold integers, got dtype " + std::string(c10::toString(t.scalar_type())));
      tensor = t.to(torch::kCPU, torch::kInt64).contiguous();
      data = tensor.data_ptr<int64_t>();
      size = static_cast<size_t>(tensor.numel());
      return;
    }
    if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || !py::isinstance<py::sequence>(obj))
      throw py::type_error(std::string(name) + " must be a sequence of ints or an integer tensor, got " +
                           std::string(py::str(py::type::of(obj).attr("__name__"))));
    // Direct CPython access: several times faster than pybind11's generic list caster.
    PyObject* seq = PySequence_Fast(obj.ptr(), name);
    if (!seq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    storage.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyLong_Check(items[i])) {
        Py_DECREF(seq);
        throw py::type_error(std::string(name) + " must contain only ints, found " + Py_TYPE(items[i])->tp_name);
      }
      int overflow = 0;
      storage[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
      if (overflow) {
        Py_DECREF(seq);
        throw ValueError(std::string(name) + " holds an int that does not fit in int64");
      }
    }
    Py_DECREF(seq);
    data = storage.data();
    size = storage.size();
  }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(data, data + size); }
};

std::string salt_bytes(const std::optional<py::object>& salt) {
  if (!salt || salt->is_none()) return {};
  if (py::isinstance<py::bytes>(*salt)) return salt->cast<std::string>();
  if (py::isinstance<py::str>(*salt)) return salt->cast<std::string>();  // UTF-8
  throw py::type_error("cache_salt must be bytes, str or None");
}

// seq_ids: one id or a sequence of ids.
std::vector<int64_t> seq_id_list(const py::handle& obj) {
  if (py::isinstance<py::int_>(obj)) return {obj.cast<int64_t>()};
  return Int64Array(obj, "seq_ids").vec();
}

py::list pairs_to_list(const std::vector<BlockPair>& pairs) {
  py::list out(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) out[i] = py::make_tuple(pairs[i].first, pairs[i].second);
  return out;
}

py::dict stats_dict(const BlockManager& bm) {
  const BlockManagerStats s = bm.stats();
  py::dict d;
  d["queries"] = s.queries;
  d["hits"] = s.hits;
  d["hit_rate"] = s.queries ? double(s.hits) / double(s.queries) : 0.0;
  d["evictions"] = s.evictions;
  d["cow_copies"] = s.cow_copies;
  d["swapped_out_blocks"] = s.swapped_out_blocks;
  d["swapped_in_blocks"] = s.swapped_in_blocks;
  d["num_blocks"] = bm.num_blocks();
  d["used_blocks"] = s.used_blocks;
  d["free_blocks"] = s.free_blocks;
  d["cached_blocks"] = s.cached_blocks;
  d["cached_free_blocks"] = s.cached_free_blocks;
  d["num_seqs"] = s.num_seqs;
  d["num_swapped_seqs"] = s.num_swapped_seqs;
  d["num_cpu_blocks"] = bm.num_cpu_blocks();
  d["free_cpu_blocks"] = s.free_cpu_blocks;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv native module: block manager and paged KV ops";
#ifdef PAGEDKV_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

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

  py::enum_<AllocStatus>(m, "AllocStatus", "Result of can_allocate / can_swap_in.")
      .value("OK", AllocStatus::kOk, "fits now")
      .value("LATER", AllocStatus::kLater, "does not fit now; may after other sequences finish")
      .value("NEVER", AllocStatus::kNever, "can never fit in this pool");

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

  py::class_<BlockManager>(m, "BlockManager")
      .def(py::init([](int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks, bool enable_prefix_caching,
                       double watermark, const std::string& hash_algo) {
             return new BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching, watermark,
                                     parse_hash_algo(hash_algo));
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::kw_only(), py::arg("num_cpu_blocks") = 0,
           py::arg("enable_prefix_caching") = true, py::arg("watermark") = 0.0, py::arg("hash_algo") = "xxh64")
      .def(
          "can_allocate",
          [](const BlockManager& bm, const py::object& token_ids, const std::optional<py::object>& cache_salt) {
            Int64Array tokens(token_ids, "token_ids");
            return bm.can_allocate(tokens.data, tokens.size, salt_bytes(cache_salt));
          },
          py::arg("token_ids"), py::kw_only(), py::arg("cache_salt") = py::none())
      .def(
          "allocate",
          [](BlockManager& bm, int64_t seq_id, const py::object& token_ids, const std::optional<py::object>& cache_salt) {
            Int64Array tokens(token_ids, "token_ids");
            return bm.allocate(seq_id, tokens.data, tokens.size, salt_bytes(cache_salt));
          },
          py::arg("seq_id"), py::arg("token_ids"), py::kw_only(), py::arg("cache_salt") = py::none(),
          "Allocates the prompt's blocks; returns the number of leading tokens whose KV is already cached.")
      .def(
          "allocate_batch",
          [](BlockManager& bm, const py::object& seq_ids, const py::sequence& prompts, const py::object& cache_salts) {
            Int64Array ids(seq_ids, "seq_ids");
            if (static_cast<size_t>(py::len(prompts)) != ids.size)
              throw ValueError("allocate_batch: " + std::to_string(ids.size) + " seq_ids but " +
                               std::to_string(py::len(prompts)) + " prompts");
            if (!cache_salts.is_none() && static_cast<size_t>(py::len(cache_salts)) != ids.size)
              throw ValueError("allocate_batch: cache_salts must have one entry per prompt");
            py::list cached;
            for (size_t i = 0; i < ids.size; ++i) {
              Int64Array tokens(prompts[i], "prompts[i]");
              const std::string salt =
                  cache_salts.is_none() ? std::string() : salt_bytes(py::reinterpret_borrow<py::object>(cache_salts[py::int_(i)]));
              if (bm.contains(ids.data[i]))
                throw ValueError("allocate_batch: sequence " + std::to_string(ids.data[i]) + " already exists");
              if (tokens.size == 0 || bm.can_allocate(tokens.data, tokens.size, salt) != AllocStatus::kOk) break;
              cached.append(bm.allocate(ids.data[i], tokens.data, tokens.size, salt));
            }
            return cached;
          },
          py::arg("seq_ids"), py::arg("prompts"), py::kw_only(), py::arg("cache_salts") = py::none(),
          "Admits prompts in order while can_allocate says OK, in one call; returns the cached-token count of\n"
          "each admitted prompt (its length is the number admitted: seq_ids[:len(result)]).")
      .def(
          "mark_computed",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& num_tokens) {
            const bool single = py::isinstance<py::int_>(seq_ids);
            std::vector<int64_t> ids = seq_id_list(seq_ids);
            if (num_tokens.is_none()) return bm.mark_computed(ids);
            std::vector<int64_t> counts;
            if (py::isinstance<py::int_>(num_tokens)) {
              counts.assign(ids.size(), num_tokens.cast<int64_t>());
            } else {
              if (single) throw py::type_error("mark_computed: num_tokens must be an int when seq_ids is an int");
              counts = Int64Array(num_tokens, "num_tokens").vec();
            }
            bm.mark_computed(ids, &counts);
          },
          py::arg("seq_ids"), py::arg("num_tokens") = py::none())
      .def(
          "can_append",
          [](const BlockManager& bm, const py::object& seq_ids) {
            std::vector<int64_t> ids = seq_id_list(seq_ids);
            return bm.can_append(ids.data(), ids.size());
          },
          py::arg("seq_ids"))
      .def("append_token", &BlockManager::append_token, py::arg("seq_id"), py::arg("token_id"))
      .def(
          "append_tokens",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& token_ids) {
            Int64Array ids(seq_ids, "seq_ids"), tokens(token_ids, "token_ids");
            if (ids.size != tokens.size)
              throw ValueError("append_tokens: " + std::to_string(ids.size) + " seq_ids but " +
                               std::to_string(tokens.size) + " token_ids");
            torch::Tensor slots = torch::empty({static_cast<int64_t>(ids.size)}, torch::kInt64);
            bm.append_tokens(ids.data, tokens.data, ids.size, slots.data_ptr<int64_t>());
            return slots;
          },
          py::arg("seq_ids"), py::arg("token_ids"),
          "Batched decode step: appends one token per sequence; returns their slots (int64 tensor).")
      .def("take_copies", [](BlockManager& bm) { return pairs_to_list(bm.take_copies()); })
      .def("free", &BlockManager::free, py::arg("seq_id"))
      .def("fork", &BlockManager::fork, py::arg("parent_seq_id"), py::arg("child_seq_id"))
      .def("can_swap_out", [](const BlockManager& bm, const py::object& ids) { return bm.can_swap_out(seq_id_list(ids)); },
           py::arg("seq_ids"))
      .def("swap_out", [](BlockManager& bm, const py::object& ids) { return pairs_to_list(bm.swap_out(seq_id_list(ids))); },
           py::arg("seq_ids"), "Moves the sequences to CPU blocks; returns (gpu_block, cpu_block) copies to perform.")
      .def("can_swap_in", [](const BlockManager& bm, const py::object& ids) { return bm.can_swap_in(seq_id_list(ids)); },
           py::arg("seq_ids"))
      .def("swap_in", [](BlockManager& bm, const py::object& ids) { return pairs_to_list(bm.swap_in(seq_id_list(ids))); },
           py::arg("seq_ids"), "Moves the sequences back to GPU blocks; returns (cpu_block, gpu_block) copies to perform.")
      .def("block_table", [](const BlockManager& bm, int64_t seq_id) { return bm.block_table(seq_id); }, py::arg("seq_id"))
      .def(
          "block_tables",
          [](const BlockManager& bm, const py::object& seq_ids, std::optional<int32_t> max_blocks, int32_t pad) {
            Int64Array ids(seq_ids, "seq_ids");
            const int32_t width = max_blocks ? *max_blocks : bm.max_table_length(ids.data, ids.size);
            if (width < 0) throw ValueError("block_tables: max_blocks must be >= 0");
            torch::Tensor out = torch::empty({static_cast<int64_t>(ids.size), width}, torch::kInt32);
            bm.block_tables(ids.data, ids.size, width, pad, out.data_ptr<int32_t>());
            return out;
          },
          py::arg("seq_ids"), py::kw_only(), py::arg("max_blocks") = py::none(), py::arg("pad") = 0,
          "Block tables as an int32 tensor [len(seq_ids), max_blocks], rows padded with `pad`.")
      .def(
          "slot_mapping",
          [](const BlockManager& bm, int64_t seq_id, int64_t start, std::optional<int64_t> end) {
            const int64_t stop = end ? *end : bm.num_tokens(seq_id);
            if (stop < start) throw ValueError("slot_mapping: end must be >= start");
            torch::Tensor out = torch::empty({stop - start}, torch::kInt64);
            bm.slot_mapping(seq_id, start, stop, out.data_ptr<int64_t>());
            return out;
          },
          py::arg("seq_id"), py::arg("start") = 0, py::arg("end") = py::none(),
          "Slots (int64 tensor) of token positions [start, end) of one sequence.")
      .def(
          "slot_mappings",
          [](const BlockManager& bm, const py::object& seq_ids, const py::object& starts, const py::object& ends) {
            Int64Array ids(seq_ids, "seq_ids"), begin(starts, "starts");
            if (ids.size != begin.size) throw ValueError("slot_mappings: seq_ids and starts differ in length");
            std::vector<int64_t> stop(ids.size);
            if (ends.is_none()) {
              for (size_t i = 0; i < ids.size; ++i) stop[i] = bm.num_tokens(ids.data[i]);
            } else {
              Int64Array e(ends, "ends");
              if (e.size != ids.size) throw ValueError("slot_mappings: seq_ids and ends differ in length");
              std::copy(e.data, e.data + e.size, stop.begin());
            }
            int64_t total = 0;
            for (size_t i = 0; i < ids.size; ++i) {
              const int64_t len = bm.num_tokens(ids.data[i]);
              if (begin.data[i] < 0 || begin.data[i] > stop[i] || stop[i] > len)
                throw ValueError("slot_mappings: positions [" + std::to_string(begin.data[i]) + ", " +
                                 std::to_string(stop[i]) + ") are not inside [0, " + std::to_string(len) +
                                 "] for sequence " + std::to_string(ids.data[i]));
              total += stop[i] - begin.data[i];
            }
            torch::Tensor out = torch::empty({total}, torch::kInt64);
            int64_t* p = out.data_ptr<int64_t>();
            for (size_t i = 0; i < ids.size; ++i) {
              bm.slot_mapping(ids.data[i], begin.data[i], stop[i], p);
              p += stop[i] - begin.data[i];
            }
            return out;
          },
          py::arg("seq_ids"), py::arg("starts"), py::arg("ends") = py::none(),
          "Concatenated slots of positions [starts[i], ends[i]) of each sequence (default end: its length); "
          "a prefill batch's slot mapping, chunked or not.")
      .def(
          "seq_lens",
          [](const BlockManager& bm, const py::object& seq_ids) {
            Int64Array ids(seq_ids, "seq_ids");
            torch::Tensor out = torch::empty({static_cast<int64_t>(ids.size)}, torch::kInt32);
            int32_t* p = out.data_ptr<int32_t>();
            for (size_t i = 0; i < ids.size; ++i) p[i] = static_cast<int32_t>(bm.num_tokens(ids.data[i]));
            return out;
          },
          py::arg("seq_ids"), "Token counts (int32 tensor) of the sequences.")
      .def("num_tokens", &BlockManager::num_tokens, py::arg("seq_id"))
      .def("num_computed_tokens", &BlockManager::num_computed_tokens, py::arg("seq_id"))
      .def("token_ids", &BlockManager::token_ids, py::arg("seq_id"))
      .def("is_swapped", &BlockManager::is_swapped, py::arg("seq_id"))
      .def("__contains__", &BlockManager::contains)
      .def_property_readonly("num_blocks", &BlockManager::num_blocks)
      .def_property_readonly("num_cpu_blocks", &BlockManager::num_cpu_blocks)
      .def_property_readonly("block_size", &BlockManager::block_size)
      .def_property_readonly("watermark_blocks", &BlockManager::watermark_blocks)
      .def_property_readonly("enable_prefix_caching", &BlockManager::prefix_caching)
      .def_property_readonly("hash_algo", [](const BlockManager& bm) { return hash_algo_name(bm.hash_algo()); })
      .def_property_readonly("num_free_blocks", &BlockManager::num_free_blocks)
      .def_property_readonly("num_free_cpu_blocks", &BlockManager::num_free_cpu_blocks)
      .def("stats", &stats_dict)
      .def("reset_prefix_cache", &BlockManager::reset_prefix_cache)
      .def("check_invariants", &BlockManager::check_invariants)
      .def("__repr__", [](const BlockManager& bm) {
        return "BlockManager(num_blocks=" + std::to_string(bm.num_blocks()) + ", block_size=" +
               std::to_string(bm.block_size()) + ", free=" + std::to_string(bm.num_free_blocks()) + ")";
      });
}
