// Block manager implementation (see block_manager.h for the contract).
#include "core/block_manager.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <unordered_set>

#include "core/errors.h"

namespace pagedkv {
namespace {

std::string seq_str(int64_t seq_id) { return "sequence " + std::to_string(seq_id); }

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

template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks,
                           bool enable_prefix_caching, double watermark, HashAlgo hash_algo, bool enable_events,
                           int64_t max_pending_events, int32_t default_priority, int32_t decode_priority,
                           double max_pinned_fraction, std::vector<int64_t> group_windows)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      num_cpu_blocks_(num_cpu_blocks),
      watermark_blocks_(0),
      windows_(std::move(group_windows)),
      prefix_caching_(enable_prefix_caching),
      hash_algo_(hash_algo),
      gpu_free_(std::max(num_blocks, 0), /*num_levels=*/2 + kMaxPriority),
      cpu_free_(std::max(num_cpu_blocks, 0)),
      cache_(std::max(block_size, 1), std::max(num_blocks, 0), hash_algo),
      default_priority_(default_priority),
      decode_priority_(decode_priority),
      max_pinned_blocks_(0),
      max_pinned_fraction_(max_pinned_fraction),
      events_enabled_(enable_events),
      max_pending_events_(static_cast<size_t>(std::max<int64_t>(max_pending_events, 1))) {
  if (max_pending_events < 1) throw ValueError(cat("max_pending_events must be >= 1, got ", max_pending_events));
  if (num_blocks <= 0) throw ValueError(cat("num_blocks must be positive, got ", num_blocks));
  if (block_size <= 0) throw ValueError(cat("block_size must be positive, got ", block_size));
  if (num_cpu_blocks < 0) throw ValueError(cat("num_cpu_blocks must be >= 0, got ", num_cpu_blocks));
  if (!(watermark >= 0.0 && watermark < 1.0))
    throw ValueError(cat("watermark must be in [0, 1), got ", watermark));
  for (const auto& [name, p] : {std::pair{"default_priority", default_priority}, {"decode_priority", decode_priority}})
    if (p < kMinPriority || p > kMaxPriority)
      throw ValueError(cat(name, " must be in [", kMinPriority, ", ", kMaxPriority, "], got ", p));
  if (!(max_pinned_fraction >= 0.0 && max_pinned_fraction < 1.0))
    throw ValueError(cat("max_pinned_fraction must be in [0, 1), got ", max_pinned_fraction));
  if (windows_.empty() || windows_.size() > static_cast<size_t>(kMaxGroups))
    throw ValueError(cat("group_windows must have 1 to ", kMaxGroups, " groups, got ", windows_.size()));
  for (size_t g = 0; g < windows_.size(); ++g) {
    if (windows_[g] < 0)
      throw ValueError(cat("group_windows[", g, "] must be a window of >= 1 tokens or full attention, got ", windows_[g]));
    has_windows_ |= windows_[g] != kFullAttention;
  }
  watermark_blocks_ = static_cast<int32_t>(watermark * num_blocks);
  max_pinned_blocks_ = static_cast<int32_t>(max_pinned_fraction * num_blocks);
  block_retention_.assign(num_blocks, BlockRetention{default_priority, kForever});
  block_stamp_.assign(num_blocks, 0);
  pin_count_.assign(num_blocks, 0);
  gpu_ref_.assign(num_blocks, 0);
  block_node_.assign(num_blocks, PrefixCache::kNoNode);
  for (int32_t b = 0; b < num_blocks; ++b) gpu_free_.push_back(b);
  cpu_ref_.assign(num_cpu_blocks, 0);
  for (int32_t b = 0; b < num_cpu_blocks; ++b) cpu_free_.push_back(b);
  seqs_.reserve(static_cast<size_t>(std::min(num_blocks, 1 << 16)));
}

// ---------------------------------------------------------------------------------------------------
// Lookup helpers

BlockManager::Sequence& BlockManager::get(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw KeyError(cat("unknown ", seq_str(seq_id)));
  return it->second;
}

const BlockManager::Sequence& BlockManager::get(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw KeyError(cat("unknown ", seq_str(seq_id)));
  return it->second;
}

const BlockManager::Sequence& BlockManager::get_resident(int64_t seq_id, const char* what) const {
  const Sequence& seq = get(seq_id);
  if (seq.swapped) throw ValueError(cat(what, ": ", seq_str(seq_id), " is swapped out; swap it in first"));
  return seq;
}

void BlockManager::check_distinct(const int64_t* seq_ids, size_t n, const char* what) {
  const auto twice = [&](int64_t id) { throw ValueError(cat(what, ": ", seq_str(id), " appears twice in seq_ids")); };
  if (n <= 16) {  // a decode batch of a few sequences: no allocation
    for (size_t i = 1; i < n; ++i)
      for (size_t j = 0; j < i; ++j)
        if (seq_ids[i] == seq_ids[j]) twice(seq_ids[i]);
    return;
  }
  std::vector<int64_t> sorted(seq_ids, seq_ids + n);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) twice(*dup);
}

// Both resolve()s: Map is seqs_, const or not, so the result points at const or mutable sequences.
template <typename Map>
auto BlockManager::resolve_in(Map& seqs, const int64_t* seq_ids, size_t n, const char* what, bool unique, Where where)
    -> std::vector<decltype(&seqs.begin()->second)> {
  if (unique) check_distinct(seq_ids, n, what);
  std::vector<decltype(&seqs.begin()->second)> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto it = seqs.find(seq_ids[i]);
    if (it == seqs.end()) throw KeyError(cat(what, ": unknown ", seq_str(seq_ids[i])));
    if (where == Where::kResident && it->second.swapped)
      throw ValueError(cat(what, ": ", seq_str(seq_ids[i]), " is swapped out; swap it in first"));
    if (where == Where::kSwapped && !it->second.swapped)
      throw ValueError(cat(what, ": ", seq_str(seq_ids[i]), " is not swapped out"));
    out.push_back(&it->second);
  }
  return out;
}

std::vector<BlockManager::Sequence*> BlockManager::resolve(const int64_t* seq_ids, size_t n, const char* what,
                                                           bool unique, Where where) {
  return resolve_in(seqs_, seq_ids, n, what, unique, where);
}

std::vector<const BlockManager::Sequence*> BlockManager::resolve(const int64_t* seq_ids, size_t n, const char* what,
                                                                 bool unique, Where where) const {
  return resolve_in(seqs_, seq_ids, n, what, unique, where);
}

void BlockManager::match_prefix(const int64_t* tokens, size_t num_tokens, std::string_view salt,
                                PrefixMatch* out) const {
  const int32_t num_groups = this->num_groups();
  PrefixMatch& m = *out;  // its vectors keep their capacity from one prompt to the next
  m.num_blocks = 0;
  m.held.resize(num_groups);
  m.chain.resize(num_groups);
  for (int32_t g = 0; g < num_groups; ++g) {
    m.held[g].clear();
    m.chain[g].clear();
  }
  m.keys.clear();
  if (!prefix_caching_) return;
  const int32_t max_hits = blocks_for_tokens(static_cast<int64_t>(num_tokens)) - 1;  // last block: computed
  // Per group, the blocks registered for the chain of the prompt's blocks (kNoBlock: the content is a
  // link of the chain without KV), as far as the chain goes. A full-attention group needs every block,
  // so it stops at the first one without KV and bounds the hit; a windowed group needs only the blocks
  // its window reads at the first token to compute.
  // Keys are computed a few blocks ahead of the walk (they depend on the content only), so the buckets
  // of the blocks walked load together instead of one cache miss after another; the walk stops at the
  // first miss, so a prompt that waits (can_allocate every step) hashes little more than its hit.
  constexpr int32_t kKeysAhead = 8;
  const int32_t num_full = static_cast<int32_t>(num_tokens / block_size_);
  const auto key_of = [&](int32_t i) {
    if (i >= static_cast<int32_t>(m.keys.size())) extend_keys(tokens, salt, std::min(num_full, i + kKeysAhead), &m.keys);
    return m.keys[i];
  };
  std::vector<std::vector<int32_t>>& chain = m.chain;
  int32_t limit = max_hits;
  for (int32_t pass = 0; pass < 2; ++pass)  // full-attention groups first: they bound the walk
    for (int32_t g = 0; g < num_groups && limit > 0; ++g) {
      const bool full = windows_[g] == kFullAttention;
      if (full != (pass == 0)) continue;
      PrefixCache::NodeId parent = PrefixCache::root(g);
      for (int32_t i = 0; i < limit; ++i) {
        const uint64_t key = key_of(i);
        if (i + 1 < limit && i + 1 < static_cast<int32_t>(m.keys.size()))
          cache_.prefetch_node(m.keys[i + 1]);  // its bucket was requested a while ago
        const int64_t* block_tokens = tokens + int64_t(i) * block_size_;
        const std::string_view block_salt = i == 0 ? salt : std::string_view();
        const PrefixCache::NodeId node = cache_.find(key, parent, block_tokens, block_salt);
        if (node == PrefixCache::kNoNode) break;
        const int32_t block = cache_.node(node).block;
        if (block == PrefixCache::kNoBlock && full) break;
        chain[g].push_back(block);
        parent = node;
      }
      if (full) limit = std::min(limit, static_cast<int32_t>(chain[g].size()));
    }
  // The longest hit every group can serve: its chain reaches block k - 1 (the cache has seen that
  // prefix) and the blocks [released_for(g, k * bs), k) hold KV.
  int32_t k = limit;
  for (; k > 0; --k) {
    bool servable = true;
    for (int32_t g = 0; g < num_groups && servable; ++g) {
      servable = k <= static_cast<int32_t>(chain[g].size());
      for (int32_t i = static_cast<int32_t>(released_for(g, int64_t(k) * block_size_)); i < k && servable; ++i)
        servable = chain[g][i] != PrefixCache::kNoBlock;
    }
    if (servable) break;
  }
  m.num_blocks = k;
  for (int32_t g = 0; g < num_groups; ++g)
    m.held[g].assign(chain[g].begin() + std::min<int64_t>(released_for(g, int64_t(k) * block_size_), k),
                     chain[g].begin() + k);  // k <= chain[g].size()
}

