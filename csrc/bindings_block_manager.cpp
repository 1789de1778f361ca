// pybind11 bindings of the block manager (pagedkv.BlockManager, pagedkv.AllocStatus). Token ids and
// sequence ids are accepted as Python sequences of ints, 1-D integer tensors or integer buffers; batches
// of slots, tables, lengths and block mappings come back as CPU tensors, single values as Python values.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "bindings_args.h"
#include "core/block_manager.h"
#include "core/errors.h"
#include "core/hashing.h"


// pybind11 hands a method called on an instance whose __init__ never ran (BlockManager.__new__(...))
// freshly allocated, uninitialised memory. This caster refuses such an instance instead.
namespace pybind11::detail {
template <>
class type_caster<pagedkv::BlockManager> : public type_caster_base<pagedkv::BlockManager> {
 public:
  bool load(handle src, bool convert) {
    static const type_info* info = get_type_info(typeid(pagedkv::BlockManager));
    if (info && PyObject_TypeCheck(src.ptr(), info->type) &&
        !reinterpret_cast<instance*>(src.ptr())->get_value_and_holder(info).holder_constructed())
      throw type_error("this BlockManager was never initialised (its __init__ did not run)");
    return type_caster_base<pagedkv::BlockManager>::load(src, convert);
  }
};
}  // namespace pybind11::detail

