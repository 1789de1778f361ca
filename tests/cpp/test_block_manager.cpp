// BlockManager core behaviour, checked without Python: allocation, prefix hits, eviction order,
// copy-on-write, swapping, exactness under forced hash collisions, and errors that change nothing.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "core/block_manager.h"
#include "core/errors.h"

using namespace pagedkv;

namespace {

std::vector<int64_t> iota_tokens(int64_t n, int64_t start = 0) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// A configuration of num_blocks blocks of block_size tokens, the rest at the defaults.
BlockManagerConfig sized(int32_t num_blocks, int32_t block_size) {
  BlockManagerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  return c;
}

int64_t alloc(BlockManager& bm, int64_t id, const std::vector<int64_t>& t, std::string_view salt = {}) {
  return bm.allocate(id, t, salt);
}

}  // namespace

TEST(BlockManager, AllBlocksUsableAndSlotsFollowTable) {
  BlockManager bm(4, 4);
  auto t = iota_tokens(16);
  EXPECT_EQ(bm.can_allocate(t), AllocStatus::kOk);
  EXPECT_EQ(alloc(bm, 1, t), 0);
  EXPECT_EQ(bm.gpu_pool().num_free(), 0);
  const auto& table = bm.block_table(1);
  std::vector<int64_t> slots(16);
  bm.slot_mapping(1, 0, 16, into(slots));
  for (int p = 0; p < 16; ++p) EXPECT_EQ(slots[p], table[p / 4] * 4 + p % 4);
  bm.check_invariants();
}

TEST(BlockManager, PrefixHitAfterMarkComputedOnly) {
  BlockManager bm(16, 4);
  auto t = iota_tokens(10);
  alloc(bm, 1, t);
  EXPECT_EQ(alloc(bm, 2, t), 0) << "hashes must not be registered before mark_computed";
  bm.mark_computed({1});
  EXPECT_EQ(alloc(bm, 3, t), 8);  // 2 full blocks hit, the partial last block is computed
  EXPECT_EQ(bm.block_table(3)[0], bm.block_table(1)[0]);
  EXPECT_EQ(bm.block_table(3)[1], bm.block_table(1)[1]);
  bm.check_invariants();
}

TEST(BlockManager, LastFullBlockIsAlwaysComputed) {
  BlockManager bm(16, 4);
  auto t = iota_tokens(8);
  alloc(bm, 1, t);
  bm.mark_computed({1});
  EXPECT_EQ(alloc(bm, 2, t), 4);
}

TEST(BlockManager, EvictsLeastRecentlyFreedTailFirst) {
  BlockManager bm(6, 2);
  auto a = iota_tokens(6, 0), b = iota_tokens(6, 100);
  alloc(bm, 1, a);
  bm.mark_computed({1});
  alloc(bm, 2, b);
  bm.mark_computed({2});
  auto ta = bm.block_table(1);
  bm.free(1);
  bm.free(2);
  // One new 2-block prompt evicts a's last block first, then a's middle block.
  auto c = iota_tokens(4, 500);
  alloc(bm, 3, c);
  EXPECT_EQ(bm.block_table(3)[0], ta[2]);
  EXPECT_EQ(bm.block_table(3)[1], ta[1]);
  EXPECT_EQ(bm.stats().evictions, 2);
  // a's first block still hits.
  EXPECT_EQ(alloc(bm, 4, a), 2);
  bm.check_invariants();
}

TEST(BlockManager, ForkCopiesOnWrite) {
  BlockManager bm(8, 4);
  auto t = iota_tokens(6);
  alloc(bm, 1, t);
  bm.fork(1, 2);
  const int32_t shared_last = bm.block_table(1)[1];
  const int64_t slot = bm.append_token(2, 42);
  auto copies = bm.take_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].first, shared_last);
  EXPECT_EQ(slot, int64_t(copies[0].second) * 4 + 2);
  EXPECT_EQ(bm.append_token(1, 43), int64_t(shared_last) * 4 + 2) << "the last owner writes in place";
  EXPECT_TRUE(bm.take_copies().empty());
  bm.check_invariants();
}

TEST(BlockManager, SwapOutAndIn) {
  BlockManager bm(4, 4, /*num_cpu_blocks=*/4);
  auto t = iota_tokens(12);
  alloc(bm, 1, t);
  bm.fork(1, 2);
  auto out = bm.swap_out({1, 2});
  EXPECT_EQ(out.size(), 3u) << "shared blocks are copied once";
  EXPECT_EQ(bm.gpu_pool().num_free(), 4);
  EXPECT_EQ(bm.cpu_pool().num_free(), 1);
  EXPECT_EQ(bm.can_swap_in({1, 2}), AllocStatus::kOk);
  auto in = bm.swap_in({1, 2});
  EXPECT_EQ(in.size(), 3u);
  EXPECT_EQ(bm.cpu_pool().num_free(), 4);
  EXPECT_EQ(bm.block_table(1), bm.block_table(2));
  bm.check_invariants();
}

