// The disk tier of the prefix cache, below the host tier: a pool of disk records (a cache pool of medium
// kDisk: the same free-list levels, retention and content tags) holding copies of host slots' KV, the
// writes (host slot -> disk record) that write KV back to it and the reads (disk record -> host slot)
// that prefetch it, each queued until the runner takes it and held until the runner confirms it. The
// manager keeps the books; the runner does the file I/O off the step's critical path.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/block_manager_stats.h"
#include "core/block_pool.h"
#include "core/host_tier.h"
#include "core/kv_event_log.h"
#include "core/pending_copies.h"
#include "core/prefix_cache.h"

namespace pagedkv {

class DiskTier final : public WriteBack {
 public:
  // num_records == 0: no tier. It writes back the host tier's slots (and reads into them).
  DiskTier(int32_t num_records, int32_t default_priority, PrefixCache* cache, KvEventLog* events, HostTier* host,
           BlockManagerStats* counters);

  bool enabled() const { return enabled_; }
  void disable() { enabled_ = false; }
  const BlockPool& pool() const { return disk_; }

  // What a record's file holds besides the KV: the block's chained hash, its parent's and its tokens (for a
  // group g > 0 both hashes are xor-ed with g times a constant, so groups' equal contents differ).
  struct Identity {
    uint64_t hash = 0;
    std::optional<uint64_t> parent;
    std::vector<int64_t> tokens;
    std::string salt;  // block 0's salt (empty for the other blocks)
  };

  // Writes. A free host slot is dirty when it holds cached KV the disk tier does not have (nor is being
  // given).
  bool dirty(int32_t slot) const;
  // WriteBack: queues the write of a dirty host slot about to be reused when a disk record can take it.
  bool write_back(int32_t free_slot) override;
  // Clean ahead: queues writes of the dirty slots among the max_slots cached free host slots the host
  // pool would evict first (coldest first); returns how many it queued.
  int32_t plan_writes(int32_t max_slots);
  std::vector<BlockPair> take_writes();  // (host slot, disk record), queued order
  // Each taken write's outcome, in the order taken (ok.size() == num_writes_in_flight()): a confirmed
  // write enters the disk tier; a failed one leaves nothing there. The host slots are released either way.
  void complete_writes(const std::vector<bool>& ok);
  int32_t num_writes_queued() const { return static_cast<int32_t>(writes_.size()); }
  int32_t num_writes_in_flight() const { return static_cast<int32_t>(writes_taken_.size()); }

  // Reads: `node` is held only on disk; takes a host slot for it (never evicting an entry of a higher
  // priority) and queues the read. Returns whether it did.
  bool queue_read(PrefixCache::NodeId node);
  std::vector<BlockPair> take_reads();  // (disk record, host slot)
  // Each taken read's outcome, in the order taken (ok.size() == num_reads_in_flight()): a confirmed read
  // gives the entry its host slot (it stays on disk); a failed one drops the disk entry and frees the slot.
  void complete_reads(const std::vector<bool>& ok);
  int32_t num_reads_queued() const { return static_cast<int32_t>(reads_.size()); }
  int32_t num_reads_in_flight() const { return static_cast<int32_t>(reads_taken_.size()); }
  int32_t num_reads_pending() const { return num_reads_queued() + num_reads_in_flight(); }

  // Equal content in two groups has equal chained hashes but other layers' KV: the group is folded into
  // the record hashes of groups after the first (xor with this), so one group's record never passes for
  // another's.
  static uint64_t group_mix(PrefixCache::NodeId root) {
    return uint64_t(PrefixCache::kRoot - root) * 0x9E3779B97F4A7C15ull;
  }

  // A record an earlier run wrote (the runner read its header back): registers it as the disk copy of the
  // block `tokens` after `parent` (a node, or a group's root for block 0, with `salt`) when `hash` is that
  // block's record hash (group_mix folded in), the record is free and holds nothing, and the block has no disk copy (nor a
  // transfer in flight). Returns the node, or kNoNode when refused; a refusal changes nothing.
  PrefixCache::NodeId restore(int32_t record, PrefixCache::NodeId parent, const int64_t* tokens,
                              std::string_view salt, uint64_t hash);

  // The identity of what a record holds or is being written or read: nullopt when it holds nothing.
  std::optional<Identity> identity(int32_t record) const;

  // The prefix cache is being cleared: records forget their content; writes and reads in flight enter
  // nothing. Those not taken yet are dropped (their slots and records released).
  void clear();
  void set_time(double now) { disk_.set_time(now); }

  // Adds the holds of pending writes and reads to the host and disk use counts; the queues agree with the
  // nodes' flags. Throws InvariantError.
  void add_uses(std::vector<int32_t>* host_uses, std::vector<int32_t>* disk_uses) const;
  void check_invariants() const;

 private:
  struct Transfer {
    int32_t slot;
    int32_t record;
    PrefixCache::NodeId node;
    uint64_t epoch;  // the cache's epoch when queued: a cleared cache makes the node id meaningless
  };
  bool can_take_record(int32_t priority) const;
  Identity identity_of(PrefixCache::NodeId node) const;
  void queue_write(int32_t slot);
  void finish_write(const Transfer& w, bool ok);
  void finish_read(const Transfer& r, bool ok);
  void queue(std::vector<Transfer>* to, const Transfer& t);
  Identity forget_pending(int32_t record);  // the identity of a finished or dropped transfer

  bool enabled_;
  PrefixCache* cache_;
  KvEventLog* events_;
  HostTier* host_tier_;
  BlockPool* host_;
  BlockManagerStats* counters_;
  BlockPool disk_;
  std::vector<Transfer> writes_, writes_taken_, reads_, reads_taken_;
  // The identity of each record with a pending transfer (a record has at most one), kept from the moment
  // it is queued: the runner may ask for it after the cache was cleared.
  std::unordered_map<int32_t, Identity> pending_identity_;
  uint64_t epoch_ = 0;
};

}  // namespace pagedkv
