// One device's pool of physical blocks and all their per-block state: reference counts, the free list,
// each block's retention (and the clock that expires it), and the prefix-cache content each block holds
// (its tag). take_fresh is the one place a block is handed out fresh, release the one place a reference
// is dropped. The GPU pool, the host tier's slots and the disk tier's records are cache pools (medium
// kGpu, kCpu, kDisk); the CPU swap
// space is a plain pool: one FIFO level, no retention, no content.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/free_list.h"
#include "core/kv_event_log.h"
#include "core/pending_copies.h"
#include "core/prefix_cache.h"
#include "core/retention.h"

namespace pagedkv {

// Writes a cached block back to a lower tier before it is reused (the host tier implements it for device
// blocks, the disk tier for host slots).
class WriteBack {
 public:
  // Queues a copy of `free_block`'s KV to the lower tier when it is worth keeping there; the copy then
  // holds the block (it leaves the free list). Returns whether it did.
  virtual bool write_back(int32_t free_block) = 0;

 protected:
  ~WriteBack() = default;
};

class BlockPool {
 public:
  // A cache pool of `medium`. Free blocks holding cached KV sit at free-list level 1 + priority (level 0:
  // no reusable content, handed out first). Untagging a block of group 0's chains records a removed event
  // of the medium in `events`; a freed source of a pending copy in `copies` (may be null) stays out of the
  // free list until the copy is taken; `evictions` counts cached blocks reused for other content.
  BlockPool(int32_t num_blocks, Medium medium, int32_t default_priority, PrefixCache* cache, KvEventLog* events,
            PendingCopies* copies, int64_t* evictions);
  // A plain pool (swap space): blocks are handed out least recently freed first.
  explicit BlockPool(int32_t num_blocks);
  Medium medium() const { return medium_; }

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return free_.size(); }
  bool is_free(int32_t block) const { return free_.contains(block); }
  int32_t ref_count(int32_t block) const { return ref_[block]; }

  // Takes the block the free list gives first (evicting its cached content), with one reference and
  // retention r (cache pools). The caller checked that a block is free. While write-backs are allowed,
  // a cached block at the front is first offered to the write-back, which may hold it for its copy.
  int32_t take_fresh(const BlockRetention& r);
  // Up to `spare` blocks may be held for write-back copies by the next take_fresh calls, on top of the
  // blocks they hand out (the caller's free blocks beyond what it takes); 0 ends it.
  void allow_write_backs(WriteBack* to, int32_t spare) {
    write_back_ = to;
    write_back_spare_ = spare;
  }
  // One more reference to a block; a free one (a prefix hit on a freed block) leaves the free list.
  void acquire(int32_t block);
  // Drops one reference; at zero the block joins the free list, unless a pending copy still reads it.
  // `cold`: it joins at the front of its level (it keeps its place as the next to evict).
  void release(int32_t block, bool cold = false);
  // The free blocks holding cached KV, in the order they would be evicted, while f(block) returns true.
  template <typename F>
  void for_each_cached_free(F&& f) const {
    free_.for_each_from(1, std::forward<F>(f));
  }
  int32_t front() const { return free_.front(); }  // the block take_fresh would take, or FreeList::kNone
  // An unreferenced block that is not free (held for a pending copy) joins the free list once no
  // pending copy reads it.
  void free_if_unheld(int32_t block);
  // The block whose KV `block` holds: the source of its pending copy, if any, else itself.
  int32_t content_source(int32_t block) const;

  // Retention (cache pools; a plain pool ignores it).
  int32_t default_priority() const { return default_priority_; }
  const BlockRetention& retention(int32_t block) const { return retention_[block]; }
  void keep_stronger_retention(int32_t block, const BlockRetention& r);
  // The clock (any unit, the one of the durations; starts at 0, never read from the wall). Advancing it
  // moves the free blocks whose priority duration has run out to the default priority.
  double now() const { return now_; }
  void set_time(double now);  // ValueError unless now >= now()

  // Content tags (cache pools).
  PrefixCache::NodeId tag(int32_t block) const { return tag_[block]; }
  // Whether the prefix cache hits this block for its content.
  bool holds_cached_kv(int32_t block) const;
  // The block now holds the KV of `node` (it forgets any other content first).
  void set_tag(int32_t block, PrefixCache::NodeId node) {
    if (tag_[block] != node) retag(block, node);
  }
  // The block forgets its content (a removed event when it held the node's KV); the caller holds it.
  void forget(int32_t block) { untag(block); }
  // The block's content is now registered in another block: a free one no longer holds a hit.
  void superseded(int32_t block);
  int32_t num_cached_free() const { return cached_free_; }
  // The prefix cache is being cleared: every block forgets its content (the cache frees the nodes).
  void clear_tags();
  // Free blocks go to level 0 in their eviction order, at the default priority (after clear_tags).
  void reset_free_levels();

  // Reference counts agree with the free list, the free list with its counts, and free blocks with their
  // levels and expiries; throws InvariantError naming the first violation.
  void check_invariants() const;

 private:
  void untag(int32_t block);
  int32_t location(PrefixCache::NodeId node) const { return cache_->node(node).*location_; }
  void retag(int32_t block, PrefixCache::NodeId node);  // set_tag to another node
  void return_to_free_list(int32_t block, bool cold = false);
  void move_to_level(int32_t free_block, int32_t level);  // to the back of that level's list
  int32_t free_level(int32_t block) const { return holds_cached_kv(block) ? 1 + retention_[block].priority : 0; }
  void expire_durations();
  bool stale(int32_t block, uint32_t stamp) const { return stamp != stamp_[block] || !free_.contains(block); }

  int32_t num_blocks_;
  bool caching_;                 // a cache pool: levels, retention, content tags
  Medium medium_ = Medium::kCpu;
  int32_t PrefixCache::Node::*location_ = nullptr;  // the node's field for this medium (no branch per read)
  const char* block_name_;       // "block ", "host slot ", "disk record " or "CPU block " in messages
  std::vector<int32_t> ref_;     // block-table entries + pins holding each block
  FreeList free_;

  PrefixCache* cache_ = nullptr;
  KvEventLog* events_ = nullptr;
  PendingCopies* copies_ = nullptr;
  int64_t* evictions_ = nullptr;
  WriteBack* write_back_ = nullptr;
  int32_t write_back_spare_ = 0;
  std::vector<PrefixCache::NodeId> tag_;  // content of each block, or kNoNode
  int32_t cached_free_ = 0;               // free blocks that still hold cached KV (kept, not counted per call)

  // A free block with a finite duration has an entry in expiries_, a min-heap on (time, order); an entry
  // is live while its stamp is the block's (bumped whenever the block enters the free list or changes
  // level), so stale entries are skipped, never searched for.
  int32_t default_priority_ = kDefaultPriority;
  double now_ = 0.0;
  std::vector<BlockRetention> retention_;
  std::vector<uint32_t> stamp_;
  struct Expiry {
    double time;
    uint64_t order;
    int32_t block;
    uint32_t stamp;
    bool operator>(const Expiry& o) const { return time != o.time ? time > o.time : order > o.order; }
  };
  std::vector<Expiry> expiries_;
  uint64_t next_expiry_order_ = 0;
};

}  // namespace pagedkv