TEST(BlockManager, ErrorsLeaveStateUnchanged) {
  BlockManager bm(3, 4);
  auto t = iota_tokens(8);
  alloc(bm, 1, t);
  EXPECT_THROW(alloc(bm, 1, t), ValueError);
  EXPECT_THROW(alloc(bm, 2, iota_tokens(9)), OutOfBlocks);
  EXPECT_THROW(bm.free(7), KeyError);
  EXPECT_THROW(bm.swap_out({1}), ValueError);
  std::vector<int64_t> slots;
  EXPECT_THROW(bm.append_tokens({1, 1}, {5, 6}, std::nullopt, into(slots)), ValueError);
  EXPECT_EQ(bm.gpu_pool().num_free(), 1);
  EXPECT_EQ(bm.num_tokens(1), 8);
  bm.check_invariants();
}

TEST(BlockManager, WatermarkGivesLaterAndNever) {
  BlockManagerConfig c = sized(10, 4);
  c.watermark = 0.2;  // 2 blocks held back
  BlockManager bm(c);
  auto big = iota_tokens(4 * 9);
  EXPECT_EQ(bm.can_allocate(big), AllocStatus::kNever);
  auto fits = iota_tokens(4 * 8);
  EXPECT_EQ(bm.can_allocate(fits), AllocStatus::kOk);
  alloc(bm, 1, iota_tokens(4, 1000));
  EXPECT_EQ(bm.can_allocate(fits), AllocStatus::kLater);
}

TEST(BlockManager, SaltIsolatesTenants) {
  BlockManager bm(16, 4);
  auto t = iota_tokens(12);
  alloc(bm, 1, t, "alice");
  bm.mark_computed({1});
  EXPECT_EQ(alloc(bm, 2, t, "bob"), 0);
  EXPECT_EQ(alloc(bm, 3, t), 0);
  EXPECT_EQ(alloc(bm, 4, t, "alice"), 8);
}

// With an 8-bit hash and a 2-token vocabulary, hashes collide constantly; every hit must still hand out
// a block whose KV was written for exactly the same prefix.
TEST(BlockManager, ForcedCollisionsNeverGiveWrongHits) {
  BlockManagerConfig c = sized(64, 2);
  c.hash_algo = HashAlgo::kWeak8;
  BlockManager bm(c);
  std::mt19937 rng(1234);
  std::vector<std::vector<int64_t>> written(64);  // prefix whose KV each physical block holds
  std::vector<int64_t> live;
  int64_t next_id = 0;
  std::map<int64_t, std::vector<int64_t>> prompts;
  for (int step = 0; step < 2000; ++step) {
    if (!live.empty() && (rng() % 3 == 0 || bm.gpu_pool().num_free() < 6)) {
      const size_t k = rng() % live.size();
      bm.free(live[k]);
      live.erase(live.begin() + k);
      continue;
    }
    std::vector<int64_t> t(2 + rng() % 9);
    for (auto& x : t) x = rng() % 2;
    if (bm.can_allocate(t) != AllocStatus::kOk) continue;
    const int64_t id = next_id++;
    const int64_t cached = alloc(bm, id, t);
    const auto& table = bm.block_table(id);
    for (int64_t i = 0; i < cached / 2; ++i) {
      std::vector<int64_t> prefix(t.begin(), t.begin() + 2 * (i + 1));
      ASSERT_EQ(written[table[i]], prefix) << "wrong hit at step " << step;
    }
    for (size_t i = cached / 2; i < table.size(); ++i)
      written[table[i]] = std::vector<int64_t>(t.begin(), t.begin() + std::min<size_t>(2 * (i + 1), t.size()));
    bm.mark_computed({id});
    live.push_back(id);
    bm.check_invariants();
  }
  EXPECT_GT(bm.stats().hits, 0);
}

TEST(BlockManager, AllocateBatchValidatesEverythingBeforeAdmitting) {
  BlockManager bm(3, 4);
  auto a = iota_tokens(4), b = iota_tokens(4, 100), empty = std::vector<int64_t>();
  alloc(bm, 1, a);
  const auto free_before = bm.gpu_pool().num_free();
  auto span = [](const std::vector<int64_t>& t) { return Span<int64_t>(t); };
  EXPECT_THROW(bm.allocate_batch({5, 1}, {span(a), span(b)}), ValueError);        // an existing id, last
  EXPECT_THROW(bm.allocate_batch({5, 5}, {span(a), span(b)}), ValueError);        // a repeated new id
  EXPECT_THROW(bm.allocate_batch({5, 6}, {span(a), span(empty)}), ValueError);    // an empty prompt
  EXPECT_THROW(bm.allocate_batch({5, 6}, {span(a)}), ValueError);                 // lengths differ
  EXPECT_THROW(bm.allocate_batch({5}, {span(a)}, {"x", "y"}), ValueError);        // salts differ
  EXPECT_FALSE(bm.contains(5));
  EXPECT_EQ(bm.gpu_pool().num_free(), free_before);
  const auto cached = bm.allocate_batch({5, 6, 7}, {span(a), span(b), span(a)});  // room for two
  EXPECT_EQ(cached.size(), 2u);
  EXPECT_TRUE(bm.contains(6) && !bm.contains(7));
  bm.check_invariants();
}

