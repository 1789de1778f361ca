// Block manager: a sequence's lifetime (free, fork) and swapping between the device and host pools
// (see block_manager.h).
#include <unordered_set>

#include "core/block_manager.h"
#include "core/errors.h"

namespace pagedkv {

// ---------------------------------------------------------------------------------------------------
// Lifetime

void BlockManager::free(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw KeyError(cat("free: unknown ", seq_str(seq_id), " (never allocated or already freed)"));
  const Sequence& seq = it->second;
  if (seq.loading > 0) loading_seqs_.erase(seq.serial);  // its loads still hold their blocks until confirmed
  num_readmit_ -= seq.readmit;
  BlockPool& pool = seq.swapped ? cpu_ : gpu_;
  // Tail first: prefix blocks are freed last, so they are the last to be evicted.
  for (const GroupTable& t : seq.groups)
    for (auto b = t.blocks.rbegin(); b != t.blocks.rend() - t.released; ++b) pool.release(*b);
  seqs_.erase(it);
}

void BlockManager::fork(int64_t parent_seq_id, int64_t child_seq_id) {
  const Sequence& parent = get_resident(parent_seq_id, "fork");
  check_loaded(parent, parent_seq_id, "fork");
  if (seqs_.count(child_seq_id)) throw ValueError(cat("fork: child ", seq_str(child_seq_id), " already exists"));
  Sequence child = parent;
  child.serial = next_serial_++;
  for (const GroupTable& t : child.groups)
    for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) gpu_.acquire(t.blocks[i]);
  seqs_.emplace(child_seq_id, std::move(child));
}

// ---------------------------------------------------------------------------------------------------
// Swapping

int32_t BlockManager::distinct_blocks(Span<int64_t> seq_ids, const char* what, Where where) const {
  std::unordered_set<int32_t> blocks;
  for (const Sequence* seq : resolve(seq_ids, what, /*unique=*/true, where))
    for (const GroupTable& t : seq->groups) blocks.insert(t.blocks.begin() + t.released, t.blocks.end());
  return static_cast<int32_t>(blocks.size());
}

std::vector<BlockPair> BlockManager::move_blocks(Span<int64_t> seq_ids, BlockPool& from, BlockPool& to) {
  // Blocks shared inside the batch are copied once; the destination block is shared the same way.
  std::vector<BlockPair> mapping;
  std::unordered_map<int32_t, int32_t> src_to_dst;
  for (int64_t id : seq_ids) {
    Sequence& seq = get(id);
    for (GroupTable& t : seq.groups) {  // released entries stay pads: only held blocks move
      std::vector<int32_t> dst_table(t.blocks.size(), kPad);
      for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) {
        const BlockRetention r = retention_of(seq, static_cast<int32_t>(i));
        auto [it, inserted] = src_to_dst.emplace(t.blocks[i], 0);
        if (inserted) {
          it->second = to.take_fresh(r);
          // A block still waiting for its copy-on-write copy holds nothing yet: move the copy's source.
          mapping.emplace_back(from.content_source(t.blocks[i]), it->second);
        } else {
          to.acquire(it->second);
          to.keep_stronger_retention(it->second, r);
        }
        dst_table[i] = it->second;
      }
      for (auto b = t.blocks.rbegin(); b != t.blocks.rend() - t.released; ++b) from.release(*b);
      t.blocks = std::move(dst_table);
      t.num_registered = 0;  // re-registered by mark_computed once the KV is back on the GPU
    }
    seq.swapped = &to == &cpu_;
  }
  (&to == &cpu_ ? counters_.swapped_out_blocks : counters_.swapped_in_blocks) += static_cast<int64_t>(mapping.size());
  return mapping;
}

int32_t BlockManager::distinct_blocks(Span<int64_t> seq_ids) const {
  if (seq_ids.empty()) return 0;
  const Where where = get(seq_ids[0]).swapped ? Where::kSwapped : Where::kResident;
  return distinct_blocks(seq_ids, "distinct_blocks", where);
}

bool BlockManager::can_swap_out(Span<int64_t> seq_ids) const {
  const std::vector<const Sequence*> seqs = resolve(seq_ids, "swap_out", /*unique=*/true);
  check_loaded(seqs, seq_ids, "swap_out");
  return distinct_blocks(seq_ids, "swap_out", Where::kResident) <= cpu_.num_free();
}

std::vector<BlockPair> BlockManager::swap_out(Span<int64_t> seq_ids) {
  if (num_cpu_blocks() == 0) throw ValueError("swap_out: this BlockManager has no CPU blocks (num_cpu_blocks=0)");
  if (!can_swap_out(seq_ids))
    throw OutOfBlocks(cat("swap_out: not enough free CPU blocks (", cpu_.num_free(), " free)"));
  return move_blocks(seq_ids, gpu_, cpu_);
}

AllocStatus BlockManager::can_swap_in(Span<int64_t> seq_ids, int64_t num_lookahead_slots) const {
  if (num_lookahead_slots < 0 || num_lookahead_slots > kMaxTokensPerAppend)
    throw ValueError(cat("can_swap_in: num_lookahead_slots must be in [0, ", kMaxTokensPerAppend, "], got ",
                         num_lookahead_slots));
  int32_t needed = distinct_blocks(seq_ids, "swap_in", Where::kSwapped);
  for (const int64_t id : seq_ids) {  // room to append that many tokens once back, in every group
    const int64_t len = static_cast<int64_t>(get(id).tokens.size());
    needed += (blocks_for_tokens(len + num_lookahead_slots) - blocks_for_tokens(len)) * num_groups();
  }
  if (needed > num_blocks() - watermark_blocks_ - pins_.num_pinned()) return AllocStatus::kNever;
  return gpu_.num_free() - needed >= watermark_blocks_ ? AllocStatus::kOk : AllocStatus::kLater;
}

std::vector<BlockPair> BlockManager::swap_in(Span<int64_t> seq_ids) {
  const int32_t needed = distinct_blocks(seq_ids, "swap_in", Where::kSwapped);
  if (needed > gpu_.num_free())
    throw OutOfBlocks(cat("swap_in: needs ", needed, " free blocks but only ", gpu_.num_free(),
                          " are free (check can_swap_in first)"));
  allow_write_backs(needed);
  std::vector<BlockPair> mapping = move_blocks(seq_ids, cpu_, gpu_);
  end_write_backs();
  return mapping;
}

}  // namespace pagedkv
