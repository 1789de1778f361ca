// Block manager: the host and disk tiers as the runner drives them: planning offloads and disk writes,
// taking the copies they need, completing them (and recovering from a failed load), prefetching a prompt
// from disk and restoring disk records at start-up (see block_manager.h).
#include <algorithm>

#include "core/block_manager.h"
#include "core/errors.h"

namespace pagedkv {

// ---------------------------------------------------------------------------------------------------
// The host tier: offloads and loads the runner performs

int32_t BlockManager::plan_offloads(int32_t max_blocks) {
  if (max_blocks < 0) throw ValueError(cat("plan_offloads: max_blocks must be >= 0, got ", max_blocks));
  return host_.plan_offloads(max_blocks);
}

std::vector<BlockPair> BlockManager::take_offloads() { return host_.take_offloads(); }

void BlockManager::complete_offloads(const std::vector<bool>& ok) {
  if (ok.size() != static_cast<size_t>(host_.num_offloads_in_flight()))
    throw ValueError(cat("complete_offloads: ", ok.size(), " outcomes for ", host_.num_offloads_in_flight(),
                         " offloads taken and not completed"));
  host_.complete_offloads(ok);
}

std::vector<BlockPair> BlockManager::take_loads() { return host_.take_loads(); }

std::vector<int64_t> BlockManager::complete_loads(const std::vector<bool>& ok) {
  if (ok.size() != static_cast<size_t>(host_.num_loads_in_flight()))
    throw ValueError(cat("complete_loads: ", ok.size(), " outcomes for ", host_.num_loads_in_flight(),
                         " loads taken and not completed"));
  const std::vector<HostTier::Load> done = host_.finish_loads(ok);
  std::vector<std::pair<int64_t, Sequence*>> loaded;
  for (size_t i = 0; i < done.size(); ++i) {
    const auto it = loading_seqs_.find(done[i].owner);
    if (it == loading_seqs_.end()) continue;  // freed meanwhile
    Sequence& seq = seqs_.at(it->second);
    if (!ok[i] && (seq.load_failed_at < 0 || done[i].index < seq.load_failed_at)) seq.load_failed_at = done[i].index;
    if (--seq.loading == 0) {
      loaded.emplace_back(it->second, &seq);
      loading_seqs_.erase(it);
    }
  }
  std::vector<int64_t> readmit;
  for (auto& [id, seq] : loaded) {
    if (seq->load_failed_at >= 0) recover_failed_load(*seq);
    if (seq->readmit) {
      // Its failed entries leave the host tier, so the next lookup does not hit them again.
      for (size_t i = 0; i < done.size(); ++i)
        if (!ok[i] && done[i].owner == seq->serial) host_.drop_entry(done[i].slot);
      ++num_readmit_;
      readmit.push_back(id);
      continue;
    }
    for (int32_t g = 0; g < num_groups(); ++g) register_computed_blocks(*seq, g);  // hits from now on
  }
  return readmit;
}

void BlockManager::recover_failed_load(Sequence& seq) {
  // Recomputing from p = j * bs needs every block at or after p private to the sequence, and each windowed
  // group's window at p present: the table holds [released, ...) only, so that is released_for(g, p) ==
  // released (a smaller p would need blocks the window did not keep). The largest candidate is the first
  // failed block's start; a smaller one needs the same windows or more, so it is that or none.
  const int32_t j = std::min<int32_t>(seq.load_failed_at, static_cast<int32_t>(seq.num_computed / block_size_));
  seq.load_failed_at = -1;
  const int64_t p = int64_t(j) * block_size_;
  bool safe = true;
  for (int32_t g = 0; g < num_groups() && safe; ++g) safe = released_for(g, p) == seq.groups[g].released;
  // Blocks at or after j that hold registered content or are shared (device hits; a windowed group may
  // take some after a loaded one; a reset may have untagged them) are replaced by fresh ones. Loaded and
  // fresh blocks are neither: nothing registered them, and only this sequence holds them.
  const auto hits_from_j = [&](const GroupTable& t, auto&& f) {
    for (size_t i = static_cast<size_t>(std::max(j, t.released)); i < t.blocks.size(); ++i)
      if (gpu_.tag(t.blocks[i]) != PrefixCache::kNoNode || gpu_.ref_count(t.blocks[i]) > 1) f(i);
  };
  int32_t shared = 0, freed = 0;  // releasing a block no one else holds frees it
  for (const GroupTable& t : seq.groups)
    hits_from_j(t, [&](size_t i) {
      ++shared;
      freed += gpu_.ref_count(t.blocks[i]) == 1 && !copies_.is_source(t.blocks[i]);
    });
  if (!safe || shared > gpu_.num_free() + freed) {
    seq.readmit = true;
    seq.num_computed = 0;
    for (GroupTable& t : seq.groups) t.num_registered = 0;
    return;
  }
  std::vector<size_t> replaced;
  for (GroupTable& t : seq.groups) {
    replaced.clear();
    hits_from_j(t, [&](size_t i) { replaced.push_back(i); });
    for (size_t i : replaced) gpu_.release(t.blocks[i]);
    for (size_t i : replaced) t.blocks[i] = gpu_.take_fresh(retention_of(seq, static_cast<int32_t>(i)));
    t.num_registered = std::min(t.num_registered, j);
  }
  seq.num_computed = std::min(seq.num_computed, p);
}

int32_t BlockManager::num_loading_blocks(int64_t seq_id) const { return get(seq_id).loading; }

// ---------------------------------------------------------------------------------------------------
// The disk tier: writes and reads the runner performs

int32_t BlockManager::plan_disk_writes(int32_t max_slots) {
  if (max_slots < 0) throw ValueError(cat("plan_disk_writes: max_slots must be >= 0, got ", max_slots));
  return disk_.plan_writes(max_slots);
}

std::vector<BlockPair> BlockManager::take_disk_writes() { return disk_.take_writes(); }

void BlockManager::complete_disk_writes(const std::vector<bool>& ok) {
  if (ok.size() != static_cast<size_t>(disk_.num_writes_in_flight()))
    throw ValueError(cat("complete_disk_writes: ", ok.size(), " outcomes for ", disk_.num_writes_in_flight(),
                         " disk writes taken and not completed"));
  disk_.complete_writes(ok);
}

int32_t BlockManager::prefetch(Span<int64_t> tokens, std::string_view salt) {
  if (tokens.empty()) throw ValueError("prefetch: token_ids is empty");
  if (!disk_.enabled()) return 0;
  std::vector<std::vector<PrefixCache::NodeId>> nodes;
  int32_t reach = 0;
  tier_walk(tokens, salt, &nodes, &reach);
  // The prompt's host entries stay while the reads take host slots (and become the most recently used),
  // and its nodes stay while taking a slot writes another entry to disk, which may evict a disk entry.
  std::vector<int32_t> held;
  for (const auto& group_nodes : nodes)
    for (PrefixCache::NodeId node : group_nodes) {
      cache_.add_ref(node);
      if (cache_.node(node).host_slot != PrefixCache::kNoBlock) {
        held.push_back(cache_.node(node).host_slot);
        host_.hold_slot(held.back());
      }
    }
  int32_t queued = 0;
  bool stopped = false;
  for (size_t g = 0; g < nodes.size() && !stopped; ++g)
    for (PrefixCache::NodeId node : nodes[g]) {
      const PrefixCache::Node& n = cache_.node(node);
      if (n.block != PrefixCache::kNoBlock || n.host_slot != PrefixCache::kNoBlock || n.disk_reading) continue;
      if (n.disk_record == PrefixCache::kNoBlock || !disk_.queue_read(node)) {  // evicted meanwhile, or no slot
        stopped = true;
        break;
      }
      ++queued;
    }
  for (int32_t slot : held) host_.release_slot(slot);
  for (auto g = nodes.rbegin(); g != nodes.rend(); ++g)
    for (auto it = g->rbegin(); it != g->rend(); ++it) cache_.release(*it);
  return queued;
}

std::vector<BlockPair> BlockManager::take_disk_reads() { return disk_.take_reads(); }

void BlockManager::complete_disk_reads(const std::vector<bool>& ok) {
  if (ok.size() != static_cast<size_t>(disk_.num_reads_in_flight()))
    throw ValueError(cat("complete_disk_reads: ", ok.size(), " outcomes for ", disk_.num_reads_in_flight(),
                         " disk reads taken and not completed"));
  disk_.complete_reads(ok);
}

DiskTier::Identity BlockManager::disk_record_identity(int32_t record) const {
  if (record < 0 || record >= disk_.pool().num_blocks())
    throw ValueError(cat("disk_record_identity: no disk record ", record, " (the disk tier has ",
                         disk_.pool().num_blocks(), ")"));
  std::optional<DiskTier::Identity> id = disk_.identity(record);
  if (!id) throw KeyError(cat("disk_record_identity: disk record ", record, " holds nothing"));
  return std::move(*id);
}

bool BlockManager::restore_disk_record(int32_t record, uint64_t hash, int32_t parent_record, Span<int64_t> tokens,
                                       std::string_view salt, int32_t group) {
  const int32_t num_records = disk_.pool().num_blocks();
  if (!disk_.enabled()) throw ValueError("restore_disk_record: the disk tier is off");
  if (hash_algo() == HashAlgo::kWeak8)
    throw ValueError("restore_disk_record: weak8 block hashes collide by design and cannot link a restored chain");
  if (record < 0 || record >= num_records)
    throw ValueError(cat("restore_disk_record: no disk record ", record, " (the disk tier has ", num_records, ")"));
  if (parent_record < -1 || parent_record >= num_records)
    throw ValueError(cat("restore_disk_record: parent_record ", parent_record, " is neither -1 nor a disk record"));
  if (static_cast<int64_t>(tokens.size) != block_size_)
    throw ValueError(cat("restore_disk_record: a record holds one block of ", block_size_, " tokens, got ", tokens.size));
  if (parent_record >= 0 && !salt.empty())
    throw ValueError("restore_disk_record: only block 0 (parent_record -1) has a salt");
  if (group < 0 || group >= num_groups())
    throw ValueError(cat("restore_disk_record: no group ", group, " (the manager has ", num_groups(), ")"));
  PrefixCache::NodeId parent = PrefixCache::root(group);
  if (parent_record >= 0) {
    parent = disk_.pool().tag(parent_record);
    if (parent == PrefixCache::kNoNode || cache_.node(parent).disk_record != parent_record ||
        cache_.node(parent).root != PrefixCache::root(group))
      return false;
  }
  return disk_.restore(record, parent, tokens.data, salt, hash) != PrefixCache::kNoNode;
}

}  // namespace pagedkv