TEST(BlockManager, MarkComputedRefusesDuplicateIds) {
  BlockManager bm(8, 4);
  alloc(bm, 1, iota_tokens(10));
  const std::vector<int64_t> counts = {8, 6};
  EXPECT_THROW(bm.mark_computed({1, 1}, Span<int64_t>(counts)), ValueError);
  EXPECT_THROW(bm.mark_computed({1, 1}), ValueError);
  EXPECT_EQ(bm.num_computed_tokens(1), 0);
  bm.check_invariants();
}

TEST(BlockManager, PendingCopyDroppedWithItsDestination) {
  BlockManager bm(8, 4);
  alloc(bm, 1, iota_tokens(6));
  bm.fork(1, 2);
  bm.append_token(2, 42);  // pending (shared, copy)
  bm.free(2);
  EXPECT_TRUE(bm.take_copies().empty()) << "the copy's destination is a free block now";
  bm.check_invariants();
}

TEST(BlockManager, SwapOutOfPendingCopyReadsItsSource) {
  BlockManager bm(8, 4, /*num_cpu_blocks=*/8);
  alloc(bm, 1, iota_tokens(6));
  bm.fork(1, 2);
  const int32_t shared_last = bm.block_table(1)[1];
  bm.append_token(2, 42);
  const int32_t copy = bm.block_table(2)[1];
  const auto mapping = bm.swap_out({2});
  ASSERT_EQ(mapping.size(), 2u);
  EXPECT_EQ(mapping[1].first, shared_last) << "the copy never happened: its source holds the KV";
  EXPECT_NE(mapping[1].first, copy);
  EXPECT_TRUE(bm.take_copies().empty());
  bm.check_invariants();
}

TEST(BlockManager, PendingCopySourceIsNotHandedOutUntilTaken) {
  BlockManager bm(3, 4);
  alloc(bm, 1, iota_tokens(6));  // blocks 0..1 of 3
  bm.fork(1, 2);
  const int32_t shared_last = bm.block_table(1)[1];
  bm.append_token(2, 42);  // copy (shared_last -> the third block)
  bm.free(1);              // the copy's source has no holder left, but its KV is still to be copied
  EXPECT_EQ(bm.gpu_pool().num_free(), 0) << "the source must stay out of the free list";
  bm.check_invariants();
  const auto copies = bm.take_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].first, shared_last);
  EXPECT_EQ(bm.gpu_pool().num_free(), 1);
  bm.check_invariants();
}

TEST(BlockManager, CopyOfAPendingCopyReadsTheOriginal) {
  BlockManager bm(8, 4);
  alloc(bm, 1, iota_tokens(6));
  bm.fork(1, 2);
  const int32_t original = bm.block_table(1)[1];
  bm.append_token(2, 42);  // (original -> c1)
  bm.fork(2, 3);
  bm.append_token(3, 43);  // c1 is shared by 2 and 3 and not yet written: copy from the original
  const auto copies = bm.take_copies();
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[1].first, original);
  EXPECT_NE(copies[1].first, copies[0].second) << "copies of one batch must not form a chain";
  bm.check_invariants();
}

TEST(BlockManager, SpeculativeAppendAndTruncate) {
  BlockManager bm(8, 4);
  alloc(bm, 1, iota_tokens(3));
  bm.mark_computed({1});
  const std::vector<int64_t> ids = {1}, counts = {5}, drafts = {3, 70, 71, 72, 73};
  EXPECT_TRUE(bm.can_append(ids, /*num_lookahead_slots=*/4));
  std::vector<int64_t> slots(5);
  bm.append_tokens(ids, drafts, Span<int64_t>(counts), into(slots));
  const auto& table = bm.block_table(1);
  for (int p = 3; p < 8; ++p) EXPECT_EQ(slots[p - 3], table[p / 4] * 4 + p % 4);
  EXPECT_EQ(bm.gpu_pool().num_free(), 6);
  bm.truncate({1}, {5});
  EXPECT_EQ(bm.num_tokens(1), 5);
  EXPECT_EQ(bm.block_table(1).size(), 2u);
  EXPECT_THROW(bm.truncate({1}, {6}), ValueError);
  EXPECT_THROW(bm.truncate({1, 1}, {2, 2}), ValueError);
  bm.check_invariants();
}

TEST(BlockManager, TruncateIntoCachedBlockCopiesOnNextWrite) {
  BlockManager bm(8, 4);
  alloc(bm, 1, iota_tokens(8));
  bm.mark_computed({1});
  const int32_t cached = bm.block_table(1)[1];
  bm.truncate({1}, {6});
  bm.append_token(1, 99);
  EXPECT_NE(bm.block_table(1)[1], cached) << "the cached block must keep its KV";
  const auto copies = bm.take_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].first, cached);
  bm.check_invariants();
}

