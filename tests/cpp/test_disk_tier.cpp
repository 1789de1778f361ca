// The prefix cache's disk tier: writes (clean ahead and write-back on host reuse), prefetch reads into host
// slots, failed writes and reads, eviction order by priority, pins, salts, events per medium, and a
// randomized run whose KV oracle checks that every computed token of every sequence holds its own KV
// through device -> host -> disk -> host -> device.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "core/block_manager.h"
#include "core/errors.h"
#include "core/hashing.h"

using namespace pagedkv;

namespace {

std::vector<int64_t> tokens_from(int64_t n, int64_t start) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

BlockManagerConfig tiered(int32_t num_blocks, int32_t block_size, int32_t num_host_blocks, int32_t num_disk_blocks) {
  BlockManagerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.num_host_blocks = num_host_blocks;
  c.num_disk_blocks = num_disk_blocks;
  return c;
}

std::vector<bool> all(size_t n, bool ok = true) { return std::vector<bool>(n, ok); }

// Allocates, computes and frees a prompt: its full blocks stay cached in the device free list.
void cache_prompt(BlockManager& bm, int64_t id, const std::vector<int64_t>& t,
                  const std::vector<RetentionRange>& retention = {}, std::string_view salt = {}) {
  bm.allocate(id, t, salt, retention);
  bm.mark_computed({id});
  bm.free(id);
}

// Offloads every cached free device block to the host tier (all confirmed); returns how many.
size_t offload_all(BlockManager& bm) {
  bm.plan_offloads(bm.gpu_pool().num_blocks());
  const size_t n = bm.take_offloads().size();
  bm.complete_offloads(all(n));
  return n;
}

// Writes every cached free host slot to the disk tier (all confirmed or all failed); returns how many.
size_t write_all(BlockManager& bm, bool ok = true) {
  bm.plan_disk_writes(bm.host_pool().num_blocks());
  const size_t n = bm.take_disk_writes().size();
  bm.complete_disk_writes(all(n, ok));
  return n;
}

// a's blocks end up only on disk: offloaded, written, then pushed out of the device and host tiers by b.
void demote_to_disk(BlockManager& bm, const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  cache_prompt(bm, 1, a);
  offload_all(bm);
  write_all(bm);
  cache_prompt(bm, 2, b);
  offload_all(bm);
  write_all(bm);
}

}  // namespace

TEST(DiskTier, NeedsTheHostTierAndServesHybridGroups) {
  EXPECT_FALSE(BlockManager(tiered(8, 4, 4, 0)).disk_tier_enabled());
  EXPECT_TRUE(BlockManager(tiered(8, 4, 4, 4)).disk_tier_enabled());
  EXPECT_THROW(BlockManager(tiered(8, 4, 0, 4)), ValueError) << "a disk tier without a host tier";
  EXPECT_THROW(BlockManager(tiered(8, 4, 4, -1)), ValueError);
  BlockManagerConfig c = tiered(8, 4, 4, 4);
  c.group_windows = {BlockManager::kFullAttention, 8};
  BlockManager hybrid(c);
  EXPECT_TRUE(hybrid.host_tier_enabled());
  EXPECT_TRUE(hybrid.disk_tier_enabled());
  EXPECT_EQ(hybrid.plan_disk_writes(4), 0);
  EXPECT_EQ(hybrid.prefetch(tokens_from(9, 0)), 0);
  c = tiered(8, 4, 4, 4);
  c.enable_prefix_caching = false;
  EXPECT_FALSE(BlockManager(c).disk_tier_enabled());
}

