// Block manager: what the model runner reads (block tables, slot mappings, lengths) and the statistics
// (see block_manager.h).
#include <algorithm>

#include "core/block_manager.h"
#include "core/errors.h"

namespace pagedkv {
namespace {

// Slots of positions [start, end) through a block table, written a block's run at a time: one division
// per block instead of a division and a modulo per token.
int64_t* write_slots(const std::vector<int32_t>& table, int32_t block_size, int64_t start, int64_t end,
                     int64_t* out) {
  int64_t index = start / block_size, offset = start - index * block_size;
  for (int64_t pos = start; pos < end; ++index, offset = 0) {
    const int64_t run = std::min<int64_t>(block_size - offset, end - pos);
    const int64_t base = int64_t(table[index]) * block_size + offset;
    for (int64_t k = 0; k < run; ++k) out[k] = base + k;
    out += run;
    pos += run;
  }
  return out;
}

}  // namespace

const std::vector<int32_t>& BlockManager::block_table(int64_t seq_id, int32_t group) const {
  return get(seq_id).groups[group_arg(group, "block_table")].blocks;
}

int32_t BlockManager::block_tables(Span<int64_t> seq_ids, std::optional<int32_t> max_blocks, int32_t pad,
                                   const Out<int32_t>& out, int32_t group) const {
  group_arg(group, "block_tables");
  const size_t n = seq_ids.size;
  const std::vector<const Sequence*> seqs = resolve(seq_ids, "block_tables", /*unique=*/false);
  size_t longest = 0;
  for (const Sequence* seq : seqs) longest = std::max(longest, seq->groups[group].blocks.size());
  const int32_t width = max_blocks ? *max_blocks : static_cast<int32_t>(longest);
  if (width < static_cast<int32_t>(longest))
    throw ValueError(cat("block_tables: max_blocks=", width, " is shorter than the longest block table (", longest,
                         " blocks)"));
  // A windowed table grows with the context (its released entries hold nothing), so only memory bounds it.
  const int64_t pools = std::max(num_blocks(), num_cpu_blocks());
  const int64_t limit = has_windows_ ? std::max<int64_t>(pools, 1 << 24) : pools;
  if (width > limit)
    throw ValueError(cat("block_tables: max_blocks=", width, " is longer than any block table can be (", limit,
                         has_windows_ ? " blocks)" : " blocks in the pool)"));
  int32_t* rows = out(n * static_cast<size_t>(width));
  for (size_t i = 0; i < n; ++i) {
    const GroupTable& t = seqs[i]->groups[group];
    int32_t* row = rows + i * static_cast<size_t>(width);
    std::fill(row, row + t.released, pad);
    std::copy(t.blocks.begin() + t.released, t.blocks.end(), row + t.released);
    std::fill(row + t.blocks.size(), row + width, pad);
  }
  return width;
}

void BlockManager::slot_mapping(int64_t seq_id, int64_t start, int64_t end, const Out<int64_t>& slots,
                                int32_t group) const {
  slot_mappings({&seq_id, 1}, {&start, 1}, Span<int64_t>(&end, 1), slots, group, "slot_mapping");
}

void BlockManager::slot_mappings(Span<int64_t> seq_ids, Span<int64_t> starts, std::optional<Span<int64_t>> ends_arg,
                                 const Out<int64_t>& out, int32_t group, const char* what) const {
  group_arg(group, what);
  const size_t n = seq_ids.size;
  if (starts.size != n) throw ValueError(cat(what, ": seq_ids and starts differ in length"));
  if (ends_arg && ends_arg->size != n) throw ValueError(cat(what, ": seq_ids and ends differ in length"));
  const int64_t* ends = ends_arg ? ends_arg->data : nullptr;
  const std::vector<const Sequence*> seqs = resolve(seq_ids, what, /*unique=*/false);
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = static_cast<int64_t>(seqs[i]->tokens.size());
    const int64_t end = ends ? ends[i] : len;
    if (starts[i] < 0 || starts[i] > end || end > len)
      throw ValueError(cat(what, ": positions [", starts[i], ", ", end, ") are not inside [0, ", len, "] for ",
                           seq_str(seq_ids[i]), " (need 0 <= start <= end <= length)"));
    if (starts[i] < end && end > allocated_tokens(*seqs[i]))
      throw ValueError(cat(what, ": position ", end - 1, " of ", seq_str(seq_ids[i]), " has no block yet (",
                           allocated_tokens(*seqs[i]), " tokens have blocks; reserve() first)"));
    const int64_t first_held = int64_t(seqs[i]->groups[group].released) * block_size_;
    if (starts[i] < end && starts[i] < first_held)
      throw ValueError(cat(what, ": position ", starts[i], " of ", seq_str(seq_ids[i]), " is in a block that the ",
                           "sliding window of group ", group, " released (positions before ", first_held, ")"));
    total += static_cast<size_t>(end - starts[i]);
  }
  int64_t* p = out(total);
  for (size_t i = 0; i < n; ++i) {
    const int64_t end = ends ? ends[i] : static_cast<int64_t>(seqs[i]->tokens.size());
    p = write_slots(seqs[i]->groups[group].blocks, block_size_, starts[i], end, p);
  }
}

int64_t BlockManager::num_tokens(int64_t seq_id) const { return static_cast<int64_t>(get(seq_id).tokens.size()); }
int64_t BlockManager::num_computed_tokens(int64_t seq_id) const { return get(seq_id).num_computed; }
bool BlockManager::is_swapped(int64_t seq_id) const { return get(seq_id).swapped; }
std::vector<int64_t> BlockManager::token_ids(int64_t seq_id) const { return get(seq_id).tokens; }

// ---------------------------------------------------------------------------------------------------
// Statistics

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats s = counters_;
  s.num_blocks = num_blocks();
  s.free_blocks = gpu_.num_free();
  s.used_blocks = num_blocks() - s.free_blocks;
  s.cached_blocks = cache_.num_registered();
  s.cached_free_blocks = gpu_.num_cached_free();
  s.num_seqs = static_cast<int32_t>(seqs_.size());
  for (const auto& kv : seqs_) s.num_swapped_seqs += kv.second.swapped;
  s.num_cpu_blocks = num_cpu_blocks();
  s.free_cpu_blocks = cpu_.num_free();
  s.pinned_blocks = pins_.num_pinned();
  s.num_host_blocks = host_.pool().num_blocks();
  s.free_host_blocks = host_.pool().num_free();
  s.cached_host_blocks = cache_.num_registered(Medium::kCpu);
  s.num_disk_blocks = disk_.pool().num_blocks();
  s.free_disk_blocks = disk_.pool().num_free();
  s.used_disk_blocks = s.num_disk_blocks - s.free_disk_blocks;
  s.cached_disk_blocks = cache_.num_registered(Medium::kDisk);
  return s;
}

BlockManagerStats BlockManager::take_step_stats() {
  const BlockManagerStats now = stats();
  BlockManagerStats step = now;  // gauges as they are; counters as differences
#define PAGEDKV_STEP_COUNTER(name) step.name -= step_start_.name;
#define PAGEDKV_STEP_GAUGE(type, name)
#define PAGEDKV_STEP_RATIO(name, num, den)
  PAGEDKV_BLOCK_MANAGER_STATS(PAGEDKV_STEP_COUNTER, PAGEDKV_STEP_GAUGE, PAGEDKV_STEP_RATIO)
#undef PAGEDKV_STEP_COUNTER
#undef PAGEDKV_STEP_GAUGE
#undef PAGEDKV_STEP_RATIO
  step_start_ = now;
  return step;
}

}  // namespace pagedkv