TEST(BlockManager, EventsReplayToCachedBlocks) {
  BlockManagerConfig c = sized(6, 2);
  c.hash_algo = HashAlgo::kWeak8;
  c.enable_events = true;
  BlockManager bm(c);
  std::map<uint64_t, int> replay;
  auto check = [&] {
    for (const KvEvent& e : bm.take_events()) {
      if (e.kind == KvEvent::Kind::kCleared) replay.clear();
      for (uint64_t h : e.block_hashes) replay[h] += e.kind == KvEvent::Kind::kStored ? 1 : -1;
    }
    std::map<uint64_t, int> cached;
    for (const auto& [h, parent] : bm.cached_blocks()) ++cached[h];
    for (auto it = replay.begin(); it != replay.end();) it = it->second == 0 ? replay.erase(it) : std::next(it);
    EXPECT_EQ(replay, cached);
  };
  std::mt19937 rng(7);
  for (int64_t id = 0; id < 300; ++id) {
    std::vector<int64_t> t(1 + rng() % 7);
    for (auto& x : t) x = rng() % 3;
    if (bm.can_allocate(t) != AllocStatus::kOk) {
      bm.reset_prefix_cache();
      for (int64_t old = std::max<int64_t>(0, id - 8); old < id; ++old)
        if (bm.contains(old)) bm.free(old);
      check();
      continue;
    }
    alloc(bm, id, t);
    bm.mark_computed({id});
    if (rng() % 2 && id > 0 && bm.contains(id - 1)) bm.free(id - 1);
    check();
  }
}

// ---------------------------------------------------------------------------------------------------
// Retention priorities, durations and pins

namespace {

int64_t alloc_r(BlockManager& bm, int64_t id, const std::vector<int64_t>& t, std::vector<RetentionRange> r) {
  return bm.allocate(id, t, {}, r);
}

// Allocates, computes and frees a prompt: its full blocks are left cached in the free list.
std::vector<int32_t> cache_prompt(BlockManager& bm, int64_t id, const std::vector<int64_t>& t,
                                  std::vector<RetentionRange> r = {}) {
  alloc_r(bm, id, t, r);
  bm.mark_computed({id});
  std::vector<int32_t> table = bm.block_table(id);
  bm.free(id);
  return table;
}

AllocStatus can_alloc(const BlockManager& bm, const std::vector<int64_t>& t) {
  return bm.can_allocate(t);
}

}  // namespace

TEST(Retention, LowestPriorityIsEvictedFirstThenLru) {
  BlockManager bm(10, 2);
  const auto sys = iota_tokens(6, 0), user = iota_tokens(6, 100);
  const auto s = cache_prompt(bm, 1, sys, {{0, 6, 90}});  // freed first, but priority 90
  const auto u = cache_prompt(bm, 2, user);                 // default 35
  EXPECT_EQ(bm.block_priority(s[0]), 90);
  EXPECT_EQ(bm.block_priority(u[0]), kDefaultPriority);
  // The 4 never-used blocks go first (level 0), then the user prompt's blocks tail first, not the system's.
  alloc(bm, 3, iota_tokens(14, 500));  // 7 blocks
  EXPECT_EQ(bm.stats().evictions, 3);
  EXPECT_EQ(std::vector<int32_t>(bm.block_table(3).begin() + 4, bm.block_table(3).end()),
            (std::vector<int32_t>{u[2], u[1], u[0]}));
  bm.free(3);
  EXPECT_EQ(alloc(bm, 4, sys), 4) << "the priority-90 prefix survived";
  bm.check_invariants();
}

TEST(Retention, WithoutRetentionEvictionIsPlainLru) {
  BlockManager bm(6, 2);
  const auto a = cache_prompt(bm, 1, iota_tokens(6, 0));
  const auto b = cache_prompt(bm, 2, iota_tokens(6, 100));
  alloc(bm, 3, iota_tokens(8, 500));  // 4 blocks: least recently freed first, each sequence tail first
  EXPECT_EQ(bm.block_table(3), (std::vector<int32_t>{a[2], a[1], a[0], b[2]}));
  bm.check_invariants();
}

TEST(Retention, HighestOverlappingRangeWinsAndSharedBlocksKeepTheHighest) {
  BlockManager bm(16, 4);
  const auto t = iota_tokens(16);
  // Block 0: ranges 60 and 80 overlap it -> 80. Block 1 (tokens 4-7): only the 60 range (ends at 5).
  // Block 2: no range -> default. Block 3: a range of priority 10 -> 10 (below the default).
  alloc_r(bm, 1, t, {{0, 5, 60}, {2, 3, 80}, {12, 16, 10}});
  const auto table = bm.block_table(1);
  EXPECT_EQ(bm.block_priority(table[0]), 80);
  EXPECT_EQ(bm.block_priority(table[1]), 60);
  EXPECT_EQ(bm.block_priority(table[2]), kDefaultPriority);
  EXPECT_EQ(bm.block_priority(table[3]), 10);
  bm.mark_computed({1});
  // A second sequence hits blocks 0-2 with priority 50 everywhere: 80 and 60 stay, the default rises.
  alloc_r(bm, 2, t, {{0, kToTheEnd, 50}});
  EXPECT_EQ(bm.block_priority(table[0]), 80);
  EXPECT_EQ(bm.block_priority(table[1]), 60);
  EXPECT_EQ(bm.block_priority(table[2]), 50);
  bm.free(1);
  bm.free(2);
  bm.check_invariants();
}

