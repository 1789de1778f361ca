// Block manager: decode steps (append, copy-on-write, speculative truncate) and the copies they queue
// (see block_manager.h).
#include <algorithm>

#include "core/block_manager.h"
#include "core/errors.h"

namespace pagedkv {

bool BlockManager::must_copy_before_write(int32_t block) const {
  // Shared with another sequence, or holding cached KV (a block left partial by truncate): writing into
  // it in place would change KV someone else reads.
  return gpu_.ref_count(block) > 1 || gpu_.tag(block) != PrefixCache::kNoNode;
}

int32_t BlockManager::blocks_needed_to_append(const Sequence* const* seqs, size_t n, const int64_t* counts,
                                              int64_t extra) const {
  int32_t needed = 0;
  std::unordered_map<int32_t, int32_t> appenders_of_shared;  // shared last block -> appenders in batch
  for (size_t i = 0; i < n; ++i) {
    const Sequence* seq = seqs[i];
    const int64_t len = static_cast<int64_t>(seq->tokens.size());
    const int64_t count = (counts ? counts[i] : 1) + extra;
    if (count <= 0) continue;
    needed += (blocks_for_tokens(len + count) - blocks_for_tokens(len)) * static_cast<int32_t>(seq->groups.size());
    if (len % block_size_ == 0) continue;
    for (const GroupTable& t : seq->groups) {  // the last block is never released while partial
      const int32_t last = t.blocks.back();
      if (gpu_.tag(last) != PrefixCache::kNoNode)
        ++needed;  // cached KV: every appender copies
      else if (gpu_.ref_count(last) > 1)
        ++appenders_of_shared[last];
    }
  }
  // k appenders on a block with r references copy k times, or k - 1 times when they are all of them.
  for (const auto& [block, k] : appenders_of_shared) needed += k < gpu_.ref_count(block) ? k : k - 1;
  return needed;
}

bool BlockManager::can_append(Span<int64_t> seq_ids, int64_t num_lookahead_slots) const {
  if (num_lookahead_slots < 0 || num_lookahead_slots > kMaxTokensPerAppend)
    throw ValueError(cat("can_append: num_lookahead_slots must be in [0, ", kMaxTokensPerAppend, "], got ",
                         num_lookahead_slots));
  const std::vector<const Sequence*> seqs = resolve(seq_ids, "can_append", /*unique=*/true);
  for (size_t i = 0; i < seq_ids.size; ++i) check_complete(*seqs[i], seq_ids[i], "can_append");
  return blocks_needed_to_append(seqs.data(), seqs.size(), nullptr, num_lookahead_slots) <= gpu_.num_free();
}

int64_t BlockManager::append_token(int64_t seq_id, int64_t token_id) {
  int64_t slot;
  append_tokens({&seq_id, 1}, {&token_id, 1}, std::nullopt, [&slot](size_t) { return &slot; });
  return slot;
}

void BlockManager::append_tokens(Span<int64_t> seq_ids, Span<int64_t> token_ids, std::optional<Span<int64_t>> counts_arg,
                                 const Out<int64_t>& slots) {
  const size_t n = seq_ids.size;
  const int64_t* counts = counts_arg ? counts_arg->data : nullptr;
  if (counts_arg && counts_arg->size != n)
    throw ValueError(cat("append_tokens: ", n, " seq_ids but ", counts_arg->size, " counts"));
  const size_t total = counts ? append_count_total(counts, n) : n;
  if (token_ids.size != total)
    throw ValueError(cat("append_tokens: ", total, counts ? " tokens to append" : " seq_ids", " but ", token_ids.size,
                         " token_ids"));
  const std::vector<Sequence*> seqs = resolve(seq_ids, "append_tokens", /*unique=*/true);
  for (size_t i = 0; i < n; ++i) {
    check_complete(*seqs[i], seq_ids[i], "append_tokens");
    check_loaded(*seqs[i], seq_ids[i], "append_tokens");
  }
  const int32_t needed = blocks_needed_to_append(seqs.data(), seqs.size(), counts, 0);
  if (needed > gpu_.num_free())
    throw OutOfBlocks(cat("append_tokens: needs ", needed, " free blocks but only ", gpu_.num_free(),
                          " are free (check can_append first)"));
  int64_t* slots_out = slots(total);
  allow_write_backs(needed);
  const int64_t* next_token = token_ids.data;
  for (size_t i = 0; i < n; ++i) {
    Sequence& seq = *seqs[i];
    const int64_t count = counts ? counts[i] : 1;
    const int64_t len = static_cast<int64_t>(seq.tokens.size());
    for (GroupTable& t : seq.groups) {
      for (int64_t pos = len; pos < len + count; ++pos) {
        if (pos % block_size_ == 0) {
          grow_table(seq, t, t.blocks.size() + 1);
        } else if (pos == len && must_copy_before_write(t.blocks.back())) {  // copy on write
          const int32_t last = t.blocks.back();
          const int32_t copy = gpu_.take_fresh(retention_of(seq, static_cast<int32_t>(t.blocks.size()) - 1));
          copies_.add(last, copy);
          ++counters_.cow_copies;
          gpu_.release(last);
          t.blocks.back() = copy;
        }
      }
    }
    const std::vector<int32_t>& table = seq.groups[0].blocks;
    for (int64_t pos = len; pos < len + count; ++pos) {
      seq.tokens.push_back(*next_token++);
      *slots_out++ = int64_t(table[pos / block_size_]) * block_size_ + pos % block_size_;
    }
  }
  end_write_backs();
}

void BlockManager::truncate(Span<int64_t> seq_ids, Span<int64_t> num_tokens) {
  if (num_tokens.size != seq_ids.size)
    throw ValueError(cat("truncate: ", seq_ids.size, " seq_ids but ", num_tokens.size, " num_tokens"));
  const std::vector<Sequence*> seqs = resolve(seq_ids, "truncate", /*unique=*/true);
  for (size_t i = 0; i < seqs.size(); ++i) {
    check_loaded(*seqs[i], seq_ids[i], "truncate");
    if (num_tokens[i] < 1 || num_tokens[i] > static_cast<int64_t>(seqs[i]->tokens.size()))
      throw ValueError(cat("truncate: num_tokens=", num_tokens[i], " for ", seq_str(seq_ids[i]), " must be in [1, ",
                           seqs[i]->tokens.size(), "]"));
    // A window never gives back what it released: rolling back below it would need those blocks again.
    const int64_t computed = std::min(seqs[i]->num_computed, num_tokens[i]);
    for (int32_t g = 0; g < num_groups(); ++g)
      if (released_for(g, computed) < seqs[i]->groups[g].released)
        throw ValueError(cat("truncate: num_tokens=", num_tokens[i], " for ", seq_str(seq_ids[i]),
                             " would need KV that the sliding window of group ", g, " already released (",
                             seqs[i]->groups[g].released, " blocks)"));
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& seq = *seqs[i];
    const int64_t n = num_tokens[i];
    const size_t keep = static_cast<size_t>(blocks_for_tokens(n));
    const int32_t full = static_cast<int32_t>(n / block_size_);
    for (GroupTable& t : seq.groups) {
      while (t.blocks.size() > keep) {  // tail first; cached blocks stay cached
        gpu_.release(t.blocks.back());
        t.blocks.pop_back();
      }
      t.num_registered = std::min(t.num_registered, full);
    }
    seq.tokens.resize(static_cast<size_t>(n));
    if (seq.block_keys.size() > static_cast<size_t>(full)) seq.block_keys.resize(static_cast<size_t>(full));
    seq.num_computed = std::min(seq.num_computed, n);
  }
}

std::vector<BlockPair> BlockManager::take_copies() {
  std::vector<BlockPair> copies = copies_.take();
  // Sources no sequence holds any more were kept out of the free list until now: once the caller has
  // the copies, it performs them before any later allocation can write the block.
  for (const BlockPair& p : copies) gpu_.free_if_unheld(p.first);
  return copies;
}

}  // namespace pagedkv
