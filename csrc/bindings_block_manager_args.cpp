// Converters of the block manager's bindings: sequence ids, retention ranges, windows, media, block
// pairs and the stats dict (bindings_block_manager.h).
#include "bindings_block_manager.h"

namespace pagedkv::bindings {


// One sequence id (an int, a numpy integer, a 0-d tensor), as opposed to a batch of them.
bool is_one_id(const py::handle& obj) {
  if (is_torch_tensor(obj.ptr())) return TensorView(obj.ptr(), "seq_ids").ndim() == 0;
  return is_int_scalar(obj);
}

// The token counts of `ids` as an int32 tensor (paged attention's seq_lens).
TorchTensor token_counts(const BlockManager& bm, const Int64Array& ids) {
  CpuTensor out({static_cast<int64_t>(ids.size)}, kInt32);
  int32_t* p = out.data<int32_t>();
  for (size_t i = 0; i < ids.size; ++i) p[i] = static_cast<int32_t>(bm.num_tokens(ids.data[i]));
  return out.release();
}

// Warns that `old` is deprecated in favour of `replacement` (once per call site, as Python does).
void deprecated(const std::string& old, const std::string& replacement) {
  const std::string message = old + " is deprecated and will be removed in the next release; use " + replacement;
  if (PyErr_WarnEx(PyExc_DeprecationWarning, message.c_str(), 1) != 0) throw py::error_already_set();
}

// seq_ids: one id or a sequence of ids.
std::vector<int64_t> seq_id_list(const py::handle& obj) {
  if (is_int_scalar(obj)) return {to_int64(obj, "seq_ids")};
  return Int64Array(obj, "seq_ids").vec();
}

// num_tokens for each of n sequences: one int for all, or one per sequence (only when seq_ids was a list).
std::vector<int64_t> per_sequence_counts(const py::handle& seq_ids, size_t n, const py::handle& num_tokens,
                                         const char* what) {
  if (is_int_scalar(num_tokens)) return std::vector<int64_t>(n, to_int64(num_tokens, "num_tokens"));
  if (is_int_scalar(seq_ids))
    throw py::type_error(std::string(what) + ": num_tokens must be an int when seq_ids is an int");
  return Int64Array(num_tokens, "num_tokens").vec();
}

// retention: None, or a list of (start, end, priority) / (start, end, priority, duration) tuples; end None
// means every later token, duration None means for ever. Values are validated by the core.
std::vector<RetentionRange> retention_ranges(const py::handle& obj, const char* name) {
  std::vector<RetentionRange> out;
  if (obj.is_none()) return out;
  const py::object ranges = fast_sequence(obj, name);
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ranges.ptr()); ++i) {
    const py::handle item = PySequence_Fast_GET_ITEM(ranges.ptr(), i);
    const std::string what = std::string(name) + "[" + std::to_string(i) + "]";
    if (!PyTuple_Check(item.ptr()) && !PyList_Check(item.ptr()))
      throw py::type_error(what + " must be a (start, end, priority[, duration]) tuple, got " +
                           Py_TYPE(item.ptr())->tp_name);
    const py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 3 && t.size() != 4)
      throw ValueError(what + " must be (start, end, priority) or (start, end, priority, duration), got " +
                       std::to_string(t.size()) + " items");
    RetentionRange r;
    r.start = to_int64(t[0], (what + ".start").c_str());
    r.end = t[1].is_none() ? kToTheEnd : to_int64(t[1], (what + ".end").c_str());
    r.priority = to_int64(t[2], (what + ".priority").c_str());
    if (t.size() == 4 && !t[3].is_none()) {
      PyObject* d = t[3].ptr();
      if (PyBool_Check(d) || !(PyFloat_Check(d) || PyLong_Check(d)))
        throw py::type_error(what + ".duration must be a number or None, got " + Py_TYPE(d)->tp_name);
      r.duration = PyFloat_AsDouble(d);
      if (r.duration == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    }
    out.push_back(r);
  }
  return out;
}


// A window in tokens: an int >= 1 (TypeError for anything else but None, which means full attention).
int64_t window_tokens(const py::handle& obj, const std::string& name) {
  if (obj.is_none()) return BlockManager::kFullAttention;
  const int64_t w = to_int64(obj, name.c_str());
  if (w < 1) throw ValueError(name + " must be >= 1 token (None: full attention), got " + std::to_string(w));
  return w;
}

// The constructor's sliding_window / group_windows as one window per group.
std::vector<int64_t> group_windows_arg(const py::object& sliding_window, const py::object& group_windows) {
  if (!sliding_window.is_none() && !group_windows.is_none())
    throw ValueError("give sliding_window (one windowed group) or group_windows (one entry per group), not both");
  if (!sliding_window.is_none()) deprecated("BlockManager(sliding_window=w)", "BlockManager(group_windows=[w])");
  if (group_windows.is_none()) return {window_tokens(sliding_window, "sliding_window")};
  const py::object list = fast_sequence(group_windows, "group_windows");
  std::vector<int64_t> windows;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(list.ptr()); ++i)
    windows.push_back(window_tokens(PySequence_Fast_GET_ITEM(list.ptr(), i), "group_windows[" + std::to_string(i) + "]"));
  return windows;  // the core checks the number of groups
}

py::object window_object(int64_t w) {
  return w == BlockManager::kFullAttention ? py::object(py::none()) : py::object(py::int_(w));
}

