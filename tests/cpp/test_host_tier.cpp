// The prefix cache's host tier: offloads (clean ahead and write-back on reuse), loads on a host hit, failed
// copies, events per medium, and a randomized run whose KV oracle checks that every computed token of
// every sequence holds its own KV through demotion, promotion and failures.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "core/block_manager.h"
#include "core/errors.h"

using namespace pagedkv;

namespace {

std::vector<int64_t> tokens_from(int64_t n, int64_t start) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

BlockManagerConfig tiered(int32_t num_blocks, int32_t block_size, int32_t num_host_blocks) {
  BlockManagerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.num_host_blocks = num_host_blocks;
  return c;
}

// Allocates, computes and frees a prompt: its full blocks stay cached in the device free list.
void cache_prompt(BlockManager& bm, int64_t id, const std::vector<int64_t>& t) {
  bm.allocate(id, t);
  bm.mark_computed({id});
  bm.free(id);
}

// Every outcome ok (n of them) or all failed.
std::vector<bool> all(size_t n, bool ok = true) { return std::vector<bool>(n, ok); }

}  // namespace

TEST(HostTier, OffByDefaultOnForWindowsAndHybridGroups) {
  BlockManagerConfig c = tiered(8, 4, 0);
  EXPECT_FALSE(BlockManager(c).host_tier_enabled());
  c.num_host_blocks = 4;
  EXPECT_TRUE(BlockManager(c).host_tier_enabled());
  c.group_windows = {BlockManager::kFullAttention, 8};
  EXPECT_TRUE(BlockManager(c).host_tier_enabled());
  c.group_windows = {8};
  EXPECT_TRUE(BlockManager(c).host_tier_enabled());
  c.enable_prefix_caching = false;
  BlockManager uncached(c);
  EXPECT_FALSE(uncached.host_tier_enabled());
  EXPECT_EQ(uncached.plan_offloads(4), 0);
  c = tiered(8, 4, -1);
  EXPECT_THROW(BlockManager{c}, ValueError);
  c = tiered(8, 4, 4);
  c.host_offload_min_priority = 101;
  EXPECT_THROW(BlockManager{c}, ValueError);
}