TEST(DiskTier, CleanAheadWritesHoldTheHostSlotsUntilConfirmed) {
  BlockManager bm(tiered(4, 4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);  // 3 full blocks + 1 token
  cache_prompt(bm, 1, a);
  EXPECT_EQ(offload_all(bm), 3u);
  EXPECT_EQ(bm.plan_disk_writes(2), 2) << "only the slots evicted first";
  EXPECT_EQ(bm.plan_disk_writes(8), 1);
  EXPECT_EQ(bm.plan_disk_writes(8), 0) << "a slot being written is not free";
  const std::vector<BlockPair> writes = bm.take_disk_writes();
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(bm.host_pool().num_free(), 1);
  EXPECT_EQ(bm.disk_pool().num_free(), 5);
  bm.check_invariants();
  // Each record's identity: the block's chained hash (as the events'), its parent's and its tokens.
  std::vector<std::optional<uint64_t>> hashes = {std::nullopt};
  for (size_t i = 0; i < 3; ++i) hashes.push_back(hash_block_tokens(a.data() + 4 * i, 4, hashes.back(), HashAlgo::kXXH64));
  std::vector<bool> seen(3, false);
  for (const auto& [slot, record] : writes) {
    const DiskTier::Identity id = bm.disk_record_identity(record);
    ASSERT_EQ(id.tokens.size(), 4u);
    const size_t i = static_cast<size_t>(id.tokens[0] / 4);  // the tail is written first (it is evicted first)
    ASSERT_LT(i, 3u);
    seen[i] = true;
    EXPECT_EQ(id.tokens, std::vector<int64_t>(a.begin() + 4 * i, a.begin() + 4 * i + 4));
    EXPECT_EQ(id.parent, hashes[i]);
    EXPECT_EQ(id.hash, hashes[i + 1]);
  }
  EXPECT_EQ(seen, std::vector<bool>(3, true));
  EXPECT_EQ(bm.stats().cached_disk_blocks, 0) << "nothing is on disk before the writes are confirmed";
  bm.complete_disk_writes(all(3));
  EXPECT_EQ(bm.stats().cached_disk_blocks, 3);
  EXPECT_EQ(bm.stats().disk_writes, 3);
  EXPECT_EQ(bm.host_pool().num_free(), 4);
  EXPECT_EQ(bm.cached_blocks(Medium::kDisk).size(), 3u);
  EXPECT_EQ(bm.plan_disk_writes(8), 0) << "clean slots are not written twice";
  EXPECT_THROW(bm.complete_disk_writes(all(1)), ValueError) << "nothing is in flight";
  bm.check_invariants();
}

TEST(DiskTier, PrefetchReadsDiskOnlyBlocksThenAllocateLoadsThem) {
  BlockManager bm(tiered(4, 4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);
  demote_to_disk(bm, a, tokens_from(16, 100));
  TierHits hits = bm.lookup(a);
  EXPECT_EQ(hits.device_blocks + hits.host_blocks, 0);
  EXPECT_EQ(hits.disk_blocks, 3);
  EXPECT_EQ(bm.prefetch(a), 3);
  EXPECT_EQ(bm.num_pending_disk_reads(), 3);
  EXPECT_EQ(bm.prefetch(a), 0) << "reads already pending are not queued twice";
  EXPECT_EQ(bm.lookup(a).disk_blocks, 3) << "pending reads still count as disk blocks";
  bm.check_invariants();
  const std::vector<BlockPair> reads = bm.take_disk_reads();
  ASSERT_EQ(reads.size(), 3u);
  for (const auto& [record, slot] : reads) EXPECT_EQ(bm.disk_record_identity(record).tokens.size(), 4u);
  bm.complete_disk_reads(all(3));
  EXPECT_EQ(bm.num_pending_disk_reads(), 0);
  EXPECT_EQ(bm.stats().disk_reads, 3);
  EXPECT_EQ(bm.stats().disk_hit_blocks, 3);
  hits = bm.lookup(a);
  EXPECT_EQ(hits.host_blocks, 3);
  EXPECT_EQ(hits.disk_blocks, 0);
  EXPECT_EQ(bm.stats().cached_disk_blocks, 7) << "a read entry stays on disk";
  EXPECT_EQ(bm.allocate(3, a), 12);
  const std::vector<BlockPair> loads = bm.take_loads();
  ASSERT_EQ(loads.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(loads[i].first, reads[i].second) << "loads read the slots the reads filled";
  bm.complete_loads(all(3));
  EXPECT_EQ(bm.num_computed_tokens(3), 12);
  bm.check_invariants();
}

// A new manager re-registers the records an earlier one wrote (what a restarted engine reads back from
// their headers): parents first, each linked only under the parent whose chained hash produces it.
TEST(DiskTier, RestoredRecordsOfAnEarlierManagerHitOnDiskAndLoad) {
  BlockManager earlier(tiered(4, 4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);
  cache_prompt(earlier, 1, a, {}, "tenant");
  offload_all(earlier);
  write_all(earlier);
  std::map<uint64_t, int32_t> record_of;  // block hash -> record
  std::vector<std::pair<int32_t, DiskTier::Identity>> records;
  for (int32_t r = 0; r < 8; ++r) {
    if (!earlier.disk_pool().holds_cached_kv(r)) continue;
    records.emplace_back(r, earlier.disk_record_identity(r));
    record_of[records.back().second.hash] = r;
  }
  ASSERT_EQ(records.size(), 3u);
  std::sort(records.begin(), records.end(),  // parents first: block 0 has no parent, then by chain
            [](const auto& x, const auto& y) { return x.second.tokens[0] < y.second.tokens[0]; });

  BlockManager bm(tiered(4, 4, 4, 8));
  const auto restore = [&](const std::pair<int32_t, DiskTier::Identity>& rec, std::optional<uint64_t> hash = {}) {
    const DiskTier::Identity& id = rec.second;
    const int32_t parent = id.parent ? record_of.at(*id.parent) : -1;
    return bm.restore_disk_record(rec.first, hash.value_or(id.hash), parent, id.tokens, id.salt);
  };
  EXPECT_FALSE(restore(records[1])) << "its parent's record holds nothing yet";
  EXPECT_FALSE(restore(records[0], records[0].second.hash + 1)) << "not this block's hash";
  EXPECT_EQ(bm.stats().cached_disk_blocks, 0);
  for (const auto& rec : records) EXPECT_TRUE(restore(rec));
  EXPECT_FALSE(restore(records[2])) << "a record that holds its block already";
  EXPECT_EQ(bm.lookup(a, "tenant").disk_blocks, 3);
  EXPECT_EQ(bm.lookup(a).disk_blocks, 0) << "block 0 keeps its salt";
  bm.check_invariants();
  EXPECT_EQ(bm.prefetch(a, "tenant"), 3);
  bm.take_disk_reads();
  bm.complete_disk_reads(all(3));
  EXPECT_EQ(bm.allocate(2, a, "tenant"), 12);
  EXPECT_EQ(bm.take_loads().size(), 3u);
  bm.complete_loads(all(3));
  bm.check_invariants();
  BlockManagerConfig weak = tiered(4, 4, 4, 8);
  weak.hash_algo = HashAlgo::kWeak8;
  BlockManager weak_bm(weak);
  EXPECT_THROW(weak_bm.restore_disk_record(0, 1, -1, records[0].second.tokens), ValueError);
}

TEST(DiskTier, APendingReadIsAMissNeverAWrongHit) {
  BlockManager bm(tiered(4, 4, 4, 8));
  const std::vector<int64_t> a = tokens_from(13, 0);
  demote_to_disk(bm, a, tokens_from(16, 100));
  EXPECT_EQ(bm.prefetch(a), 3);
  bm.take_disk_reads();  // in flight: the host slots hold nothing yet
  EXPECT_EQ(bm.lookup(a).device_blocks + bm.lookup(a).host_blocks, 0);
  EXPECT_EQ(bm.allocate(3, a), 0) << "a block being read is a miss";
  EXPECT_TRUE(bm.take_loads().empty());
  bm.mark_computed({3});  // recomputed on the device meanwhile
  bm.check_invariants();
  bm.complete_disk_reads(all(3));
  bm.check_invariants();
  bm.free(3);
  EXPECT_EQ(bm.lookup(a).device_blocks, 3);
}

TEST(DiskTier, AFailedWriteLeavesNoDiskEntry) {
  BlockManagerConfig c = tiered(4, 4, 4, 8);
  c.enable_events = true;
  BlockManager bm(c);
  cache_prompt(bm, 1, tokens_from(13, 0));
  offload_all(bm);
  bm.take_events();
  EXPECT_EQ(write_all(bm, /*ok=*/false), 3u);
  EXPECT_EQ(bm.stats().cached_disk_blocks, 0);
  EXPECT_EQ(bm.stats().disk_write_failures, 3);
  EXPECT_EQ(bm.disk_pool().num_free(), 8);
  for (const KvEvent& e : bm.take_events()) EXPECT_NE(e.medium, Medium::kDisk);
  EXPECT_THROW(bm.disk_record_identity(0), KeyError) << "a record that holds nothing";
  EXPECT_THROW(bm.disk_record_identity(8), ValueError);
  EXPECT_THROW(bm.disk_record_identity(-1), ValueError);
  EXPECT_EQ(write_all(bm), 3u) << "the slots are still dirty";
  bm.check_invariants();
}

TEST(DiskTier, AFailedReadDropsTheDiskEntryAndFreesTheSlot) {
  BlockManagerConfig c = tiered(4, 4, 4, 8);
  c.enable_events = true;
  BlockManager bm(c);
  const std::vector<int64_t> a = tokens_from(13, 0);
  demote_to_disk(bm, a, tokens_from(16, 100));
  bm.take_events();
  EXPECT_EQ(bm.prefetch(a), 3);
  const std::vector<BlockPair> reads = bm.take_disk_reads();
  bm.complete_disk_reads({true, false, true});  // a stale file for block 1
  EXPECT_EQ(bm.stats().disk_read_failures, 1);
  int removed = 0, stored_cpu = 0;
  for (const KvEvent& e : bm.take_events()) {
    removed += e.kind == KvEvent::Kind::kRemoved && e.medium == Medium::kDisk;
    stored_cpu += e.kind == KvEvent::Kind::kStored && e.medium == Medium::kCpu ? int(e.block_hashes.size()) : 0;
  }
  EXPECT_EQ(removed, 1);
  EXPECT_EQ(stored_cpu, 2);
  EXPECT_THROW(bm.disk_record_identity(reads[1].first), KeyError);
  const TierHits hits = bm.lookup(a);
  EXPECT_EQ(hits.host_blocks, 1) << "the hit stops at the block whose read failed";
  EXPECT_EQ(hits.disk_blocks, 0) << "block 2 is held after a block no tier holds";
  bm.check_invariants();
}

TEST(DiskTier, WriteBackWhenAHostSlotIsReusedAndASlotIsSpare) {
  BlockManager bm(tiered(4, 4, 3, 8));
  cache_prompt(bm, 1, tokens_from(13, 0));
  EXPECT_EQ(offload_all(bm), 3u);  // the host tier is full of dirty entries
  cache_prompt(bm, 2, tokens_from(9, 100));
  // The first offload takes a slot while two stay free: the two entries ahead are written back (their
  // slots held for the writes) and the third is dropped; the second offload finds no free slot.
  EXPECT_EQ(bm.plan_offloads(8), 1);
  EXPECT_EQ(bm.take_disk_writes().size(), 2u);
  EXPECT_EQ(bm.stats().host_evictions, 1);
  bm.take_offloads();
  bm.complete_offloads(all(1));
  bm.complete_disk_writes(all(2));
  EXPECT_EQ(bm.stats().cached_disk_blocks, 2);
  EXPECT_EQ(bm.plan_offloads(8), 1) << "clean host entries are evicted without a write";
  EXPECT_TRUE(bm.take_disk_writes().empty());
  bm.check_invariants();
}

TEST(DiskTier, EvictionFollowsPriorityAndNeverDropsAStrongerEntry) {
  BlockManager bm(tiered(8, 4, 8, 2));
  cache_prompt(bm, 1, tokens_from(5, 0), {{0, 4, 90}});
  cache_prompt(bm, 2, tokens_from(5, 100), {{0, 4, 20}});
  offload_all(bm);
  EXPECT_EQ(write_all(bm), 2u);  // the disk tier is full: one entry at 90, one at 20
  cache_prompt(bm, 3, tokens_from(5, 200), {{0, 4, 10}});
  offload_all(bm);
  EXPECT_EQ(bm.plan_disk_writes(8), 0) << "a weaker entry never evicts a stronger one";
  cache_prompt(bm, 4, tokens_from(5, 300), {{0, 4, 50}});
  offload_all(bm);
  EXPECT_EQ(bm.plan_disk_writes(8), 0) << "the coldest dirty slot (priority 10) blocks the clean-ahead";
  bm.reset_prefix_cache();
  // Priorities order the disk free list: a write at 50 evicts the entry at 20, not the one at 90.
  BlockManager bm2(tiered(8, 4, 8, 2));
  cache_prompt(bm2, 1, tokens_from(5, 0), {{0, 4, 90}});
  cache_prompt(bm2, 2, tokens_from(5, 100), {{0, 4, 20}});
  offload_all(bm2);
  write_all(bm2);
  const std::vector<std::pair<uint64_t, std::optional<uint64_t>>> before = bm2.cached_blocks(Medium::kDisk);
  cache_prompt(bm2, 4, tokens_from(5, 300), {{0, 4, 50}});
  offload_all(bm2);
  EXPECT_EQ(write_all(bm2), 1u);
  EXPECT_EQ(bm2.stats().disk_evictions, 1);
  const uint64_t h90 = hash_block_tokens(tokens_from(4, 0).data(), 4, std::nullopt, HashAlgo::kXXH64);
  const uint64_t h20 = hash_block_tokens(tokens_from(4, 100).data(), 4, std::nullopt, HashAlgo::kXXH64);
  std::vector<uint64_t> on_disk;
  for (const auto& [h, parent] : bm2.cached_blocks(Medium::kDisk)) on_disk.push_back(h);
  EXPECT_NE(std::find(on_disk.begin(), on_disk.end(), h90), on_disk.end());
  EXPECT_EQ(std::find(on_disk.begin(), on_disk.end(), h20), on_disk.end());
  bm2.check_invariants();
}

TEST(DiskTier, PinnedAndLowPriorityBlocksNeverReachTheDisk) {
  BlockManagerConfig c = tiered(8, 4, 8, 8);
  c.host_offload_min_priority = 50;
  BlockManager bm(c);
  bm.allocate(1, tokens_from(9, 0), {}, {{0, 8, 80}});
  bm.mark_computed({1});
  bm.pin(1);
  bm.free(1);
  cache_prompt(bm, 2, tokens_from(9, 100));  // priority 35: below the minimum
  EXPECT_EQ(bm.plan_offloads(8), 0);
  EXPECT_EQ(bm.plan_disk_writes(8), 0);
  EXPECT_EQ(bm.stats().cached_disk_blocks, 0);
  bm.unpin(1);
  EXPECT_EQ(offload_all(bm), 2u);
  EXPECT_EQ(write_all(bm), 2u);
  bm.check_invariants();
}

TEST(DiskTier, SaltsKeepDiskEntriesApart) {
  BlockManager bm(tiered(4, 4, 4, 8));
  const std::vector<int64_t> a = tokens_from(9, 0);
  cache_prompt(bm, 1, a, {}, "tenant-a");
  offload_all(bm);
  write_all(bm);
  cache_prompt(bm, 2, tokens_from(16, 100));
  offload_all(bm);
  write_all(bm);
  EXPECT_EQ(bm.lookup(a, "tenant-a").disk_blocks, 2);
  EXPECT_EQ(bm.lookup(a, "tenant-b").disk_blocks, 0);
  EXPECT_EQ(bm.lookup(a).disk_blocks, 0);
  EXPECT_EQ(bm.prefetch(a, "tenant-b"), 0);
  EXPECT_EQ(bm.prefetch(a, "tenant-a"), 2);
  const std::vector<BlockPair> reads = bm.take_disk_reads();
  EXPECT_EQ(bm.disk_record_identity(reads[0].first).hash,
            hash_block_tokens(a.data(), 4, std::nullopt, HashAlgo::kXXH64, "tenant-a"));
  bm.complete_disk_reads(all(2));
  EXPECT_EQ(bm.lookup(a, "tenant-a").host_blocks, 2);
  bm.check_invariants();
}

TEST(DiskTier, UnderWeak8CollisionsAReadIsAlwaysItsOwnBlockAndAnUnseenBlockMisses) {
  BlockManagerConfig c = tiered(4, 2, 2, 512);
  c.hash_algo = HashAlgo::kWeak8;  // 8-bit hashes and index keys: 400 blocks collide all over
  BlockManager bm(c);
  std::mt19937 rng(5);
  std::vector<std::vector<int64_t>> cached;
  std::map<uint64_t, int> stored_hashes;
  for (int k = 0; k < 400; ++k) {
    const std::vector<int64_t> t = {int64_t(rng() % 100000), int64_t(rng() % 100000), 7};
    cache_prompt(bm, k, t);
    offload_all(bm);
    write_all(bm);
    cached.push_back(t);
    ++stored_hashes[hash_block_tokens(t.data(), 2, std::nullopt, HashAlgo::kWeak8)];
  }
  EXPECT_GT(bm.stats().cached_disk_blocks, 300);
  int read = 0;
  for (const std::vector<int64_t>& t : cached) {
    if (bm.prefetch(t) == 0) continue;
    const std::vector<BlockPair> reads = bm.take_disk_reads();
    ASSERT_EQ(reads.size(), 1u);
    EXPECT_EQ(bm.disk_record_identity(reads[0].first).tokens, std::vector<int64_t>(t.begin(), t.begin() + 2));
    bm.complete_disk_reads(all(1));
    EXPECT_EQ(bm.lookup(t).host_blocks, 1);
    ++read;
  }
  EXPECT_GT(read, 300);
  int collisions = 0;
  for (int k = 0; k < 200; ++k) {  // blocks never cached: their hashes collide with stored ones, yet no hit
    const std::vector<int64_t> t = {int64_t(100000 + rng() % 100000), int64_t(rng() % 100000), 7};
    collisions += stored_hashes.count(hash_block_tokens(t.data(), 2, std::nullopt, HashAlgo::kWeak8)) != 0;
    const TierHits hits = bm.lookup(t);
    EXPECT_EQ(hits.device_blocks + hits.host_blocks + hits.disk_blocks, 0);
    EXPECT_EQ(bm.prefetch(t), 0);
  }
  EXPECT_GT(collisions, 100);
  bm.check_invariants();
}

TEST(DiskTier, ResetForgetsDiskEntriesAndInFlightTransfersEnterNothing) {
  BlockManager bm(tiered(4, 4, 4, 12));
  const std::vector<int64_t> a = tokens_from(13, 0);
  demote_to_disk(bm, a, tokens_from(16, 100));
  cache_prompt(bm, 3, tokens_from(9, 300));
  offload_all(bm);
  EXPECT_EQ(bm.plan_disk_writes(8), 2);
  const std::vector<BlockPair> writes = bm.take_disk_writes();
  const int32_t reads = bm.prefetch(a);
  ASSERT_GT(reads, 0);
  bm.take_disk_reads();
  bm.reset_prefix_cache();
  bm.check_invariants();
  EXPECT_EQ(bm.stats().cached_disk_blocks, 0);
  EXPECT_EQ(bm.lookup(a).disk_blocks, 0);
  EXPECT_EQ(bm.disk_record_identity(writes[0].second).tokens.size(), 4u) << "the runner may still ask";
  bm.complete_disk_writes(all(writes.size()));
  bm.complete_disk_reads(all(static_cast<size_t>(reads)));
  EXPECT_EQ(bm.stats().cached_disk_blocks, 0);
  EXPECT_EQ(bm.stats().cached_host_blocks, 0);
  EXPECT_EQ(bm.disk_pool().num_free(), 12);
  EXPECT_EQ(bm.host_pool().num_free(), 4);
  bm.check_invariants();
}

TEST(DiskTier, EventsReplayToEachMediumsCachedBlocks) {
  BlockManagerConfig c = tiered(6, 2, 3, 4);
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
    for (Medium m : {Medium::kGpu, Medium::kCpu, Medium::kDisk}) {
      std::map<uint64_t, int> cached;
      for (const auto& [h, parent] : bm.cached_blocks(m)) ++cached[h];
      std::map<uint64_t, int>& r = replay[static_cast<int>(m)];
      for (auto it = r.begin(); it != r.end();) it = it->second == 0 ? r.erase(it) : std::next(it);
      EXPECT_EQ(r, cached) << medium_name(m);
    }
  };
  std::mt19937 rng(12);
  int disk_stored = 0;
  for (int64_t id = 0; id < 400; ++id) {
    std::vector<int64_t> t(1 + rng() % 7);
    for (auto& x : t) x = rng() % 3;
    if (rng() % 2) bm.prefetch(t);
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
    bm.complete_offloads(all(bm.take_offloads().size(), rng() % 4 != 0));
    bm.plan_disk_writes(static_cast<int32_t>(rng() % 3));
    if (rng() % 2) bm.complete_disk_writes(all(bm.take_disk_writes().size(), rng() % 4 != 0));
    if (rng() % 2) bm.complete_disk_reads(all(bm.take_disk_reads().size(), rng() % 4 != 0));
    disk_stored += bm.stats().cached_disk_blocks > 0;
    if (rng() % 60 == 0) bm.reset_prefix_cache();
    check();
    bm.check_invariants();
  }
  EXPECT_GT(disk_stored, 50);
  EXPECT_GT(bm.stats().disk_reads, 2);
}

TEST(DiskTier, HybridGroupsRoundTripThroughTheDiskAndPrefetchOnlyTheWindow) {
  BlockManagerConfig c = tiered(12, 4, 10, 32);
  c.group_windows = {BlockManager::kFullAttention, 8};
  BlockManager bm(c);
  const std::vector<int64_t> a = tokens_from(21, 0);  // 5 full blocks per group
  demote_to_disk(bm, a, tokens_from(24, 100));
  bm.check_invariants();
  TierHits hits = bm.lookup(a);
  EXPECT_EQ(hits.device_blocks + hits.host_blocks, 0);
  EXPECT_EQ(hits.disk_blocks, 5);
  // Group 0 needs every block, the window of group 1 blocks 3 and 4 only.
  EXPECT_EQ(bm.prefetch(a), 7);
  const std::vector<BlockPair> reads = bm.take_disk_reads();
  ASSERT_EQ(reads.size(), 7u);
  // Equal content in two groups is told apart by the identity the record is written under.
  std::map<std::vector<int64_t>, std::vector<uint64_t>> hashes_of_tokens;
  for (const auto& [record, slot] : reads) {
    const DiskTier::Identity id = bm.disk_record_identity(record);
    hashes_of_tokens[id.tokens].push_back(id.hash);
  }
  int two_groups = 0;
  for (const auto& [tokens, hashes] : hashes_of_tokens)
    if (hashes.size() == 2) {
      ++two_groups;
      EXPECT_NE(hashes[0], hashes[1]);
    }
  EXPECT_EQ(two_groups, 2);
  bm.complete_disk_reads(all(reads.size()));
  bm.check_invariants();
  hits = bm.lookup(a);
  EXPECT_EQ(hits.host_blocks, 5);
  EXPECT_EQ(hits.disk_blocks, 0);
  EXPECT_EQ(bm.allocate(3, a), 20);
  EXPECT_EQ(bm.take_loads().size(), 7u);
  EXPECT_TRUE(bm.complete_loads(all(7)).empty());
  bm.mark_computed({3});
  bm.check_invariants();
}

TEST(DiskTier, EventsStayGroupZerosWithEveryGroupInTheTiers) {
  BlockManagerConfig c = tiered(12, 4, 10, 32);
  c.group_windows = {BlockManager::kFullAttention, 8};
  c.enable_events = true;
  BlockManager bm(c);
  demote_to_disk(bm, tokens_from(21, 0), tokens_from(24, 100));
  std::map<uint64_t, int> replay[kNumMedia];
  for (const KvEvent& e : bm.take_events())
    for (uint64_t h : e.block_hashes) replay[static_cast<int>(e.medium)][h] += e.kind == KvEvent::Kind::kStored ? 1 : -1;
  for (Medium m : {Medium::kGpu, Medium::kCpu, Medium::kDisk}) {
    std::map<uint64_t, int> cached;
    for (const auto& [h, parent] : bm.cached_blocks(m)) ++cached[h];
    std::map<uint64_t, int>& r = replay[static_cast<int>(m)];
    for (auto it = r.begin(); it != r.end();) it = it->second == 0 ? r.erase(it) : std::next(it);
    EXPECT_EQ(r, cached) << medium_name(m);
  }
  EXPECT_EQ(bm.cached_blocks(Medium::kDisk).size(), 11u) << "group 0's blocks of both prompts (5 + 6)";
  EXPECT_GT(bm.stats().cached_disk_blocks, 11) << "group 1's blocks are on disk too";
}

// ---------------------------------------------------------------------------------------------------
// A randomized run with a KV oracle: the runner keeps the KV of every device block, host slot and disk
// record (the value written for a position is a function of the whole prefix up to it), performs every
// transfer the manager hands out and fails some; every computed token of every sequence must hold its own
// KV, and every record read back must hold the identity the manager gave when it was written.

namespace {

class Oracle {
 public:
  // Every group's layers have their own KV in each block id (a copy moves all of them).
  Oracle(BlockManager& bm, int32_t block_size)
      : bm_(bm),
        bs_(block_size),
        device_(bm.num_groups(), std::vector<int64_t>(size_t(bm.gpu_pool().num_blocks()) * block_size, -1)),
        host_(bm.num_groups(), std::vector<int64_t>(size_t(bm.host_pool().num_blocks()) * block_size, -1)),
        disk_(bm.num_groups(), std::vector<int64_t>(size_t(bm.disk_pool().num_blocks()) * block_size, -1)),
        header_(size_t(bm.disk_pool().num_blocks())) {}

  static int64_t kv_of(const std::vector<int64_t>& tokens, int64_t pos, int32_t group) {
    uint64_t h = 1469598103934665603ull + uint64_t(group);
    for (int64_t p = 0; p <= pos; ++p) h = (h ^ uint64_t(tokens[p])) * 1099511628211ull;
    return static_cast<int64_t>(h >> 1);
  }
  void run_copies(std::mt19937& rng, double fail) {
    std::bernoulli_distribution failed(fail);
    for (const auto& [src, dst] : bm_.take_copies()) copy(device_, src, device_, dst);
    std::vector<bool> ok;
    for (const auto& [block, slot] : bm_.take_offloads()) {
      ok.push_back(!failed(rng));
      if (ok.back()) copy(device_, block, host_, slot);
      else scribble(host_, slot);
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
  // The disk I/O, which may lag a step behind (taken now, completed at a later call).
  void run_disk_io(std::mt19937& rng, double fail) {
    std::bernoulli_distribution failed(fail);
    std::vector<bool> ok;
    for (const auto& [slot, record] : writes_) {
      ok.push_back(!failed(rng));
      if (ok.back()) {  // a write replaces the file whole (a failed one leaves the old file)
        copy(host_, slot, disk_, record);
        header_[record] = header_of(bm_.disk_record_identity(record));
      }
    }
    if (!writes_.empty()) bm_.complete_disk_writes(ok);
    ok.clear();
    for (const auto& [record, slot] : reads_) {
      // The header must be the one written for this record's content; a corrupt file fails the read.
      const bool good = header_[record] == header_of(bm_.disk_record_identity(record)) && !failed(rng);
      if (good) copy(disk_, record, host_, slot);
      else scribble(host_, slot);
      ok.push_back(good);
    }
    if (!reads_.empty()) bm_.complete_disk_reads(ok);
    writes_ = bm_.take_disk_writes();
    reads_ = bm_.take_disk_reads();
  }
  void drain(std::mt19937& rng) {
    run_disk_io(rng, 0.0);
    run_disk_io(rng, 0.0);
  }
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
  Kv device_, host_, disk_;
  std::vector<std::vector<int64_t>> readmit_;
  using Header = std::tuple<uint64_t, std::optional<uint64_t>, std::vector<int64_t>>;
  static Header header_of(const DiskTier::Identity& id) { return {id.hash, id.parent, id.tokens}; }
  std::vector<Header> header_;
  std::vector<BlockPair> writes_, reads_;
};

void run_oracle(HashAlgo algo, uint32_t seed, const std::vector<int64_t>& windows = {BlockManager::kFullAttention}) {
  const int32_t num_groups = static_cast<int32_t>(windows.size());
  BlockManagerConfig c = tiered(16 * num_groups, 4, 8 * num_groups, 24 * num_groups);
  c.hash_algo = algo;
  c.group_windows = windows;
  BlockManager bm(c);
  Oracle oracle(bm, 4);
  std::mt19937 rng(seed);
  std::vector<std::vector<int64_t>> prefixes(6);
  for (auto& p : prefixes) {
    p.resize(4 * (1 + rng() % 4));
    for (auto& x : p) x = rng() % 3;
  }
  std::vector<int64_t> live;
  int64_t next_id = 0;
  const auto admit = [&](const std::vector<int64_t>& t) {
    if (rng() % 2) {  // prefetch, and sometimes wait for the reads before admitting
      bm.prefetch(t);
      if (rng() % 2) oracle.drain(rng);
    }
    if (bm.can_allocate(t) != AllocStatus::kOk) return;
    bm.allocate(next_id, t);
    live.push_back(next_id++);
  };
  const auto drop_freed = [&] {  // sequences a failed load sent back to admission
    live.erase(std::remove_if(live.begin(), live.end(), [&](int64_t id) { return !bm.contains(id); }), live.end());
  };
  for (int step = 0; step < 500; ++step) {
    for (const std::vector<int64_t>& t : oracle.take_readmitted()) admit(t);
    std::vector<int64_t> t = prefixes[rng() % prefixes.size()];
    for (int k = 0, n = 1 + int(rng() % 9); k < n; ++k) t.push_back(rng() % 3);
    admit(t);
    oracle.run_copies(rng, 0.15);
    drop_freed();
    for (int64_t id : live) {
      oracle.check(id);
      if (bm.num_computed_tokens(id) < bm.num_tokens(id)) oracle.compute(id, bm.num_tokens(id));
    }
    for (int64_t id : live)
      if (rng() % 2 && bm.can_append(Span<int64_t>(&id, 1))) {
        bm.append_token(id, rng() % 3);
        oracle.run_copies(rng, 0.15);
        oracle.compute(id, bm.num_tokens(id));
      }
    while (live.size() > 3 || (!live.empty() && rng() % 3 == 0)) {
      const size_t k = rng() % live.size();
      bm.free(live[k]);
      live.erase(live.begin() + k);
    }
    bm.plan_offloads(static_cast<int32_t>(rng() % 4));
    bm.plan_disk_writes(static_cast<int32_t>(rng() % 4));
    if (rng() % 2) oracle.run_copies(rng, 0.15);
    drop_freed();
    oracle.run_disk_io(rng, 0.15);
    if (rng() % 100 == 0) bm.reset_prefix_cache();
    bm.check_invariants();
    for (int64_t id : live) oracle.check(id);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(bm.stats().disk_writes, 20);
  EXPECT_GT(bm.stats().disk_reads, 10);
  EXPECT_GT(bm.stats().loaded_blocks, 10);
}

}  // namespace

TEST(DiskTier, OracleEveryComputedTokenHoldsItsOwnKv) { run_oracle(HashAlgo::kXXH64, 1); }
TEST(DiskTier, OracleUnderForcedHashCollisions) { run_oracle(HashAlgo::kWeak8, 2); }
TEST(DiskTier, OracleSlidingWindow) { run_oracle(HashAlgo::kXXH64, 3, {8}); }
TEST(DiskTier, OracleHybridGroups) { run_oracle(HashAlgo::kXXH64, 4, {BlockManager::kFullAttention, 8}); }
TEST(DiskTier, OracleHybridGroupsUnderForcedHashCollisions) {
  run_oracle(HashAlgo::kWeak8, 5, {6, BlockManager::kFullAttention});
}
