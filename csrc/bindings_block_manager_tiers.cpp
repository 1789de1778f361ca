// pybind11 bindings of the block manager's host and disk tiers (offloads, loads, disk reads and writes),
// pins and the retention clock.
#include "bindings_block_manager.h"

namespace pagedkv::bindings {

void bind_tiers(py::class_<BlockManager>& block_manager) {
  block_manager
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
      .def_property_readonly("decode_priority", [](const BlockManager& bm) { return bm.config().decode_priority; });
}

}  // namespace pagedkv::bindings
