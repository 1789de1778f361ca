// Block pool implementation (see block_pool.h).
#include "core/block_pool.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_set>

#include "core/errors.h"
#include "core/util.h"

namespace pagedkv {

BlockPool::BlockPool(int32_t num_blocks, Medium medium, int32_t default_priority, PrefixCache* cache,
                     KvEventLog* events, PendingCopies* copies, int64_t* evictions)
    : num_blocks_(num_blocks),
      caching_(true),
      medium_(medium),
      location_(medium == Medium::kGpu   ? &PrefixCache::Node::block
                : medium == Medium::kCpu ? &PrefixCache::Node::host_slot
                                         : &PrefixCache::Node::disk_record),
      block_name_(medium == Medium::kGpu ? "block " : medium == Medium::kCpu ? "host slot " : "disk record "),
      ref_(num_blocks, 0),
      free_(num_blocks, /*num_levels=*/2 + kMaxPriority),
      cache_(cache),
      events_(events),
      copies_(copies),
      evictions_(evictions),
      tag_(num_blocks, PrefixCache::kNoNode),
      default_priority_(default_priority),
      retention_(num_blocks, BlockRetention{default_priority, kForever}),
      stamp_(num_blocks, 0) {
  for (int32_t b = 0; b < num_blocks; ++b) free_.push_back(b);
}

BlockPool::BlockPool(int32_t num_blocks)
    : num_blocks_(num_blocks), caching_(false), block_name_("CPU block "), ref_(num_blocks, 0), free_(num_blocks) {
  for (int32_t b = 0; b < num_blocks; ++b) free_.push_back(b);
}

// ---------------------------------------------------------------------------------------------------
// References and the free list

int32_t BlockPool::take_fresh(const BlockRetention& r) {
  while (write_back_spare_ > 0 && holds_cached_kv(free_.front()) && write_back_->write_back(free_.front()))
    --write_back_spare_;
  const int32_t block = free_.pop_front();
  ref_[block] = 1;
  if (!caching_) return block;
  if (holds_cached_kv(block)) {
    ++*evictions_;
    --cached_free_;
  }
  untag(block);
  retention_[block] = r;
  return block;
}

void BlockPool::acquire(int32_t block) {
  if (ref_[block]++ == 0 && free_.contains(block)) {  // else held for a pending copy
    free_.remove(block);
    if (caching_ && holds_cached_kv(block)) --cached_free_;
  }
}

void BlockPool::release(int32_t block, bool cold) {
  if (--ref_[block] > 0) return;
  if (copies_ && !copies_->empty()) {
    const int32_t source = copies_->drop_to(block);  // a freed destination drops its copy ...
    if (source >= 0) free_if_unheld(source);          // ... whose source may have been held only for it
    if (copies_->is_source(block)) return;            // held until the copy is taken
  }
  return_to_free_list(block, cold);
}

void BlockPool::free_if_unheld(int32_t block) {
  if (ref_[block] == 0 && !free_.contains(block) && !(copies_ && copies_->is_source(block)))
    return_to_free_list(block);
}

int32_t BlockPool::content_source(int32_t block) const {
  if (!copies_ || copies_->empty()) return block;
  const int32_t source = copies_->source_of(block);
  return source >= 0 ? source : block;
}

void BlockPool::return_to_free_list(int32_t block, bool cold) {
  if (!caching_) {
    free_.push_back(block);
    return;
  }
  // Cached KV goes to the back of its priority's list (evicted after lower priorities, least recently
  // freed first); a block without reusable content goes to the front of level 0, handed out first.
  ++stamp_[block];
  if (!holds_cached_kv(block)) {
    free_.push_front(block, 0);
    return;
  }
  ++cached_free_;
  BlockRetention& r = retention_[block];
  if (r.duration != kForever) {  // the duration runs from now
    const double expiry = now_ + r.duration;
    if (expiry > now_) {
      expiries_.push_back({expiry, next_expiry_order_++, block, stamp_[block]});
      std::push_heap(expiries_.begin(), expiries_.end(), std::greater<>());
    } else {
      r = {default_priority_, kForever};
    }
  }
  if (cold)
    free_.push_front(block, 1 + r.priority);
  else
    free_.push_back(block, 1 + r.priority);
}

void BlockPool::move_to_level(int32_t free_block, int32_t level) {
  free_.remove(free_block);
  free_.push_back(free_block, level);
  ++stamp_[free_block];
}

// ---------------------------------------------------------------------------------------------------
// Retention

void BlockPool::keep_stronger_retention(int32_t block, const BlockRetention& r) {
  if (caching_ && stronger(r, retention_[block])) retention_[block] = r;
}

void BlockPool::set_time(double now) {
  if (std::isnan(now) || now < now_)
    throw ValueError(cat("set_time: the clock only moves forward (now ", now_, ", got ", now, ")"));
  now_ = now;
  expire_durations();
}

void BlockPool::expire_durations() {
  while (!expiries_.empty() && expiries_.front().time <= now_) {
    const Expiry e = expiries_.front();
    std::pop_heap(expiries_.begin(), expiries_.end(), std::greater<>());
    expiries_.pop_back();
    if (stale(e.block, e.stamp)) continue;
    retention_[e.block] = {default_priority_, kForever};
    move_to_level(e.block, 1 + default_priority_);
  }
  // Blocks revived and freed again leave stale entries behind: drop them once they outnumber the blocks,
  // so the heap stays O(num_blocks) (amortised O(1) per release).
  if (expiries_.size() > 2 * static_cast<size_t>(num_blocks_) + 64) {
    expiries_.erase(std::remove_if(expiries_.begin(), expiries_.end(),
                                   [this](const Expiry& e) { return stale(e.block, e.stamp); }),
                    expiries_.end());
    std::make_heap(expiries_.begin(), expiries_.end(), std::greater<>());
  }
}

// ---------------------------------------------------------------------------------------------------
// Content tags

bool BlockPool::holds_cached_kv(int32_t block) const {
  const PrefixCache::NodeId node = tag_[block];
  return node != PrefixCache::kNoNode && location(node) == block;
}

void BlockPool::untag(int32_t block) {
  const PrefixCache::NodeId node = tag_[block];
  if (node == PrefixCache::kNoNode) return;
  if (location(node) == block) {
    if (events_->enabled() && cache_->node(node).root == PrefixCache::kRoot) events_->removed(cache_->hash(node), medium_);
    cache_->set_location(node, medium_, PrefixCache::kNoBlock);
  }
  tag_[block] = PrefixCache::kNoNode;
  cache_->release(node);
}

void BlockPool::retag(int32_t block, PrefixCache::NodeId node) {
  untag(block);
  tag_[block] = node;
  cache_->add_ref(node);
}

void BlockPool::superseded(int32_t block) {
  if (!free_.contains(block)) return;
  --cached_free_;  // a free copy of content registered elsewhere: no longer a hit
  move_to_level(block, 0);
}

void BlockPool::clear_tags() {
  std::fill(tag_.begin(), tag_.end(), PrefixCache::kNoNode);
  cached_free_ = 0;
}

void BlockPool::reset_free_levels() {
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(free_.size()));
  free_.for_each([&](int32_t b) { order.push_back(b); });
  for (int32_t b : order) {
    retention_[b] = {default_priority_, kForever};
    if (free_.level(b) != 0) move_to_level(b, 0);
  }
}