const BlockManager::PrefixMatch& BlockManager::match_prefix_memo(const int64_t* tokens, size_t num_tokens,
                                                                 std::string_view salt) const {
  MatchMemo& m = memo_;
  const bool same = m.cache_version == cache_.version() && m.tokens.size() == num_tokens && m.salt == salt &&
                    std::equal(m.tokens.begin(), m.tokens.end(), tokens);
  if (!same) {
    match_prefix(tokens, num_tokens, salt, &m.match);
    m.tokens.assign(tokens, tokens + num_tokens);
    m.salt.assign(salt);
    m.cache_version = cache_.version();
  }
  return m.match;
}

int32_t BlockManager::from_free_for(const PrefixMatch& m, int32_t num_blocks) const {
  int32_t from_free = 0;
  for (int32_t g = 0; g < num_groups(); ++g) {
    from_free += num_blocks - m.num_blocks;
    for (int32_t b : m.held[g]) from_free += gpu_ref_[b] == 0;  // in-use hits cost no free block
  }
  return from_free;
}

int32_t BlockManager::group_arg(int32_t group, const char* what) const {
  if (group < 0 || group >= num_groups())
    throw ValueError(cat(what, ": group=", group, " is not one of this manager's ", num_groups(), " groups"));
  return group;
}

int64_t BlockManager::blocks_held(int64_t num_tokens, int64_t num_computed) const {
  if (num_tokens < 0 || num_computed < 0 || num_computed > num_tokens)
    throw ValueError(cat("blocks_held: need 0 <= num_computed <= num_tokens, got num_tokens=", num_tokens,
                         " num_computed=", num_computed));
  int64_t held = 0;
  const int64_t blocks = num_tokens / block_size_ + (num_tokens % block_size_ != 0);
  for (int32_t g = 0; g < num_groups(); ++g) held += blocks - released_for(g, num_computed);
  return held;
}

int32_t BlockManager::num_released_blocks(int64_t seq_id, int32_t group) const {
  return get(seq_id).groups[group_arg(group, "num_released_blocks")].released;
}

// ---------------------------------------------------------------------------------------------------
// Block pools

void BlockManager::untag_block(int32_t block) {
  const PrefixCache::NodeId node = block_node_[block];
  if (node == PrefixCache::kNoNode) return;
  if (cache_.node(node).block == block) {
    if (events_enabled_ && cache_.node(node).root == PrefixCache::kRoot) record_removed(node);
    cache_.set_block(node, PrefixCache::kNoBlock);
  }
  block_node_[block] = PrefixCache::kNoNode;
  cache_.release(node);
}

int32_t BlockManager::take_free_block() {
  const int32_t block = gpu_free_.pop_front();
  if (holds_cached_kv(block)) {
    ++counters_.evictions;
    --cached_free_blocks_;
  }
  untag_block(block);
  gpu_ref_[block] = 1;
  return block;
}

void BlockManager::release_block(int32_t block) {
  if (--gpu_ref_[block] > 0) return;
  if (!pending_copies_.empty()) {
    drop_pending_copies_to(block);
    if (is_pending_copy_source(block)) return;  // held until take_copies hands its copy out
  }
  return_to_free_list(block);
}

bool BlockManager::holds_cached_kv(int32_t block) const {
  const PrefixCache::NodeId node = block_node_[block];
  return node != PrefixCache::kNoNode && cache_.node(node).block == block;
}

void BlockManager::return_to_free_list(int32_t block) {
  // Cached KV goes to the back of its priority's list (evicted after lower priorities, least recently
  // freed first); a block without reusable content goes to the front of level 0, handed out first.
  ++block_stamp_[block];
  if (!holds_cached_kv(block)) {
    gpu_free_.push_front(block, 0);
    return;
  }
  ++cached_free_blocks_;
  BlockRetention& r = block_retention_[block];
  if (r.duration != kForever) {  // the duration runs from now
    const double expiry = now_ + r.duration;
    if (expiry > now_) {
      expiries_.push_back({expiry, next_expiry_order_++, block, block_stamp_[block]});
      std::push_heap(expiries_.begin(), expiries_.end(), std::greater<>());
    } else {
      r = {default_priority_, kForever};
    }
  }
  gpu_free_.push_back(block, 1 + r.priority);
}

void BlockManager::move_to_level(int32_t free_block, int32_t level) {
  gpu_free_.remove(free_block);
  gpu_free_.push_back(free_block, level);
  ++block_stamp_[free_block];
}

int32_t BlockManager::block_priority(int32_t block) const {
  if (block < 0 || block >= num_blocks_) throw ValueError(cat("block_priority: no GPU block ", block));
  return block_retention_[block].priority;
}

// ---------------------------------------------------------------------------------------------------
// Retention: clock and pins

BlockManager::BlockRetention BlockManager::retention_of(const Sequence& seq, int32_t index) const {
  const int64_t first = int64_t(index) * block_size_, last = first + block_size_;
  BlockRetention r{-1, 0.0};
  for (const RetentionRange& range : seq.retention)
    if (std::max(range.start, first) < std::min(range.end, last) &&  // an empty range overlaps nothing
        stronger({static_cast<int32_t>(range.priority), range.duration}, r))
      r = {static_cast<int32_t>(range.priority), range.duration};
  if (r.priority < 0) r = {first < seq.prompt_len ? default_priority_ : decode_priority_, kForever};
  return r;
}

void BlockManager::validate_retention(const std::vector<RetentionRange>& ranges, const char* what) const {
  for (size_t i = 0; i < ranges.size(); ++i) {
    const RetentionRange& r = ranges[i];
    if (r.start < 0 || r.end < r.start)
      throw ValueError(cat(what, ": retention[", i, "] covers tokens [", r.start, ", ", r.end,
                           "); need 0 <= start <= end"));
    if (r.priority < kMinPriority || r.priority > kMaxPriority)
      throw ValueError(cat(what, ": retention[", i, "] has priority ", r.priority, "; need ", kMinPriority,
                           " <= priority <= ", kMaxPriority));
    if (!(r.duration >= 0.0))
      throw ValueError(cat(what, ": retention[", i, "] has duration ", r.duration, "; need >= 0 (or none)"));
  }
}

void BlockManager::set_time(double now) {
  if (std::isnan(now) || now < now_)
    throw ValueError(cat("set_time: the clock only moves forward (now ", now_, ", got ", now, ")"));
  now_ = now;
  expire_durations();
}

void BlockManager::expire_durations() {
  while (!expiries_.empty() && expiries_.front().time <= now_) {
    const Expiry e = expiries_.front();
    std::pop_heap(expiries_.begin(), expiries_.end(), std::greater<>());
    expiries_.pop_back();
    if (e.stamp != block_stamp_[e.block] || !gpu_free_.contains(e.block)) continue;  // stale
    block_retention_[e.block] = {default_priority_, kForever};
    move_to_level(e.block, 1 + default_priority_);
  }
  // Blocks revived and freed again leave stale entries behind: drop them once they outnumber the blocks,
  // so the heap stays O(num_blocks) (amortised O(1) per release).
  if (expiries_.size() > 2 * static_cast<size_t>(num_blocks_) + 64) {
    expiries_.erase(std::remove_if(expiries_.begin(), expiries_.end(),
                                   [this](const Expiry& e) {
                                     return e.stamp != block_stamp_[e.block] || !gpu_free_.contains(e.block);
                                   }),
                    expiries_.end());
    std::make_heap(expiries_.begin(), expiries_.end(), std::greater<>());
  }
}