TEST(Retention, DecodeBlocksTakeTheDecodePriorityOrACoveringRange) {
  BlockManagerConfig c = sized(16, 2);
  c.default_priority = 35;
  c.decode_priority = 5;
  BlockManager bm(c);
  alloc_r(bm, 1, iota_tokens(4), {});
  alloc_r(bm, 2, iota_tokens(4, 10), {{0, kToTheEnd, 70}});
  bm.append_token(1, 9);
  bm.append_token(2, 9);
  EXPECT_EQ(bm.block_priority(bm.block_table(1)[2]), 5);
  EXPECT_EQ(bm.block_priority(bm.block_table(2)[2]), 70);
  EXPECT_EQ(bm.block_priority(bm.block_table(1)[0]), 35);
  bm.check_invariants();
}

TEST(Retention, DurationRunsFromTheFreeAndFallsBackToTheDefault) {
  BlockManager bm(6, 2);
  const auto sys = iota_tokens(6, 0);
  alloc_r(bm, 1, sys, {{0, 6, 90, /*duration=*/10.0}});
  bm.mark_computed({1});
  bm.set_time(100.0);  // in use: the duration has not started
  const auto s = bm.block_table(1);
  bm.free(1);
  EXPECT_EQ(bm.block_priority(s[0]), 90);
  const auto u = cache_prompt(bm, 2, iota_tokens(6, 100));
  bm.set_time(109.5);
  bm.check_invariants();
  EXPECT_EQ(bm.block_priority(s[0]), 90);
  bm.set_time(110.0);
  EXPECT_EQ(bm.block_priority(s[0]), kDefaultPriority);
  bm.check_invariants();
  // Back at the default, as if freed at 110: after the user prompt (freed at 100) in LRU order.
  alloc(bm, 3, iota_tokens(8, 500));  // 4 blocks
  EXPECT_EQ(bm.block_table(3), (std::vector<int32_t>{u[2], u[1], u[0], s[2]}));
  EXPECT_THROW(bm.set_time(50.0), ValueError);
  EXPECT_THROW(bm.set_time(std::nan("")), ValueError);
  EXPECT_EQ(bm.now(), 110.0);
  bm.check_invariants();
}

TEST(Retention, RevivedBlockRestartsItsDuration) {
  BlockManager bm(8, 2);
  const auto sys = iota_tokens(6, 0);
  const auto s = cache_prompt(bm, 1, sys, {{0, 6, 90, 10.0}});  // freed at 0: falls back at 10
  bm.set_time(8.0);
  EXPECT_EQ(alloc(bm, 2, sys), 4);  // revived: the entry expiring at 10 is stale now
  bm.set_time(12.0);
  EXPECT_EQ(bm.block_priority(s[0]), 90);
  bm.free(2);  // freed at 12: falls back at 22
  bm.set_time(21.0);
  EXPECT_EQ(bm.block_priority(s[0]), 90);
  bm.set_time(22.0);
  EXPECT_EQ(bm.block_priority(s[0]), kDefaultPriority);
  bm.check_invariants();
}

TEST(Retention, ZeroDurationFallsBackAtOnce) {
  BlockManager bm(8, 2);
  const auto s = cache_prompt(bm, 1, iota_tokens(6), {{0, 6, 90, 0.0}});
  EXPECT_EQ(bm.block_priority(s[0]), kDefaultPriority);
  bm.check_invariants();
}

TEST(Retention, BadRangesAreValueErrorsAndChangeNothing) {
  BlockManager bm(8, 2);
  const auto t = iota_tokens(6);
  const std::vector<std::vector<RetentionRange>> bad = {
      {{0, 6, 101}}, {{0, 6, -1}}, {{4, 2, 50}}, {{-1, 2, 50}}, {{0, 6, 50, -1.0}}, {{0, 6, 50, std::nan("")}}};
  for (const auto& r : bad) {
    EXPECT_THROW(alloc_r(bm, 1, t, r), ValueError);
    EXPECT_FALSE(bm.contains(1));
    EXPECT_EQ(bm.gpu_pool().num_free(), 8);
    std::vector<Span<int64_t>> spans = {Span<int64_t>(t)};
    EXPECT_THROW(bm.allocate_batch({1}, spans, {}, {r}), ValueError);
    EXPECT_FALSE(bm.contains(1));
  }
  BlockManagerConfig c = sized(8, 2);
  c.default_priority = 101;
  EXPECT_THROW(BlockManager{c}, ValueError);
  c = sized(8, 2);
  c.decode_priority = -1;
  EXPECT_THROW(BlockManager{c}, ValueError);
  c = sized(8, 2);
  c.max_pinned_fraction = 1.0;
  EXPECT_THROW(BlockManager{c}, ValueError);
  bm.check_invariants();
}

