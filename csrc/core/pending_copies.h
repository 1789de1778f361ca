// Copy-on-write copies that append_tokens queued and the runner has not taken yet. They are independent
// (no copy reads another's destination); until they are taken, the pool holds every source out of its
// free list (nothing may overwrite it before the copy is done) and drops a copy whose destination it frees.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace pagedkv {

using BlockPair = std::pair<int32_t, int32_t>;  // (src block, dst block)

class PendingCopies {
 public:
  bool empty() const { return copies_.empty(); }
  // Queues a copy of src into dst. A src still waiting for its own copy holds nothing yet: the copy reads
  // that copy's source instead, which keeps the copies independent.
  void add(int32_t src, int32_t dst);
  // Hands the copies out, oldest first, and forgets them.
  std::vector<BlockPair> take();
  // The source of the copy into dst, or -1.
  int32_t source_of(int32_t dst) const;
  bool is_source(int32_t block) const;
  // Drops the copy into dst (its block was freed); returns that copy's source, or -1 when there was none.
  int32_t drop_to(int32_t dst);
  // Blocks in [0, num_blocks), each destination once and never its own source; throws InvariantError.
  void check_invariants(int32_t num_blocks) const;

 private:
  std::vector<BlockPair> copies_;
};

}  // namespace pagedkv
