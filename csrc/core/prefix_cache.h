// The prefix cache: a trie of block contents. A node is one distinct full-block prefix, keyed by
// (parent node, the block's tokens, the salt for block 0); the index key only speeds up the lookup: a
// chained XXH3 over the content (key_after: the block's tokens seeded with the parent's key), so a
// sequence can compute the keys of all its blocks before any node exists and prefetch their buckets. A hit
// requires the block's tokens AND its whole prefix to be identical: a collision costs a miss, never a
// wrong hit. A node remembers where its KV lives in each tier: the device block registered for it (the
// latest registration wins), the host slot and the disk record holding a copy; it stays while any tier (or
// a chain) holds it.
// Its chained block hash (hash(): the manager's hash algorithm, for events) is computed only when asked for.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/hashing.h"
#include "core/medium.h"

namespace pagedkv {

class PrefixCache {
 public:
  using NodeId = int32_t;
  static constexpr NodeId kNoNode = -1;   // no node (an empty bucket, an untagged block)
  static constexpr NodeId kRoot = -2;     // the parent of every block 0 of group 0: not a node
  // Each group of layers has its own root (kRoot - group), so groups never hit each other's blocks.
  static constexpr NodeId root(int32_t group) { return kRoot - group; }
  static constexpr bool is_root(NodeId id) { return id <= kRoot; }
  static constexpr int32_t kNoBlock = -1; // no physical block holds a node's KV

  struct Node {
    uint64_t key = 0;        // index key (key(parent, tokens, salt))
    NodeId parent = kRoot;
    NodeId root = kRoot;     // the root this node's chain starts from (its group)
    std::string salt;        // block 0 only
    int32_t block = kNoBlock;  // physical block registered for this content, or kNoBlock
    int32_t host_slot = kNoBlock;  // host-tier slot holding a copy of the KV, or kNoBlock
    int32_t disk_record = kNoBlock;  // disk-tier record holding a copy of the KV, or kNoBlock
    int32_t refs = 0;        // blocks tagged with this node + child nodes; freed at 0
    NodeId next = kNoNode;     // next node in the same hash bucket
    bool offloading = false;   // a copy to the host tier is pending
    bool disk_writing = false; // a copy from its host slot to the disk tier is pending
    bool disk_reading = false; // a copy from its disk record to a host slot is pending
    mutable bool hashed = false;   // `hash` holds the chained block hash (computed on first use)
    mutable uint64_t hash = 0;
  };

  // Every node holds one full block of `block_size` tokens; `capacity` sizes the hash index; `algo`
  // makes the chained block hashes hash() returns (kWeak8 also keeps 8 bits of the index keys, so
  // that tests meet colliding keys).
  PrefixCache(int32_t block_size, int32_t capacity, HashAlgo algo = HashAlgo::kXXH64);

