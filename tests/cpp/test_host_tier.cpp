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

TEST(HostTier, OffByDefaultAndForHybridGroups) {
  BlockManagerConfig c = tiered(8, 4, 0);
  EXPECT_FALSE(BlockManager(c).host_tier_enabled());
  c.num_host_blocks = 4;
  EXPECT_TRUE(BlockManager(c).host_tier_enabled());
  c.group_windows = {BlockManager::kFullAttention, 8};
  BlockManager hybrid(c);
  EXPECT_FALSE(hybrid.host_tier_enabled());
  EXPECT_EQ(hybrid.plan_offloads(4), 0);
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
// A randomized run with a KV oracle: the runner keeps the KV of every device block and host slot (the
// value written for a position is a function of the whole prefix up to it), performs every copy the
// manager hands out and fails some; every computed token of every sequence must hold its own KV.

namespace {

class Oracle {
 public:
  Oracle(BlockManager& bm, int32_t block_size)
      : bm_(bm),
        bs_(block_size),
        device_(size_t(bm.gpu_pool().num_blocks()) * block_size, -1),
        host_(size_t(bm.host_pool().num_blocks()) * block_size, -1) {}

  static int64_t kv_of(const std::vector<int64_t>& tokens, int64_t pos) {
    uint64_t h = 1469598103934665603ull;
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
    bm_.complete_loads(ok);
  }
  // Writes the KV of the sequence's positions [num_computed, end) and marks them computed.
  void compute(int64_t id, int64_t end) {
    const std::vector<int64_t> tokens = bm_.token_ids(id);
    const std::vector<int32_t>& table = bm_.block_table(id);
    for (int64_t p = bm_.num_computed_tokens(id); p < end; ++p)
      device_[size_t(table[p / bs_]) * bs_ + p % bs_] = kv_of(tokens, p);
    const int64_t n = end;
    bm_.mark_computed(Span<int64_t>(&id, 1), Span<int64_t>(&n, 1));
  }
  void check(int64_t id) const {
    const std::vector<int64_t> tokens = bm_.token_ids(id);
    const std::vector<int32_t>& table = bm_.block_table(id);
    for (int64_t p = 0; p < bm_.num_computed_tokens(id); ++p)
      ASSERT_EQ(device_[size_t(table[p / bs_]) * bs_ + p % bs_], kv_of(tokens, p))
          << "seq " << id << " position " << p << " holds KV that is not its own";
  }

 private:
  void copy(const std::vector<int64_t>& from, int32_t src, std::vector<int64_t>& to, int32_t dst) {
    std::copy_n(from.begin() + size_t(src) * bs_, bs_, to.begin() + size_t(dst) * bs_);
  }
  void scribble(std::vector<int64_t>& kv, int32_t block) {
    std::fill_n(kv.begin() + size_t(block) * bs_, bs_, -7);
  }
  BlockManager& bm_;
  int32_t bs_;
  std::vector<int64_t> device_, host_;
};

void run_oracle(HashAlgo algo, uint32_t seed) {
  BlockManagerConfig c = tiered(24, 4, 16);
  c.hash_algo = algo;
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
  for (int step = 0; step < 400; ++step) {
    // Admit a prompt: a shared prefix and a random tail.
    std::vector<int64_t> t = prefixes[rng() % prefixes.size()];
    for (int k = 0, n = 1 + int(rng() % 9); k < n; ++k) t.push_back(rng() % 3);
    if (bm.can_allocate(t) == AllocStatus::kOk) {
      bm.allocate(next_id, t);
      live.push_back(next_id++);
    }
    oracle.run_copies(rng, 0.2);
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
    bm.check_invariants();
    for (int64_t id : live) oracle.check(id);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(bm.stats().loaded_blocks, 20);
  EXPECT_GT(bm.stats().offloaded_blocks, 20);
}

}  // namespace

TEST(HostTier, OracleEveryComputedTokenHoldsItsOwnKv) { run_oracle(HashAlgo::kXXH64, 1); }
TEST(HostTier, OracleUnderForcedHashCollisions) { run_oracle(HashAlgo::kWeak8, 2); }