// Block pairs as the int64 [n, 2] (src, dst) CPU tensor that copy_blocks and swap_blocks take.
// medium: "GPU", "CPU" or "DISK".
Medium medium_arg(const std::string& medium) {
  if (medium == "GPU") return Medium::kGpu;
  if (medium == "CPU") return Medium::kCpu;
  if (medium == "DISK") return Medium::kDisk;
  throw ValueError("medium must be 'GPU', 'CPU' or 'DISK', got '" + medium + "'");
}

// A 1-D bool or integer tensor of outcomes (nonzero: success), on the CPU or CUDA.
static std::vector<bool> tensor_outcomes(PyObject* t) {
  const TensorView view(t, "ok");
  const DLDataType dtype = view.dl().dtype;
  if (view.ndim() != 1 || dtype.lanes != 1 || !(view.is_integer() || dtype.code == kDLBool))
    throw py::type_error("ok must be a bool, or a 1-D bool or integer tensor");
  if (view.is_cuda()) return tensor_outcomes(to_cpu(t).ptr());
  if (!view.is_cpu()) throw ValueError("ok must be a CPU or CUDA tensor, got one on " + view.device_name());
  const size_t bytes = (dtype.bits + 7) / 8;
  const Py_ssize_t step = static_cast<Py_ssize_t>(view.stride(0) * static_cast<int64_t>(bytes));
  std::vector<bool> out(static_cast<size_t>(view.size(0)));
  const char* base = view.data();
  for (size_t i = 0; i < out.size(); ++i) {
    const char* item = base + static_cast<Py_ssize_t>(i) * step;
    bool nonzero = false;
    for (size_t b = 0; b < bytes; ++b) nonzero |= item[b] != 0;
    out[i] = nonzero;
  }
  return out;
}

// ok: one bool for all n outcomes, or a list / tuple / 1-D bool or integer tensor of n outcomes.
std::vector<bool> outcomes(const py::object& ok, int32_t n) {  // the core checks the count
  if (PyBool_Check(ok.ptr())) return std::vector<bool>(static_cast<size_t>(n), ok.ptr() == Py_True);
  if (is_torch_tensor(ok.ptr())) return tensor_outcomes(ok.ptr());
  const py::object items = fast_sequence(ok, "ok");
  std::vector<bool> out;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items.ptr()); ++i) {
    const py::handle item = PySequence_Fast_GET_ITEM(items.ptr(), i);
    const int truth = PyObject_IsTrue(item.ptr());
    if (truth < 0) throw py::error_already_set();
    out.push_back(truth == 1);
  }
  return out;
}

TorchTensor pairs_tensor(const std::vector<BlockPair>& pairs) {
  CpuTensor out({static_cast<int64_t>(pairs.size()), 2}, kInt64);
  int64_t* p = out.data<int64_t>();
  for (const auto& [src, dst] : pairs) {
    *p++ = src;
    *p++ = dst;
  }
  return out.release();
}


py::dict stats_dict(const BlockManagerStats& s) {
  py::dict d;
#define PAGEDKV_DICT_STAT(name) d[#name] = s.name;
#define PAGEDKV_DICT_GAUGE(type, name) d[#name] = s.name;
#define PAGEDKV_DICT_RATIO(name, num, den) d[#name] = s.den ? double(s.num) / double(s.den) : 0.0;
  PAGEDKV_BLOCK_MANAGER_STATS(PAGEDKV_DICT_STAT, PAGEDKV_DICT_GAUGE, PAGEDKV_DICT_RATIO)
#undef PAGEDKV_DICT_STAT
#undef PAGEDKV_DICT_GAUGE
#undef PAGEDKV_DICT_RATIO
  return d;
}

// Slots of positions [begin[i], end[i]) (end null: each sequence's length) as one int64 tensor, written in
// place by the core once it has validated every range; more than max_total slots is a ValueError.
TorchTensor slot_tensor(const BlockManager& bm, Span<int64_t> ids, Span<int64_t> begin,
                        std::optional<Span<int64_t>> end, const char* what, int32_t group, size_t max_total) {
  std::optional<CpuTensor> slots;
  bm.slot_mappings(ids, begin, end, [&](size_t total) {
    if (total > max_total)
      throw ValueError(std::string(what) + ": " + std::to_string(total) + " query tokens do not fit the int32 "
                       "query_start_loc");
    slots.emplace(std::initializer_list<int64_t>{static_cast<int64_t>(total)}, kInt64);
    return slots->data<int64_t>();
  }, group, what);
  return slots->release();
}

// Block tables of `ids` as an int32 tensor [len(ids), width], written in place by the core.
TorchTensor block_table_tensor(const BlockManager& bm, const Int64Array& ids, const std::optional<int32_t>& max_blocks,
                               int32_t pad, int32_t group) {
  // Allocated in its final shape (a view() afterwards costs as much as the rest of a small call).
  std::optional<CpuTensor> rows;
  const auto batch = static_cast<int64_t>(ids.size);
  const int32_t width = bm.block_tables(ids.span(), max_blocks, pad, [&rows, batch](size_t n) {
    rows.emplace(std::initializer_list<int64_t>{batch, batch ? static_cast<int64_t>(n) / batch : 0}, kInt32);
    return rows->data<int32_t>();
  }, group);
  if (!batch || !rows) return CpuTensor({0, width}, kInt32).release();
  return rows->release();
}

}  // namespace pagedkv::bindings