namespace pagedkv::bindings {
namespace {

// One sequence id (an int, a numpy integer, a 0-d tensor), as opposed to a batch of them.
bool is_one_id(const py::handle& obj) {
  if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr()).dim() == 0;
  return is_int_scalar(obj);
}

// The token counts of `ids` as an int32 tensor (paged attention's seq_lens).
torch::Tensor token_counts(const BlockManager& bm, const Int64Array& ids) {
  torch::Tensor out = cpu_tensor({static_cast<int64_t>(ids.size)}, torch::kInt32);
  int32_t* p = out.data_ptr<int32_t>();
  for (size_t i = 0; i < ids.size; ++i) p[i] = static_cast<int32_t>(bm.num_tokens(ids.data[i]));
  return out;
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

// ok: one bool for all n outcomes, or a list / tuple / 1-D bool or integer tensor of n outcomes.
std::vector<bool> outcomes(const py::object& ok, int32_t n) {  // the core checks the count
  if (PyBool_Check(ok.ptr())) return std::vector<bool>(static_cast<size_t>(n), ok.ptr() == Py_True);
  if (THPVariable_Check(ok.ptr())) {
    const torch::Tensor t = THPVariable_Unpack(ok.ptr());
    if (t.dim() != 1 || t.is_floating_point() || t.is_complex())
      throw py::type_error("ok must be a bool, or a 1-D bool or integer tensor");
    if (!t.device().is_cpu() && !t.device().is_cuda())
      throw ValueError("ok must be a CPU or CUDA tensor, got one on " + t.device().str());
    const torch::Tensor flags = t.to(torch::kCPU).to(torch::kBool).contiguous();
    const bool* p = flags.data_ptr<bool>();
    return std::vector<bool>(p, p + flags.numel());
  }
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

torch::Tensor pairs_tensor(const std::vector<BlockPair>& pairs) {
  torch::Tensor out = cpu_tensor({static_cast<int64_t>(pairs.size()), 2}, torch::kInt64);
  int64_t* p = out.data_ptr<int64_t>();
  for (const auto& [src, dst] : pairs) {
    *p++ = src;
    *p++ = dst;
  }
  return out;
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
torch::Tensor slot_tensor(const BlockManager& bm, Span<int64_t> ids, Span<int64_t> begin,
                          std::optional<Span<int64_t>> end, const char* what, int32_t group,
                          size_t max_total = std::numeric_limits<size_t>::max()) {
  torch::Tensor slots;
  bm.slot_mappings(ids, begin, end, [&](size_t total) {
    if (total > max_total)
      throw ValueError(std::string(what) + ": " + std::to_string(total) + " query tokens do not fit the int32 "
                       "query_start_loc");
    slots = cpu_tensor({static_cast<int64_t>(total)}, torch::kInt64);
    return slots.data_ptr<int64_t>();
  }, group, what);
  return slots;
}

// Block tables of `ids` as an int32 tensor [len(ids), width], written in place by the core.
torch::Tensor block_table_tensor(const BlockManager& bm, const Int64Array& ids, const std::optional<int32_t>& max_blocks,
                                int32_t pad, int32_t group) {
  // Allocated in its final shape (a view() afterwards costs as much as the rest of a small call).
  torch::Tensor rows;
  const auto batch = static_cast<int64_t>(ids.size);
  const int32_t width = bm.block_tables(ids.span(), max_blocks, pad, [&rows, batch](size_t n) {
    rows = cpu_tensor({batch, batch ? static_cast<int64_t>(n) / batch : 0}, torch::kInt32);
    return rows.data_ptr<int32_t>();
  }, group);
  return batch ? rows : cpu_tensor({0, width}, torch::kInt32);
}

// The (seq_ids, starts, ends=None) arguments of slot_mappings and attention_inputs, checked for equal lengths.
struct PositionRanges {
  Int64Array ids, begin;
  std::optional<Int64Array> stop;
  PositionRanges(const py::object& seq_ids, const py::object& starts, const py::object& ends, const std::string& op)
      : ids(seq_ids, "seq_ids"), begin(starts, "starts") {
    if (ids.size != begin.size) throw ValueError(op + ": seq_ids and starts differ in length");
    if (!ends.is_none()) {
      stop.emplace(ends, "ends");
      if (stop->size != ids.size) throw ValueError(op + ": seq_ids and ends differ in length");
    }
  }
  std::optional<Span<int64_t>> ends() const { return stop ? std::optional(stop->span()) : std::nullopt; }
};

}  // namespace

void bind_block_manager(py::module_& m) {
  py::enum_<AllocStatus>(m, "AllocStatus", "Result of can_allocate / can_swap_in.")
      .value("OK", AllocStatus::kOk, "fits now")
      .value("LATER", AllocStatus::kLater, "does not fit now; may after other sequences finish")
      .value("NEVER", AllocStatus::kNever, "can never fit in this pool");


  py::class_<BlockManager> block_manager(m, "BlockManager");
  block_manager
      .def(py::init([](int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks, bool enable_prefix_caching,
                       double watermark, const std::string& hash_algo, bool enable_events, int64_t max_pending_events,
                       int32_t default_priority, std::optional<int32_t> decode_priority, double max_pinned_fraction,
                       const py::object& sliding_window, const py::object& group_windows, int32_t num_host_blocks,
                       int32_t host_offload_min_priority, int32_t num_disk_blocks) {
             BlockManagerConfig config;
             config.num_blocks = num_blocks;
             config.block_size = block_size;
             config.num_cpu_blocks = num_cpu_blocks;
             config.enable_prefix_caching = enable_prefix_caching;
             config.watermark = watermark;
             config.hash_algo = parse_hash_algo(hash_algo);
             config.enable_events = enable_events;
             config.max_pending_events = max_pending_events;
             config.default_priority = default_priority;
             config.decode_priority = decode_priority.value_or(default_priority);
             config.max_pinned_fraction = max_pinned_fraction;
             config.group_windows = group_windows_arg(sliding_window, group_windows);
             config.num_host_blocks = num_host_blocks;
             config.host_offload_min_priority = host_offload_min_priority;
             config.num_disk_blocks = num_disk_blocks;
             return new BlockManager(std::move(config));
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::kw_only(), py::arg("num_cpu_blocks") = 0,
           py::arg("enable_prefix_caching") = true, py::arg("watermark") = 0.0, py::arg("hash_algo") = "xxh64",
           py::arg("enable_events") = false, py::arg("max_pending_events") = BlockManager::kDefaultMaxPendingEvents,
           py::arg("default_priority") = kDefaultPriority, py::arg("decode_priority") = py::none(),
           py::arg("max_pinned_fraction") = BlockManager::kDefaultMaxPinnedFraction,
           py::arg("sliding_window") = py::none(), py::arg("group_windows") = py::none(),
           py::arg("num_host_blocks") = 0, py::arg("host_offload_min_priority") = kMinPriority,
           py::arg("num_disk_blocks") = 0)
      .def(
          "can_allocate",
          [](const BlockManager& bm, const py::object& token_ids, const std::optional<py::object>& cache_salt,
             std::optional<int64_t> num_new_tokens) {
            Int64Array tokens(token_ids, "token_ids");
            return bm.can_allocate(tokens.span(), salt_bytes(cache_salt),
                                   num_new_tokens.value_or(BlockManager::kWholePrompt));
          },
          py::arg("token_ids"), py::kw_only(), py::arg("cache_salt") = py::none(), py::arg("num_new_tokens") = py::none())
      .def(
          "allocate",
          [](BlockManager& bm, int64_t seq_id, const py::object& token_ids, const std::optional<py::object>& cache_salt,
             const py::object& retention, std::optional<int64_t> num_new_tokens) {
            Int64Array tokens(token_ids, "token_ids");
            return bm.allocate(seq_id, tokens.span(), salt_bytes(cache_salt),
                               retention_ranges(retention, "retention"),
                               num_new_tokens.value_or(BlockManager::kWholePrompt));
          },
          py::arg("seq_id"), py::arg("token_ids"), py::kw_only(), py::arg("cache_salt") = py::none(),
          py::arg("retention") = py::none(), py::arg("num_new_tokens") = py::none(),
          "Allocates the prompt's blocks; returns the number of leading tokens whose KV is already cached.\n"
          "retention: [(start, end, priority[, duration])] token ranges whose blocks are evicted later (priority\n"
          "0-100, default 35; end None: to the end; duration: clock units after the block is freed).\n"
          "num_new_tokens: blocks only for the cached tokens and the next num_new_tokens (chunked prefill;\n"
          "reserve() the later chunks).")
      .def(
          "can_reserve",
          [](const BlockManager& bm, const py::object& seq_ids, const py::object& num_tokens) {
            const std::vector<int64_t> ids = seq_id_list(seq_ids);
            return bm.can_reserve(ids, per_sequence_counts(seq_ids, ids.size(), num_tokens, "can_reserve"));
          },
          py::arg("seq_ids"), py::arg("num_tokens"))
      .def(
          "reserve",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& num_tokens) {
            const std::vector<int64_t> ids = seq_id_list(seq_ids);
            bm.reserve(ids, per_sequence_counts(seq_ids, ids.size(), num_tokens, "reserve"));
          },
          py::arg("seq_ids"), py::arg("num_tokens"),
          "Chunked prefill: gives each sequence the blocks of its first num_tokens tokens in every group\n"
          "(after mark_computed of the previous chunk, so that a window has released what it no longer reads).")
      .def("num_allocated_tokens", &BlockManager::num_allocated_tokens, py::arg("seq_id"),
           "Tokens of the sequence that have blocks (its length once its whole prompt is reserved).")
      .def(
          "allocate_batch",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& prompts, const py::object& cache_salts,
             const py::object& retentions) {
            Int64Array ids(seq_ids, "seq_ids");
            std::vector<Span<int64_t>> spans;
            std::vector<Int64Array> tokens;
            std::optional<Int64Array> rows;
            if (THPVariable_Check(prompts.ptr())) {  // a 2-D integer tensor: one prompt per row
              const torch::Tensor t = THPVariable_Unpack(prompts.ptr());
              if (t.dim() != 2) throw ValueError("allocate_batch: a prompts tensor must be 2-D (one prompt per row)");
              if (!at::isIntegralType(t.scalar_type(), /*includeBool=*/false))
                throw py::type_error("allocate_batch: prompts must hold integers, got dtype " +
                                     std::string(c10::toString(t.scalar_type())));
              rows.emplace(t.flatten(), "prompts");
              for (int64_t i = 0; i < t.size(0); ++i) spans.push_back({rows->data + i * t.size(1), size_t(t.size(1))});
            } else {
            // Items of a list/tuple made once: they stay alive while we read them (a generic sequence's
            // items, e.g. a numpy array's rows, are new objects that a py::handle would not keep alive).
            const py::object prompt_list = fast_sequence(prompts, "prompts");
            tokens.reserve(static_cast<size_t>(PySequence_Fast_GET_SIZE(prompt_list.ptr())));
            for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(prompt_list.ptr()); ++i)
              tokens.emplace_back(PySequence_Fast_GET_ITEM(prompt_list.ptr(), i), "prompts[i]");
            for (const Int64Array& t : tokens) spans.push_back({t.data, t.size});
            }
            std::vector<std::string> salts;
            if (!cache_salts.is_none()) {
              if (!py::isinstance<py::sequence>(cache_salts) || py::isinstance<py::str>(cache_salts) ||
                  py::isinstance<py::bytes>(cache_salts))
                throw py::type_error("allocate_batch: cache_salts must be a list with one salt per prompt, or None");
              const py::object salt_list = fast_sequence(cache_salts, "cache_salts");
              for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(salt_list.ptr()); ++i)
                salts.push_back(salt_bytes(py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(salt_list.ptr(), i))));
              if (salts.size() != spans.size())  // an empty list for an empty batch is fine
                throw ValueError("allocate_batch: cache_salts must have one entry per prompt");
            }
            std::vector<std::vector<RetentionRange>> ranges;
            if (!retentions.is_none()) {
              const py::object list = fast_sequence(retentions, "retentions");
              for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(list.ptr()); ++i)
                ranges.push_back(retention_ranges(PySequence_Fast_GET_ITEM(list.ptr(), i), "retentions[i]"));
              if (ranges.size() != spans.size())
                throw ValueError("allocate_batch: retentions must have one entry (a list or None) per prompt");
            }
            return bm.allocate_batch(ids.span(), spans, salts, ranges);
          },
          py::arg("seq_ids"), py::arg("prompts"), py::kw_only(), py::arg("cache_salts") = py::none(),
          py::arg("retentions") = py::none(),
          "Admits prompts in order while can_allocate says OK, in one call; returns the cached-token count of\n"
          "each admitted prompt (its length is the number admitted: seq_ids[:len(result)]).")
      .def(
          "mark_computed",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& num_tokens) {
            std::vector<int64_t> ids = seq_id_list(seq_ids);
            if (num_tokens.is_none()) return bm.mark_computed(ids);
            const std::vector<int64_t> counts = per_sequence_counts(seq_ids, ids.size(), num_tokens, "mark_computed");
            bm.mark_computed(ids, Span<int64_t>(counts));
          },
          py::arg("seq_ids"), py::arg("num_tokens") = py::none())
      .def(
          "can_append",
          [](const BlockManager& bm, const py::object& seq_ids, int64_t num_lookahead_slots) {
            std::vector<int64_t> ids = seq_id_list(seq_ids);
            return bm.can_append(ids, num_lookahead_slots);
          },
          py::arg("seq_ids"), py::arg("num_lookahead_slots") = 0,
          "Whether every sequence can append 1 + num_lookahead_slots tokens now.")
      .def("append_token", &BlockManager::append_token, py::arg("seq_id"), py::arg("token_id"))
      .def(
          "append_tokens",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& token_ids, const py::object& counts) {
            Int64Array ids(seq_ids, "seq_ids"), tokens(token_ids, "token_ids");
            std::optional<Int64Array> per_seq;
            if (!counts.is_none()) per_seq.emplace(counts, "counts");
            torch::Tensor slots;
            bm.append_tokens(ids.span(), tokens.span(), per_seq ? std::optional(per_seq->span()) : std::nullopt,
                             [&slots](size_t total) {
                               slots = cpu_tensor({static_cast<int64_t>(total)}, torch::kInt64);
                               return slots.data_ptr<int64_t>();
                             });
            return slots;
          },
          py::arg("seq_ids"), py::arg("token_ids"), py::arg("counts") = py::none(),
          "Batched decode step: appends one token per sequence, or counts[i] tokens to sequence i (its input\n"
          "and draft tokens, concatenated in token_ids); returns each token's slot (int64 tensor).")
      .def(
          "truncate",
          [](BlockManager& bm, const py::object& seq_ids, const py::object& num_tokens) {
            const std::vector<int64_t> ids = seq_id_list(seq_ids);
            bm.truncate(ids, per_sequence_counts(seq_ids, ids.size(), num_tokens, "truncate"));
          },
          py::arg("seq_ids"), py::arg("num_tokens"),
          "Rolls sequences back to their first num_tokens tokens (rejected draft tokens); blocks past them are\n"
          "released (cached ones stay cached).")
      .def("take_copies", [](BlockManager& bm) { return pairs_tensor(bm.take_copies()); },
           "Hands out the copy-on-write copies queued since the previous call, as an int64 [n, 2] (src, dst)\n"
           "CPU tensor for copy_blocks; perform them before the next KV write.")
      .def("free", &BlockManager::free, py::arg("seq_id"))
      .def("fork", &BlockManager::fork, py::arg("parent_seq_id"), py::arg("child_seq_id"))
      .def("distinct_blocks", [](const BlockManager& bm, const py::object& ids) { return bm.distinct_blocks(seq_id_list(ids)); },
           py::arg("seq_ids"),
           "Distinct blocks the sequences hold over every group (a block they share counts once; entries a window\n"
           "released excepted): what swap_out / swap_in moves. The sequences are all resident or all swapped out.")
      .def("can_swap_out", [](const BlockManager& bm, const py::object& ids) { return bm.can_swap_out(seq_id_list(ids)); },
           py::arg("seq_ids"))
      .def("swap_out", [](BlockManager& bm, const py::object& ids) { return pairs_tensor(bm.swap_out(seq_id_list(ids))); },
           py::arg("seq_ids"), "Moves the sequences to CPU blocks; returns the copies to perform as an int64 [n, 2] (gpu_block,\n"
           "cpu_block) CPU tensor for swap_blocks.")
      .def("can_swap_in",
           [](const BlockManager& bm, const py::object& ids, int64_t num_lookahead_slots) {
             return bm.can_swap_in(seq_id_list(ids), num_lookahead_slots);
           },
           py::arg("seq_ids"), py::arg("num_lookahead_slots") = 0)
      .def("swap_in", [](BlockManager& bm, const py::object& ids) { return pairs_tensor(bm.swap_in(seq_id_list(ids))); },
           py::arg("seq_ids"), "Moves the sequences back to GPU blocks; returns the copies to perform as an int64 [n, 2] (cpu_block,\n"
           "gpu_block) CPU tensor for swap_blocks.")
      .def("block_table", [](const BlockManager& bm, int64_t seq_id, int32_t group) { return bm.block_table(seq_id, group); },
           py::arg("seq_id"), py::kw_only(), py::arg("group") = 0,
           "The sequence's block table in `group`; entries its sliding window released hold block 0 (a pad).")
      .def(
          "block_tables",
          [](const BlockManager& bm, const py::object& seq_ids, std::optional<int32_t> max_blocks, int32_t pad,
             int32_t group) {
            Int64Array ids(seq_ids, "seq_ids");
            return block_table_tensor(bm, ids, max_blocks, pad, group);
          },
          py::arg("seq_ids"), py::kw_only(), py::arg("max_blocks") = py::none(), py::arg("pad") = 0,
          py::arg("group") = 0,
          "Block tables of `group` as an int32 tensor [len(seq_ids), max_blocks], rows padded with `pad`\n"
          "(entries released by a sliding window too).")
      .def(
          "slot_mapping",
          [](const BlockManager& bm, const py::object& seq_id, const py::object& start, const py::object& end,
             int32_t group) {
            const int64_t id = to_int64(seq_id, "seq_id"), begin = to_int64(start, "start");
            const int64_t stop = end.is_none() ? 0 : to_int64(end, "end");
            const std::optional<Span<int64_t>> ends = end.is_none() ? std::nullopt : std::optional(Span<int64_t>(&stop, 1));
            return slot_tensor(bm, {&id, 1}, {&begin, 1}, ends, "slot_mapping", group);
          },
          py::arg("seq_id"), py::arg("start") = 0, py::arg("end") = py::none(), py::kw_only(), py::arg("group") = 0,
          "Slots (int64 tensor) of token positions [start, end) of one sequence.")
      .def(
          "slot_mappings",
          [](const BlockManager& bm, const py::object& seq_ids, const py::object& starts, const py::object& ends,
             int32_t group) {
            const PositionRanges ranges(seq_ids, starts, ends, "slot_mappings");
            const Int64Array &ids = ranges.ids, &begin = ranges.begin;
            const std::optional<Int64Array>& stop = ranges.stop;
            return slot_tensor(bm, ids.span(), begin.span(), ranges.ends(), "slot_mappings", group);
          },
          py::arg("seq_ids"), py::arg("starts"), py::arg("ends") = py::none(), py::kw_only(), py::arg("group") = 0,
          "Concatenated slots of positions [starts[i], ends[i]) of each sequence (default end: its length); "
          "a prefill batch's slot mapping, chunked or not.")
      .def(
          "attention_inputs",
          [](const BlockManager& bm, const py::object& seq_ids, const py::object& starts, const py::object& ends,
             std::optional<int32_t> max_blocks, int32_t pad, int32_t group) {
            const PositionRanges ranges(seq_ids, starts, ends, "attention_inputs");
            const Int64Array &ids = ranges.ids, &begin = ranges.begin;
            const std::optional<Int64Array>& stop = ranges.stop;
            // slot_mappings validates every id and range before it writes anything.
            const torch::Tensor slots = slot_tensor(bm, ids.span(), begin.span(), ranges.ends(), "attention_inputs", group,
                                                    static_cast<size_t>(std::numeric_limits<int32_t>::max()));
            const torch::Tensor tables = block_table_tensor(bm, ids, max_blocks, pad, group);
            const auto n = static_cast<int64_t>(ids.size);
            torch::Tensor lens = cpu_tensor({n}, torch::kInt32), starts_out = cpu_tensor({n + 1}, torch::kInt32);
            int32_t* len = lens.data_ptr<int32_t>();
            int32_t* qsl = starts_out.data_ptr<int32_t>();
            qsl[0] = 0;
            for (int64_t i = 0; i < n; ++i) {
              const int64_t end = stop ? stop->data[i] : bm.num_tokens(ids.data[i]);
              len[i] = static_cast<int32_t>(end);
              qsl[i + 1] = qsl[i] + static_cast<int32_t>(end - begin.data[i]);
            }
            return py::make_tuple(slots, tables, lens, starts_out);
          },
          py::arg("seq_ids"), py::arg("starts"), py::arg("ends") = py::none(), py::kw_only(),
          py::arg("max_blocks") = py::none(), py::arg("pad") = 0, py::arg("group") = 0,
          "What paged attention needs for a step whose sequence i has queries at positions [starts[i], ends[i])\n"
          "(default end: its length), in one call: (slot_mapping int64 [total], block_tables int32 [n, width],\n"
          "seq_lens int32 [n] (= ends), query_start_loc int32 [n + 1]). The same as slot_mappings, block_tables and\n"
          "seq_lens, and the cumulative query lengths, without a Python crossing for each.")
      .def(
          "seq_lens",
          [](const BlockManager& bm, const py::object& seq_ids, int32_t group) {
            deprecated("BlockManager.seq_lens(seq_ids)", "num_tokens(seq_ids) (the same int32 tensor)");
            if (group < 0 || group >= bm.num_groups())
              throw ValueError("seq_lens: group=" + std::to_string(group) + " is not one of this manager's " +
                               std::to_string(bm.num_groups()) + " groups");
            return token_counts(bm, Int64Array(seq_ids, "seq_ids"));
          },
          py::arg("seq_ids"), py::kw_only(), py::arg("group") = 0,
          "Deprecated: num_tokens(seq_ids). Token counts (int32 tensor) of the sequences.")
      .def("num_released_blocks", &BlockManager::num_released_blocks, py::arg("seq_id"), py::kw_only(),
           py::arg("group") = 0, "Leading entries of the sequence's table in `group` that its sliding window released.")
      .def("blocks_held", &BlockManager::blocks_held, py::arg("num_tokens"), py::arg("num_computed") = 0,
           "Blocks a sequence of num_tokens tokens, the first num_computed computed, holds over all groups.")
      .def_property_readonly("num_groups", &BlockManager::num_groups)
      .def_property_readonly("group_windows",
                             [](const BlockManager& bm) {
                               py::list out;
                               for (int64_t w : bm.config().group_windows) out.append(window_object(w));
                               return out;
                             }, "One window (tokens; None: full attention) per group of layers.")
      .def_property_readonly("sliding_window",
                             [](const BlockManager& bm) {
                               deprecated("BlockManager.sliding_window", "group_windows");
                               if (bm.num_groups() != 1)
                                 throw ValueError("sliding_window: this manager has " + std::to_string(bm.num_groups()) +
                                                  " groups; read group_windows");
                               return window_object(bm.config().group_windows[0]);
                             }, "Deprecated: group_windows. The window of a one-group manager (None: full attention).")
      .def(
          "num_tokens",
          [](const BlockManager& bm, const py::object& seq_ids) -> py::object {
            if (is_one_id(seq_ids)) return py::int_(bm.num_tokens(to_int64(seq_ids, "seq_ids")));
            return py::cast(token_counts(bm, Int64Array(seq_ids, "seq_ids")));
          },
          py::arg("seq_ids"),
          "Tokens of one sequence (an int), or of each of several (an int32 tensor: paged attention's seq_lens).")
      .def(
          "num_tokens",
          [](const BlockManager& bm, int64_t seq_id) {
            deprecated("BlockManager.num_tokens(seq_id=...)", "num_tokens(seq_ids=...) or a positional id");
            return bm.num_tokens(seq_id);
          },
          py::kw_only(), py::arg("seq_id"))
      .def("num_computed_tokens", &BlockManager::num_computed_tokens, py::arg("seq_id"))
      .def("token_ids", &BlockManager::token_ids, py::arg("seq_id"))
      .def("is_swapped", &BlockManager::is_swapped, py::arg("seq_id"))
      .def("__contains__", &BlockManager::contains)
      .def_property_readonly("num_blocks", [](const BlockManager& bm) { return bm.config().num_blocks; })
      .def_property_readonly("num_cpu_blocks", [](const BlockManager& bm) { return bm.config().num_cpu_blocks; })
      .def_property_readonly("block_size", &BlockManager::block_size)
      .def_property_readonly("watermark_blocks", &BlockManager::watermark_blocks)
      .def_property_readonly("enable_prefix_caching", [](const BlockManager& bm) { return bm.config().enable_prefix_caching; })
      .def_property_readonly("hash_algo", [](const BlockManager& bm) { return hash_algo_name(bm.config().hash_algo); })
      .def_property_readonly("num_free_blocks", [](const BlockManager& bm) { return bm.gpu_pool().num_free(); })
      .def_property_readonly("num_free_cpu_blocks", [](const BlockManager& bm) { return bm.cpu_pool().num_free(); })
      .def("stats", [](const BlockManager& bm) { return stats_dict(bm.stats()); },
           "Cumulative counters (queries and hits in tokens and blocks, evictions, copies, swaps, dropped\n"
           "events) and gauges (used / free / cached blocks, sequences).")
      .def("take_step_stats", [](BlockManager& bm) { return stats_dict(bm.take_step_stats()); },
           "Like stats(), but the counters count only what happened since the previous call.")
      .def(
          "take_events",
          [](BlockManager& bm) {
            if (!bm.config().enable_events)
              throw ValueError("take_events: this BlockManager was made with enable_events=False");
            const std::vector<KvEvent> events = bm.take_events();
            py::list out(events.size());
            static const char* kinds[] = {"stored", "removed", "cleared"};
            for (size_t i = 0; i < events.size(); ++i) {
              const KvEvent& e = events[i];
              py::dict d;
              d["seq"] = e.seq;
              d["kind"] = kinds[static_cast<int>(e.kind)];
              d["block_hashes"] = e.block_hashes;
              d["parent_block_hash"] = e.parent_hash ? py::object(py::int_(*e.parent_hash)) : py::object(py::none());
              const bool stored = e.kind == KvEvent::Kind::kStored;
              d["token_ids"] = stored ? py::object(py::cast(e.token_ids)) : py::object(py::none());
              d["cache_salt"] = stored && !e.salt.empty() ? py::object(py::bytes(e.salt)) : py::object(py::none());
              d["block_size"] = bm.block_size();
              d["medium"] = medium_name(e.medium);
              out[i] = std::move(d);
            }
            return out;
          },
          "Drains the KV events recorded since the previous call, in order (enable_events=True): dicts with\n"
          "seq, kind ('stored' | 'removed' | 'cleared'), block_hashes, parent_block_hash, token_ids and\n"
          "cache_salt (stored), block_size, medium ('GPU', 'CPU': the host tier, or 'DISK': the disk tier).")
      .def(
          "cached_blocks", [](const BlockManager& bm, const std::string& medium) { return bm.cached_blocks(medium_arg(medium)); },
          py::arg("medium") = "GPU",
          "(block_hash, parent_block_hash) of every block whose KV the prefix cache holds now on `medium` ('GPU':\n"
          "device blocks, 'CPU': the host tier, 'DISK': the disk tier); replaying that medium's KV events gives\n"
          "the same multiset.")
      .def_property_readonly("host_tier_enabled", &BlockManager::host_tier_enabled,
                             "Whether the host tier is in use: num_host_blocks > 0 and prefix caching (any groups and windows).")
      .def_property_readonly("num_host_blocks", [](const BlockManager& bm) { return bm.config().num_host_blocks; })
      .def_property_readonly("num_free_host_blocks", [](const BlockManager& bm) { return bm.host_pool().num_free(); })
      .def_property_readonly("host_offload_min_priority",
                             [](const BlockManager& bm) { return bm.config().host_offload_min_priority; })
      .def(
          "lookup",
          [](const BlockManager& bm, const py::object& token_ids, const std::optional<py::object>& cache_salt) {
            Int64Array tokens(token_ids, "token_ids");
            const TierHits hits = bm.lookup(tokens.span(), salt_bytes(cache_salt));
            return py::make_tuple(hits.device_blocks, hits.host_blocks, hits.disk_blocks);
          },
          py::arg("token_ids"), py::kw_only(), py::arg("cache_salt") = py::none(),
          "The prompt's prefix hit as allocate() would take it now: (device_blocks, host_blocks, disk_blocks),\n"
          "the leading blocks hit on the device, after them those loaded from the host tier (with several groups:\n"
          "from the first block any group loads; a windowed group loads only its window's blocks), and after the\n"
          "hit the blocks that would hit once the disk tier's reads are confirmed (those prefetch() reads and\n"
          "the host entries between them).")
      .def("plan_offloads", &BlockManager::plan_offloads, py::arg("max_blocks"),
           "Clean ahead: of the max_blocks cached free device blocks the pool would evict first, queues copies to\n"
           "the host tier of those it lacks, so that reusing them later needs no copy; returns how many it queued.")
      .def("take_offloads", [](BlockManager& bm) { return pairs_tensor(bm.take_offloads()); },
           "Drains the queued offloads: an int64 [n, 2] CPU tensor of (device block, host slot). Each device\n"
           "block is held (never handed out) until complete_offloads.")
      .def(
          "complete_offloads",
          [](BlockManager& bm, const py::object& ok) {
            bm.complete_offloads(outcomes(ok, bm.num_offloads_in_flight()));
          },
          py::arg("ok") = true,
          "The outcome of every offload taken and not yet completed, in the order taken (one bool for all, or\n"
          "one per offload): a copy that failed leaves no host entry.")
      .def("take_loads", [](BlockManager& bm) { return pairs_tensor(bm.take_loads()); },
           "Drains the queued loads of host hits: an int64 [n, 2] CPU tensor of (host slot, device block), to\n"
           "copy before the step's attention reads them; both are held until complete_loads.")
      .def(
          "complete_loads",
          [](BlockManager& bm, const py::object& ok) {
            return bm.complete_loads(outcomes(ok, bm.num_loads_in_flight()));
          },
          py::arg("ok") = true,
          "The outcome of every load taken and not yet completed, in the order taken (one bool for all, or one\n"
          "per load). A sequence whose load failed keeps as computed the tokens before the first failed block:\n"
          "num_computed_tokens drops and the rest is recomputed. Returns the ids of the sequences for which no\n"
          "such point is safe (a window would need blocks it released, or no free block can replace a shared\n"
          "one): their num_computed_tokens is 0 and they refuse everything but free(); free and re-admit them.")
      .def("must_readmit", &BlockManager::must_readmit, py::arg("seq_id"),
           "Whether a failed load left the sequence to be freed and re-admitted (complete_loads returned it).")
      .def("num_loading_blocks", &BlockManager::num_loading_blocks, py::arg("seq_id"),
           "Blocks of the sequence whose loads from the host tier are not confirmed yet.")
      .def_property_readonly("disk_tier_enabled", &BlockManager::disk_tier_enabled,
                             "Whether the disk tier is in use: num_disk_blocks > 0 below an enabled host tier.")
      .def_property_readonly("num_disk_blocks", [](const BlockManager& bm) { return bm.config().num_disk_blocks; })
      .def_property_readonly("num_free_disk_blocks", [](const BlockManager& bm) { return bm.disk_pool().num_free(); })
      .def_property_readonly("num_pending_disk_reads", &BlockManager::num_pending_disk_reads,
                             "Disk reads queued by prefetch() and not yet completed (taken or not).")
      .def("plan_disk_writes", &BlockManager::plan_disk_writes, py::arg("max_slots"),
           "Clean ahead: of the max_slots cached free host slots the host tier would evict first, queues writes\n"
           "to the disk tier of those it lacks; returns how many it queued.")
      .def("take_disk_writes", [](BlockManager& bm) { return pairs_tensor(bm.take_disk_writes()); },
           "Drains the queued disk writes: an int64 [n, 2] CPU tensor of (host slot, disk record). Each host slot\n"
           "is held (never reused) until complete_disk_writes.")
      .def(
          "complete_disk_writes",
          [](BlockManager& bm, const py::object& ok) {
            bm.complete_disk_writes(outcomes(ok, bm.num_disk_writes_in_flight()));
          },
          py::arg("ok") = true,
          "The outcome of every disk write taken and not yet completed, in the order taken (one bool for all, or\n"
          "one per write): a confirmed write stores the entry on disk (a 'DISK' stored event); a failed one\n"
          "leaves no disk entry.")
      .def(
          "prefetch",
          [](BlockManager& bm, const py::object& token_ids, const std::optional<py::object>& cache_salt) {
            Int64Array tokens(token_ids, "token_ids");
            return bm.prefetch(tokens.span(), salt_bytes(cache_salt));
          },
          py::arg("token_ids"), py::kw_only(), py::arg("cache_salt") = py::none(),
          "Queues reads from the disk tier into host slots for the prompt's blocks after its device/host hit\n"
          "that only the disk holds (up to the first block no tier holds), evicting host entries of at most the\n"
          "block's priority; stops when no slot can be taken. Returns how many reads it queued.")
      .def("take_disk_reads", [](BlockManager& bm) { return pairs_tensor(bm.take_disk_reads()); },
           "Drains the queued disk reads: an int64 [n, 2] CPU tensor of (disk record, host slot); both are held\n"
           "until complete_disk_reads, and allocate() treats the block as not on the host meanwhile.")
      .def(
          "complete_disk_reads",
          [](BlockManager& bm, const py::object& ok) {
            bm.complete_disk_reads(outcomes(ok, bm.num_disk_reads_in_flight()));
          },
          py::arg("ok") = true,
          "The outcome of every disk read taken and not yet completed, in the order taken (one bool for all, or\n"
          "one per read): a confirmed read gives the entry its host slot (a 'CPU' stored event; it stays on\n"
          "disk); a failed one (stale or foreign file) drops the disk entry (a 'DISK' removed event).")
      .def(
          "disk_record_identity",
          [](const BlockManager& bm, int32_t record) {
            const DiskTier::Identity id = bm.disk_record_identity(record);
            return py::make_tuple(id.hash, id.parent ? py::object(py::int_(*id.parent)) : py::object(py::none()),
                                  py::cast(id.tokens));
          },
          py::arg("record"),
          "(block_hash, parent_block_hash or None, token_ids) of what the disk record holds or is being written\n"
          "or read: what the runner writes in the record's header and checks on read (the events' hashes).\n"
          "ValueError for a record out of range, KeyError for one that holds nothing.")
      .def(
          "disk_record_salt",
          [](const BlockManager& bm, int32_t record) { return py::bytes(bm.disk_record_identity(record).salt); },
          py::arg("record"),
          "The cache salt of the block the disk record holds or is being written or read (block 0 of a salted\n"
          "prompt; b'' otherwise): with disk_record_identity, what restore_disk_record needs after a restart.\n"
          "ValueError for a record out of range, KeyError for one that holds nothing.")
      .def(
          "restore_disk_record",
          [](BlockManager& bm, int32_t record, uint64_t block_hash, std::optional<int32_t> parent_record,
             const py::object& token_ids, const std::optional<py::object>& cache_salt, int32_t group) {
            Int64Array tokens(token_ids, "token_ids");
            return bm.restore_disk_record(record, block_hash, parent_record.value_or(-1), tokens.span(),
                                          salt_bytes(cache_salt), group);
          },
          py::arg("record"), py::arg("block_hash"), py::arg("parent_record"), py::arg("token_ids"), py::kw_only(),
          py::arg("cache_salt") = py::none(), py::arg("group") = 0,
          "Re-registers a disk record an earlier run of the same model wrote (its header read back and checked\n"
          "by the runner): the block `token_ids` whose chained hash is `block_hash`, after the block that disk\n"
          "record `parent_record` holds (None: block 0 of a prompt, salted with `cache_salt`). Restore parents\n"
          "before children. Returns False and changes nothing when the hash is not that block's after that\n"
          "parent, the record is in use or holds something, the parent record holds nothing, or the block has a\n"
          "disk copy already, or is in another group than `group` (the group of a block 0; a child is in its\n"
          "parent's); True adds a 'DISK' stored event for group 0. ValueError: no disk tier, a record or group\n"
          "out of range, not one block of tokens, a salt after block 0, or hash_algo='weak8'.")
      .def("set_time", &BlockManager::set_time, py::arg("now"),
           "Advances the manager's clock (the unit of retention durations; it starts at 0 and is never read\n"
           "from the wall): free blocks whose priority duration has run out fall back to the default.")
      .def_property_readonly("now", &BlockManager::now)
      .def("pin", &BlockManager::pin, py::arg("seq_id"),
           "Keeps the sequence's full cached blocks cached after free() until unpin(); returns how many\n"
           "blocks the pin holds. RuntimeError if it would pin more than max_pinned_blocks.")
      .def("unpin", &BlockManager::unpin, py::arg("seq_id"))
      .def("is_pinned", [](const BlockManager& bm, int64_t seq_id) { return bm.pins().is_pinned(seq_id); }, py::arg("seq_id"))
      .def("pinned_blocks", [](const BlockManager& bm, int64_t seq_id) { return bm.pins().blocks(seq_id); }, py::arg("seq_id"), "The blocks the sequence's pin holds.")
      .def("block_priority", &BlockManager::block_priority, py::arg("block"),
           "The eviction priority GPU block `block` has now.")
      .def_property_readonly("num_pinned_blocks", [](const BlockManager& bm) { return bm.pins().num_pinned(); })
      .def_property_readonly("max_pinned_blocks", [](const BlockManager& bm) { return bm.pins().max_pinned(); })
      .def_property_readonly("default_priority", [](const BlockManager& bm) { return bm.config().default_priority; })
      .def_property_readonly("decode_priority", [](const BlockManager& bm) { return bm.config().decode_priority; })
      .def("reset_prefix_cache", &BlockManager::reset_prefix_cache)
      .def("check_invariants", &BlockManager::check_invariants)
      .def("__repr__", [](const BlockManager& bm) {
        return "BlockManager(num_blocks=" + std::to_string(bm.config().num_blocks) + ", block_size=" +
               std::to_string(bm.block_size()) + ", free=" + std::to_string(bm.gpu_pool().num_free()) + ")";
      });

  // pybind11 silently ignores a second __init__ on a live instance (any function named __init__ gets that
  // treatment), which would leave a caller believing the manager was rebuilt. Wrap it under another name.
  py::object construct = block_manager.attr("__init__");
  static const std::string init_doc = py::str(construct.attr("__doc__"));
  py::cpp_function init_once(
      [construct](py::handle self, py::args args, py::kwargs kwargs) {
        static const py::detail::type_info* info = py::detail::get_type_info(typeid(BlockManager));
        if (reinterpret_cast<py::detail::instance*>(self.ptr())->get_value_and_holder(info).holder_constructed())
          throw py::type_error("BlockManager.__init__ called on an initialised manager; create a new one instead");
        construct(self, *args, **kwargs);
      },
      py::name("init_once"), py::is_method(block_manager), py::doc(init_doc.c_str()));
  block_manager.attr("__init__") = init_once;
}

}  // namespace pagedkv::bindings
