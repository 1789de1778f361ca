// Pending copy-on-write copies (see pending_copies.h).
#include "core/pending_copies.h"

#include <algorithm>
#include <unordered_set>

#include "core/errors.h"
#include "core/util.h"

namespace pagedkv {

void PendingCopies::add(int32_t src, int32_t dst) {
  const int32_t pending = copies_.empty() ? -1 : source_of(src);
  copies_.emplace_back(pending >= 0 ? pending : src, dst);
}

std::vector<BlockPair> PendingCopies::take() {
  std::vector<BlockPair> out;
  out.swap(copies_);
  return out;
}

int32_t PendingCopies::source_of(int32_t dst) const {
  for (const BlockPair& p : copies_)
    if (p.second == dst) return p.first;
  return -1;
}

bool PendingCopies::is_source(int32_t block) const {
  for (const BlockPair& p : copies_)
    if (p.first == block) return true;
  return false;
}

int32_t PendingCopies::drop_to(int32_t dst) {
  const int32_t source = source_of(dst);
  if (source < 0) return -1;
  copies_.erase(std::remove_if(copies_.begin(), copies_.end(), [dst](const BlockPair& p) { return p.second == dst; }),
                copies_.end());
  return source;
}

void PendingCopies::check_invariants(int32_t num_blocks) const {
  std::unordered_set<int32_t> destinations;
  for (const auto& [src, dst] : copies_) {
    if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks || src == dst)
      throw InvariantError(cat("BlockManager invariant violated: pending copy (", src, ", ", dst, ") is malformed"));
    if (!destinations.insert(dst).second)
      throw InvariantError(cat("BlockManager invariant violated: block ", dst, " is the destination of two pending copies"));
  }
}

}  // namespace pagedkv
