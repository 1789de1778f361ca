// Content-keyed prefix cache (see prefix_cache.h).
#include "core/prefix_cache.h"

#include <algorithm>

namespace pagedkv {

PrefixCache::PrefixCache(int32_t block_size, int32_t capacity) : block_size_(block_size) {
  // Live nodes rarely exceed the number of blocks: size the storage now (and touch its pages here, not
  // on the serving path); it grows only past that.
  index_.reserve(static_cast<size_t>(capacity));
  nodes_.resize(static_cast<size_t>(capacity));
  live_.resize(static_cast<size_t>(capacity), false);
  token_pool_.resize(static_cast<size_t>(capacity) * block_size);
}

bool PrefixCache::matches(NodeId id, NodeId parent, const int64_t* block_tokens, std::string_view salt) const {
  const Node& n = nodes_[id];
  return n.parent == parent && std::equal(block_tokens, block_tokens + block_size_, tokens(id)) && n.salt == salt;
}

PrefixCache::NodeId PrefixCache::find(uint64_t hash, NodeId parent, const int64_t* block_tokens,
                                      std::string_view salt) const {
  auto [lo, hi] = index_.equal_range(hash);
  for (auto it = lo; it != hi; ++it)
    if (matches(it->second, parent, block_tokens, salt)) return it->second;
  return kNone;
}

PrefixCache::NodeId PrefixCache::find_or_create(uint64_t hash, NodeId parent, const int64_t* block_tokens,
                                                std::string_view salt, bool* created) {
  const NodeId id = find(hash, parent, block_tokens, salt);
  if (created) *created = id == kNone;
  return id != kNone ? id : create(hash, parent, block_tokens, salt);
}

PrefixCache::NodeId PrefixCache::create(uint64_t hash, NodeId parent, const int64_t* block_tokens,
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
  n.hash = hash;
  n.parent = parent;
  std::copy(block_tokens, block_tokens + block_size_, token_pool_.begin() + int64_t(id) * block_size_);
  n.salt.assign(salt);
  n.block = kNone;
  n.refs = 0;
  live_[id] = true;
  if (parent != kRoot) add_ref(parent);
  index_.emplace(hash, id);
  return id;
}

void PrefixCache::set_block(NodeId id, int32_t block) {
  Node& n = nodes_[id];
  ++version_;
  num_registered_ += (block != kNone) - (n.block != kNone);
  n.block = block;
}

void PrefixCache::release(NodeId id) {
  while (id != kRoot && --nodes_[id].refs == 0) {
    Node& n = nodes_[id];
    auto [lo, hi] = index_.equal_range(n.hash);
    for (auto it = lo; it != hi; ++it)
      if (it->second == id) {
        index_.erase(it);
        break;
      }
    set_block(id, kNone);
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
  index_.clear();
  num_registered_ = 0;
  ++version_;
}

std::vector<PrefixCache::NodeId> PrefixCache::live_nodes() const {
  std::vector<NodeId> ids;
  for (NodeId i = 0; i < num_created_; ++i)
    if (live_[i]) ids.push_back(i);
  return ids;
}

bool PrefixCache::indexed(NodeId id) const {
  auto [lo, hi] = index_.equal_range(nodes_[id].hash);
  return std::any_of(lo, hi, [id](const auto& kv) { return kv.second == id; });
}

}  // namespace pagedkv
