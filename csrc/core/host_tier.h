// The host tier of the prefix cache: a pool of host slots (a cache pool of medium kCpu: the device pool's
// free-list levels, retention and content tags) holding copies of device blocks' KV, the offloads
// (device block -> host slot) that write KV back to it and the loads (host slot -> device block) that
// bring it back, each queued until the runner takes it and held until the runner confirms it. Every group's
// chains are offloaded: a block id's bytes serve whichever group owns it, so the copy is the same.
#pragma once
#include <cstdint>
#include <vector>

#include "core/block_manager_stats.h"
#include "core/block_pool.h"
#include "core/kv_event_log.h"
#include "core/pending_copies.h"
#include "core/prefix_cache.h"

namespace pagedkv {

class HostTier final : public WriteBack {
 public:
  // num_slots == 0: no tier. Device blocks below min_priority are never offloaded.
  HostTier(int32_t num_slots, int32_t min_priority, int32_t default_priority, PrefixCache* cache,
           KvEventLog* events, BlockPool* device, BlockManagerStats* counters);

  bool enabled() const { return enabled_; }
  void disable() { enabled_ = false; }
  const BlockPool& pool() const { return host_; }
  BlockPool& pool() { return host_; }

  // The tier below (the disk tier): a cached host slot about to be reused is first offered to it.
  void set_lower_tier(WriteBack* lower) { lower_ = lower; }
  // Takes a host slot for KV of the given retention: the slot the pool evicts first, after offering the
  // cached entries ahead of it to the tier below while another slot stays free (the tier below holds those
  // it writes back). Returns kNoSlot when no slot is free or taking one would evict an entry of a higher
  // priority.
  static constexpr int32_t kNoSlot = -1;
  int32_t take_slot(const BlockRetention& r);
  // Holds and releases host slots (a hit's slot before device blocks are taken; slots kept from eviction
  // while a prefetch takes others).
  void release_slot(int32_t slot) { host_.release(slot); }

  // Offloads. A free device block is dirty when it holds cached KV (of any group) that the host tier does not
  // have (nor is being given or read from disk), at a priority >= min_priority.
  bool dirty(int32_t block) const;
  // WriteBack: queues the offload of a dirty block about to be reused when a host slot can take it.
  bool write_back(int32_t free_block) override;
  // Clean ahead: queues offloads of the dirty blocks among the max_blocks cached free device blocks the
  // pool would evict first (coldest first); returns how many it queued.
  int32_t plan_offloads(int32_t max_blocks);
  std::vector<BlockPair> take_offloads();  // (device block, host slot), queued order
  // Each taken offload's outcome, in the order taken (ok.size() == num_offloads_in_flight()): a
  // successful copy enters the host tier; a failed one leaves nothing there. The device blocks are
  // released either way.
  void complete_offloads(const std::vector<bool>& ok);
  int32_t num_offloads_queued() const { return static_cast<int32_t>(offloads_.size()); }
  int32_t num_offloads_in_flight() const { return static_cast<int32_t>(offloads_taken_.size()); }

  // Loads: a load copies a host slot into a device block some sequence took for it; it holds both until
  // the runner confirms it. `owner` identifies the sequence (its serial) and `index` the block in it (in
  // whichever group: a failed load's recovery needs only the position).
  struct Load {
    int32_t slot;
    int32_t block;
    uint64_t owner;
    int32_t index;
  };
  void hold_slot(int32_t slot) { host_.acquire(slot); }   // a hit's slot, before device blocks are taken
  void queue_load(int32_t slot, int32_t block, uint64_t owner, int32_t index);  // takes over the slot's hold
  std::vector<BlockPair> take_loads();  // (host slot, device block)
  // Each taken load's outcome, in the order taken (ok.size() == num_loads_in_flight()): releases the
  // loads' slots and device blocks and returns the loads.
  std::vector<Load> finish_loads(const std::vector<bool>& ok);
  // Drops the entry a free or held slot holds (a removed event for group 0's), as when it is evicted.
  void drop_entry(int32_t slot);
  int32_t num_loads_queued() const { return static_cast<int32_t>(loads_.size()); }
  int32_t num_loads_in_flight() const { return static_cast<int32_t>(loads_taken_.size()); }

  // The prefix cache is being cleared: host slots forget their content, offloads in flight will enter
  // nothing. Offloads not taken yet are dropped (their device blocks released).
  void clear();
  void set_time(double now) { host_.set_time(now); }

  // Adds the holds of pending offloads and loads to the device and host use counts; the queues agree with
  // the nodes' offloading flags. Throws InvariantError.
  void add_uses(std::vector<int32_t>* device_uses, std::vector<int32_t>* host_uses) const;
  void check_invariants() const;

 private:
  struct Offload {
    int32_t block;
    int32_t slot;
    PrefixCache::NodeId node;
    uint64_t epoch;  // the cache's epoch when queued: a cleared cache makes the node id meaningless
  };
  bool can_take_slot(int32_t priority) const;
  void queue_offload(int32_t block, int32_t slot);
  void finish_offload(const Offload& o, bool ok);

  bool enabled_;
  int32_t min_priority_;
  PrefixCache* cache_;
  KvEventLog* events_;
  BlockPool* device_;
  BlockManagerStats* counters_;
  BlockPool host_;
  WriteBack* lower_ = nullptr;
  std::vector<Offload> offloads_, offloads_taken_;
  std::vector<Load> loads_, loads_taken_;
  uint64_t epoch_ = 0;
};

}  // namespace pagedkv