const std::vector<int32_t>& BlockManager::pinned_blocks(int64_t seq_id) const {
  auto it = pins_.find(seq_id);
  if (it == pins_.end()) throw KeyError(cat("pinned_blocks: ", seq_str(seq_id), " is not pinned"));
  return it->second;
}

int32_t BlockManager::pin(int64_t seq_id) {
  const Sequence& seq = get_resident(seq_id, "pin");
  std::vector<int32_t> blocks;
  for (const GroupTable& t : seq.groups)
    for (int32_t i = t.released; i < t.num_registered; ++i)
      if (holds_cached_kv(t.blocks[i])) blocks.push_back(t.blocks[i]);
  // Blocks pinned after this call: the others' pins, plus these.
  const auto old = pins_.find(seq_id);
  std::unordered_set<int32_t> held_before;
  if (old != pins_.end()) held_before.insert(old->second.begin(), old->second.end());
  int32_t after = pinned_blocks_;
  for (int32_t b : held_before) after -= pin_count_[b] == 1;
  for (int32_t b : blocks) after += pin_count_[b] - static_cast<int32_t>(held_before.count(b)) == 0;
  if (after > max_pinned_blocks_)
    throw OutOfBlocks(cat("pin: ", seq_str(seq_id), " would bring the pinned blocks to ", after,
                          ", over the cap of ", max_pinned_blocks_, " (max_pinned_fraction=", max_pinned_fraction_,
                          " of ", num_blocks_, " blocks); unpin other sequences first"));
  for (int32_t b : blocks) {  // blocks of a live sequence: in use, never in the free list
    ++gpu_ref_[b];
    pinned_blocks_ += pin_count_[b]++ == 0;
  }
  if (old != pins_.end()) drop_pin(old->second);
  pins_[seq_id] = std::move(blocks);
  return static_cast<int32_t>(pins_[seq_id].size());
}

void BlockManager::drop_pin(std::vector<int32_t>& blocks) {
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {  // tail first, as free() does
    pinned_blocks_ -= --pin_count_[*b] == 0;
    release_block(*b);
  }
  blocks.clear();
}

void BlockManager::unpin(int64_t seq_id) {
  auto it = pins_.find(seq_id);
  if (it == pins_.end()) throw KeyError(cat("unpin: ", seq_str(seq_id), " is not pinned"));
  drop_pin(it->second);
  pins_.erase(it);
}

bool BlockManager::is_pending_copy_source(int32_t block) const {
  for (const BlockPair& p : pending_copies_)
    if (p.first == block) return true;
  return false;
}

int32_t BlockManager::pending_copy_source(int32_t block) const {
  for (const BlockPair& p : pending_copies_)
    if (p.second == block) return p.first;
  return -1;
}

void BlockManager::drop_pending_copies_to(int32_t block) {
  const int32_t source = pending_copy_source(block);
  if (source < 0) return;
  pending_copies_.erase(std::remove_if(pending_copies_.begin(), pending_copies_.end(),
                                       [block](const BlockPair& p) { return p.second == block; }),
                        pending_copies_.end());
  // The source may have been held only for this copy.
  if (gpu_ref_[source] == 0 && !is_pending_copy_source(source) && !gpu_free_.contains(source))
    return_to_free_list(source);
}

int32_t BlockManager::take_cpu_block() {
  const int32_t block = cpu_free_.pop_front();
  cpu_ref_[block] = 1;
  return block;
}

void BlockManager::release_cpu_block(int32_t block) {
  if (--cpu_ref_[block] == 0) cpu_free_.push_back(block);
}

// ---------------------------------------------------------------------------------------------------
// Allocation

int64_t BlockManager::max_blocks_held(int64_t num_tokens, int64_t num_new_tokens) const {
  if (num_new_tokens == kWholePrompt) return blocks_held(num_tokens, 0);
  const int64_t blocks = num_tokens / block_size_ + (num_tokens % block_size_ != 0);
  const int64_t chunk = num_new_tokens / block_size_ + (num_new_tokens % block_size_ != 0);
  int64_t held = 0;
  for (int32_t g = 0; g < num_groups(); ++g) {
    const int64_t w = windows_[g];  // a windowed group: the window's blocks, the chunk's, the one written
    held += w == kFullAttention ? blocks : std::min(blocks, (w + block_size_ - 2) / block_size_ + 1 + chunk);
  }
  return held;
}

namespace {
void check_num_new_tokens(int64_t num_new_tokens, const char* what) {
  if (num_new_tokens != BlockManager::kWholePrompt && num_new_tokens < 1)
    throw ValueError(cat(what, ": num_new_tokens must be >= 1 (or None: the whole prompt), got ", num_new_tokens));
}
}  // namespace

AllocStatus BlockManager::can_allocate(const int64_t* tokens, size_t num_tokens, std::string_view salt,
                                       int64_t num_new_tokens) const {
  if (num_tokens == 0) throw ValueError("can_allocate: token_ids is empty");
  check_num_new_tokens(num_new_tokens, "can_allocate");
  const int64_t len = static_cast<int64_t>(num_tokens);
  if (never_fits(len, num_new_tokens)) return AllocStatus::kNever;
  return fits(len, match_prefix_memo(tokens, num_tokens, salt), num_new_tokens);
}

bool BlockManager::never_fits(int64_t num_tokens, int64_t num_new_tokens) const {
  return max_blocks_held(num_tokens, num_new_tokens) > num_blocks_ - watermark_blocks_;
}

int64_t BlockManager::first_chunk_end(int64_t num_tokens, const PrefixMatch& m, int64_t num_new_tokens) const {
  const int64_t computed = int64_t(m.num_blocks) * block_size_;
  return num_new_tokens == kWholePrompt || num_new_tokens >= num_tokens - computed ? num_tokens
                                                                                  : computed + num_new_tokens;
}

AllocStatus BlockManager::fits(int64_t num_tokens, const PrefixMatch& m, int64_t num_new_tokens) const {
  const int64_t first = first_chunk_end(num_tokens, m, num_new_tokens);
  const int32_t needed = static_cast<int32_t>(blocks_held(first, int64_t(m.num_blocks) * block_size_));
  const int32_t from_free = from_free_for(m, blocks_for_tokens(first));
  if (pinned_blocks_ > 0) {  // pinned blocks never come free: what does not fit beside them waits forever
    int32_t pinned_hits = 0;
    for (const auto& held : m.held)
      for (int32_t b : held) pinned_hits += pin_count_[b] > 0;
    if (needed - pinned_hits > num_blocks_ - watermark_blocks_ - pinned_blocks_) return AllocStatus::kNever;
  }
  return gpu_free_.size() - from_free >= watermark_blocks_ ? AllocStatus::kOk : AllocStatus::kLater;
}

int64_t BlockManager::allocate(int64_t seq_id, const int64_t* tokens, size_t num_tokens, std::string_view salt,
                               const std::vector<RetentionRange>& retention, int64_t num_new_tokens) {
  if (seqs_.count(seq_id)) throw ValueError(cat("allocate: ", seq_str(seq_id), " already exists"));
  if (num_tokens == 0) throw ValueError("allocate: token_ids is empty");
  check_num_new_tokens(num_new_tokens, "allocate");
  validate_retention(retention, "allocate");
  const PrefixMatch& m = match_prefix_memo(tokens, num_tokens, salt);  // admit() does not look up again
  const int32_t from_free =
      from_free_for(m, blocks_for_tokens(first_chunk_end(static_cast<int64_t>(num_tokens), m, num_new_tokens)));
  if (from_free > gpu_free_.size())
    throw OutOfBlocks(cat("allocate: ", seq_str(seq_id), " needs ", from_free, " free blocks but only ",
                          gpu_free_.size(), " are free (check can_allocate first)"));
  return admit(seq_id, tokens, num_tokens, salt, retention, m, num_new_tokens);
}

