// Pins implementation (see pins.h).
#include "core/pins.h"

#include <algorithm>
#include <string>
#include <unordered_set>
#include <utility>

#include "core/errors.h"
#include "core/util.h"

namespace pagedkv {

Pins::Pins(BlockPool* pool, double max_pinned_fraction)
    : pool_(pool),
      max_fraction_(max_pinned_fraction),
      max_pinned_(static_cast<int32_t>(max_pinned_fraction * pool->num_blocks())),
      count_(pool->num_blocks(), 0) {}

int32_t Pins::pin(int64_t seq_id, std::vector<int32_t> blocks) {
  // Blocks pinned after this call: the others' pins, plus these.
  const auto old = pins_.find(seq_id);
  std::unordered_set<int32_t> held_before;
  if (old != pins_.end()) held_before.insert(old->second.begin(), old->second.end());
  int32_t after = pinned_;
  for (int32_t b : held_before) after -= count_[b] == 1;
  for (int32_t b : blocks) after += count_[b] - static_cast<int32_t>(held_before.count(b)) == 0;
  if (after > max_pinned_)
    throw OutOfBlocks(cat("pin: ", seq_str(seq_id), " would bring the pinned blocks to ", after,
                          ", over the cap of ", max_pinned_, " (max_pinned_fraction=", max_fraction_, " of ",
                          pool_->num_blocks(), " blocks); unpin other sequences first"));
  for (int32_t b : blocks) {  // blocks of a live sequence: in use, never in the free list
    pool_->acquire(b);
    pinned_ += count_[b]++ == 0;
  }
  if (old != pins_.end()) drop(old->second);
  std::vector<int32_t>& held = pins_[seq_id];
  held = std::move(blocks);
  return static_cast<int32_t>(held.size());
}

void Pins::drop(std::vector<int32_t>& blocks) {
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {  // tail first, as free() does
    pinned_ -= --count_[*b] == 0;
    pool_->release(*b);
  }
  blocks.clear();
}

void Pins::unpin(int64_t seq_id) {
  auto it = pins_.find(seq_id);
  if (it == pins_.end()) throw KeyError(cat("unpin: ", seq_str(seq_id), " is not pinned"));
  drop(it->second);
  pins_.erase(it);
}

void Pins::clear() {
  std::vector<int64_t> ids;
  for (const auto& kv : pins_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());  // a defined free-list order, whatever the hashing
  for (int64_t id : ids) drop(pins_[id]);
  pins_.clear();
}

const std::vector<int32_t>& Pins::blocks(int64_t seq_id) const {
  auto it = pins_.find(seq_id);
  if (it == pins_.end()) throw KeyError(cat("pinned_blocks: ", seq_str(seq_id), " is not pinned"));
  return it->second;
}

void Pins::add_uses(std::vector<int32_t>* uses) const {
  for (const auto& kv : pins_)
    for (int32_t b : kv.second)
      if (b >= 0 && b < static_cast<int32_t>(uses->size())) ++(*uses)[b];
}

void Pins::check_invariants() const {
  auto fail = [](const std::string& what) { throw InvariantError("BlockManager invariant violated: " + what); };
  const int32_t num_blocks = pool_->num_blocks();
  std::vector<int32_t> pins_of(num_blocks, 0);
  for (const auto& [id, blocks] : pins_) {
    const std::unordered_set<int32_t> distinct(blocks.begin(), blocks.end());
    if (distinct.size() != blocks.size()) fail(cat("the pin of ", seq_str(id), " holds a block twice"));
    for (int32_t b : blocks) {
      if (b < 0 || b >= num_blocks) fail(cat("the pin of ", seq_str(id), " holds out-of-range block ", b));
      ++pins_of[b];
    }
  }
  int32_t pinned = 0;
  for (int32_t b = 0; b < num_blocks; ++b) {
    if (count_[b] != pins_of[b]) fail(cat("block ", b, " has pin count ", count_[b], " but ", pins_of[b], " pins"));
    pinned += pins_of[b] > 0;
  }
  if (pinned != pinned_) fail(cat(pinned, " blocks are pinned but the count says ", pinned_));
  if (pinned_ > max_pinned_) fail(cat(pinned_, " pinned blocks exceed the cap ", max_pinned_));
}

}  // namespace pagedkv