TEST(Retention, PinnedBlocksStayCachedAfterFreeUntilUnpin) {
  BlockManagerConfig c = sized(8, 2);
  c.max_pinned_fraction = 0.5;
  BlockManager bm(c);
  const auto sys = iota_tokens(7, 0);  // 3 full blocks + 1
  alloc(bm, 1, sys);
  EXPECT_EQ(bm.pin(1), 0) << "nothing is cached before mark_computed";
  bm.mark_computed({1});
  EXPECT_EQ(bm.pin(1), 3);
  const std::vector<int32_t> pinned = bm.pins().blocks(1);
  bm.free(1);
  EXPECT_TRUE(bm.pins().is_pinned(1));
  EXPECT_EQ(bm.gpu_pool().num_free(), 5) << "pinned blocks are never free";
  EXPECT_EQ(bm.stats().pinned_blocks, 3);
  // Pressure: a 5-block prompt fits, a 6-block one never does while the pin holds.
  EXPECT_EQ(can_alloc(bm, iota_tokens(10, 100)), AllocStatus::kOk);
  EXPECT_EQ(can_alloc(bm, iota_tokens(12, 100)), AllocStatus::kNever);
  alloc(bm, 2, iota_tokens(10, 100));
  EXPECT_EQ(can_alloc(bm, iota_tokens(2, 300)), AllocStatus::kLater);
  bm.free(2);
  // The pinned prefix still hits; its blocks count as in use, so a sys-sharing prompt of 8 blocks fits.
  auto longer = sys;
  for (int64_t x = 0; x < 9; ++x) longer.push_back(1000 + x);  // 16 tokens: 8 blocks, 3 of them pinned hits
  EXPECT_EQ(can_alloc(bm, longer), AllocStatus::kOk);
  EXPECT_EQ(alloc(bm, 3, longer), 6);
  EXPECT_EQ(std::vector<int32_t>(bm.block_table(3).begin(), bm.block_table(3).begin() + 3), pinned);
  bm.free(3);
  bm.unpin(1);
  EXPECT_FALSE(bm.pins().is_pinned(1));
  EXPECT_EQ(bm.gpu_pool().num_free(), 8);
  EXPECT_THROW(bm.unpin(1), KeyError);
  bm.check_invariants();
}

TEST(Retention, PinCapIsAClearErrorThatChangesNothing) {
  BlockManagerConfig c = sized(10, 2);
  c.max_pinned_fraction = 0.5;
  BlockManager bm(c);
  alloc(bm, 1, iota_tokens(7, 0));    // 3 full blocks
  alloc(bm, 2, iota_tokens(7, 100));  // 3 full blocks (4 + 4 of 10 blocks in use)
  bm.mark_computed({1, 2});
  EXPECT_EQ(bm.pin(1), 3);
  EXPECT_THROW(bm.pin(2), OutOfBlocks);  // 6 > 5
  EXPECT_FALSE(bm.pins().is_pinned(2));
  EXPECT_EQ(bm.pins().num_pinned(), 3);
  EXPECT_EQ(bm.pin(1), 3) << "pinning again holds the same blocks, not twice as many";
  EXPECT_EQ(bm.pins().num_pinned(), 3);
  EXPECT_THROW(bm.pin(99), KeyError);
  bm.check_invariants();
}

TEST(Retention, PinSurvivesSwapAndResetLetsGo) {
  BlockManager bm(8, 2, /*num_cpu_blocks=*/8);
  alloc(bm, 1, iota_tokens(5));
  bm.mark_computed({1});
  bm.pin(1);
  bm.swap_out({1});
  EXPECT_THROW(bm.pin(1), ValueError) << "a swapped-out sequence cannot be pinned";
  EXPECT_EQ(bm.gpu_pool().num_free(), 6) << "the pin keeps its 2 blocks on the GPU";
  bm.check_invariants();
  bm.reset_prefix_cache();
  EXPECT_FALSE(bm.pins().is_pinned(1));
  EXPECT_EQ(bm.gpu_pool().num_free(), 8);
  bm.check_invariants();
}

TEST(Retention, SwapInAndCopyOnWriteCarryTheSequencesPriority) {
  BlockManager bm(8, 2, /*num_cpu_blocks=*/8);
  alloc_r(bm, 1, iota_tokens(5), {{0, kToTheEnd, 80}});
  bm.fork(1, 2);
  bm.append_token(2, 7);  // copy of the shared last block
  EXPECT_EQ(bm.block_priority(bm.block_table(2)[2]), 80);
  bm.take_copies();
  bm.swap_out({1});
  bm.swap_in({1});
  for (int32_t b : bm.block_table(1)) EXPECT_EQ(bm.block_priority(b), 80);
  bm.check_invariants();
}

TEST(Retention, EvictingAPriorityBlockIsARemovedEvent) {
  BlockManagerConfig c = sized(4, 2);
  c.enable_events = true;
  BlockManager bm(c);
  cache_prompt(bm, 1, iota_tokens(3), {{0, 3, 90}});  // 1 cached block at 90
  bm.take_events();
  alloc(bm, 2, iota_tokens(7, 100));  // 4 blocks: the cached one is evicted last but evicted
  const auto events = bm.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, KvEvent::Kind::kRemoved);
  EXPECT_TRUE(bm.cached_blocks().empty());
}

