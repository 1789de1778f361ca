// PrefixCache on its own: exact lookups through colliding hashes, the intrusive hash index across growth
// past its initial capacity (rehash), release of whole chains, and clear.
#include <gtest/gtest.h>

#include <algorithm>
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
