// Block manager: construction, sequence lookup, admission and chunked reservation (see block_manager.h
// for the contract). Lifetime and swapping live in block_manager_lifetime.cpp, prefix matching and
// registration in block_manager_prefix.cpp, the runner's tier copies in block_manager_tiers.cpp, decode in
// block_manager_decode.cpp, the runner's queries and statistics in block_manager_queries.cpp, invariants in
// block_manager_invariants.cpp.
#include "core/block_manager.h"

#include <algorithm>
#include <limits>

#include "core/errors.h"

namespace pagedkv {

BlockManagerConfig BlockManager::validated(BlockManagerConfig c) {
  if (c.max_pending_events < 1) throw ValueError(cat("max_pending_events must be >= 1, got ", c.max_pending_events));
  if (c.num_blocks <= 0) throw ValueError(cat("num_blocks must be positive, got ", c.num_blocks));
  if (c.block_size <= 0) throw ValueError(cat("block_size must be positive, got ", c.block_size));
  if (c.num_cpu_blocks < 0) throw ValueError(cat("num_cpu_blocks must be >= 0, got ", c.num_cpu_blocks));
  if (c.num_host_blocks < 0) throw ValueError(cat("num_host_blocks must be >= 0, got ", c.num_host_blocks));
  if (c.host_offload_min_priority < kMinPriority || c.host_offload_min_priority > kMaxPriority)
    throw ValueError(cat("host_offload_min_priority must be in [", kMinPriority, ", ", kMaxPriority, "], got ",
                         c.host_offload_min_priority));
  if (c.num_disk_blocks < 0) throw ValueError(cat("num_disk_blocks must be >= 0, got ", c.num_disk_blocks));
  if (c.num_disk_blocks > 0 && c.num_host_blocks == 0)
    throw ValueError(cat("num_disk_blocks=", c.num_disk_blocks, " needs a host tier (num_host_blocks > 0)"));
  if (!(c.watermark >= 0.0 && c.watermark < 1.0))
    throw ValueError(cat("watermark must be in [0, 1), got ", c.watermark));
  for (const auto& [name, p] : {std::pair{"default_priority", c.default_priority}, {"decode_priority", c.decode_priority}})
    if (p < kMinPriority || p > kMaxPriority)
      throw ValueError(cat(name, " must be in [", kMinPriority, ", ", kMaxPriority, "], got ", p));
  if (!(c.max_pinned_fraction >= 0.0 && c.max_pinned_fraction < 1.0))
    throw ValueError(cat("max_pinned_fraction must be in [0, 1), got ", c.max_pinned_fraction));
  const std::vector<int64_t>& windows = c.group_windows;
  if (windows.empty() || windows.size() > static_cast<size_t>(kMaxGroups))
    throw ValueError(cat("group_windows must have 1 to ", kMaxGroups, " groups, got ", windows.size()));
  for (size_t g = 0; g < windows.size(); ++g)
    if (windows[g] < 0)
      throw ValueError(cat("group_windows[", g, "] must be a window of >= 1 tokens or full attention, got ", windows[g]));
  return c;
}

BlockManager::BlockManager(BlockManagerConfig config)
    : config_(validated(std::move(config))),
      block_size_(config_.block_size),
      watermark_blocks_(static_cast<int32_t>(config_.watermark * config_.num_blocks)),
      cache_(config_.block_size, config_.num_blocks, config_.hash_algo),
      events_(config_.enable_events, static_cast<size_t>(config_.max_pending_events), &counters_.events_dropped),
      gpu_(config_.num_blocks, Medium::kGpu, config_.default_priority, &cache_, &events_, &copies_,
           &counters_.evictions),
      cpu_(config_.num_cpu_blocks),
      pins_(&gpu_, config_.max_pinned_fraction),
      host_(config_.num_host_blocks, config_.host_offload_min_priority, config_.default_priority, &cache_, &events_,
            &gpu_, &counters_),
      disk_(config_.num_disk_blocks, config_.default_priority, &cache_, &events_, &host_, &counters_) {
  for (int64_t w : config_.group_windows) has_windows_ |= w != kFullAttention;
  if (!prefix_caching()) host_.disable();
  if (!host_.enabled()) disk_.disable();  // it writes back host slots and reads into them
  if (disk_.enabled()) host_.set_lower_tier(&disk_);
  seqs_.reserve(static_cast<size_t>(std::min(config_.num_blocks, 1 << 16)));
}

namespace {
BlockManagerConfig sized(int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks) {
  BlockManagerConfig config;
  config.num_blocks = num_blocks;
  config.block_size = block_size;
  config.num_cpu_blocks = num_cpu_blocks;
  return config;
}
}  // namespace

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks)
    : BlockManager(sized(num_blocks, block_size, num_cpu_blocks)) {}

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