TEST(Retention, APinnedRegistrationIsNotSupersededByALaterIdenticalOne) {
  BlockManager bm(12, 2);
  const auto t = iota_tokens(5);
  alloc(bm, 1, t);
  alloc(bm, 2, t);  // same wave: no hit, its own blocks
  bm.mark_computed({1});
  ASSERT_EQ(bm.pin(1), 2);
  const auto pinned = bm.pins().blocks(1);
  bm.mark_computed({2});  // without the pin, seq 2's blocks would become the ones that hit
  bm.free(1);
  bm.free(2);
  alloc(bm, 3, iota_tokens(20, 100));  // 10 blocks: evicts everything that is not pinned
  bm.free(3);
  EXPECT_EQ(alloc(bm, 4, t), 4);
  EXPECT_EQ(std::vector<int32_t>(bm.block_table(4).begin(), bm.block_table(4).begin() + 2), pinned);
  bm.check_invariants();
}

TEST(Retention, AnEmptyRangeOverlapsNothing) {
  BlockManager bm(8, 4);
  alloc_r(bm, 1, iota_tokens(8), {{5, 5, 90}});
  for (int32_t b : bm.block_table(1)) EXPECT_EQ(bm.block_priority(b), kDefaultPriority);
}

// ---------------------------------------------------------------------------------------------------
// Sliding windows and hybrid groups

namespace {

BlockManager windowed(int32_t num_blocks, int32_t bs, std::vector<int64_t> windows, int32_t cpu_blocks = 0) {
  BlockManagerConfig c = sized(num_blocks, bs);
  c.num_cpu_blocks = cpu_blocks;
  c.group_windows = std::move(windows);
  return BlockManager(c);
}

}  // namespace

TEST(SlidingWindow, BadWindowsAreValueErrors) {
  EXPECT_THROW(windowed(8, 4, {}), ValueError);
  EXPECT_THROW(windowed(8, 4, {-1}), ValueError);
  EXPECT_THROW(windowed(8, 4, std::vector<int64_t>(BlockManager::kMaxGroups + 1, 0)), ValueError);
  BlockManager bm = windowed(8, 4, {0, 16});
  EXPECT_EQ(bm.num_groups(), 2);
  EXPECT_TRUE(bm.has_windows());
  alloc(bm, 1, iota_tokens(5));
  EXPECT_THROW(bm.block_table(1, 2), ValueError);
  EXPECT_THROW(bm.num_released_blocks(1, -1), ValueError);
}

TEST(SlidingWindow, ReleasesExactlyTheBlocksNoFutureQueryReads) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    const int32_t bs = 1 << (rng() % 4);
    const int64_t window = 1 + rng() % 30;
    BlockManager bm = windowed(512, bs, {window});
    int64_t n = 1 + rng() % 40;
    alloc(bm, 1, iota_tokens(n));
    for (int step = 0; step < 20; ++step) {
      bm.mark_computed({1});
      // The query at position n reads (n - window, n]: a block is released iff it ends before n - window + 1.
      const std::vector<int32_t>& table = bm.block_table(1);
      int32_t released = 0;
      for (size_t i = 0; i < table.size(); ++i)
        if (int64_t(i + 1) * bs <= n - window + 1) ++released;
      ASSERT_EQ(bm.num_released_blocks(1), released) << "bs " << bs << " window " << window << " n " << n;
      for (int32_t i = 0; i < released; ++i) EXPECT_EQ(table[i], BlockManager::kPad);
      EXPECT_EQ(bm.gpu_pool().num_free(), 512 - (static_cast<int32_t>(table.size()) - released));
      bm.check_invariants();
      const int64_t k = 1 + rng() % 5;
      const std::vector<int64_t> more = iota_tokens(k, 1000);
      std::vector<int64_t> slots(k);
      bm.append_tokens({1}, more, Span<int64_t>(&k, 1), into(slots));
      n += k;
    }
  }
}

TEST(SlidingWindow, LongDecodeHoldsOnlyTheWindow) {
  BlockManager bm = windowed(6, 4, {12});
  alloc(bm, 1, iota_tokens(10));
  bm.mark_computed({1});
  for (int64_t t = 0; t < 500; ++t) {
    ASSERT_TRUE(bm.can_append({1}));
    bm.append_token(1, t);
    bm.mark_computed({1});
  }
  EXPECT_LE(6 - bm.gpu_pool().num_free(), 12 / 4 + 1);
  bm.check_invariants();
  bm.free(1);
  EXPECT_EQ(bm.gpu_pool().num_free(), 6);
}

TEST(SlidingWindow, HitNeedsOnlyTheWindowsBlocks) {
  BlockManager bm = windowed(12, 4, {8});
  const auto prompt = iota_tokens(33);
  alloc(bm, 1, prompt);
  bm.mark_computed({1});
  ASSERT_EQ(bm.num_released_blocks(1), 6);
  alloc(bm, 2, iota_tokens(36, 500));  // evicts the six released blocks
  EXPECT_EQ(bm.stats().evictions, 6);
  bm.free(2);
  EXPECT_EQ(alloc(bm, 3, prompt), 32);
  EXPECT_EQ(bm.num_released_blocks(3), 6);
  bm.check_invariants();
}

