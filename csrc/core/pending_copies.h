// Copy-on-write copies that append_tokens queued and the runner has not taken yet. They are independent
// (no copy reads another's destination); until they are taken, the pool holds every source out of its
// free list (nothing may overwrite it before the copy is done) and drops a copy whose destination it frees.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace pagedkv {

using BlockPair = std::pair<int32_t, int32_t>;  // (src block, dst block)

// The tiers' transfers (host offloads and loads, disk writes and reads) wait in two queues each: queued,
// then taken by the runner, then completed in the order taken.

// Hands every queued transfer over as pair(t), oldest first, moving it to `taken`.
template <class T, class Pair>
std::vector<BlockPair> hand_over(std::vector<T>* queued, std::vector<T>* taken, Pair pair) {
  std::vector<BlockPair> out;
  out.reserve(queued->size());
  for (const T& t : *queued) {
    out.push_back(pair(t));
    taken->push_back(t);
  }
  queued->clear();
  return out;
}

// Empties `taken`, giving each transfer its outcome in the order taken (finish(t, ok[i])); returns them.
template <class T, class Finish>
std::vector<T> complete_in_order(std::vector<T>* taken, const std::vector<bool>& ok, Finish finish) {
  std::vector<T> done;
  done.swap(*taken);
  for (std::size_t i = 0; i < done.size(); ++i) finish(done[i], ok[i]);
  return done;
}

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