// ---------------------------------------------------------------------------------------------------
// Invariants

void BlockPool::check_invariants() const {
  auto fail = [](const std::string& what) { throw InvariantError("BlockManager invariant violated: " + what); };
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (ref_[b] < 0) fail(cat(block_name_, b, " has ref_count ", ref_[b]));
    if (ref_[b] > 0 && free_.contains(b)) fail(cat(block_name_, b, " is used and in the free list"));
    if (ref_[b] == 0 && !free_.contains(b) && !(copies_ && copies_->is_source(b)))
      fail(cat(block_name_, b, copies_ ? " is unused but neither free nor the source of a pending copy"
                                       : " is unused but not in the free list"));
  }
  int32_t walked = 0, cached_free = 0;
  free_.for_each([&](int32_t b) {
    ++walked;
    cached_free += caching_ && holds_cached_kv(b);
  });
  if (walked != free_.size()) fail(cat("free list walks ", walked, " blocks but counts ", free_.size()));
  if (!caching_) return;
  if (cached_free != cached_free_)
    fail(cat(cached_free, " free blocks hold cached KV but the count says ", cached_free_));

  // Retention: each free block sits at its level (1 + priority with cached KV, else 0); one whose
  // priority has a duration has a live expiry entry in the future.
  std::unordered_set<int32_t> live_expiry;
  for (const Expiry& e : expiries_)
    if (!stale(e.block, e.stamp)) {
      if (e.time <= now_) fail(cat("block ", e.block, " should have fallen back to the default priority at ", e.time));
      live_expiry.insert(e.block);
    }
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const BlockRetention& r = retention_[b];
    if (r.priority < kMinPriority || r.priority > kMaxPriority || !(r.duration >= 0.0))
      fail(cat(block_name_, b, " has retention (", r.priority, ", ", r.duration, ")"));
    if (!free_.contains(b)) continue;
    if (free_.level(b) != free_level(b))
      fail(cat("free ", block_name_, b, " is at level ", free_.level(b), " instead of ", free_level(b)));
    if (holds_cached_kv(b) && (r.duration != kForever) != (live_expiry.count(b) != 0))
      fail(cat("free block ", b, " has duration ", r.duration, " but ", live_expiry.count(b), " live expiry entries"));
  }
}

}  // namespace pagedkv
