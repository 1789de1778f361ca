// Disk tier of the prefix cache (see disk_tier.h).
#include "core/disk_tier.h"

#include <unordered_set>

#include "core/errors.h"
#include "core/util.h"

namespace pagedkv {

DiskTier::DiskTier(int32_t num_records, int32_t default_priority, PrefixCache* cache, KvEventLog* events,
                   HostTier* host, BlockManagerStats* counters)
    : enabled_(num_records > 0),
      cache_(cache),
      events_(events),
      host_tier_(host),
      host_(&host->pool()),
      counters_(counters),
      disk_(num_records, Medium::kDisk, default_priority, cache, events, /*copies=*/nullptr,
            &counters->disk_evictions) {}

DiskTier::Identity DiskTier::identity_of(PrefixCache::NodeId node) const {
  const PrefixCache::Node& n = cache_->node(node);
  Identity id;
  const uint64_t group_mix = DiskTier::group_mix(n.root);
  id.hash = cache_->hash(node) ^ group_mix;
  if (!PrefixCache::is_root(n.parent)) id.parent = cache_->hash(n.parent) ^ group_mix;
  const int64_t* tokens = cache_->tokens(node);
  id.tokens.assign(tokens, tokens + cache_->block_size());
  id.salt = n.salt;
  return id;
}

bool DiskTier::can_take_record(int32_t priority) const {
  // A disk entry is evicted for a host entry of at least its priority, never for a weaker one.
  const int32_t front = disk_.front();
  if (front == FreeList::kNone) return false;
  return !disk_.holds_cached_kv(front) || disk_.retention(front).priority <= priority;
}

// ---------------------------------------------------------------------------------------------------
// Writes

bool DiskTier::dirty(int32_t slot) const {
  if (!host_->holds_cached_kv(slot)) return false;
  const PrefixCache::Node& n = cache_->node(host_->tag(slot));
  return n.disk_record == PrefixCache::kNoBlock && !n.disk_writing;
}

bool DiskTier::write_back(int32_t free_slot) {
  if (!enabled_ || !dirty(free_slot) || !can_take_record(host_->retention(free_slot).priority)) return false;
  queue_write(free_slot);
  return true;
}

int32_t DiskTier::plan_writes(int32_t max_slots) {
  if (!enabled_ || max_slots <= 0) return 0;
  std::vector<int32_t> picked;
  int32_t seen = 0;
  host_->for_each_cached_free([&](int32_t slot) {
    if (dirty(slot)) picked.push_back(slot);
    return ++seen < max_slots;
  });
  int32_t queued = 0;
  for (int32_t slot : picked) {  // coldest first; stop when the disk tier would evict something stronger
    if (!can_take_record(host_->retention(slot).priority)) break;
    queue_write(slot);
    ++queued;
  }
  return queued;
}

void DiskTier::queue_write(int32_t slot) {
  const PrefixCache::NodeId node = host_->tag(slot);
  const int32_t record = disk_.take_fresh(host_->retention(slot));
  host_->acquire(slot);  // never reused while its write is pending
  cache_->add_ref(node);
  cache_->set_disk_writing(node, true);
  queue(&writes_, {slot, record, node, epoch_});
}

void DiskTier::queue(std::vector<Transfer>* to, const Transfer& t) {
  pending_identity_.emplace(t.record, identity_of(t.node));
  to->push_back(t);
}

DiskTier::Identity DiskTier::forget_pending(int32_t record) {
  auto it = pending_identity_.find(record);
  Identity id = std::move(it->second);
  pending_identity_.erase(it);
  return id;
}

std::vector<BlockPair> DiskTier::take_writes() {
  return hand_over(&writes_, &writes_taken_, [](const Transfer& w) { return BlockPair(w.slot, w.record); });
}

void DiskTier::complete_writes(const std::vector<bool>& ok) {
  complete_in_order(&writes_taken_, ok, [this](const Transfer& w, bool done) { finish_write(w, done); });
}

void DiskTier::finish_write(const Transfer& w, bool ok) {
  const bool current = w.epoch == epoch_;  // else the cache was cleared: the node is gone
  const Identity id = forget_pending(w.record);
  if (ok && current) {
    disk_.set_tag(w.record, w.node);
    cache_->set_location(w.node, Medium::kDisk, w.record);
    if (events_->enabled() && cache_->node(w.node).root == PrefixCache::kRoot)  // events: group 0's cache
      events_->stored(id.hash, id.parent, id.tokens.data(), cache_->block_size(), cache_->node(w.node).salt,
                      Medium::kDisk);
    ++counters_->disk_writes;
  }
  if (!ok) ++counters_->disk_write_failures;
  if (current) {
    cache_->set_disk_writing(w.node, false);
    cache_->release(w.node);
  }
  disk_.release(w.record);
  host_->release(w.slot, /*cold=*/true);  // clean now: it keeps its place as the next to evict
}

// ---------------------------------------------------------------------------------------------------
// Reads

bool DiskTier::queue_read(PrefixCache::NodeId node) {
  const int32_t record = cache_->node(node).disk_record;
  disk_.acquire(record);  // first: taking a slot may write another entry back and take a record
  const int32_t slot = host_tier_->take_slot(disk_.retention(record));
  if (slot == HostTier::kNoSlot) {
    disk_.release(record);
    return false;
  }
  cache_->add_ref(node);
  cache_->set_disk_reading(node, true);
  queue(&reads_, {slot, record, node, epoch_});
  ++counters_->disk_hit_blocks;
  return true;
}

std::vector<BlockPair> DiskTier::take_reads() {
  return hand_over(&reads_, &reads_taken_, [](const Transfer& r) { return BlockPair(r.record, r.slot); });
}

void DiskTier::complete_reads(const std::vector<bool>& ok) {
  complete_in_order(&reads_taken_, ok, [this](const Transfer& r, bool done) { finish_read(r, done); });
}

void DiskTier::finish_read(const Transfer& r, bool ok) {
  const bool current = r.epoch == epoch_;
  const Identity id = forget_pending(r.record);
  ++(ok ? counters_->disk_reads : counters_->disk_read_failures);
  if (current) {
    cache_->set_disk_reading(r.node, false);
    if (ok && cache_->node(r.node).host_slot == PrefixCache::kNoBlock) {
      host_->set_tag(r.slot, r.node);
      cache_->set_location(r.node, Medium::kCpu, r.slot);
      if (events_->enabled() && cache_->node(r.node).root == PrefixCache::kRoot)
        events_->stored(id.hash, id.parent, id.tokens.data(), cache_->block_size(), cache_->node(r.node).salt,
                        Medium::kCpu);
    } else if (!ok && disk_.tag(r.record) == r.node) {
      disk_.forget(r.record);  // a stale or foreign file: the entry is gone (a removed event)
    }
  }
  host_->release(r.slot);
  disk_.release(r.record);
  if (current) cache_->release(r.node);
}

// ---------------------------------------------------------------------------------------------------
// Identity, reset and invariants

// ---------------------------------------------------------------------------------------------------
// Records of an earlier run

PrefixCache::NodeId DiskTier::restore(int32_t record, PrefixCache::NodeId parent, const int64_t* tokens,
                                      std::string_view salt, uint64_t hash) {
  if (!enabled_ || disk_.ref_count(record) != 0 || disk_.tag(record) != PrefixCache::kNoNode) return PrefixCache::kNoNode;
  const std::optional<uint64_t> parent_hash =
      PrefixCache::is_root(parent) ? std::nullopt : std::optional<uint64_t>(cache_->hash(parent));
  const int32_t block_size = cache_->block_size();
  const uint64_t mix = group_mix(PrefixCache::is_root(parent) ? parent : cache_->node(parent).root);
  if ((hash_block_tokens(tokens, static_cast<size_t>(block_size), parent_hash, cache_->algo(), salt) ^ mix) != hash)
    return PrefixCache::kNoNode;  // another block, the same tokens after another prefix, or another group
  const PrefixCache::NodeId found = cache_->find(cache_->key(parent, tokens, salt), parent, tokens, salt);
  if (found != PrefixCache::kNoNode) {
    const PrefixCache::Node& n = cache_->node(found);
    if (n.disk_record != PrefixCache::kNoBlock || n.disk_writing || n.disk_reading) return PrefixCache::kNoNode;
  }
  const PrefixCache::NodeId node =
      found != PrefixCache::kNoNode ? found : cache_->create(cache_->key(parent, tokens, salt), parent, tokens, salt);
  disk_.acquire(record);
  disk_.set_tag(record, node);  // the record's reference keeps the new node
  cache_->set_location(node, Medium::kDisk, record);
  if (events_->enabled() && cache_->node(node).root == PrefixCache::kRoot)  // group 0's: mix is 0
    events_->stored(hash, parent_hash, tokens, block_size, cache_->node(node).salt, Medium::kDisk);
  disk_.release(record);
  return node;
}

std::optional<DiskTier::Identity> DiskTier::identity(int32_t record) const {
  if (const auto it = pending_identity_.find(record); it != pending_identity_.end()) return it->second;
  if (disk_.holds_cached_kv(record)) return identity_of(disk_.tag(record));
  return std::nullopt;
}

void DiskTier::clear() {
  ++epoch_;
  for (const Transfer& w : writes_) {  // not taken: nothing writes them
    pending_identity_.erase(w.record);
    disk_.release(w.record);
    host_->release(w.slot, /*cold=*/true);
  }
  writes_.clear();
  for (const Transfer& r : reads_) {  // not taken: nothing reads them
    pending_identity_.erase(r.record);
    host_->release(r.slot);
    disk_.release(r.record);
  }
  reads_.clear();
  disk_.clear_tags();
  disk_.reset_free_levels();
}

void DiskTier::add_uses(std::vector<int32_t>* host_uses, std::vector<int32_t>* disk_uses) const {
  for (const auto* queue : {&writes_, &writes_taken_, &reads_, &reads_taken_})
    for (const Transfer& t : *queue) {
      ++(*host_uses)[t.slot];
      ++(*disk_uses)[t.record];
    }
}

void DiskTier::check_invariants() const {
  const auto fail = [](const std::string& what) { throw InvariantError("BlockManager invariant violated: " + what); };
  disk_.check_invariants();
  std::unordered_set<PrefixCache::NodeId> writing, reading;
  size_t num_pending = 0;
  for (const auto* queue : {&writes_, &writes_taken_, &reads_, &reads_taken_}) {
    num_pending += queue->size();
    for (const Transfer& t : *queue)
      if (!pending_identity_.count(t.record)) fail(cat("disk record ", t.record, " has a pending transfer without an identity"));
  }
  if (num_pending != pending_identity_.size())
    fail(cat(pending_identity_.size(), " pending disk identities for ", num_pending, " pending transfers"));
  for (const auto* queue : {&writes_, &writes_taken_})
    for (const Transfer& w : *queue) {
      if (w.epoch != epoch_) continue;
      if (!writing.insert(w.node).second) fail(cat("prefix-cache node ", w.node, " has two pending disk writes"));
      if (!cache_->node(w.node).disk_writing)
        fail(cat("prefix-cache node ", w.node, " is being written to disk but not marked so"));
      if (disk_.tag(w.record) != PrefixCache::kNoNode)
        fail(cat("disk record ", w.record, " holds content before its write is confirmed"));
      if (host_->tag(w.slot) != w.node) fail(cat("host slot ", w.slot, " changed content while its disk write is pending"));
    }
  for (const auto* queue : {&reads_, &reads_taken_})
    for (const Transfer& r : *queue) {
      if (r.epoch != epoch_) continue;
      if (!reading.insert(r.node).second) fail(cat("prefix-cache node ", r.node, " has two pending disk reads"));
      if (!cache_->node(r.node).disk_reading)
        fail(cat("prefix-cache node ", r.node, " is being read from disk but not marked so"));
      if (host_->tag(r.slot) != PrefixCache::kNoNode)
        fail(cat("host slot ", r.slot, " holds content before its disk read is confirmed"));
      if (cache_->node(r.node).host_slot != PrefixCache::kNoBlock)
        fail(cat("prefix-cache node ", r.node, " is on the host while its disk read is pending"));
    }
  for (PrefixCache::NodeId id : cache_->live_nodes()) {
    if (cache_->node(id).disk_writing && !writing.count(id))
      fail(cat("prefix-cache node ", id, " is marked disk_writing without a pending write"));
    if (cache_->node(id).disk_reading && !reading.count(id))
      fail(cat("prefix-cache node ", id, " is marked disk_reading without a pending read"));
  }
}

}  // namespace pagedkv
