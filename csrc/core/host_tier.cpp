// Host tier of the prefix cache (see host_tier.h).
#include "core/host_tier.h"

#include <optional>
#include <unordered_set>

#include "core/errors.h"
#include "core/util.h"

namespace pagedkv {

HostTier::HostTier(int32_t num_slots, int32_t min_priority, int32_t default_priority, PrefixCache* cache,
                   KvEventLog* events, BlockPool* device, BlockManagerStats* counters)
    : enabled_(num_slots > 0),
      min_priority_(min_priority),
      cache_(cache),
      events_(events),
      device_(device),
      counters_(counters),
      host_(num_slots, Medium::kCpu, default_priority, cache, events, /*copies=*/nullptr, &counters->host_evictions) {}

// ---------------------------------------------------------------------------------------------------
// Offloads

bool HostTier::dirty(int32_t block) const {
  if (!device_->holds_cached_kv(block)) return false;
  const PrefixCache::Node& n = cache_->node(device_->tag(block));
  return n.host_slot == PrefixCache::kNoBlock && !n.offloading && !n.disk_reading &&
         device_->retention(block).priority >= min_priority_;
}

bool HostTier::can_take_slot(int32_t priority) const {
  // A host entry is evicted for a device block of at least its priority, never for a weaker one.
  const int32_t front = host_.front();
  if (front == FreeList::kNone) return false;
  return !host_.holds_cached_kv(front) || host_.retention(front).priority <= priority;
}

int32_t HostTier::take_slot(const BlockRetention& r) {
  // Entries written back to the tier below leave the free list for their copy, so only while another free
  // slot remains for this one (no waiting: past that, a dirty entry is dropped); each next entry offered
  // must be evictable for this priority too.
  while (lower_ && host_.num_free() > 1 && can_take_slot(r.priority) && host_.holds_cached_kv(host_.front()) &&
         lower_->write_back(host_.front())) {
  }
  return can_take_slot(r.priority) ? host_.take_fresh(r) : kNoSlot;
}

bool HostTier::write_back(int32_t free_block) {
  if (!enabled_ || !dirty(free_block) || !can_take_slot(device_->retention(free_block).priority)) return false;
  const int32_t slot = take_slot(device_->retention(free_block));
  if (slot == kNoSlot) return false;
  queue_offload(free_block, slot);
  return true;
}

int32_t HostTier::plan_offloads(int32_t max_blocks) {
  if (!enabled_ || max_blocks <= 0) return 0;
  // Only the max_blocks cached free blocks evicted first: those further back are not due soon, and the
  // walk stays O(max_blocks) however many clean blocks lead the free list.
  std::vector<int32_t> picked;
  int32_t seen = 0;
  device_->for_each_cached_free([&](int32_t block) {
    if (dirty(block)) picked.push_back(block);
    return ++seen < max_blocks;
  });
  int32_t queued = 0;
  for (int32_t block : picked) {  // coldest first; stop when the host tier would evict something stronger
    const int32_t slot = take_slot(device_->retention(block));
    if (slot == kNoSlot) break;
    queue_offload(block, slot);
    ++queued;
  }
  return queued;
}

void HostTier::queue_offload(int32_t block, int32_t slot) {
  const PrefixCache::NodeId node = device_->tag(block);
  device_->acquire(block);  // never handed out while its copy is pending
  cache_->add_ref(node);
  cache_->set_offloading(node, true);
  offloads_.push_back({block, slot, node, epoch_});
}

std::vector<BlockPair> HostTier::take_offloads() {
  return hand_over(&offloads_, &offloads_taken_, [](const Offload& o) { return BlockPair(o.block, o.slot); });
}

void HostTier::complete_offloads(const std::vector<bool>& ok) {
  complete_in_order(&offloads_taken_, ok, [this](const Offload& o, bool done) { finish_offload(o, done); });
}

void HostTier::finish_offload(const Offload& o, bool ok) {
  const bool current = o.epoch == epoch_;  // else the cache was cleared: the node is gone
  if (ok && current) {
    host_.set_tag(o.slot, o.node);
    cache_->set_location(o.node, Medium::kCpu, o.slot);
    const PrefixCache::Node& n = cache_->node(o.node);
    if (events_->enabled() && n.root == PrefixCache::kRoot) {  // events describe group 0's cache
      const std::optional<uint64_t> parent =
          PrefixCache::is_root(n.parent) ? std::nullopt : std::optional<uint64_t>(cache_->hash(n.parent));
      events_->stored(cache_->hash(o.node), parent, cache_->tokens(o.node), cache_->block_size(), n.salt, Medium::kCpu);
    }
    ++counters_->offloaded_blocks;
  }
  if (!ok) ++counters_->offload_failures;
  if (current) {
    cache_->set_offloading(o.node, false);
    cache_->release(o.node);
  }
  host_.release(o.slot);
  device_->release(o.block, /*cold=*/true);  // clean now: it keeps its place as the next to evict
}

// ---------------------------------------------------------------------------------------------------
// Loads

void HostTier::queue_load(int32_t slot, int32_t block, uint64_t owner, int32_t index) {
  device_->acquire(block);  // held until the copy is confirmed, even if the sequence lets go of it
  loads_.push_back({slot, block, owner, index});
}

void HostTier::drop_entry(int32_t slot) {
  if (host_.tag(slot) == PrefixCache::kNoNode) return;
  host_.acquire(slot);  // forget() wants it held: a free slot leaves its cached level
  host_.forget(slot);
  host_.release(slot);
}

std::vector<BlockPair> HostTier::take_loads() {
  return hand_over(&loads_, &loads_taken_, [](const Load& l) { return BlockPair(l.slot, l.block); });
}

std::vector<HostTier::Load> HostTier::finish_loads(const std::vector<bool>& ok) {
  return complete_in_order(&loads_taken_, ok, [this](const Load& l, bool done) {
    ++(done ? counters_->loaded_blocks : counters_->load_failures);
    host_.release(l.slot);
    device_->release(l.block);
  });
}

// ---------------------------------------------------------------------------------------------------
// Reset and invariants

void HostTier::clear() {
  ++epoch_;
  for (const Offload& o : offloads_) {  // not taken: nothing copies them
    host_.release(o.slot);
    device_->release(o.block, /*cold=*/true);
  }
  offloads_.clear();
  host_.clear_tags();
  host_.reset_free_levels();
}

void HostTier::add_uses(std::vector<int32_t>* device_uses, std::vector<int32_t>* host_uses) const {
  for (const auto* queue : {&offloads_, &offloads_taken_})
    for (const Offload& o : *queue) {
      ++(*device_uses)[o.block];
      ++(*host_uses)[o.slot];
    }
  for (const auto* queue : {&loads_, &loads_taken_})
    for (const Load& l : *queue) {
      ++(*device_uses)[l.block];
      ++(*host_uses)[l.slot];
    }
}

void HostTier::check_invariants() const {
  const auto fail = [](const std::string& what) { throw InvariantError("BlockManager invariant violated: " + what); };
  host_.check_invariants();
  std::unordered_set<PrefixCache::NodeId> offloading;
  for (const auto* queue : {&offloads_, &offloads_taken_})
    for (const Offload& o : *queue) {
      if (o.epoch != epoch_) continue;
      if (!offloading.insert(o.node).second) fail(cat("prefix-cache node ", o.node, " has two pending offloads"));
      if (!cache_->node(o.node).offloading) fail(cat("prefix-cache node ", o.node, " is offloading but not marked so"));
      if (host_.tag(o.slot) != PrefixCache::kNoNode)
        fail(cat("host slot ", o.slot, " holds content before its offload is confirmed"));
    }
  for (PrefixCache::NodeId id : cache_->live_nodes())
    if (cache_->node(id).offloading && !offloading.count(id))
      fail(cat("prefix-cache node ", id, " is marked offloading without a pending offload"));
  for (const auto* queue : {&loads_, &loads_taken_})
    for (const Load& l : *queue)
      if (device_->tag(l.block) != PrefixCache::kNoNode)
        fail(cat("block ", l.block, " holds registered content before its load is confirmed"));
}

}  // namespace pagedkv