  // The index key of a block holding `tokens` (one full block; `salt` for block 0) after a block whose key
  // is parent_key (kRootKey for block 0). It depends on the content only, not on node ids nor on the
  // group: nodes of equal content in different groups share a bucket and differ by their parent.
  static constexpr uint64_t kRootKey = 0x243F6A8885A308D3ull;
  uint64_t key_after(uint64_t parent_key, const int64_t* tokens, std::string_view salt) const;
  // The same for a child of `parent` (a node or a root).
  uint64_t key(NodeId parent, const int64_t* tokens, std::string_view salt) const {
    return key_after(is_root(parent) ? kRootKey : nodes_[parent].key, tokens, salt);
  }
  // Starts loading the bucket of `key` into the cache, so that a find / create of it soon after does not
  // wait for memory (the bucket array is touched at random: one cache miss per new block otherwise).
  void prefetch(uint64_t key) const { __builtin_prefetch(&buckets_[key & (buckets_.size() - 1)]); }
  // Starts loading, for writing, the storage of the next `count` nodes create() will hand out (their node
  // and token slots were last touched when the cache was built: cold by the time blocks are registered).
  void prefetch_creates(int32_t count) const;
  // Starts loading the first node in the bucket of `key` and its tokens (call once the bucket is cached).
  void prefetch_node(uint64_t key) const {
    const NodeId id = bucket(key);
    if (id == kNoNode) return;
    __builtin_prefetch(&nodes_[id]);
    __builtin_prefetch(tokens(id));
  }
  // The node with exactly this content (one full block of tokens), or kNoNode. `key` is key(parent,
  // tokens, salt), or any value the node was created with.
  NodeId find(uint64_t key, NodeId parent, const int64_t* tokens, std::string_view salt) const;
  NodeId find_or_create(uint64_t key, NodeId parent, const int64_t* tokens, std::string_view salt,
                        bool* created = nullptr);
  // A new node, without looking for an existing one: only for a parent known to have no such child
  // (e.g. a parent created a moment ago).
  NodeId create(uint64_t key, NodeId parent, const int64_t* tokens, std::string_view salt);
  const int64_t* tokens(NodeId id) const { return token_pool_.data() + int64_t(id) * block_size_; }
  // The chained block hash of the node's prefix: h = H(hash(parent), tokens), as hash_block_tokens
  // with the constructor's algorithm (the salt in block 0). Computed on first use, then kept.
  uint64_t hash(NodeId id) const;

  const Node& node(NodeId id) const { return nodes_[id]; }
  int32_t block_size() const { return block_size_; }
  HashAlgo algo() const { return algo_; }
  void set_block(NodeId id, int32_t block) { set_location(id, Medium::kGpu, block); }
  // Where the node's KV lives on medium m (kGpu: node.block, kCpu: node.host_slot, kDisk: node.disk_record).
  static int32_t location(const Node& n, Medium m) {
    return m == Medium::kGpu ? n.block : m == Medium::kCpu ? n.host_slot : n.disk_record;
  }
  void set_location(NodeId id, Medium m, int32_t where);
  void set_offloading(NodeId id, bool offloading) { nodes_[id].offloading = offloading; }
  void set_disk_writing(NodeId id, bool writing) { nodes_[id].disk_writing = writing; }
  void set_disk_reading(NodeId id, bool reading) { nodes_[id].disk_reading = reading; }
  void add_ref(NodeId id) { ++nodes_[id].refs; }
  void release(NodeId id);  // drops one reference; frees the node (and releases its parent) at 0

  int32_t num_nodes() const { return num_created_ - static_cast<int32_t>(free_ids_.size()); }
  int32_t num_registered(Medium m = Medium::kGpu) const { return num_registered_[static_cast<int>(m)]; }
  uint64_t version() const { return version_; }  // changes whenever a lookup could answer differently
  void clear();

  // Every live node id (for check_invariants).
  std::vector<NodeId> live_nodes() const;
  bool indexed(NodeId id) const;  // the hash index points at this node

 private:
  bool matches(NodeId id, NodeId parent, const int64_t* tokens, std::string_view salt) const;
  NodeId& bucket(uint64_t key) { return buckets_[key & (buckets_.size() - 1)]; }
  NodeId bucket(uint64_t key) const { return buckets_[key & (buckets_.size() - 1)]; }
  void unlink(NodeId id);
  void rehash(size_t num_buckets);

  int32_t block_size_;
  HashAlgo algo_;
  mutable std::vector<NodeId> unhashed_;  // hash()'s walk up to the first hashed ancestor
  std::vector<Node> nodes_;
  std::vector<int64_t> token_pool_;  // node id * block_size: the node's tokens (no allocation per node)
  std::vector<NodeId> free_ids_;
  std::vector<bool> live_;
  NodeId num_created_ = 0;           // ids [0, num_created_) have been handed out
  // Hash index: chained buckets threaded through Node::next (a power-of-two count, at least twice the
  // live nodes), so inserting and erasing never allocate.
  std::vector<NodeId> buckets_;
  int32_t num_live_ = 0;
  int32_t num_registered_[kNumMedia] = {0, 0, 0};
  uint64_t version_ = 0;
};

}  // namespace pagedkv