TEST(HostTier, CleanAheadOffloadsThenAHostHitLoads) {
  BlockManager bm(tiered(4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);  // 3 full blocks + 1 token
  cache_prompt(bm, 1, a);
  EXPECT_EQ(bm.plan_offloads(8), 3);
  EXPECT_EQ(bm.gpu_pool().num_free(), 1) << "a device block with a pending offload is not free";
  const std::vector<BlockPair> offloads = bm.take_offloads();
  ASSERT_EQ(offloads.size(), 3u);
  bm.check_invariants();
  bm.complete_offloads(all(3));
  EXPECT_EQ(bm.stats().cached_host_blocks, 3);
  EXPECT_EQ(bm.gpu_pool().num_free(), 4);
  EXPECT_EQ(bm.plan_offloads(8), 0) << "clean blocks are not offloaded twice";
  bm.check_invariants();

  cache_prompt(bm, 2, tokens_from(16, 100));  // evicts every device copy of a
  EXPECT_EQ(bm.stats().cached_host_blocks, 3);
  const TierHits hits = bm.lookup(a);
  EXPECT_EQ(hits.device_blocks, 0);
  EXPECT_EQ(hits.host_blocks, 3);
  EXPECT_EQ(bm.allocate(3, a), 12) << "loaded blocks count as computed from allocate on";
  EXPECT_EQ(bm.num_loading_blocks(3), 3);
  EXPECT_THROW(bm.mark_computed({3}), ValueError);
  const std::vector<BlockPair> loads = bm.take_loads();
  ASSERT_EQ(loads.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(loads[i].second, bm.block_table(3)[i]);
  bm.check_invariants();
  bm.complete_loads(all(3));
  EXPECT_EQ(bm.num_loading_blocks(3), 0);
  EXPECT_EQ(bm.num_computed_tokens(3), 12);
  EXPECT_EQ(bm.stats().loaded_blocks, 3);
  bm.check_invariants();
  bm.mark_computed({3});
  // The loaded blocks are device hits now.
  EXPECT_EQ(bm.lookup(a).host_blocks, 0);
  EXPECT_EQ(bm.lookup(a).device_blocks, 3);
}

TEST(HostTier, CleanAheadLooksOnlyAtTheBlocksEvictedNext) {
  BlockManager bm(tiered(8, 4, 8));
  cache_prompt(bm, 1, tokens_from(9, 0));
  EXPECT_EQ(bm.plan_offloads(8), 2);
  bm.take_offloads();
  bm.complete_offloads(all(2));  // clean, and still the first cached blocks to be evicted
  cache_prompt(bm, 2, tokens_from(9, 100));
  EXPECT_EQ(bm.plan_offloads(2), 0) << "the two blocks evicted next are clean";
  EXPECT_EQ(bm.plan_offloads(4), 2);
  bm.check_invariants();
}

TEST(HostTier, LoadsReadTheSlotsTheOffloadsWrote) {
  BlockManager bm(tiered(4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);
  cache_prompt(bm, 1, a);
  bm.plan_offloads(8);
  std::map<int32_t, int32_t> slot_of_block;
  for (const auto& [block, slot] : bm.take_offloads()) slot_of_block[block] = slot;
  bm.complete_offloads(all(slot_of_block.size()));
  std::vector<int32_t> slots;
  bm.allocate(2, a);  // device hits: nothing to load
  EXPECT_TRUE(bm.take_loads().empty());
  for (int i = 0; i < 3; ++i) slots.push_back(slot_of_block.at(bm.block_table(2)[i]));
  bm.free(2);
  cache_prompt(bm, 3, tokens_from(16, 100));
  bm.allocate(4, a);
  const std::vector<BlockPair> loads = bm.take_loads();
  ASSERT_EQ(loads.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(loads[i].first, slots[i]) << "block " << i;
  bm.complete_loads(all(3));
  bm.check_invariants();
}

TEST(HostTier, FailedOffloadLeavesNoHostEntry) {
  BlockManager bm(tiered(4, 4, 8));
  cache_prompt(bm, 1, tokens_from(13, 0));
  bm.plan_offloads(8);
  EXPECT_THROW(bm.complete_offloads(all(3)), ValueError) << "nothing taken yet";
  bm.take_offloads();
  EXPECT_THROW(bm.complete_offloads(all(2)), ValueError);
  bm.complete_offloads({true, false, true});
  EXPECT_EQ(bm.stats().cached_host_blocks, 2);
  EXPECT_EQ(bm.stats().offload_failures, 1);
  bm.check_invariants();
  cache_prompt(bm, 2, tokens_from(16, 100));
  // Block 1 failed: the host hit stops before it.
  EXPECT_EQ(bm.lookup(tokens_from(13, 0)).host_blocks, 1);
  EXPECT_EQ(bm.lookup(tokens_from(13, 0)).device_blocks, 0);
}

TEST(HostTier, FailedLoadKeepsOnlyThePrefixBeforeIt) {
  BlockManager bm(tiered(4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);
  cache_prompt(bm, 1, a);
  bm.plan_offloads(8);
  bm.take_offloads();
  bm.complete_offloads(all(3));
  cache_prompt(bm, 2, tokens_from(16, 100));
  EXPECT_EQ(bm.allocate(3, a), 12);
  bm.take_loads();
  bm.complete_loads({true, false, true});
  EXPECT_EQ(bm.num_computed_tokens(3), 4) << "tokens after the failed block are recomputed";
  EXPECT_EQ(bm.stats().load_failures, 1);
  bm.check_invariants();
  bm.mark_computed({3});
  EXPECT_EQ(bm.num_computed_tokens(3), 13);
  bm.check_invariants();
}

TEST(HostTier, FreeWhileLoadingHoldsTheBlocksUntilConfirmed) {
  BlockManager bm(tiered(4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);
  cache_prompt(bm, 1, a);
  bm.plan_offloads(8);
  bm.take_offloads();
  bm.complete_offloads(all(3));
  cache_prompt(bm, 2, tokens_from(16, 100));
  bm.allocate(3, a);
  const std::vector<BlockPair> loads = bm.take_loads();
  bm.free(3);
  EXPECT_EQ(bm.gpu_pool().num_free(), 1) << "blocks being written by a load are not free";
  bm.allocate(3, tokens_from(3, 500));  // the id again: the old loads are not its
  bm.check_invariants();
  bm.complete_loads(all(3));
  EXPECT_EQ(bm.num_loading_blocks(3), 0);
  EXPECT_EQ(bm.num_computed_tokens(3), 0);
  bm.check_invariants();
}

TEST(HostTier, WriteBackOnReuseWhenFreeBlocksAreSpare) {
  BlockManager bm(tiered(8, 4, 8));
  cache_prompt(bm, 1, tokens_from(9, 0));  // 2 cached blocks, freed tail first
  // 7 blocks from 8 free: 6 without content, then the coldest cached one; one block is spare, so the
  // cached block about to be reused is written back first and the next one is taken instead.
  bm.allocate(2, tokens_from(28, 100));
  const std::vector<BlockPair> offloads = bm.take_offloads();
  ASSERT_EQ(offloads.size(), 1u);
  const std::vector<int32_t>& table = bm.block_table(2);
  EXPECT_EQ(std::count(table.begin(), table.end(), offloads[0].first), 0) << "handed out with a pending offload";
  bm.check_invariants();
  bm.complete_offloads(all(1));
  EXPECT_EQ(bm.stats().cached_host_blocks, 1);
  bm.check_invariants();
}

TEST(HostTier, BelowTheMinimumPriorityIsDroppedNotOffloaded) {
  BlockManagerConfig c = tiered(8, 4, 8);
  c.host_offload_min_priority = 50;
  BlockManager bm(c);
  bm.allocate(1, tokens_from(13, 0), {}, {{0, 4, 80}});  // block 0 at 80, the others at the default 35
  bm.mark_computed({1});
  bm.free(1);
  EXPECT_EQ(bm.plan_offloads(8), 1);
  const std::vector<BlockPair> offloads = bm.take_offloads();
  EXPECT_EQ(bm.block_priority(offloads[0].first), 80);
  bm.complete_offloads(all(1));
  EXPECT_EQ(bm.plan_offloads(8), 0);
  bm.check_invariants();
}

TEST(HostTier, AFullHostTierNeverEvictsAStrongerEntryForAWeakerBlock) {
  BlockManager bm(tiered(8, 4, 1));
  bm.allocate(1, tokens_from(5, 0), {}, {{0, 4, 90}});
  bm.mark_computed({1});
  bm.free(1);
  EXPECT_EQ(bm.plan_offloads(8), 1);
  bm.take_offloads();
  bm.complete_offloads(all(1));
  cache_prompt(bm, 2, tokens_from(5, 100));  // priority 35
  EXPECT_EQ(bm.plan_offloads(8), 0);
  bm.check_invariants();
}

TEST(HostTier, ResetWithOffloadsInFlightEntersNothing) {
  BlockManager bm(tiered(4, 4, 8));
  cache_prompt(bm, 1, tokens_from(13, 0));
  bm.plan_offloads(2);
  bm.take_offloads();
  bm.plan_offloads(8);  // one more queued, not taken
  bm.reset_prefix_cache();
  bm.check_invariants();
  bm.complete_offloads(all(2));
  EXPECT_EQ(bm.stats().cached_host_blocks, 0);
  EXPECT_EQ(bm.gpu_pool().num_free(), 4);
  bm.check_invariants();
}

TEST(HostTier, EventsReplayToEachMediumsCachedBlocks) {
  BlockManagerConfig c = tiered(6, 2, 5);
  c.hash_algo = HashAlgo::kWeak8;
  c.enable_events = true;
  BlockManager bm(c);
  std::map<uint64_t, int> replay[kNumMedia];
  auto check = [&] {
    for (const KvEvent& e : bm.take_events()) {
      if (e.kind == KvEvent::Kind::kCleared)
        for (auto& r : replay) r.clear();
      for (uint64_t h : e.block_hashes)
        replay[static_cast<int>(e.medium)][h] += e.kind == KvEvent::Kind::kStored ? 1 : -1;
    }
    for (Medium m : {Medium::kGpu, Medium::kCpu}) {
      std::map<uint64_t, int> cached;
      for (const auto& [h, parent] : bm.cached_blocks(m)) ++cached[h];
      std::map<uint64_t, int>& r = replay[static_cast<int>(m)];
      for (auto it = r.begin(); it != r.end();) it = it->second == 0 ? r.erase(it) : std::next(it);
      EXPECT_EQ(r, cached) << medium_name(m);
    }
  };
  std::mt19937 rng(11);
  int host_stored = 0;
  for (int64_t id = 0; id < 300; ++id) {
    std::vector<int64_t> t(1 + rng() % 7);
    for (auto& x : t) x = rng() % 3;
    if (bm.can_allocate(t) == AllocStatus::kOk) {
      bm.allocate(id, t);
      const std::vector<BlockPair> loads = bm.take_loads();
      bm.complete_loads(all(loads.size(), rng() % 4 != 0));
      bm.mark_computed({id});
      if (id > 0 && bm.contains(id - 1)) bm.free(id - 1);
    } else if (bm.contains(id - 1)) {
      bm.free(id - 1);
    }
    bm.plan_offloads(static_cast<int32_t>(rng() % 3));
    const size_t n = bm.take_offloads().size();
    bm.complete_offloads(all(n, rng() % 4 != 0));
    host_stored += bm.stats().cached_host_blocks > 0;
    if (rng() % 50 == 0) bm.reset_prefix_cache();
    check();
    bm.check_invariants();
  }
  EXPECT_GT(host_stored, 50);
}

// ---------------------------------------------------------------------------------------------------
// Sliding windows and hybrid groups

namespace {

BlockManagerConfig windowed(int32_t num_blocks, int32_t num_host_blocks, std::vector<int64_t> windows) {
  BlockManagerConfig c = tiered(num_blocks, 4, num_host_blocks);
  c.group_windows = std::move(windows);
  return c;
}

// Offloads every cached free device block (all confirmed); returns how many.
size_t offload_all(BlockManager& bm) {
  bm.plan_offloads(bm.gpu_pool().num_blocks());
  const size_t n = bm.take_offloads().size();
  bm.complete_offloads(all(n));
  return n;
}

}  // namespace

TEST(HostTier, AWindowedGroupDemotesEveryCachedBlockAndLoadsOnlyItsWindow) {
  BlockManager bm(windowed(6, 8, {8}));
  const std::vector<int64_t> a = tokens_from(21, 0);  // 5 full blocks + 1 token
  bm.allocate(1, a);
  bm.mark_computed({1});
  EXPECT_EQ(bm.num_released_blocks(1), 3) << "the window released blocks 0-2 (still cached)";
  bm.free(1);
  EXPECT_EQ(offload_all(bm), 5u) << "released blocks are cached and demoted too";
  cache_prompt(bm, 2, tokens_from(24, 100));  // evicts every device copy of a
  bm.check_invariants();
  const TierHits hits = bm.lookup(a);
  EXPECT_EQ(hits.device_blocks + hits.host_blocks, 5);
  EXPECT_EQ(hits.host_blocks, 2) << "the window at position 20 reads blocks 3 and 4 only";
  EXPECT_EQ(bm.allocate(3, a), 20);
  EXPECT_EQ(bm.num_released_blocks(3), 3);
  const std::vector<BlockPair> loads = bm.take_loads();
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0].second, bm.block_table(3)[3]);
  EXPECT_EQ(loads[1].second, bm.block_table(3)[4]);
  EXPECT_TRUE(bm.complete_loads(all(2)).empty());
  EXPECT_EQ(bm.num_computed_tokens(3), 20);
  bm.check_invariants();
  bm.mark_computed({3});
  bm.free(3);
  EXPECT_EQ(bm.lookup(a).host_blocks, 0) << "the loaded blocks are device hits now";
  bm.check_invariants();
}

TEST(HostTier, AFailedWindowLoadSendsTheSequenceBackToAdmission) {
  for (int failed = 0; failed < 2; ++failed) {
    BlockManager bm(windowed(6, 8, {8}));
    const std::vector<int64_t> a = tokens_from(21, 0);
    cache_prompt(bm, 1, a);
    offload_all(bm);
    cache_prompt(bm, 2, tokens_from(24, 100));
    bm.allocate(3, a);
    offload_all(bm);  // the write-backs allocate queued
    std::vector<bool> ok = all(bm.take_loads().size());
    ok[failed] = false;
    // Recomputing from block `failed` would need the window's blocks before it, which were not kept.
    EXPECT_EQ(bm.complete_loads(ok), std::vector<int64_t>{3}) << "failed load " << failed;
    EXPECT_TRUE(bm.must_readmit(3));
    EXPECT_EQ(bm.num_computed_tokens(3), 0);
    bm.check_invariants();
    EXPECT_THROW(bm.mark_computed({3}), ValueError);
    EXPECT_THROW(bm.append_token(3, 1), ValueError);
    EXPECT_THROW(bm.fork(3, 4), ValueError);
    EXPECT_THROW(bm.pin(3), ValueError);
    const int64_t n = 21;
    EXPECT_THROW(bm.reserve({3}, Span<int64_t>(&n, 1)), ValueError);
    EXPECT_THROW(bm.truncate({3}, Span<int64_t>(&n, 1)), ValueError);
    const int32_t free_before = bm.gpu_pool().num_free();
    bm.free(3);
    EXPECT_EQ(bm.gpu_pool().num_free(), free_before + 3) << "every block it held is back";
    bm.check_invariants();
    // The failed entry was dropped: the lookup now stops short of it.
    EXPECT_LT(bm.lookup(a).device_blocks + bm.lookup(a).host_blocks, 5);
    bm.allocate(3, a);
    bm.complete_loads(all(bm.take_loads().size()));
    bm.check_invariants();
  }
}

TEST(HostTier, HybridHitLoadsEveryGroupsBlocksAndRecoversInPlaceWhenTheWindowAllows) {
  // Group 0 a window of 32 tokens (wider than the prompt: nothing is released), group 1 full attention.
  BlockManager bm(windowed(12, 16, {32, BlockManager::kFullAttention}));
  const std::vector<int64_t> a = tokens_from(21, 0);
  cache_prompt(bm, 1, a);
  // Confirmed offloads keep their blocks next to evict, the last confirmed first: group 1's, then group 0's.
  EXPECT_EQ(offload_all(bm), 10u);
  cache_prompt(bm, 2, tokens_from(14, 100));  // 8 fresh blocks: the 2 empty ones, group 1's 5, group 0's block 0
  bm.check_invariants();
  const TierHits hits = bm.lookup(a);
  EXPECT_EQ(hits.device_blocks, 0);
  EXPECT_EQ(hits.host_blocks, 5);
  EXPECT_EQ(bm.allocate(3, a), 20);
  const std::vector<int32_t> group0 = bm.block_table(3, 0);
  const std::vector<BlockPair> loads = bm.take_loads();
  ASSERT_EQ(loads.size(), 6u) << "group 0's block 0 and group 1's five blocks";
  EXPECT_EQ(loads[0].second, group0[0]);
  bm.check_invariants();
  std::vector<bool> ok = all(loads.size());
  ok[3] = false;  // group 1's block 2
  EXPECT_TRUE(bm.complete_loads(ok).empty());
  EXPECT_EQ(bm.num_computed_tokens(3), 8) << "recomputed from the failed block on";
  const std::vector<int32_t>& after = bm.block_table(3, 0);
  EXPECT_EQ(after[0], group0[0]);
  EXPECT_EQ(after[1], group0[1]);
  // The device hits after the recompute point are private now: released, and fresh blocks taken (with
  // nothing else free the same blocks come back, their cached content evicted).
  for (int i = 2; i < 5; ++i) {
    EXPECT_EQ(bm.gpu_pool().ref_count(after[i]), 1) << i;
    EXPECT_EQ(bm.gpu_pool().tag(after[i]), PrefixCache::kNoNode) << i;
  }
  bm.check_invariants();
  bm.mark_computed({3});
  bm.check_invariants();
  EXPECT_EQ(bm.lookup(a).device_blocks, 5);
}

TEST(HostTier, FailedLoadsAtEveryPositionOfAHybridHit) {
  for (const std::vector<int64_t>& windows :
       {std::vector<int64_t>{BlockManager::kFullAttention, 8}, std::vector<int64_t>{BlockManager::kFullAttention, 32}}) {
    for (size_t failed = 0;; ++failed) {
      BlockManager bm(windowed(12, 16, windows));
      const std::vector<int64_t> a = tokens_from(21, 0);
      cache_prompt(bm, 1, a);
      offload_all(bm);
      cache_prompt(bm, 2, tokens_from(24, 100));
      bm.allocate(3, a);
      const size_t n = bm.take_loads().size();
      if (failed == n) break;
      std::vector<bool> ok = all(n);
      ok[failed] = false;
      const std::vector<int64_t> readmit = bm.complete_loads(ok);
      bm.check_invariants();
      if (readmit.empty()) {
        EXPECT_LT(bm.num_computed_tokens(3), 20);
        EXPECT_EQ(bm.num_computed_tokens(3) % 4, 0);
        bm.mark_computed({3});
      } else {
        EXPECT_EQ(windows[1], 8) << "a window wider than the prompt always has a safe point";
        EXPECT_EQ(bm.num_computed_tokens(3), 0);
        bm.free(3);
      }
      bm.check_invariants();
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// A randomized run with a KV oracle: the runner keeps the KV of every device block and host slot (the
// value written for a position is a function of the whole prefix up to it), performs every copy the
// manager hands out and fails some; every computed token of every sequence must hold its own KV.

namespace {

class Oracle {
 public:
  // Every group's layers have their own KV in each block id (a copy moves all of them).
  Oracle(BlockManager& bm, int32_t block_size)
      : bm_(bm),
        bs_(block_size),
        device_(bm.num_groups(), std::vector<int64_t>(size_t(bm.gpu_pool().num_blocks()) * block_size, -1)),
        host_(bm.num_groups(), std::vector<int64_t>(size_t(bm.host_pool().num_blocks()) * block_size, -1)) {}

  static int64_t kv_of(const std::vector<int64_t>& tokens, int64_t pos, int32_t group) {
    uint64_t h = 1469598103934665603ull + uint64_t(group);
    for (int64_t p = 0; p <= pos; ++p) h = (h ^ uint64_t(tokens[p])) * 1099511628211ull;
    return static_cast<int64_t>(h >> 1);
  }
  // Copies every offload, load and copy-on-write the manager queued; fails each with probability fail.
  void run_copies(std::mt19937& rng, double fail) {
    std::bernoulli_distribution failed(fail);
    for (const auto& [src, dst] : bm_.take_copies()) copy(device_, src, device_, dst);
    const std::vector<BlockPair> offloads = bm_.take_offloads();
    std::vector<bool> ok;
    for (const auto& [block, slot] : offloads) {
      ok.push_back(!failed(rng));
      if (ok.back()) copy(device_, block, host_, slot);
      else scribble(host_, slot);  // a failed copy may leave anything behind
    }
    bm_.complete_offloads(ok);
    ok.clear();
    for (const auto& [slot, block] : bm_.take_loads()) {
      ok.push_back(!failed(rng));
      if (ok.back()) copy(host_, slot, device_, block);
      else scribble(device_, block);
    }
    // A sequence left without a safe point to recompute from is freed; the run admits its prompt again.
    for (int64_t id : bm_.complete_loads(ok)) {
      EXPECT_EQ(bm_.num_computed_tokens(id), 0);
      EXPECT_THROW(bm_.mark_computed(Span<int64_t>(&id, 1)), ValueError);
      readmit_.push_back(bm_.token_ids(id));
      bm_.free(id);
    }
  }
  std::vector<std::vector<int64_t>> take_readmitted() { return std::move(readmit_); }
  // Writes the KV of the sequence's positions [num_computed, end) and marks them computed.
  void compute(int64_t id, int64_t end) {
    const std::vector<int64_t> tokens = bm_.token_ids(id);
    for (int32_t g = 0; g < bm_.num_groups(); ++g) {
      const std::vector<int32_t>& table = bm_.block_table(id, g);
      for (int64_t p = bm_.num_computed_tokens(id); p < end; ++p)
        device_[g][size_t(table[p / bs_]) * bs_ + p % bs_] = kv_of(tokens, p, g);
    }
    const int64_t n = end;
    bm_.mark_computed(Span<int64_t>(&id, 1), Span<int64_t>(&n, 1));
  }
  // Every computed position each group still holds (a window releases its oldest blocks).
  void check(int64_t id) const {
    const std::vector<int64_t> tokens = bm_.token_ids(id);
    for (int32_t g = 0; g < bm_.num_groups(); ++g) {
      const std::vector<int32_t>& table = bm_.block_table(id, g);
      const int64_t released = bm_.num_released_blocks(id, g);
      for (int64_t p = released * bs_; p < bm_.num_computed_tokens(id); ++p)
        ASSERT_EQ(device_[g][size_t(table[p / bs_]) * bs_ + p % bs_], kv_of(tokens, p, g))
            << "seq " << id << " group " << g << " position " << p << " holds KV that is not its own";
    }
  }

 private:
  using Kv = std::vector<std::vector<int64_t>>;  // per group, per block id
  void copy(const Kv& from, int32_t src, Kv& to, int32_t dst) {
    for (size_t g = 0; g < from.size(); ++g)
      std::copy_n(from[g].begin() + size_t(src) * bs_, bs_, to[g].begin() + size_t(dst) * bs_);
  }
  void scribble(Kv& kv, int32_t block) {
    for (auto& layer : kv) std::fill_n(layer.begin() + size_t(block) * bs_, bs_, -7);
  }
  BlockManager& bm_;
  int32_t bs_;
  Kv device_, host_;
  std::vector<std::vector<int64_t>> readmit_;
};

void run_oracle(HashAlgo algo, uint32_t seed, const std::vector<int64_t>& windows = {BlockManager::kFullAttention}) {
  const int32_t num_groups = static_cast<int32_t>(windows.size());
  BlockManagerConfig c = tiered(24 * num_groups, 4, 16 * num_groups);
  c.hash_algo = algo;
  c.group_windows = windows;
  BlockManager bm(c);
  Oracle oracle(bm, 4);
  std::mt19937 rng(seed);
  std::vector<std::vector<int64_t>> prefixes(4);
  for (auto& p : prefixes) {
    p.resize(4 * (1 + rng() % 4));
    for (auto& x : p) x = rng() % 3;  // a tiny vocabulary: equal blocks under different prefixes
  }
  std::vector<int64_t> live;
  int64_t next_id = 0;
  int readmitted = 0;
  const auto admit = [&](const std::vector<int64_t>& t) {
    if (bm.can_allocate(t) != AllocStatus::kOk) return;
    bm.allocate(next_id, t);
    live.push_back(next_id++);
  };
  const auto drop_freed = [&] {  // sequences a failed load sent back to admission
    live.erase(std::remove_if(live.begin(), live.end(), [&](int64_t id) { return !bm.contains(id); }), live.end());
  };
  for (int step = 0; step < 400; ++step) {
    for (const std::vector<int64_t>& t : oracle.take_readmitted()) {
      ++readmitted;
      admit(t);
    }
    // Admit a prompt: a shared prefix and a random tail.
    std::vector<int64_t> t = prefixes[rng() % prefixes.size()];
    for (int k = 0, n = 1 + int(rng() % 9); k < n; ++k) t.push_back(rng() % 3);
    admit(t);
    oracle.run_copies(rng, 0.2);
    drop_freed();
    for (int64_t id : live) {  // every loaded prefix holds its own KV once confirmed
      oracle.check(id);
      if (bm.num_computed_tokens(id) < bm.num_tokens(id)) oracle.compute(id, bm.num_tokens(id));
    }
    // Decode a token for some sequences (copy-on-write included), and fork one now and then.
    for (int64_t id : live)
      if (rng() % 2 && bm.can_append(Span<int64_t>(&id, 1))) {
        bm.append_token(id, rng() % 3);
        oracle.run_copies(rng, 0.2);
        oracle.compute(id, bm.num_tokens(id));
      }
    if (!live.empty() && rng() % 8 == 0 && bm.can_append(Span<int64_t>(&live[0], 1))) {
      bm.fork(live[0], next_id);
      live.push_back(next_id++);
    }
    while (live.size() > 3 || (!live.empty() && rng() % 3 == 0)) {
      const size_t k = rng() % live.size();
      bm.free(live[k]);
      live.erase(live.begin() + k);
    }
    bm.plan_offloads(static_cast<int32_t>(rng() % 4));
    if (rng() % 2) oracle.run_copies(rng, 0.2);
    drop_freed();
    bm.check_invariants();
    for (int64_t id : live) oracle.check(id);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(bm.stats().loaded_blocks, 20);
  EXPECT_GT(bm.stats().offloaded_blocks, 20);
  ::testing::Test::RecordProperty("readmitted", readmitted);
}

}  // namespace

TEST(HostTier, OracleEveryComputedTokenHoldsItsOwnKv) { run_oracle(HashAlgo::kXXH64, 1); }
TEST(HostTier, OracleUnderForcedHashCollisions) { run_oracle(HashAlgo::kWeak8, 2); }
TEST(HostTier, OracleSlidingWindow) { run_oracle(HashAlgo::kXXH64, 3, {8}); }
TEST(HostTier, OracleHybridGroups) { run_oracle(HashAlgo::kXXH64, 4, {BlockManager::kFullAttention, 8}); }
TEST(HostTier, OracleHybridGroupsUnderForcedHashCollisions) {
  run_oracle(HashAlgo::kWeak8, 5, {6, BlockManager::kFullAttention});
}