int64_t BlockManager::admit(int64_t seq_id, const int64_t* tokens, size_t num_tokens, std::string_view salt,
                            const std::vector<RetentionRange>& retention, const PrefixMatch& m,
                            int64_t num_new_tokens) {
  // Blocks allocated now: the whole prompt's, or those of the cached tokens and the first chunk.
  const int32_t total = blocks_for_tokens(static_cast<int64_t>(num_tokens));
  const int32_t needed = blocks_for_tokens(first_chunk_end(static_cast<int64_t>(num_tokens), m, num_new_tokens));
  const int32_t from_free = from_free_for(m, needed);
  Sequence seq;
  seq.tokens.assign(tokens, tokens + num_tokens);
  seq.block_keys = m.keys;
  seq.salt.assign(salt);
  seq.prompt_len = static_cast<int64_t>(num_tokens);
  seq.retention = retention;
  seq.num_computed = int64_t(m.num_blocks) * block_size_;
  seq.groups.resize(num_groups());
  int32_t held_hits = 0;
  // Every group's hits first: a fresh block taken for one group must not evict another group's hit.
  for (int32_t g = 0; g < num_groups(); ++g) {
    GroupTable& t = seq.groups[g];
    t.released = static_cast<int32_t>(released_for(g, seq.num_computed));
    t.num_registered = m.num_blocks;
    t.blocks.reserve(needed);
    t.blocks.assign(static_cast<size_t>(t.released), kPad);
    for (int32_t b : m.held[g]) {
      if (gpu_ref_[b]++ == 0 && gpu_free_.contains(b)) {  // else held for a pending copy
        gpu_free_.remove(b);
        --cached_free_blocks_;  // a hit holds cached KV
      }
      keep_stronger_retention(b, retention_of(seq, static_cast<int32_t>(t.blocks.size())));
      t.blocks.push_back(b);
    }
    held_hits += static_cast<int32_t>(m.held[g].size());
  }
  const int32_t fresh = (needed - m.num_blocks) * num_groups();
  counters_.queries += static_cast<int64_t>(num_tokens);
  counters_.hits += seq.num_computed;
  counters_.query_blocks += int64_t(total) * num_groups();
  counters_.hit_blocks += int64_t(m.num_blocks) * num_groups();
  counters_.hit_blocks_in_use += held_hits - (from_free - fresh);  // hits on blocks another sequence holds
  counters_.hit_blocks_revived += from_free - fresh;
  // From here on m may be stale: taking free blocks changes the prefix cache.
  for (GroupTable& t : seq.groups) {
    while (static_cast<int32_t>(t.blocks.size()) < needed) {
      const int32_t b = take_free_block();
      block_retention_[b] = retention_of(seq, static_cast<int32_t>(t.blocks.size()));
      t.blocks.push_back(b);
    }
  }
  const int64_t cached = seq.num_computed;
  seqs_.emplace(seq_id, std::move(seq));
  return cached;
}

std::vector<int64_t> BlockManager::allocate_batch(const std::vector<int64_t>& seq_ids,
                                                  const std::vector<TokenSpan>& prompts,
                                                  const std::vector<std::string>& salts,
                                                  const std::vector<std::vector<RetentionRange>>& retentions) {
  if (prompts.size() != seq_ids.size())
    throw ValueError(cat("allocate_batch: ", seq_ids.size(), " seq_ids but ", prompts.size(), " prompts"));
  if (!salts.empty() && salts.size() != seq_ids.size())
    throw ValueError(cat("allocate_batch: ", salts.size(), " cache_salts for ", seq_ids.size(), " prompts"));
  if (!retentions.empty() && retentions.size() != seq_ids.size())
    throw ValueError(cat("allocate_batch: ", retentions.size(), " retentions for ", seq_ids.size(), " prompts"));
  for (const auto& r : retentions) validate_retention(r, "allocate_batch");
  check_distinct(seq_ids.data(), seq_ids.size(), "allocate_batch");
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    if (seqs_.count(seq_ids[i])) throw ValueError(cat("allocate_batch: ", seq_str(seq_ids[i]), " already exists"));
    if (prompts[i].size == 0) throw ValueError(cat("allocate_batch: prompts[", i, "] is empty"));
  }
  std::vector<int64_t> cached;
  cached.reserve(seq_ids.size());
  PrefixMatch& m = batch_match_;  // one lookup per prompt, shared by the fit check and the admission
  static const std::vector<RetentionRange> kNoRetention;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const std::string_view salt = salts.empty() ? std::string_view() : std::string_view(salts[i]);
    const int64_t len = static_cast<int64_t>(prompts[i].size);
    if (never_fits(len, kWholePrompt)) break;
    match_prefix(prompts[i].data, prompts[i].size, salt, &m);
    if (fits(len, m, kWholePrompt) != AllocStatus::kOk) break;
    cached.push_back(admit(seq_ids[i], prompts[i].data, prompts[i].size, salt,
                           retentions.empty() ? kNoRetention : retentions[i], m, kWholePrompt));
  }
  return cached;
}

PrefixCache::NodeId BlockManager::chain_node(Sequence& seq, int32_t group, int32_t i) {
  const std::vector<uint64_t>& keys = block_keys_upto(seq, i + 1);
  PrefixCache::NodeId node = PrefixCache::root(group);
  for (int32_t j = 0; j <= i; ++j) {
    const std::string_view salt = j == 0 ? std::string_view(seq.salt) : std::string_view();
    node = cache_.find_or_create(keys[j], node, seq.tokens.data() + int64_t(j) * block_size_, salt);
  }
  return node;
}

const std::vector<uint64_t>& BlockManager::block_keys_upto(Sequence& seq, int32_t num_blocks) const {
  extend_keys(seq.tokens.data(), seq.salt, num_blocks, &seq.block_keys);
  return seq.block_keys;
}

void BlockManager::extend_keys(const int64_t* tokens, std::string_view salt, int32_t num_blocks,
                               std::vector<uint64_t>* keys) const {
  constexpr int64_t kAhead = 512;  // bytes of tokens requested ahead of the hashing (a fresh prompt is cold)
  const char* const end = reinterpret_cast<const char*>(tokens + int64_t(num_blocks) * block_size_);
  for (int32_t i = static_cast<int32_t>(keys->size()); i < num_blocks; ++i) {
    const int64_t* block_tokens = tokens + int64_t(i) * block_size_;
    const char* ahead = reinterpret_cast<const char*>(block_tokens) + kAhead;
    for (const char* p = ahead; p < ahead + sizeof(int64_t) * block_size_ && p < end; p += 64) __builtin_prefetch(p);
    keys->push_back(cache_.key_after(i == 0 ? PrefixCache::kRootKey : keys->back(), block_tokens,
                                     i == 0 ? salt : std::string_view()));
    cache_.prefetch(keys->back());  // its find / create comes soon
  }
}

void BlockManager::register_computed_blocks(Sequence& seq, int32_t group) {
  if (!prefix_caching_) return;
  stored_run_open_ = false;
  GroupTable& t = seq.groups[group];
  const int32_t full = static_cast<int32_t>(seq.num_computed / block_size_);
  bool parent_is_new = false;  // a node created in this loop has no children yet: skip the lookup
  const bool record = events_enabled_ && group == 0;  // events describe group 0's cache
  const std::vector<uint64_t>& keys = block_keys_upto(seq, full);
  for (int32_t i = std::max(t.num_registered, t.released); i < full; ++i) {
    PrefixCache::NodeId parent = PrefixCache::root(group);
    if (i > 0) parent = i - 1 < t.released ? chain_node(seq, group, i - 1) : block_node_[t.blocks[i - 1]];
    if (parent == PrefixCache::kNoNode) break;  // the prefix lost its content tag (cache reset)
    const int32_t block = t.blocks[i];
    const int64_t* block_tokens = seq.tokens.data() + int64_t(i) * block_size_;
    const std::string_view salt = i == 0 ? std::string_view(seq.salt) : std::string_view();
    const uint64_t h = keys[i];
    const PrefixCache::NodeId node = parent_is_new ? cache_.create(h, parent, block_tokens, salt)
                                                   : cache_.find_or_create(h, parent, block_tokens, salt, &parent_is_new);
    if (block_node_[block] != node) {
      untag_block(block);
      block_node_[block] = node;
      cache_.add_ref(node);
    }
    const int32_t previous = cache_.node(node).block;
    if (record && previous == PrefixCache::kNoBlock) record_stored(node, block_tokens, salt);
    // The latest registration wins, unless a pin holds the earlier one: what is pinned keeps hitting.
    if (previous == PrefixCache::kNoBlock || pin_count_[previous] == 0) cache_.set_block(node, block);
    if (previous != PrefixCache::kNoBlock && previous != block && gpu_free_.contains(previous)) {
      --cached_free_blocks_;  // a free copy of this content is superseded: no longer a hit
      move_to_level(previous, 0);
    }
    t.num_registered = i + 1;
  }
}

