// Content-keyed prefix cache (see prefix_cache.h).
#include "core/prefix_cache.h"

#include <algorithm>

namespace pagedkv {

bool PrefixCache::matches(const Node& n, NodeId parent, const int64_t* tokens, size_t num_tokens,
                          std::string_view salt) const {
  return n.parent == parent && n.tokens.size() == num_tokens &&
         std::equal(n.tokens.begin(), n.tokens.end(), tokens) && n.salt == salt;
}

PrefixCache::NodeId PrefixCache::find(uint64_t hash, NodeId parent, const int64_t* tokens,
                                      size_t num_tokens, std::string_view salt) const {
  auto [lo, hi] = index_.equal_range(hash);
  for (auto it = lo; it != hi; ++it)
    if (matches(nodes_[it->second], parent, tokens, num_tokens, salt)) return it->second;
  return kNone;
}

PrefixCache::NodeId PrefixCache::find_or_create(uint64_t hash, NodeId parent, const int64_t* tokens,
                                                size_t num_tokens, std::string_view salt) {
  NodeId id = find(hash, parent, tokens, num_tokens, salt);
  if (id != kNone) return id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<NodeId>(nodes_.size());
    nodes_.emplace_back();
    live_.push_back(false);
  }
  Node& n = nodes_[id];
  n.hash = hash;
  n.parent = parent;
  n.tokens.assign(tokens, tokens + num_tokens);
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
    n.tokens = {};
    n.salt.clear();
    live_[id] = false;
    free_ids_.push_back(id);
    ++version_;
    id = parent;
  }
}

void PrefixCache::clear() {
  nodes_.clear();
  free_ids_.clear();
  live_.clear();
  index_.clear();
  num_registered_ = 0;
  ++version_;
}

std::vector<PrefixCache::NodeId> PrefixCache::live_nodes() const {
  std::vector<NodeId> ids;
  for (NodeId i = 0; i < static_cast<NodeId>(nodes_.size()); ++i)
    if (live_[i]) ids.push_back(i);
  return ids;
}

bool PrefixCache::indexed(NodeId id) const {
  auto [lo, hi] = index_.equal_range(nodes_[id].hash);
  return std::any_of(lo, hi, [id](const auto& kv) { return kv.second == id; });
}

}  // namespace pagedkv
