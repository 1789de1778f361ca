// Block manager: prefix matching of prompts, registration of computed blocks, pins, the clock, the
// prefix cache's events and its reset (see block_manager.h).
#include <algorithm>

#include "core/block_manager.h"
#include "core/errors.h"

namespace pagedkv {

void BlockManager::match_prefix(Span<int64_t> prompt, std::string_view salt, PrefixMatch* out) const {
  const int64_t* tokens = prompt.data;
  const size_t num_tokens = prompt.size;
  const int32_t num_groups = this->num_groups();
  PrefixMatch& m = *out;  // its vectors keep their capacity from one prompt to the next
  m.num_blocks = 0;
  m.host_blocks = 0;
  m.first_loaded = 0;
  m.held.resize(num_groups);
  m.held_slots.resize(num_groups);
  m.chain.resize(num_groups);
  m.slots.resize(num_groups);
  for (int32_t g = 0; g < num_groups; ++g) {
    m.held[g].clear();
    m.held_slots[g].clear();
    m.chain[g].clear();
    m.slots[g].clear();
  }
  m.keys.clear();
  if (!prefix_caching()) return;
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
  const bool tiered = host_.enabled();
  for (int32_t pass = 0; pass < 2; ++pass)  // full-attention groups first: they bound the walk
    for (int32_t g = 0; g < num_groups && limit > 0; ++g) {
      const bool full = group_windows()[g] == kFullAttention;
      if (full != (pass == 0)) continue;
      PrefixCache::NodeId parent = PrefixCache::root(g);
      std::vector<int32_t>& blocks = chain[g];
      std::vector<int32_t>& slots = m.slots[g];
      bool on_host = false;  // a full group: once a block is loaded, the rest of its hit is loaded too
      for (int32_t i = 0; i < limit; ++i) {
        const uint64_t key = key_of(i);
        if (i + 1 < limit && i + 1 < static_cast<int32_t>(m.keys.size()))
          cache_.prefetch_node(m.keys[i + 1]);  // its bucket was requested a while ago
        const int64_t* block_tokens = tokens + int64_t(i) * block_size_;
        const std::string_view block_salt = i == 0 ? salt : std::string_view();
        const PrefixCache::NodeId node = cache_.find(key, parent, block_tokens, block_salt);
        if (node == PrefixCache::kNoNode) break;
        int32_t block = cache_.node(node).block;
        if (tiered) {
          // A full group's loaded blocks form the tail of its hit, so a failed load leaves the blocks after
          // it fresh. A windowed group takes what the device has and loads the rest: its hit is only the
          // window, and recovering from a failed load replaces whatever shared block follows it anyway.
          const int32_t slot = cache_.node(node).host_slot;
          if (full) {
            on_host = on_host || block == PrefixCache::kNoBlock;
            if (on_host && slot == PrefixCache::kNoBlock) break;
            if (on_host) block = kHostHit;
          } else if (block == PrefixCache::kNoBlock && slot != PrefixCache::kNoBlock) {
            block = kHostHit;
          }
          slots.push_back(block == kHostHit ? slot : PrefixCache::kNoBlock);
        }
        if (block == PrefixCache::kNoBlock && full) break;
        blocks.push_back(block);
        parent = node;
      }
      if (full) limit = std::min(limit, static_cast<int32_t>(blocks.size()));
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
  m.first_loaded = k;
  for (int32_t g = 0; g < num_groups; ++g) {
    const int32_t first = static_cast<int32_t>(std::min<int64_t>(released_for(g, int64_t(k) * block_size_), k));
    m.held[g].assign(chain[g].begin() + first, chain[g].begin() + k);  // k <= chain[g].size()
    if (!tiered) continue;
    m.held_slots[g].assign(m.slots[g].begin() + first, m.slots[g].begin() + k);
    for (int32_t i = first; i < k; ++i)
      if (chain[g][i] == kHostHit) {
        ++m.host_blocks;
        m.first_loaded = std::min(m.first_loaded, i);
      }
  }
}

int32_t BlockManager::tier_walk(Span<int64_t> prompt, std::string_view salt,
                               std::vector<std::vector<PrefixCache::NodeId>>* nodes, int32_t* reach) const {
  const int32_t hit = match_prefix_memo(prompt, salt).num_blocks;
  const int32_t num_groups = this->num_groups();
  nodes->resize(num_groups);
  const int32_t max_hits = blocks_for_tokens(static_cast<int64_t>(prompt.size)) - 1;  // last block: computed
  std::vector<uint64_t> keys;
  // Per group, the chain's nodes and whether some tier holds (or is reading) each one's KV. A full group
  // stops past the hit at the first block no tier holds; a windowed group walks the whole chain.
  std::vector<std::vector<PrefixCache::NodeId>> chain(num_groups);
  std::vector<std::vector<char>> held(num_groups);
  int32_t limit = max_hits;
  for (int32_t pass = 0; pass < 2; ++pass)
    for (int32_t g = 0; g < num_groups; ++g) {
      const bool full = group_windows()[g] == kFullAttention;
      if (full != (pass == 0)) continue;
      PrefixCache::NodeId parent = PrefixCache::root(g);
      for (int32_t i = 0; i < limit; ++i) {
        if (i >= static_cast<int32_t>(keys.size())) extend_keys(prompt.data, salt, std::min(max_hits, i + 8), &keys);
        const std::string_view block_salt = i == 0 ? salt : std::string_view();
        const PrefixCache::NodeId node = cache_.find(keys[i], parent, prompt.data + int64_t(i) * block_size_, block_salt);
        if (node == PrefixCache::kNoNode) break;
        const PrefixCache::Node& n = cache_.node(node);
        const bool some_tier = n.block != PrefixCache::kNoBlock || n.host_slot != PrefixCache::kNoBlock ||
                               n.disk_record != PrefixCache::kNoBlock || n.disk_reading;
        if (full && i >= hit && !some_tier) break;
        chain[g].push_back(node);
        held[g].push_back(some_tier);
        parent = node;
      }
      if (full) limit = std::min(limit, static_cast<int32_t>(chain[g].size()));
    }
  int32_t k = std::max(limit, hit);
  for (; k > hit; --k) {  // the longest extension every group serves once its reads are confirmed
    bool servable = true;
    for (int32_t g = 0; g < num_groups && servable; ++g) {
      servable = k <= static_cast<int32_t>(chain[g].size());
      for (int32_t i = static_cast<int32_t>(released_for(g, int64_t(k) * block_size_)); i < k && servable; ++i)
        servable = held[g][i];
    }
    if (servable) break;
  }
  *reach = k;
  for (int32_t g = 0; g < num_groups; ++g) {
    const int32_t first = static_cast<int32_t>(std::min<int64_t>(released_for(g, int64_t(k) * block_size_), k));
    const int32_t last = std::min<int32_t>(k, static_cast<int32_t>(chain[g].size()));  // k == hit: the hit's chain
    (*nodes)[g].assign(chain[g].begin() + std::min(first, last), chain[g].begin() + last);
  }
  return hit;
}

const BlockManager::PrefixMatch& BlockManager::match_prefix_memo(Span<int64_t> tokens, std::string_view salt) const {
  MatchMemo& m = memo_;
  const bool same = m.cache_version == cache_.version() && m.tokens.size() == tokens.size && m.salt == salt &&
                    std::equal(m.tokens.begin(), m.tokens.end(), tokens.begin());
  if (!same) {
    match_prefix(tokens, salt, &m.match);
    m.tokens.assign(tokens.begin(), tokens.end());
    m.salt.assign(salt);
    m.cache_version = cache_.version();
  }
  return m.match;
}

int32_t BlockManager::from_free_for(const PrefixMatch& m, int32_t num_blocks) const {
  int32_t from_free = 0;
  for (int32_t g = 0; g < num_groups(); ++g) {
    from_free += num_blocks - m.num_blocks;
    for (int32_t b : m.held[g]) from_free += b == kHostHit || gpu_.ref_count(b) == 0;  // in-use hits cost none
  }
  return from_free;
}

// ---------------------------------------------------------------------------------------------------
// Registration

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
  if (!prefix_caching()) return;
  events_.end_run();
  GroupTable& t = seq.groups[group];
  const int32_t full = static_cast<int32_t>(seq.num_computed / block_size_);
  bool parent_is_new = false;  // a node created in this loop has no children yet: skip the lookup
  const bool record = events_.enabled() && group == 0;  // events describe group 0's cache
  const std::vector<uint64_t>& keys = block_keys_upto(seq, full);
  for (int32_t i = std::max(t.num_registered, t.released); i < full; ++i) {
    PrefixCache::NodeId parent = PrefixCache::root(group);
    if (i > 0) parent = i - 1 < t.released ? chain_node(seq, group, i - 1) : gpu_.tag(t.blocks[i - 1]);
    if (parent == PrefixCache::kNoNode) break;  // the prefix lost its content tag (cache reset)
    const int32_t block = t.blocks[i];
    const int64_t* block_tokens = seq.tokens.data() + int64_t(i) * block_size_;
    const std::string_view salt = i == 0 ? std::string_view(seq.salt) : std::string_view();
    const uint64_t h = keys[i];
    const PrefixCache::NodeId node = parent_is_new ? cache_.create(h, parent, block_tokens, salt)
                                                   : cache_.find_or_create(h, parent, block_tokens, salt, &parent_is_new);
    gpu_.set_tag(block, node);
    const int32_t previous = cache_.node(node).block;
    if (record && previous == PrefixCache::kNoBlock)
      events_.stored(cache_.hash(node), parent_hash(node), block_tokens, block_size_, salt);
    // The latest registration wins, unless a pin holds the earlier one: what is pinned keeps hitting.
    if (previous == PrefixCache::kNoBlock || !pins_.holds(previous)) cache_.set_block(node, block);
    if (previous != PrefixCache::kNoBlock && previous != block) gpu_.superseded(previous);
    t.num_registered = i + 1;
  }
}

void BlockManager::release_out_of_window(Sequence& seq) {
  for (int32_t g = 0; g < num_groups(); ++g) {
    GroupTable& t = seq.groups[g];
    const int32_t target = static_cast<int32_t>(released_for(g, seq.num_computed));
    for (; t.released < target; ++t.released) {  // oldest first: the oldest is evicted first
      gpu_.release(t.blocks[t.released]);
      t.blocks[t.released] = kPad;
    }
  }
}

void BlockManager::mark_computed(Span<int64_t> seq_ids, std::optional<Span<int64_t>> num_tokens) {
  if (num_tokens && num_tokens->size != seq_ids.size)
    throw ValueError(cat("mark_computed: ", seq_ids.size, " seq_ids but ", num_tokens->size, " num_tokens"));
  const std::vector<Sequence*> seqs = resolve(seq_ids, "mark_computed", /*unique=*/true);
  check_loaded(seqs, seq_ids, "mark_computed");
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
  if (prefix_caching()) {  // the memory of every block about to be registered is loaded together
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

// ---------------------------------------------------------------------------------------------------
// Retention: the clock and pins

void BlockManager::set_time(double now) {
  gpu_.set_time(now);
  host_.set_time(now);
  disk_.set_time(now);
}

int32_t BlockManager::block_priority(int32_t block) const {
  if (block < 0 || block >= num_blocks()) throw ValueError(cat("block_priority: no GPU block ", block));
  return gpu_.retention(block).priority;
}

int32_t BlockManager::pin(int64_t seq_id) {
  const Sequence& seq = get_resident(seq_id, "pin");
  check_loaded(seq, seq_id, "pin");
  std::vector<int32_t> blocks;
  for (const GroupTable& t : seq.groups)
    for (int32_t i = t.released; i < t.num_registered; ++i)
      if (gpu_.holds_cached_kv(t.blocks[i])) blocks.push_back(t.blocks[i]);
  return pins_.pin(seq_id, std::move(blocks));
}

void BlockManager::unpin(int64_t seq_id) { pins_.unpin(seq_id); }

// ---------------------------------------------------------------------------------------------------
// Events and the cache's contents

std::optional<uint64_t> BlockManager::parent_hash(PrefixCache::NodeId node) const {
  const PrefixCache::NodeId parent = cache_.node(node).parent;
  if (PrefixCache::is_root(parent)) return std::nullopt;
  return cache_.hash(parent);
}

std::vector<KvEvent> BlockManager::take_events() { return events_.take(); }

std::vector<std::pair<uint64_t, std::optional<uint64_t>>> BlockManager::cached_blocks(Medium medium) const {
  std::vector<std::pair<uint64_t, std::optional<uint64_t>>> out;
  out.reserve(static_cast<size_t>(cache_.num_registered(medium)));
  for (PrefixCache::NodeId id : cache_.live_nodes())  // group 0's, as the events
    if (PrefixCache::location(cache_.node(id), medium) != PrefixCache::kNoBlock &&
        cache_.node(id).root == PrefixCache::kRoot)
      out.emplace_back(cache_.hash(id), parent_hash(id));
  return out;
}

void BlockManager::reset_prefix_cache() {
  if (events_.enabled()) events_.cleared();
  disk_.clear();
  host_.clear();
  gpu_.clear_tags();
  cache_.clear();
  for (auto& kv : seqs_)
    for (GroupTable& t : kv.second.groups) t.num_registered = 0;
  // Nothing is cached any more: pins (which keep cached KV) let go, and free blocks go to level 0 in
  // their eviction order, at the default priority.
  pins_.clear();
  gpu_.reset_free_levels();
}

}  // namespace pagedkv
