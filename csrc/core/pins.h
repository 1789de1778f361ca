// Pins: a sequence's pin holds blocks whose KV the prefix cache has (one pool reference each), so that
// they stay cached after the sequence is freed, until unpin. Pinned blocks are never free nor evictable;
// at most max_pinned() blocks are pinned at once.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/block_pool.h"

namespace pagedkv {

class Pins {
 public:
  Pins(BlockPool* pool, double max_pinned_fraction);

  // seq_id's pin holds `blocks` from now on (distinct blocks in use), in place of the pin it had. A pin
  // that would bring the pinned blocks over max_pinned() is refused (OutOfBlocks) and changes nothing.
  // Returns the number of blocks the pin holds.
  int32_t pin(int64_t seq_id, std::vector<int32_t> blocks);
  void unpin(int64_t seq_id);  // KeyError unless pinned
  void clear();                // every pin lets go, in the order of the ids
  bool is_pinned(int64_t seq_id) const { return pins_.count(seq_id) != 0; }
  const std::vector<int32_t>& blocks(int64_t seq_id) const;  // KeyError unless pinned
  bool holds(int32_t block) const { return count_[block] > 0; }
  int32_t num_pinned() const { return pinned_; }
  int32_t max_pinned() const { return max_pinned_; }
  // Adds one use of each block a pin holds (for the pool's reference counts).
  void add_uses(std::vector<int32_t>* uses) const;
  // Each pin holds distinct blocks in range; the counts agree with the pins and the cap; throws InvariantError.
  void check_invariants() const;

 private:
  void drop(std::vector<int32_t>& blocks);

  BlockPool* pool_;
  double max_fraction_;
  int32_t max_pinned_;
  std::unordered_map<int64_t, std::vector<int32_t>> pins_;  // seq id -> the blocks its pin holds
  std::vector<int32_t> count_;  // pins holding each block
  int32_t pinned_ = 0;          // blocks with count_ > 0
};

}  // namespace pagedkv