void BlockManager::release_out_of_window(Sequence& seq) {
  for (int32_t g = 0; g < num_groups(); ++g) {
    GroupTable& t = seq.groups[g];
    const int32_t target = static_cast<int32_t>(released_for(g, seq.num_computed));
    for (; t.released < target; ++t.released) {  // oldest first: the oldest is evicted first
      release_block(t.blocks[t.released]);
      t.blocks[t.released] = kPad;
    }
  }
}

void BlockManager::mark_computed(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>* num_tokens) {
  if (num_tokens && num_tokens->size() != seq_ids.size())
    throw ValueError(cat("mark_computed: ", seq_ids.size(), " seq_ids but ", num_tokens->size(), " num_tokens"));
  const std::vector<Sequence*> seqs = resolve(seq_ids.data(), seq_ids.size(), "mark_computed", /*unique=*/true);
  for (size_t i = 0; i < seqs.size() && num_tokens; ++i) {
    const int64_t n = (*num_tokens)[i];
    if (n < seqs[i]->num_computed || n > static_cast<int64_t>(seqs[i]->tokens.size()))
      throw ValueError(cat("mark_computed: num_tokens=", n, " for ", seq_str(seq_ids[i]), " must be in [",
                           seqs[i]->num_computed, ", ", seqs[i]->tokens.size(), "] (computed so far, length)"));
    if (n > allocated_tokens(*seqs[i]))
      throw ValueError(cat("mark_computed: num_tokens=", n, " for ", seq_str(seq_ids[i]), " but only ",
                           allocated_tokens(*seqs[i]), " tokens have blocks (reserve() first)"));
  }
  if (!num_tokens)
    for (size_t i = 0; i < seqs.size(); ++i) check_complete(*seqs[i], seq_ids[i], "mark_computed");
  if (prefix_caching_) {  // the memory of every block about to be registered is loaded together
    int32_t new_blocks = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& seq = *seqs[i];
      const int64_t computed = num_tokens ? (*num_tokens)[i] : static_cast<int64_t>(seq.tokens.size());
      const int32_t full = static_cast<int32_t>(computed / block_size_);
      if (full <= seq.groups[0].num_registered) continue;  // most of a decode batch
      const std::vector<uint64_t>& keys = block_keys_upto(seq, full);
      for (int32_t b = seq.groups[0].num_registered; b < full; ++b) cache_.prefetch(keys[b]);
      new_blocks += full - seq.groups[0].num_registered;
    }
    if (new_blocks > 1) cache_.prefetch_creates(std::min(new_blocks, 256));  // at most new_blocks nodes are created
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& seq = *seqs[i];
    seq.num_computed = num_tokens ? (*num_tokens)[i] : static_cast<int64_t>(seq.tokens.size());
    // Each group registers its new full blocks, then lets go of those its window no longer reads.
    for (int32_t g = 0; g < num_groups(); ++g) register_computed_blocks(seq, g);
    if (has_windows_) release_out_of_window(seq);
  }
}

int32_t BlockManager::blocks_to_reserve(const std::vector<const Sequence*>& seqs, const std::vector<int64_t>& seq_ids,
                                        const std::vector<int64_t>& num_tokens) const {
  if (num_tokens.size() != seqs.size())
    throw ValueError(cat("reserve: ", seqs.size(), " seq_ids but ", num_tokens.size(), " num_tokens"));
  int64_t needed = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t len = static_cast<int64_t>(seqs[i]->tokens.size());
    if (num_tokens[i] < 1 || num_tokens[i] > len)
      throw ValueError(cat("reserve: num_tokens=", num_tokens[i], " for ", seq_str(seq_ids[i]), " must be in [1, ",
                           len, "]"));
    needed += std::max<int64_t>(0, blocks_for_tokens(num_tokens[i]) - int64_t(seqs[i]->groups[0].blocks.size()));
  }
  return static_cast<int32_t>(std::min<int64_t>(needed * num_groups(), std::numeric_limits<int32_t>::max()));
}

bool BlockManager::can_reserve(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& num_tokens) const {
  const std::vector<const Sequence*> seqs = resolve(seq_ids.data(), seq_ids.size(), "reserve", /*unique=*/true);
  return blocks_to_reserve(seqs, seq_ids, num_tokens) <= gpu_free_.size();
}

void BlockManager::reserve(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& num_tokens) {
  const std::vector<Sequence*> seqs = resolve(seq_ids.data(), seq_ids.size(), "reserve", /*unique=*/true);
  const int32_t needed =
      blocks_to_reserve(std::vector<const Sequence*>(seqs.begin(), seqs.end()), seq_ids, num_tokens);
  if (needed > gpu_free_.size())
    throw OutOfBlocks(cat("reserve: needs ", needed, " free blocks but only ", gpu_free_.size(),
                          " are free (check can_reserve first)"));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const size_t target = static_cast<size_t>(blocks_for_tokens(num_tokens[i]));
    for (GroupTable& t : seqs[i]->groups)
      while (t.blocks.size() < target) {
        const int32_t b = take_free_block();
        block_retention_[b] = retention_of(*seqs[i], static_cast<int32_t>(t.blocks.size()));
        t.blocks.push_back(b);
      }
  }
}

int64_t BlockManager::num_allocated_tokens(int64_t seq_id) const { return allocated_tokens(get(seq_id)); }

void BlockManager::check_complete(const Sequence& seq, int64_t seq_id, const char* what) const {
  if (allocated_tokens(seq) < static_cast<int64_t>(seq.tokens.size()))
    throw ValueError(cat(what, ": ", seq_str(seq_id), " has blocks for ", allocated_tokens(seq), " of its ",
                         seq.tokens.size(), " tokens; reserve() the rest of its prompt first"));
}

// ---------------------------------------------------------------------------------------------------
// Decode

bool BlockManager::must_copy_before_write(int32_t block) const {
  // Shared with another sequence, or holding cached KV (a block left partial by truncate): writing into
  // it in place would change KV someone else reads.
  return gpu_ref_[block] > 1 || block_node_[block] != PrefixCache::kNoNode;
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
      if (block_node_[last] != PrefixCache::kNoNode)
        ++needed;  // cached KV: every appender copies
      else if (gpu_ref_[last] > 1)
        ++appenders_of_shared[last];
    }
  }
  // k appenders on a block with r references copy k times, or k - 1 times when they are all of them.
  for (const auto& [block, k] : appenders_of_shared) needed += k < gpu_ref_[block] ? k : k - 1;
  return needed;
}

bool BlockManager::can_append(const int64_t* seq_ids, size_t n, int64_t num_lookahead_slots) const {
  if (num_lookahead_slots < 0 || num_lookahead_slots > kMaxTokensPerAppend)
    throw ValueError(cat("can_append: num_lookahead_slots must be in [0, ", kMaxTokensPerAppend, "], got ",
                         num_lookahead_slots));
  const std::vector<const Sequence*> seqs = resolve(seq_ids, n, "can_append", /*unique=*/true);
  for (size_t i = 0; i < n; ++i) check_complete(*seqs[i], seq_ids[i], "can_append");
  return blocks_needed_to_append(seqs.data(), seqs.size(), nullptr, num_lookahead_slots) <= gpu_free_.size();
}

int64_t BlockManager::append_token(int64_t seq_id, int64_t token_id) {
  int64_t slot;
  append_tokens(&seq_id, &token_id, 1, &slot);
  return slot;
}

void BlockManager::append_tokens(const int64_t* seq_ids, const int64_t* token_ids, size_t n, int64_t* slots_out) {
  append_tokens(seq_ids, n, token_ids, nullptr, slots_out);
}

size_t BlockManager::append_count_total(const int64_t* counts, size_t n) const {
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] < 0 || counts[i] > kMaxTokensPerAppend)
      throw ValueError(cat("append_tokens: counts[", i, "]=", counts[i], " must be in [0, ", kMaxTokensPerAppend, "]"));
    total += static_cast<size_t>(counts[i]);
  }
  return total;
}

