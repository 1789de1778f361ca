// pybind11 bindings of the block manager (pagedkv.BlockManager, pagedkv.AllocStatus). Token ids and
// sequence ids are accepted as Python sequences of ints, 1-D integer tensors or integer buffers; batches
// of slots, tables, lengths and block mappings come back as CPU tensors, single values as Python values.
// The tiers' methods are in bindings_block_manager_tiers.cpp, the argument converters in
// bindings_block_manager_args.cpp.
#include "bindings_block_manager.h"

namespace pagedkv::bindings {

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
            if (is_torch_tensor(prompts.ptr())) {  // a 2-D integer tensor: one prompt per row
              int64_t num_rows = 0, width = 0;
              {
                const TensorView view(prompts.ptr(), "prompts");
                if (view.ndim() != 2) throw ValueError("allocate_batch: a prompts tensor must be 2-D (one prompt per row)");
                if (!view.is_integer())
                  throw py::type_error("allocate_batch: prompts must hold integers, got dtype " + view.dtype_name());
                num_rows = view.size(0);
                width = view.size(1);
              }
              py::object flat = prompts.attr("reshape")(-1);  // a view when contiguous
              rows.emplace(flat, "prompts");
              for (int64_t i = 0; i < num_rows; ++i) spans.push_back({rows->data + i * width, size_t(width)});
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
            std::optional<CpuTensor> slots;
            bm.append_tokens(ids.span(), tokens.span(), per_seq ? std::optional(per_seq->span()) : std::nullopt,
                             [&slots](size_t total) {
                               slots.emplace(std::initializer_list<int64_t>{static_cast<int64_t>(total)}, kInt64);
                               return slots->data<int64_t>();
                             });
            return slots->release();
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
            const TorchTensor slots = slot_tensor(bm, ids.span(), begin.span(), ranges.ends(), "attention_inputs", group,
                                                  static_cast<size_t>(std::numeric_limits<int32_t>::max()));
            const TorchTensor tables = block_table_tensor(bm, ids, max_blocks, pad, group);
            const auto n = static_cast<int64_t>(ids.size);
            CpuTensor lens({n}, kInt32), starts_out({n + 1}, kInt32);
            int32_t* len = lens.data<int32_t>();
            int32_t* qsl = starts_out.data<int32_t>();
            qsl[0] = 0;
            for (int64_t i = 0; i < n; ++i) {
              const int64_t end = stop ? stop->data[i] : bm.num_tokens(ids.data[i]);
              len[i] = static_cast<int32_t>(end);
              qsl[i + 1] = qsl[i] + static_cast<int32_t>(end - begin.data[i]);
            }
            return py::make_tuple(slots, tables, lens.release(), starts_out.release());
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
            return token_counts(bm, Int64Array(seq_ids, "seq_ids"));
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
          "the same multiset.");
  bind_tiers(block_manager);
  block_manager
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