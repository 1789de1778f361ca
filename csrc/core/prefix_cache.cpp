// Content-keyed prefix cache (see prefix_cache.h).
#include "core/prefix_cache.h"

#include <algorithm>
#include <iterator>
#include <optional>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pagedkv {

PrefixCache::PrefixCache(int32_t block_size, int32_t capacity, HashAlgo algo)
    : block_size_(block_size), algo_(algo) {
  // Live nodes rarely exceed the number of blocks: size the storage now (and touch its pages here, not
  // on the serving path); it grows only past that.
  size_t num_buckets = 16;
  while (num_buckets < 2 * static_cast<size_t>(std::max(capacity, 0))) num_buckets *= 2;
  rehash(num_buckets);
  nodes_.resize(static_cast<size_t>(capacity));
  live_.resize(static_cast<size_t>(capacity), false);
  token_pool_.resize(static_cast<size_t>(capacity) * block_size);
}

bool PrefixCache::matches(NodeId id, NodeId parent, const int64_t* block_tokens, std::string_view salt) const {
  const Node& n = nodes_[id];
  return n.parent == parent && std::equal(block_tokens, block_tokens + block_size_, tokens(id)) && n.salt == salt;
}

uint64_t PrefixCache::key_after(uint64_t parent_key, const int64_t* block_tokens, std::string_view salt) const {
  // The parent's key stands for its whole prefix; the salt of block 0 is folded into the seed.
  uint64_t seed = parent_key;
  if (!salt.empty()) seed ^= XXH3_64bits_withSeed(salt.data(), salt.size(), 0x9E3779B97F4A7C15ull);
  const uint64_t k = XXH3_64bits_withSeed(block_tokens, sizeof(int64_t) * static_cast<size_t>(block_size_), seed);
  return algo_ == HashAlgo::kWeak8 ? (k & 0xFFu) : k;
}

uint64_t PrefixCache::hash(NodeId id) const {
  unhashed_.clear();
  for (NodeId n = id; !is_root(n) && !nodes_[n].hashed; n = nodes_[n].parent) unhashed_.push_back(n);
  for (auto it = unhashed_.rbegin(); it != unhashed_.rend(); ++it) {  // from the oldest ancestor down
    const Node& n = nodes_[*it];
    const std::optional<uint64_t> parent_hash =
        is_root(n.parent) ? std::nullopt : std::optional<uint64_t>(nodes_[n.parent].hash);
    n.hash = hash_block_tokens(tokens(*it), static_cast<size_t>(block_size_), parent_hash, algo_, n.salt);
    n.hashed = true;
  }
  return nodes_[id].hash;
}

PrefixCache::NodeId PrefixCache::find(uint64_t key, NodeId parent, const int64_t* block_tokens,
                                      std::string_view salt) const {
  for (NodeId id = bucket(key); id != kNoNode; id = nodes_[id].next)
    if (nodes_[id].key == key && matches(id, parent, block_tokens, salt)) return id;
  return kNoNode;
}

PrefixCache::NodeId PrefixCache::find_or_create(uint64_t key, NodeId parent, const int64_t* block_tokens,
                                                std::string_view salt, bool* created) {
  const NodeId id = find(key, parent, block_tokens, salt);
  if (created) *created = id == kNoNode;
  return id != kNoNode ? id : create(key, parent, block_tokens, salt);
}

PrefixCache::NodeId PrefixCache::create(uint64_t key, NodeId parent, const int64_t* block_tokens,
                                        std::string_view salt) {
  NodeId id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = num_created_++;
    if (static_cast<size_t>(id) == nodes_.size()) {
      nodes_.emplace_back();
      live_.push_back(false);
      token_pool_.resize(token_pool_.size() + block_size_);
    }
  }
  Node& n = nodes_[id];
  n.key = key;
  n.hashed = false;
  n.parent = parent;
  n.root = PrefixCache::is_root(parent) ? parent : nodes_[parent].root;
  std::copy(block_tokens, block_tokens + block_size_, token_pool_.begin() + int64_t(id) * block_size_);
  n.salt.assign(salt);
  n.block = kNoBlock;
  n.host_slot = kNoBlock;
  n.disk_record = kNoBlock;
  n.offloading = false;
  n.disk_writing = false;
  n.disk_reading = false;
  n.refs = 0;
  live_[id] = true;
  if (!is_root(parent)) add_ref(parent);
  NodeId& head = bucket(key);
  n.next = head;
  head = id;
  if (2 * static_cast<size_t>(++num_live_) > buckets_.size()) rehash(2 * buckets_.size());
  return id;
}

void PrefixCache::prefetch_creates(int32_t count) const {
  const int32_t reused = std::min<int32_t>(count, static_cast<int32_t>(free_ids_.size()));
  for (int32_t k = 0; k < count; ++k) {  // the order create() takes them in: freed ids first
    const NodeId id = k < reused ? free_ids_[free_ids_.size() - 1 - k] : num_created_ + (k - reused);
    if (static_cast<size_t>(id) >= nodes_.size()) break;
    __builtin_prefetch(&nodes_[id], 1);
    const char* slot = reinterpret_cast<const char*>(tokens(id));
    for (size_t b = 0; b < sizeof(int64_t) * static_cast<size_t>(block_size_); b += 64) __builtin_prefetch(slot + b, 1);
  }
}

void PrefixCache::set_location(NodeId id, Medium m, int32_t where) {
  Node& n = nodes_[id];
  int32_t& slot = m == Medium::kGpu ? n.block : m == Medium::kCpu ? n.host_slot : n.disk_record;
  ++version_;
  num_registered_[static_cast<int>(m)] += (where != kNoBlock) - (slot != kNoBlock);
  slot = where;
}

void PrefixCache::release(NodeId id) {
  while (!is_root(id) && --nodes_[id].refs == 0) {
    Node& n = nodes_[id];
    unlink(id);
    --num_live_;
    set_block(id, kNoBlock);
    const NodeId parent = n.parent;
    n.salt.clear();
    live_[id] = false;
    free_ids_.push_back(id);
    ++version_;
    id = parent;
  }
}

void PrefixCache::clear() {
  num_created_ = 0;  // storage is kept for reuse
  free_ids_.clear();
  std::fill(live_.begin(), live_.end(), false);
  std::fill(buckets_.begin(), buckets_.end(), kNoNode);
  num_live_ = 0;
  std::fill(std::begin(num_registered_), std::end(num_registered_), 0);
  ++version_;
}

std::vector<PrefixCache::NodeId> PrefixCache::live_nodes() const {
  std::vector<NodeId> ids;
  for (NodeId i = 0; i < num_created_; ++i)
    if (live_[i]) ids.push_back(i);
  return ids;
}

bool PrefixCache::indexed(NodeId id) const {
  for (NodeId i = bucket(nodes_[id].key); i != kNoNode; i = nodes_[i].next)
    if (i == id) return true;
  return false;
}

void PrefixCache::unlink(NodeId id) {
  NodeId* link = &bucket(nodes_[id].key);
  while (*link != id) link = &nodes_[*link].next;  // id is in its bucket's chain
  *link = nodes_[id].next;
  nodes_[id].next = kNoNode;
}

void PrefixCache::rehash(size_t num_buckets) {
  buckets_.assign(num_buckets, kNoNode);
  for (NodeId id = 0; id < num_created_; ++id) {
    if (!live_[id]) continue;
    NodeId& head = bucket(nodes_[id].key);
    nodes_[id].next = head;
    head = id;
  }
}

}  // namespace pagedkv