void BlockManager::append_tokens(const int64_t* seq_ids, size_t n, const int64_t* token_ids, const int64_t* counts,
                                 int64_t* slots_out) {
  if (counts) append_count_total(counts, n);
  const std::vector<Sequence*> seqs = resolve(seq_ids, n, "append_tokens", /*unique=*/true);
  for (size_t i = 0; i < n; ++i) check_complete(*seqs[i], seq_ids[i], "append_tokens");
  const int32_t needed = blocks_needed_to_append(seqs.data(), seqs.size(), counts, 0);
  if (needed > gpu_free_.size())
    throw OutOfBlocks(cat("append_tokens: needs ", needed, " free blocks but only ", gpu_free_.size(),
                          " are free (check can_append first)"));
  for (size_t i = 0; i < n; ++i) {
    Sequence& seq = *seqs[i];
    const int64_t count = counts ? counts[i] : 1;
    const int64_t len = static_cast<int64_t>(seq.tokens.size());
    for (GroupTable& t : seq.groups) {
      for (int64_t pos = len; pos < len + count; ++pos) {
        if (pos % block_size_ == 0) {
          const int32_t b = take_free_block();
          block_retention_[b] = retention_of(seq, static_cast<int32_t>(t.blocks.size()));
          t.blocks.push_back(b);
        } else if (pos == len && must_copy_before_write(t.blocks.back())) {  // copy on write
          const int32_t last = t.blocks.back();
          const int32_t copy = take_free_block();
          block_retention_[copy] = retention_of(seq, static_cast<int32_t>(t.blocks.size()) - 1);
          // Copying a block whose own copy is still pending: copy from that copy's source instead, so that
          // no copy reads another copy's destination (the copies of one batch are independent).
          const int32_t pending = pending_copies_.empty() ? -1 : pending_copy_source(last);
          pending_copies_.emplace_back(pending >= 0 ? pending : last, copy);
          ++counters_.cow_copies;
          release_block(last);
          t.blocks.back() = copy;
        }
      }
    }
    const std::vector<int32_t>& table = seq.groups[0].blocks;
    for (int64_t pos = len; pos < len + count; ++pos) {
      seq.tokens.push_back(*token_ids++);
      *slots_out++ = int64_t(table[pos / block_size_]) * block_size_ + pos % block_size_;
    }
  }
}

void BlockManager::truncate(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& num_tokens) {
  if (num_tokens.size() != seq_ids.size())
    throw ValueError(cat("truncate: ", seq_ids.size(), " seq_ids but ", num_tokens.size(), " num_tokens"));
  const std::vector<Sequence*> seqs = resolve(seq_ids.data(), seq_ids.size(), "truncate", /*unique=*/true);
  for (size_t i = 0; i < seqs.size(); ++i) {
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
        release_block(t.blocks.back());
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
  std::vector<BlockPair> copies;
  copies.swap(pending_copies_);
  // Sources no sequence holds any more were kept out of the free list until now: once the caller has
  // the copies, it performs them before any later allocation can write the block.
  for (const BlockPair& p : copies)
    if (gpu_ref_[p.first] == 0 && !gpu_free_.contains(p.first)) return_to_free_list(p.first);
  return copies;
}

// ---------------------------------------------------------------------------------------------------
// Lifetime

void BlockManager::free(int64_t seq_id) {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) throw KeyError(cat("free: unknown ", seq_str(seq_id), " (never allocated or already freed)"));
  const Sequence& seq = it->second;
  // Tail first: prefix blocks are freed last, so they are the last to be evicted.
  for (const GroupTable& t : seq.groups)
    for (auto b = t.blocks.rbegin(); b != t.blocks.rend() - t.released; ++b)
      seq.swapped ? release_cpu_block(*b) : release_block(*b);
  seqs_.erase(it);
}

void BlockManager::fork(int64_t parent_seq_id, int64_t child_seq_id) {
  const Sequence& parent = get_resident(parent_seq_id, "fork");
  if (seqs_.count(child_seq_id)) throw ValueError(cat("fork: child ", seq_str(child_seq_id), " already exists"));
  Sequence child = parent;
  for (const GroupTable& t : child.groups)
    for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) ++gpu_ref_[t.blocks[i]];
  seqs_.emplace(child_seq_id, std::move(child));
}

// ---------------------------------------------------------------------------------------------------
// Swapping

int32_t BlockManager::distinct_blocks(const std::vector<int64_t>& seq_ids, const char* what, Where where) const {
  std::unordered_set<int32_t> blocks;
  for (const Sequence* seq : resolve(seq_ids.data(), seq_ids.size(), what, /*unique=*/true, where))
    for (const GroupTable& t : seq->groups) blocks.insert(t.blocks.begin() + t.released, t.blocks.end());
  return static_cast<int32_t>(blocks.size());
}

std::vector<BlockPair> BlockManager::move_blocks(const std::vector<int64_t>& seq_ids, bool to_cpu) {
  // Blocks shared inside the group are copied once; the destination block is shared the same way.
  std::vector<BlockPair> mapping;
  std::unordered_map<int32_t, int32_t> src_to_dst;
  // A block still waiting for its copy-on-write copy holds nothing yet: swap out the copy's source.
  std::unordered_map<int32_t, int32_t> copy_source;
  if (to_cpu)
    for (const BlockPair& p : pending_copies_) copy_source[p.second] = p.first;
  for (int64_t id : seq_ids) {
    Sequence& seq = get(id);
    for (GroupTable& t : seq.groups) {  // released entries stay pads: only held blocks move
      std::vector<int32_t> dst_table(t.blocks.size(), kPad);
      for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) {
        auto [it, inserted] = src_to_dst.emplace(t.blocks[i], 0);
        if (inserted) {
          it->second = to_cpu ? take_cpu_block() : take_free_block();
          if (!to_cpu) block_retention_[it->second] = retention_of(seq, static_cast<int32_t>(i));
          const auto pending = copy_source.find(t.blocks[i]);
          mapping.emplace_back(pending == copy_source.end() ? t.blocks[i] : pending->second, it->second);
        } else {
          ++(to_cpu ? cpu_ref_ : gpu_ref_)[it->second];
          if (!to_cpu) keep_stronger_retention(it->second, retention_of(seq, static_cast<int32_t>(i)));
        }
        dst_table[i] = it->second;
      }
      for (auto b = t.blocks.rbegin(); b != t.blocks.rend() - t.released; ++b)
        to_cpu ? release_block(*b) : release_cpu_block(*b);
      t.blocks = std::move(dst_table);
      t.num_registered = 0;  // re-registered by mark_computed once the KV is back on the GPU
    }
    seq.swapped = to_cpu;
  }
  (to_cpu ? counters_.swapped_out_blocks : counters_.swapped_in_blocks) += static_cast<int64_t>(mapping.size());
  return mapping;
}

int32_t BlockManager::distinct_blocks(const std::vector<int64_t>& seq_ids) const {
  if (seq_ids.empty()) return 0;
  const Where where = get(seq_ids[0]).swapped ? Where::kSwapped : Where::kResident;
  return distinct_blocks(seq_ids, "distinct_blocks", where);
}

bool BlockManager::can_swap_out(const std::vector<int64_t>& seq_ids) const {
  return distinct_blocks(seq_ids, "swap_out", Where::kResident) <= cpu_free_.size();
}

std::vector<BlockPair> BlockManager::swap_out(const std::vector<int64_t>& seq_ids) {
  if (num_cpu_blocks_ == 0) throw ValueError("swap_out: this BlockManager has no CPU blocks (num_cpu_blocks=0)");
  if (!can_swap_out(seq_ids))
    throw OutOfBlocks(cat("swap_out: not enough free CPU blocks (", cpu_free_.size(), " free)"));
  return move_blocks(seq_ids, /*to_cpu=*/true);
}

AllocStatus BlockManager::can_swap_in(const std::vector<int64_t>& seq_ids, int64_t num_lookahead_slots) const {
  if (num_lookahead_slots < 0 || num_lookahead_slots > kMaxTokensPerAppend)
    throw ValueError(cat("can_swap_in: num_lookahead_slots must be in [0, ", kMaxTokensPerAppend, "], got ",
                         num_lookahead_slots));
  int32_t needed = distinct_blocks(seq_ids, "swap_in", Where::kSwapped);
  for (const int64_t id : seq_ids) {  // room to append that many tokens once back, in every group
    const int64_t len = static_cast<int64_t>(get(id).tokens.size());
    needed += (blocks_for_tokens(len + num_lookahead_slots) - blocks_for_tokens(len)) * num_groups();
  }
  if (needed > num_blocks_ - watermark_blocks_ - pinned_blocks_) return AllocStatus::kNever;
  return gpu_free_.size() - needed >= watermark_blocks_ ? AllocStatus::kOk : AllocStatus::kLater;
}

std::vector<BlockPair> BlockManager::swap_in(const std::vector<int64_t>& seq_ids) {
  const int32_t needed = distinct_blocks(seq_ids, "swap_in", Where::kSwapped);
  if (needed > gpu_free_.size())
    throw OutOfBlocks(cat("swap_in: needs ", needed, " free blocks but only ", gpu_free_.size(),
                          " are free (check can_swap_in first)"));
  return move_blocks(seq_ids, /*to_cpu=*/false);
}

// ---------------------------------------------------------------------------------------------------
// Queries for the model runner

const std::vector<int32_t>& BlockManager::block_table(int64_t seq_id, int32_t group) const {
  return get(seq_id).groups[group_arg(group, "block_table")].blocks;
}