TEST(SlidingWindow, HybridAllocateNeverEvictsItsOwnHits) {
  // Group 1's hit sits in the free list when group 0 takes its fresh blocks: it must be claimed first.
  BlockManager bm = windowed(6, 2, {0, 3}, 4);
  alloc(bm, 1, iota_tokens(4));
  bm.mark_computed({1});  // group 1 releases block 0 (cached, free)
  auto swapped = bm.swap_out({1});
  EXPECT_EQ(swapped.size(), 3u);
  alloc(bm, 2, iota_tokens(3));  // hit of block 0 in both groups; fresh blocks for block 1
  EXPECT_EQ(bm.num_computed_tokens(2), 2);
  bm.check_invariants();
}

TEST(SlidingWindow, GroupsHaveTheirOwnPrefixCache) {
  BlockManager bm = windowed(32, 2, {0, 0});
  alloc(bm, 1, iota_tokens(9));
  bm.mark_computed({1});
  EXPECT_EQ(bm.stats().cached_blocks, 8);
  EXPECT_EQ(bm.cached_blocks().size(), 4u);  // group 0's
  EXPECT_EQ(alloc(bm, 2, iota_tokens(9)), 8);
  for (int32_t g = 0; g < 2; ++g)
    for (int32_t i = 0; i < 4; ++i) EXPECT_EQ(bm.block_table(2, g)[i], bm.block_table(1, g)[i]);
  for (int32_t i = 0; i < 5; ++i)
    for (int32_t j = 0; j < 5; ++j) EXPECT_NE(bm.block_table(1, 0)[i], bm.block_table(1, 1)[j]);
  bm.check_invariants();
}

TEST(SlidingWindow, ForkSwapTruncateKeepPadsAndCounts) {
  BlockManager bm = windowed(32, 4, {5}, 32);
  alloc(bm, 1, iota_tokens(18));
  bm.mark_computed({1});
  ASSERT_EQ(bm.num_released_blocks(1), 3);
  bm.fork(1, 2);
  const std::vector<int64_t> ids{1, 2}, next{7, 8};
  std::vector<int64_t> slots(2);
  bm.append_tokens(ids, next, std::nullopt, into(slots));
  EXPECT_EQ(bm.take_copies().size(), 1u);  // the shared partial block, copied once
  bm.check_invariants();
  const auto out = bm.swap_out({1, 2});
  EXPECT_EQ(out.size(), 3u);  // block 3 shared, the two last blocks
  EXPECT_EQ(bm.block_table(1)[0], BlockManager::kPad);
  EXPECT_EQ(bm.can_swap_in({1, 2}), AllocStatus::kOk);
  bm.swap_in({1, 2});
  bm.check_invariants();
  EXPECT_THROW(bm.truncate({1}, {5}), ValueError);  // would need released KV
  EXPECT_EQ(bm.num_tokens(1), 19);
  bm.check_invariants();
  bm.free(1);
  bm.free(2);
  EXPECT_EQ(bm.gpu_pool().num_free(), 32);
}

TEST(SlidingWindow, AdmissionCountsHeldBlocksOfEveryGroup) {
  BlockManager bm = windowed(10, 4, {0, 8});
  EXPECT_EQ(bm.blocks_held(17, 0), 10);
  EXPECT_EQ(bm.blocks_held(17, 17), 5 + 5 - 2);
  const auto fits = iota_tokens(20), too_long = iota_tokens(21);
  EXPECT_EQ(bm.can_allocate(fits), AllocStatus::kOk);
  EXPECT_EQ(bm.can_allocate(too_long), AllocStatus::kNever);
  EXPECT_THROW(bm.blocks_held(3, 4), ValueError);
}

TEST(SlidingWindow, PromptLongerThanThePoolIsPrefilledInChunks) {
  BlockManager bm = windowed(8, 4, {8});  // 32 tokens of pool
  const auto prompt = iota_tokens(100);
  EXPECT_EQ(bm.can_allocate(prompt), AllocStatus::kNever);
  ASSERT_EQ(bm.can_allocate(prompt, {}, 8), AllocStatus::kOk);
  EXPECT_EQ(bm.allocate(1, prompt, {}, {}, 8), 0);
  EXPECT_EQ(bm.num_allocated_tokens(1), 8);
  std::vector<int64_t> slots(100);
  EXPECT_THROW(bm.slot_mapping(1, 0, 9, into(slots)), ValueError);
  EXPECT_THROW(bm.append_token(1, 5), ValueError);
  for (int64_t done = 0; done < 100;) {
    const int64_t end = std::min<int64_t>(100, done + 8);
    if (bm.num_allocated_tokens(1) < end) {
      ASSERT_TRUE(bm.can_reserve({1}, {end}));
      bm.reserve({1}, {end});
    }
    bm.slot_mapping(1, done, end, into(slots));
    const std::vector<int64_t> n{end};
    bm.mark_computed({1}, Span<int64_t>(n));
    done = end;
    EXPECT_LE(8 - bm.gpu_pool().num_free(), 8 / 4 + 1 + 2);
    bm.check_invariants();
  }
  EXPECT_THROW(bm.reserve({1}, {101}), ValueError);
  bm.append_token(1, 7);
  bm.mark_computed({1});
  bm.check_invariants();
}