void BlockManager::check_loaded(const Sequence& seq, int64_t seq_id, const char* what) const {
  if (seq.readmit)
    throw ValueError(cat(what, ": ", seq_str(seq_id), " lost its cached prefix to a failed load and must be "
                         "re-admitted; free() it and allocate it again"));
  if (seq.loading > 0)
    throw ValueError(cat(what, ": ", seq_str(seq_id), " has ", seq.loading,
                         " blocks loading from the host tier; complete_loads() first"));
}

void BlockManager::check_distinct(Span<int64_t> seq_ids, const char* what) {
  const size_t n = seq_ids.size;
  const auto twice = [&](int64_t id) { throw ValueError(cat(what, ": ", seq_str(id), " appears twice in seq_ids")); };
  if (n <= 16) {  // a decode batch of a few sequences: no allocation
    for (size_t i = 1; i < n; ++i)
      for (size_t j = 0; j < i; ++j)
        if (seq_ids[i] == seq_ids[j]) twice(seq_ids[i]);
    return;
  }
  std::vector<int64_t> sorted(seq_ids.begin(), seq_ids.end());
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) twice(*dup);
}

// Both resolve()s: Map is seqs_, const or not, so the result points at const or mutable sequences.
template <typename Map>
auto BlockManager::resolve_in(Map& seqs, Span<int64_t> seq_ids, const char* what, bool unique, Where where)
    -> std::vector<decltype(&seqs.begin()->second)> {
  if (unique) check_distinct(seq_ids, what);
  std::vector<decltype(&seqs.begin()->second)> out;
  out.reserve(seq_ids.size);
  for (size_t i = 0; i < seq_ids.size; ++i) {
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

std::vector<BlockManager::Sequence*> BlockManager::resolve(Span<int64_t> seq_ids, const char* what, bool unique,
                                                           Where where) {
  return resolve_in(seqs_, seq_ids, what, unique, where);
}

std::vector<const BlockManager::Sequence*> BlockManager::resolve(Span<int64_t> seq_ids, const char* what, bool unique,
                                                                 Where where) const {
  return resolve_in(seqs_, seq_ids, what, unique, where);
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
  const int64_t blocks = ceil_div(num_tokens, block_size_);
  for (int32_t g = 0; g < num_groups(); ++g) held += blocks - released_for(g, num_computed);
  return held;
}

int32_t BlockManager::num_released_blocks(int64_t seq_id, int32_t group) const {
  return get(seq_id).groups[group_arg(group, "num_released_blocks")].released;
}

BlockRetention BlockManager::retention_of(const Sequence& seq, int32_t index) const {
  const int64_t first = int64_t(index) * block_size_, last = first + block_size_;
  BlockRetention r{-1, 0.0};
  for (const RetentionRange& range : seq.retention)
    if (std::max(range.start, first) < std::min(range.end, last) &&  // an empty range overlaps nothing
        stronger({static_cast<int32_t>(range.priority), range.duration}, r))
      r = {static_cast<int32_t>(range.priority), range.duration};
  if (r.priority < 0) r = {first < seq.prompt_len ? config_.default_priority : config_.decode_priority, kForever};
  return r;
}

void BlockManager::grow_table(const Sequence& seq, GroupTable& t, size_t size) {
  while (t.blocks.size() < size) t.blocks.push_back(gpu_.take_fresh(retention_of(seq, static_cast<int32_t>(t.blocks.size()))));
}

// ---------------------------------------------------------------------------------------------------
// Admission

int64_t BlockManager::max_blocks_held(int64_t num_tokens, int64_t num_new_tokens) const {
  if (num_new_tokens == kWholePrompt) return blocks_held(num_tokens, 0);
  const int64_t blocks = ceil_div(num_tokens, block_size_);
  const int64_t chunk = ceil_div(num_new_tokens, block_size_);
  int64_t held = 0;
  for (int32_t g = 0; g < num_groups(); ++g)  // a windowed group: the window's blocks, the chunk's, the one written
    held += group_windows()[g] == kFullAttention ? blocks : std::min(blocks, window_blocks(g, chunk));
  return held;
}

namespace {
void check_num_new_tokens(int64_t num_new_tokens, const char* what) {
  if (num_new_tokens != BlockManager::kWholePrompt && num_new_tokens < 1)
    throw ValueError(cat(what, ": num_new_tokens must be >= 1 (or None: the whole prompt), got ", num_new_tokens));
}
}  // namespace

AllocStatus BlockManager::can_allocate(Span<int64_t> tokens, std::string_view salt, int64_t num_new_tokens) const {
  if (tokens.empty()) throw ValueError("can_allocate: token_ids is empty");
  check_num_new_tokens(num_new_tokens, "can_allocate");
  const int64_t len = static_cast<int64_t>(tokens.size);
  if (never_fits(len, num_new_tokens)) return AllocStatus::kNever;
  return fits(len, match_prefix_memo(tokens, salt), num_new_tokens);
}

bool BlockManager::never_fits(int64_t num_tokens, int64_t num_new_tokens) const {
  return max_blocks_held(num_tokens, num_new_tokens) > num_blocks() - watermark_blocks_;
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
  if (pins_.num_pinned() > 0) {  // pinned blocks never come free: what does not fit beside them waits forever
    int32_t pinned_hits = 0;
    for (const auto& held : m.held)
      for (int32_t b : held) pinned_hits += b >= 0 && pins_.holds(b);
    if (needed - pinned_hits > num_blocks() - watermark_blocks_ - pins_.num_pinned()) return AllocStatus::kNever;
  }
  return gpu_.num_free() - from_free >= watermark_blocks_ ? AllocStatus::kOk : AllocStatus::kLater;
}

int64_t BlockManager::allocate(int64_t seq_id, Span<int64_t> tokens, std::string_view salt,
                               const std::vector<RetentionRange>& retention, int64_t num_new_tokens) {
  if (seqs_.count(seq_id)) throw ValueError(cat("allocate: ", seq_str(seq_id), " already exists"));
  if (tokens.empty()) throw ValueError("allocate: token_ids is empty");
  check_num_new_tokens(num_new_tokens, "allocate");
  validate_retention(retention, "allocate");
  const PrefixMatch& m = match_prefix_memo(tokens, salt);  // admit() does not look up again
  const int32_t from_free =
      from_free_for(m, blocks_for_tokens(first_chunk_end(static_cast<int64_t>(tokens.size), m, num_new_tokens)));
  if (from_free > gpu_.num_free())
    throw OutOfBlocks(cat("allocate: ", seq_str(seq_id), " needs ", from_free, " free blocks but only ",
                          gpu_.num_free(), " are free (check can_allocate first)"));
  return admit(seq_id, tokens, salt, retention, m, num_new_tokens);
}

TierHits BlockManager::lookup(Span<int64_t> tokens, std::string_view salt) const {
  if (tokens.empty()) throw ValueError("lookup: token_ids is empty");
  const PrefixMatch& m = match_prefix_memo(tokens, salt);
  TierHits hits{m.first_loaded, m.num_blocks - m.first_loaded, 0};
  if (disk_.enabled()) {
    std::vector<std::vector<PrefixCache::NodeId>> nodes;
    int32_t reach = 0;
    const int32_t hit = tier_walk(tokens, salt, &nodes, &reach);
    hits.disk_blocks = reach - hit;
  }
  return hits;
}

int64_t BlockManager::admit(int64_t seq_id, Span<int64_t> tokens, std::string_view salt,
                            const std::vector<RetentionRange>& retention, const PrefixMatch& m,
                            int64_t num_new_tokens) {
  const int64_t num_tokens = static_cast<int64_t>(tokens.size);
  // Blocks allocated now: the whole prompt's, or those of the cached tokens and the first chunk.
  const int32_t total = blocks_for_tokens(num_tokens);
  const int32_t needed = blocks_for_tokens(first_chunk_end(num_tokens, m, num_new_tokens));
  const int32_t from_free = from_free_for(m, needed);
  Sequence seq;
  seq.tokens.assign(tokens.begin(), tokens.end());
  seq.block_keys = m.keys;
  seq.salt.assign(salt);
  seq.prompt_len = num_tokens;
  seq.retention = retention;
  seq.num_computed = int64_t(m.num_blocks) * block_size_;
  seq.serial = next_serial_++;
  seq.groups.resize(num_groups());
  int32_t held_hits = 0;
  // Every group's hits first (and the host slots of loaded hits): a fresh block taken for one group must
  // not evict another group's hit.
  for (int32_t g = 0; g < num_groups(); ++g) {
    GroupTable& t = seq.groups[g];
    t.released = static_cast<int32_t>(released_for(g, seq.num_computed));
    t.num_registered = m.num_blocks;
    t.blocks.reserve(needed);
    t.blocks.assign(static_cast<size_t>(t.released), kPad);
    for (size_t j = 0; j < m.held[g].size(); ++j) {
      const int32_t b = m.held[g][j];
      if (b == kHostHit) {  // registered only once loaded
        host_.hold_slot(m.held_slots[g][j]);
        t.num_registered = std::min(t.num_registered, static_cast<int32_t>(t.blocks.size()));
        t.blocks.push_back(kHostHit);
        continue;
      }
      gpu_.acquire(b);
      gpu_.keep_stronger_retention(b, retention_of(seq, static_cast<int32_t>(t.blocks.size())));
      t.blocks.push_back(b);
    }
    held_hits += static_cast<int32_t>(m.held[g].size());
  }
  held_hits -= m.host_blocks;
  const int32_t fresh = (needed - m.num_blocks) * num_groups();
  const int32_t revived = from_free - fresh - m.host_blocks;
  counters_.queries += num_tokens;
  counters_.hits += seq.num_computed;
  counters_.query_blocks += int64_t(total) * num_groups();
  counters_.hit_blocks += int64_t(m.num_blocks) * num_groups();
  counters_.hit_blocks_in_use += held_hits - revived;  // hits on blocks another sequence holds
  counters_.hit_blocks_revived += revived;
  counters_.host_hit_blocks += m.host_blocks;
  // From here on m may be stale: taking free blocks changes the prefix cache.
  allow_write_backs(fresh + m.host_blocks);  // the hits taken back from the free list are out of it already
  if (m.host_blocks > 0) {
    for (int32_t g = 0; g < num_groups(); ++g) {
      GroupTable& t = seq.groups[g];
      for (int32_t i = t.released; i < m.num_blocks; ++i) {
        if (t.blocks[i] != kHostHit) continue;
        t.blocks[i] = gpu_.take_fresh(retention_of(seq, i));
        host_.queue_load(m.held_slots[g][i - t.released], t.blocks[i], seq.serial, i);
        ++seq.loading;
      }
    }
    loading_seqs_.emplace(seq.serial, seq_id);
  }
  for (GroupTable& t : seq.groups) grow_table(seq, t, static_cast<size_t>(needed));
  end_write_backs();
  const int64_t cached = seq.num_computed;
  seqs_.emplace(seq_id, std::move(seq));
  return cached;
}

std::vector<int64_t> BlockManager::allocate_batch(Span<int64_t> seq_ids, Span<Span<int64_t>> prompts,
                                                  const std::vector<std::string>& salts,
                                                  const std::vector<std::vector<RetentionRange>>& retentions) {
  const size_t n = seq_ids.size;
  if (prompts.size != n) throw ValueError(cat("allocate_batch: ", n, " seq_ids but ", prompts.size, " prompts"));
  if (!salts.empty() && salts.size() != n)
    throw ValueError(cat("allocate_batch: ", salts.size(), " cache_salts for ", n, " prompts"));
  if (!retentions.empty() && retentions.size() != n)
    throw ValueError(cat("allocate_batch: ", retentions.size(), " retentions for ", n, " prompts"));
  for (const auto& r : retentions) validate_retention(r, "allocate_batch");
  check_distinct(seq_ids, "allocate_batch");
  for (size_t i = 0; i < n; ++i) {
    if (seqs_.count(seq_ids[i])) throw ValueError(cat("allocate_batch: ", seq_str(seq_ids[i]), " already exists"));
    if (prompts[i].size == 0) throw ValueError(cat("allocate_batch: prompts[", i, "] is empty"));
  }
  std::vector<int64_t> cached;
  cached.reserve(n);
  PrefixMatch& m = batch_match_;  // one lookup per prompt, shared by the fit check and the admission
  static const std::vector<RetentionRange> kNoRetention;
  for (size_t i = 0; i < n; ++i) {
    const std::string_view salt = salts.empty() ? std::string_view() : std::string_view(salts[i]);
    const int64_t len = static_cast<int64_t>(prompts[i].size);
    if (never_fits(len, kWholePrompt)) break;
    match_prefix(prompts[i], salt, &m);
    if (fits(len, m, kWholePrompt) != AllocStatus::kOk) break;
    cached.push_back(admit(seq_ids[i], prompts[i], salt, retentions.empty() ? kNoRetention : retentions[i], m,
                           kWholePrompt));
  }
  return cached;
}

// ---------------------------------------------------------------------------------------------------
// Chunked prefill

int32_t BlockManager::blocks_to_reserve(const std::vector<const Sequence*>& seqs, Span<int64_t> seq_ids,
                                        Span<int64_t> num_tokens) const {
  if (num_tokens.size != seqs.size())
    throw ValueError(cat("reserve: ", seqs.size(), " seq_ids but ", num_tokens.size, " num_tokens"));
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

bool BlockManager::can_reserve(Span<int64_t> seq_ids, Span<int64_t> num_tokens) const {
  const std::vector<const Sequence*> seqs = resolve(seq_ids, "reserve", /*unique=*/true);
  for (size_t i = 0; i < seqs.size() && num_readmit_ > 0; ++i)
    if (seqs[i]->readmit) check_loaded(*seqs[i], seq_ids[i], "reserve");
  return blocks_to_reserve(seqs, seq_ids, num_tokens) <= gpu_.num_free();
}

void BlockManager::reserve(Span<int64_t> seq_ids, Span<int64_t> num_tokens) {
  const std::vector<Sequence*> seqs = resolve(seq_ids, "reserve", /*unique=*/true);
  for (size_t i = 0; i < seqs.size() && num_readmit_ > 0; ++i)
    if (seqs[i]->readmit) check_loaded(*seqs[i], seq_ids[i], "reserve");
  const int32_t needed =
      blocks_to_reserve(std::vector<const Sequence*>(seqs.begin(), seqs.end()), seq_ids, num_tokens);
  if (needed > gpu_.num_free())
    throw OutOfBlocks(cat("reserve: needs ", needed, " free blocks but only ", gpu_.num_free(),
                          " are free (check can_reserve first)"));
  allow_write_backs(needed);
  for (size_t i = 0; i < seqs.size(); ++i)
    for (GroupTable& t : seqs[i]->groups) grow_table(*seqs[i], t, static_cast<size_t>(blocks_for_tokens(num_tokens[i])));
  end_write_backs();
}

int64_t BlockManager::num_allocated_tokens(int64_t seq_id) const { return allocated_tokens(get(seq_id)); }

void BlockManager::check_complete(const Sequence& seq, int64_t seq_id, const char* what) const {
  if (allocated_tokens(seq) < static_cast<int64_t>(seq.tokens.size()))
    throw ValueError(cat(what, ": ", seq_str(seq_id), " has blocks for ", allocated_tokens(seq), " of its ",
                         seq.tokens.size(), " tokens; reserve() the rest of its prompt first"));
}

}  // namespace pagedkv