int32_t BlockManager::block_tables(const int64_t* seq_ids, size_t n, const int32_t* max_blocks, int32_t pad,
                                   const std::function<int32_t*(int32_t)>& out, int32_t group) const {
  group_arg(group, "block_tables");
  const std::vector<const Sequence*> seqs = resolve(seq_ids, n, "block_tables", /*unique=*/false);
  size_t longest = 0;
  for (const Sequence* seq : seqs) longest = std::max(longest, seq->groups[group].blocks.size());
  const int32_t width = max_blocks ? *max_blocks : static_cast<int32_t>(longest);
  if (width < static_cast<int32_t>(longest))
    throw ValueError(cat("block_tables: max_blocks=", width, " is shorter than the longest block table (", longest,
                         " blocks)"));
  // A windowed table grows with the context (its released entries hold nothing), so only memory bounds it.
  const int64_t limit = has_windows_ ? std::max<int64_t>(std::max(num_blocks_, num_cpu_blocks_), 1 << 24)
                                     : std::max(num_blocks_, num_cpu_blocks_);
  if (width > limit)
    throw ValueError(cat("block_tables: max_blocks=", width, " is longer than any block table can be (", limit,
                         has_windows_ ? " blocks)" : " blocks in the pool)"));
  int32_t* rows = out(width);
  for (size_t i = 0; i < n; ++i) {
    const GroupTable& t = seqs[i]->groups[group];
    int32_t* row = rows + i * static_cast<size_t>(width);
    std::fill(row, row + t.released, pad);
    std::copy(t.blocks.begin() + t.released, t.blocks.end(), row + t.released);
    std::fill(row + t.blocks.size(), row + width, pad);
  }
  return width;
}

void BlockManager::slot_mapping(int64_t seq_id, int64_t start, int64_t end, int64_t* out, int32_t group) const {
  std::vector<int64_t> slots;
  slot_mappings(&seq_id, &start, &end, 1, &slots, "slot_mapping", group);
  std::copy(slots.begin(), slots.end(), out);
}

void BlockManager::slot_mappings(const int64_t* seq_ids, const int64_t* starts, const int64_t* ends, size_t n,
                                 std::vector<int64_t>* out, const char* what, int32_t group) const {
  slot_mappings(seq_ids, starts, ends, n, [out](size_t total) {
    out->resize(total);
    return out->data();
  }, what, group);
}

void BlockManager::slot_mappings(const int64_t* seq_ids, const int64_t* starts, const int64_t* ends, size_t n,
                                 const std::function<int64_t*(size_t)>& out, const char* what, int32_t group) const {
  group_arg(group, what);
  const std::vector<const Sequence*> seqs = resolve(seq_ids, n, what, /*unique=*/false);
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
// Events and metrics

std::optional<uint64_t> BlockManager::parent_hash(PrefixCache::NodeId node) const {
  const PrefixCache::NodeId parent = cache_.node(node).parent;
  if (PrefixCache::is_root(parent)) return std::nullopt;
  return cache_.hash(parent);
}

void BlockManager::record_event(KvEvent&& event) {
  stored_run_open_ = false;
  event.seq = next_event_seq_++;
  if (events_.size() == max_pending_events_) {
    events_.pop_front();
    ++counters_.events_dropped;
  }
  events_.push_back(std::move(event));
}

void BlockManager::record_stored(PrefixCache::NodeId node, const int64_t* tokens, std::string_view salt) {
  const std::optional<uint64_t> parent = parent_hash(node);
  if (stored_run_open_ && !events_.empty() && parent && events_.back().block_hashes.back() == *parent) {
    KvEvent& run = events_.back();  // the next block of the same chain: one event for both
    run.block_hashes.push_back(cache_.hash(node));
    run.token_ids.insert(run.token_ids.end(), tokens, tokens + block_size_);
    return;
  }
  KvEvent stored;
  stored.kind = KvEvent::Kind::kStored;
  stored.block_hashes.push_back(cache_.hash(node));
  stored.parent_hash = parent;
  stored.token_ids.assign(tokens, tokens + block_size_);
  stored.salt.assign(salt);
  record_event(std::move(stored));
  stored_run_open_ = true;
}

void BlockManager::record_removed(PrefixCache::NodeId node) {
  KvEvent removed;
  removed.kind = KvEvent::Kind::kRemoved;
  removed.block_hashes.push_back(cache_.hash(node));
  record_event(std::move(removed));
}

std::vector<KvEvent> BlockManager::take_events() {
  std::vector<KvEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  stored_run_open_ = false;
  return out;
}

std::vector<std::pair<uint64_t, std::optional<uint64_t>>> BlockManager::cached_blocks() const {
  std::vector<std::pair<uint64_t, std::optional<uint64_t>>> out;
  out.reserve(static_cast<size_t>(cache_.num_registered()));
  for (PrefixCache::NodeId id : cache_.live_nodes())  // group 0's, as the events
    if (cache_.node(id).block != PrefixCache::kNoBlock && cache_.node(id).root == PrefixCache::kRoot)
      out.emplace_back(cache_.hash(id), parent_hash(id));
  return out;
}

BlockManagerStats BlockManager::take_step_stats() {
  BlockManagerStats now = stats();
  BlockManagerStats step = now;  // gauges as they are; counters as differences
  step.queries -= step_start_.queries;
  step.hits -= step_start_.hits;
  step.query_blocks -= step_start_.query_blocks;
  step.hit_blocks -= step_start_.hit_blocks;
  step.hit_blocks_in_use -= step_start_.hit_blocks_in_use;
  step.hit_blocks_revived -= step_start_.hit_blocks_revived;
  step.events_dropped -= step_start_.events_dropped;
  step.evictions -= step_start_.evictions;
  step.cow_copies -= step_start_.cow_copies;
  step.swapped_out_blocks -= step_start_.swapped_out_blocks;
  step.swapped_in_blocks -= step_start_.swapped_in_blocks;
  step_start_ = now;
  return step;
}

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats s = counters_;
  s.free_blocks = gpu_free_.size();
  s.used_blocks = num_blocks_ - s.free_blocks;
  s.cached_blocks = cache_.num_registered();
  s.cached_free_blocks = cached_free_blocks_;
  s.num_seqs = static_cast<int32_t>(seqs_.size());
  for (const auto& kv : seqs_) s.num_swapped_seqs += kv.second.swapped;
  s.free_cpu_blocks = cpu_free_.size();
  s.pinned_blocks = pinned_blocks_;
  return s;
}

void BlockManager::reset_prefix_cache() {
  if (events_enabled_) {
    KvEvent cleared;
    cleared.kind = KvEvent::Kind::kCleared;
    record_event(std::move(cleared));
  }
  for (int32_t b = 0; b < num_blocks_; ++b) block_node_[b] = PrefixCache::kNoNode;
  cache_.clear();
  cached_free_blocks_ = 0;
  for (auto& kv : seqs_)
    for (GroupTable& t : kv.second.groups) t.num_registered = 0;
  // Nothing is cached any more: pins (which keep cached KV) let go, and free blocks go to level 0 in
  // their eviction order, at the default priority.
  std::vector<int64_t> pinned_ids;
  for (const auto& kv : pins_) pinned_ids.push_back(kv.first);
  std::sort(pinned_ids.begin(), pinned_ids.end());  // a defined free-list order, whatever the hashing
  for (int64_t id : pinned_ids) drop_pin(pins_[id]);
  pins_.clear();
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(gpu_free_.size()));
  gpu_free_.for_each([&](int32_t b) { order.push_back(b); });
  for (int32_t b : order) {
    block_retention_[b] = {default_priority_, kForever};
    if (gpu_free_.level(b) != 0) move_to_level(b, 0);
  }
}

// ---------------------------------------------------------------------------------------------------
// Invariants

