// What the block manager's bindings share (bindings_block_manager*.cpp): the caster that refuses an
// uninitialised BlockManager, and the converters between Python arguments and the core's types.
#pragma once

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

// One sequence id (an int, a numpy integer, a 0-d tensor), as opposed to a batch of them.
bool is_one_id(const py::handle& obj);

// The token counts of `ids` as an int32 tensor (paged attention's seq_lens).
TorchTensor token_counts(const BlockManager& bm, const Int64Array& ids);

// Warns that `old` is deprecated in favour of `replacement` (once per call site, as Python does).
void deprecated(const std::string& old, const std::string& replacement);

// seq_ids: one id or a sequence of ids.
std::vector<int64_t> seq_id_list(const py::handle& obj);

// num_tokens for each of n sequences: one int for all, or one per sequence (only when seq_ids was a list).
std::vector<int64_t> per_sequence_counts(const py::handle& seq_ids, size_t n, const py::handle& num_tokens,
                                         const char* what);

// retention: None, or a list of (start, end, priority) / (start, end, priority, duration) tuples; end None
// means every later token, duration None means for ever. Values are validated by the core.
std::vector<RetentionRange> retention_ranges(const py::handle& obj, const char* name);

// A window in tokens: an int >= 1 (TypeError for anything else but None, which means full attention).
int64_t window_tokens(const py::handle& obj, const std::string& name);

// The constructor's sliding_window / group_windows as one window per group.
std::vector<int64_t> group_windows_arg(const py::object& sliding_window, const py::object& group_windows);

py::object window_object(int64_t w);

// medium: "GPU", "CPU" or "DISK".
Medium medium_arg(const std::string& medium);

// ok: one bool for all n outcomes, or a list / tuple / 1-D bool or integer tensor of n outcomes.
std::vector<bool> outcomes(const py::object& ok, int32_t n);

// Block pairs as the int64 [n, 2] (src, dst) CPU tensor that copy_blocks and swap_blocks take.
TorchTensor pairs_tensor(const std::vector<BlockPair>& pairs);

py::dict stats_dict(const BlockManagerStats& s);

// Slots of positions [begin[i], end[i]) (end null: each sequence's length) as one int64 tensor, written in
// place by the core once it has validated every range; more than max_total slots is a ValueError.
TorchTensor slot_tensor(const BlockManager& bm, Span<int64_t> ids, Span<int64_t> begin,
                          std::optional<Span<int64_t>> end, const char* what, int32_t group,
                          size_t max_total = std::numeric_limits<size_t>::max());

// Block tables of `ids` as an int32 tensor [len(ids), width], written in place by the core.
TorchTensor block_table_tensor(const BlockManager& bm, const Int64Array& ids, const std::optional<int32_t>& max_blocks,
                                int32_t pad, int32_t group);

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

// The host and disk tiers', pins' and retention clock's methods (bindings_block_manager_tiers.cpp).
void bind_tiers(py::class_<BlockManager>& block_manager);

}  // namespace pagedkv::bindings
