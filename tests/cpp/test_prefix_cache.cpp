// PrefixCache on its own: exact lookups through colliding hashes, the intrusive hash index across growth
// past its initial capacity (rehash), release of whole chains, and clear.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <random>
#include <vector>

#include "core/prefix_cache.h"

using namespace pagedkv;
using NodeId = PrefixCache::NodeId;

namespace {

constexpr int32_t kBlock = 4;

std::vector<int64_t> block_tokens(int64_t i) { return {i, i + 1, i * 7, -i}; }

}  // namespace

TEST(PrefixCache, FindsExactContentThroughCollisionsAndGrowth) {
  PrefixCache cache(kBlock, /*capacity=*/8);  // 400 nodes: the index grows and rehashes several times
  std::vector<NodeId> ids;
  for (int64_t i = 0; i < 400; ++i) {
    const auto t = block_tokens(i);
    bool created = false;
    // Only 5 distinct hashes: every bucket chain is long and every lookup must compare contents.
    ids.push_back(cache.find_or_create(uint64_t(i % 5), PrefixCache::kRoot, t.data(), "", &created));
    ASSERT_TRUE(created);
    cache.add_ref(ids.back());
  }
  EXPECT_EQ(cache.num_nodes(), 400);
  for (int64_t i = 0; i < 400; ++i) {
    const auto t = block_tokens(i);
    EXPECT_EQ(cache.find(uint64_t(i % 5), PrefixCache::kRoot, t.data(), ""), ids[i]);
    EXPECT_EQ(cache.find(uint64_t(i % 5), PrefixCache::kRoot, t.data(), "other salt"), PrefixCache::kNoNode);
    EXPECT_EQ(cache.find(uint64_t((i + 1) % 5), PrefixCache::kRoot, t.data(), ""), PrefixCache::kNoNode);
    EXPECT_TRUE(cache.indexed(ids[i]));
  }
  // Release in random order: released nodes disappear from their chains, the others stay findable.
  std::vector<int64_t> order(400);
  for (int64_t i = 0; i < 400; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  for (size_t k = 0; k < order.size(); ++k) {
    cache.release(ids[order[k]]);
    if (k % 37 != 0) continue;
    for (size_t j = 0; j < order.size(); ++j) {
      const int64_t i = order[j];
      const auto t = block_tokens(i);
      EXPECT_EQ(cache.find(uint64_t(i % 5), PrefixCache::kRoot, t.data(), ""), j <= k ? PrefixCache::kNoNode : ids[i]);
    }
  }
  EXPECT_EQ(cache.num_nodes(), 0);
}

TEST(PrefixCache, ChildKeepsParentAliveAndClearForgetsEverything) {
  PrefixCache cache(kBlock, 4);
  const auto a = block_tokens(1), b = block_tokens(2);
  const NodeId parent = cache.create(11, PrefixCache::kRoot, a.data(), "");
  const NodeId child = cache.create(11, parent, b.data(), "");  // same hash as its parent
  cache.add_ref(child);
  EXPECT_EQ(cache.find(11, parent, b.data(), ""), child);
  EXPECT_EQ(cache.find(11, PrefixCache::kRoot, b.data(), ""), PrefixCache::kNoNode);  // other prefix
  cache.release(child);  // the child's last reference also drops the parent's (its only one)
  EXPECT_EQ(cache.num_nodes(), 0);
  EXPECT_EQ(cache.find(11, PrefixCache::kRoot, a.data(), ""), PrefixCache::kNoNode);

  const NodeId again = cache.create(3, PrefixCache::kRoot, a.data(), "s");
  cache.add_ref(again);
  cache.clear();
  EXPECT_EQ(cache.num_nodes(), 0);
  EXPECT_EQ(cache.find(3, PrefixCache::kRoot, a.data(), "s"), PrefixCache::kNoNode);
  const NodeId fresh = cache.create(3, PrefixCache::kRoot, a.data(), "s");
  EXPECT_EQ(cache.find(3, PrefixCache::kRoot, a.data(), "s"), fresh);
}

TEST(PrefixCache, HashesAreChainedBlockHashesComputedOnDemand) {
  std::mt19937_64 rng(std::random_device{}());
  for (HashAlgo algo : {HashAlgo::kXXH64, HashAlgo::kWeak8}) {
    PrefixCache cache(kBlock, 4, algo);
    // A chain of random length under a salted block 0, and a branch off its middle.
    const int n = 2 + static_cast<int>(rng() % 8);
    std::vector<std::vector<int64_t>> blocks;
    for (int i = 0; i < n + 1; ++i) blocks.push_back({int64_t(rng() % 1000), int64_t(rng()), -i, i});
    std::vector<NodeId> chain;
    NodeId parent = PrefixCache::kRoot;
    for (int i = 0; i < n; ++i) {
      const std::string_view salt = i == 0 ? "salt" : "";
      parent = cache.create(cache.key(parent, blocks[i].data(), salt), parent, blocks[i].data(), salt);
      chain.push_back(parent);
    }
    const NodeId branch = cache.create(cache.key(chain[n / 2], blocks[n].data(), ""), chain[n / 2], blocks[n].data(), "");
    // Asked for out of order (the tail first, which hashes its whole prefix on the way).
    const uint64_t tail = cache.hash(chain.back());
    std::optional<uint64_t> expected;
    for (int i = 0; i < n; ++i) {
      expected = hash_block_tokens(blocks[i].data(), kBlock, expected, algo, i == 0 ? "salt" : "");
      EXPECT_EQ(cache.hash(chain[i]), *expected) << "block " << i;
    }
    EXPECT_EQ(tail, *expected);
    const uint64_t at_branch = hash_block_tokens(
        blocks[n].data(), kBlock, cache.hash(chain[n / 2]), algo, "");
    EXPECT_EQ(cache.hash(branch), at_branch);
    // Keys find exactly the content they were made from; the parent and the salt are part of them.
    for (int i = 1; i < n; ++i)
      EXPECT_EQ(cache.find(cache.key(chain[i - 1], blocks[i].data(), ""), chain[i - 1], blocks[i].data(), ""), chain[i]);
    EXPECT_EQ(cache.find(cache.key(PrefixCache::kRoot, blocks[0].data(), ""), PrefixCache::kRoot, blocks[0].data(), ""),
              PrefixCache::kNoNode);
    if (algo == HashAlgo::kWeak8) EXPECT_LT(cache.key(chain[0], blocks[1].data(), ""), 256u);
  }
}