void BlockManager::check_invariants() const {
  auto fail = [](const std::string& what) { throw InvariantError("BlockManager invariant violated: " + what); };

  // Reference counts equal the number of block-table entries that point at each block.
  std::vector<int32_t> gpu_uses(num_blocks_, 0), cpu_uses(num_cpu_blocks_, 0);
  for (const auto& [id, seq] : seqs_) {
    const int64_t len = static_cast<int64_t>(seq.tokens.size());
    if (seq.num_computed < 0 || seq.num_computed > len)
      fail(cat(seq_str(id), " has num_computed=", seq.num_computed, " outside [0, ", len, "]"));
    if (static_cast<int32_t>(seq.groups.size()) != num_groups())
      fail(cat(seq_str(id), " has ", seq.groups.size(), " group tables for ", num_groups(), " groups"));
    for (int32_t g = 0; g < static_cast<int32_t>(seq.groups.size()); ++g) {
      const GroupTable& t = seq.groups[g];
      const std::string where = cat(seq_str(id), " group ", g);
      // All of its tokens' blocks, or (a prompt prefilled in chunks) at least those of its computed tokens.
      if (static_cast<int64_t>(t.blocks.size()) > blocks_for_tokens(len) ||
          static_cast<int64_t>(t.blocks.size()) < std::max<int64_t>(blocks_for_tokens(seq.num_computed), t.released) ||
          t.blocks.size() != seq.groups[0].blocks.size())
        fail(cat(where, " has ", t.blocks.size(), " blocks for ", len, " tokens (", seq.num_computed, " computed)"));
      if (t.released != released_for(g, seq.num_computed))
        fail(cat(where, " released ", t.released, " blocks but its window releases ",
                 released_for(g, seq.num_computed), " at ", seq.num_computed, " computed tokens"));
      // Held: at most the window's blocks, the block being written and the tokens not yet computed.
      if (windows_[g] != kFullAttention &&
          static_cast<int64_t>(t.blocks.size()) - t.released >
              (windows_[g] + block_size_ - 2) / block_size_ + 1 + blocks_for_tokens(len - seq.num_computed))
        fail(cat(where, " holds ", t.blocks.size() - t.released, " blocks, more than its window needs"));
      if (int64_t(t.num_registered) * block_size_ > seq.num_computed)
        fail(cat(where, " registered ", t.num_registered, " blocks beyond its computed tokens"));
      for (int32_t i = 0; i < t.released; ++i)
        if (t.blocks[i] != kPad) fail(cat(where, " released entry ", i, " holds ", t.blocks[i], " instead of the pad"));
      for (size_t i = static_cast<size_t>(t.released); i < t.blocks.size(); ++i) {
        const int32_t b = t.blocks[i];
        const int32_t limit = seq.swapped ? num_cpu_blocks_ : num_blocks_;
        if (b < 0 || b >= limit) fail(cat(where, " holds out-of-range block ", b));
        ++(seq.swapped ? cpu_uses : gpu_uses)[b];
      }
      // Registered held blocks carry exactly this sequence's content, and their chain its prefix, from
      // the group's root.
      const int32_t last = t.num_registered - 1;
      if (seq.swapped || last < t.released) continue;
      PrefixCache::NodeId node = block_node_[t.blocks[last]];
      for (int32_t i = last; i >= 0; --i) {
        if (node == PrefixCache::kNoNode || PrefixCache::is_root(node))
          fail(cat(where, " block ", i, " is registered but its chain has no content there"));
        if (i >= t.released && block_node_[t.blocks[i]] != node)
          fail(cat(where, " block ", i, " is tagged with content other than its chain's"));
        const auto& n = cache_.node(node);
        const int64_t* block_tokens = seq.tokens.data() + int64_t(i) * block_size_;
        if (!std::equal(block_tokens, block_tokens + block_size_, cache_.tokens(node)) || (i == 0 && n.salt != seq.salt))
          fail(cat(where, " block ", i, " is tagged with content that differs from its tokens or prefix"));
        node = n.parent;
      }
      if (node != PrefixCache::root(g)) fail(cat(where, "'s registered chain does not start at the group's root"));
    }
  }
  // Pins: each holds distinct blocks, counted in pin_count_ and as one reference.
  std::vector<int32_t> pins_of(num_blocks_, 0);
  for (const auto& [id, blocks] : pins_) {
    const std::unordered_set<int32_t> distinct(blocks.begin(), blocks.end());
    if (distinct.size() != blocks.size()) fail(cat("the pin of ", seq_str(id), " holds a block twice"));
    for (int32_t b : blocks) {
      if (b < 0 || b >= num_blocks_) fail(cat("the pin of ", seq_str(id), " holds out-of-range block ", b));
      ++pins_of[b];
      ++gpu_uses[b];
    }
  }
  int32_t pinned = 0;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (pin_count_[b] != pins_of[b]) fail(cat("block ", b, " has pin count ", pin_count_[b], " but ", pins_of[b], " pins"));
    pinned += pins_of[b] > 0;
  }
  if (pinned != pinned_blocks_) fail(cat(pinned, " blocks are pinned but the count says ", pinned_blocks_));
  if (pinned_blocks_ > max_pinned_blocks_) fail(cat(pinned_blocks_, " pinned blocks exceed the cap ", max_pinned_blocks_));
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (gpu_ref_[b] != gpu_uses[b]) fail(cat("block ", b, " has ref_count ", gpu_ref_[b], " but ", gpu_uses[b], " uses"));
    if (gpu_ref_[b] > 0 && gpu_free_.contains(b)) fail(cat("block ", b, " is used and in the free list"));
    if (gpu_ref_[b] == 0 && !gpu_free_.contains(b) && !is_pending_copy_source(b))
      fail(cat("block ", b, " is unused but neither free nor the source of a pending copy"));
  }
  for (int32_t b = 0; b < num_cpu_blocks_; ++b) {
    if (cpu_ref_[b] != cpu_uses[b]) fail(cat("CPU block ", b, " has ref_count ", cpu_ref_[b], " but ", cpu_uses[b], " uses"));
    if ((cpu_ref_[b] == 0) != cpu_free_.contains(b)) fail(cat("CPU block ", b, " free-list membership is wrong"));
  }
  int32_t walked = 0, cached_free = 0;
  gpu_free_.for_each([&](int32_t b) {
    ++walked;
    cached_free += holds_cached_kv(b);
  });
  if (walked != gpu_free_.size()) fail(cat("free list walks ", walked, " blocks but counts ", gpu_free_.size()));
  if (cached_free != cached_free_blocks_)
    fail(cat(cached_free, " free blocks hold cached KV but the count says ", cached_free_blocks_));

  // Retention: each free block sits at its level (1 + priority with cached KV, else 0); one whose
  // priority has a duration has a live expiry entry in the future.
  std::unordered_set<int32_t> live_expiry;
  for (const Expiry& e : expiries_)
    if (e.stamp == block_stamp_[e.block] && gpu_free_.contains(e.block)) {
      if (e.time <= now_) fail(cat("block ", e.block, " should have fallen back to the default priority at ", e.time));
      live_expiry.insert(e.block);
    }
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const BlockRetention& r = block_retention_[b];
    if (r.priority < kMinPriority || r.priority > kMaxPriority || !(r.duration >= 0.0))
      fail(cat("block ", b, " has retention (", r.priority, ", ", r.duration, ")"));
    if (!gpu_free_.contains(b)) continue;
    if (gpu_free_.level(b) != free_level(b))
      fail(cat("free block ", b, " is at level ", gpu_free_.level(b), " instead of ", free_level(b)));
    if (holds_cached_kv(b) && (r.duration != kForever) != (live_expiry.count(b) != 0))
      fail(cat("free block ", b, " has duration ", r.duration, " but ", live_expiry.count(b), " live expiry entries"));
  }

  // Prefix cache: node references, registrations and the hash index agree.
  const std::vector<PrefixCache::NodeId> live = cache_.live_nodes();
  std::unordered_map<PrefixCache::NodeId, int32_t> refs;
  const std::unordered_set<PrefixCache::NodeId> live_set(live.begin(), live.end());
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (block_node_[b] == PrefixCache::kNoNode) continue;
    if (!live_set.count(block_node_[b])) fail(cat("block ", b, " is tagged with a freed prefix-cache node"));
    ++refs[block_node_[b]];
  }
  int32_t registered = 0;
  for (PrefixCache::NodeId id : live) {
    const auto& n = cache_.node(id);
    if (!PrefixCache::is_root(n.parent)) ++refs[n.parent];
    if (n.root > PrefixCache::kRoot || n.root < PrefixCache::root(num_groups() - 1) ||
        n.root != (PrefixCache::is_root(n.parent) ? n.parent : cache_.node(n.parent).root))
      fail(cat("prefix-cache node ", id, " has root ", n.root, " which is not its chain's group root"));
    if (!cache_.indexed(id)) fail(cat("prefix-cache node ", id, " is missing from the hash index"));
    if (n.block != PrefixCache::kNoBlock) {
      ++registered;
      if (block_node_[n.block] != id) fail(cat("prefix-cache node ", id, " names block ", n.block, " which holds other content"));
    }
  }
  for (PrefixCache::NodeId id : live)
    if (cache_.node(id).refs != refs[id])
      fail(cat("prefix-cache node ", id, " has refs ", cache_.node(id).refs, " but ", refs[id], " referrers"));
  if (registered != cache_.num_registered()) fail("prefix-cache registration count is wrong");
}

}  // namespace pagedkv
