// The block manager: which physical block holds every token's KV. A thin sequence manager over its parts:
// the GPU block pool (block_pool.h: reference counts, free list, retention, content tags), the CPU pool
// used for swapping, the prefix cache (prefix_cache.h), pins (pins.h), pending copy-on-write copies
// (pending_copies.h) and the KV event log (kv_event_log.h). It owns each sequence's block tables (one per
// group of layers), admission, registration of computed blocks and swapping. Every public call validates
// its arguments before changing anything, so an exception leaves the manager exactly as it was.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/block_manager_stats.h"
#include "core/block_pool.h"
#include "core/disk_tier.h"
#include "core/hashing.h"
#include "core/host_tier.h"
#include "core/kv_event_log.h"
#include "core/pending_copies.h"
#include "core/pins.h"
#include "core/prefix_cache.h"
#include "core/retention.h"
#include "core/span.h"
#include "core/util.h"
#include "core/validation.h"

namespace pagedkv {

enum class AllocStatus { kOk = 0, kLater = 1, kNever = 2 };

// Everything a BlockManager is made with; the constructor validates it.
struct BlockManagerConfig {
  static constexpr int64_t kDefaultMaxPendingEvents = 1 << 16;
  static constexpr int64_t kFullAttention = 0;  // a group without a window
  static constexpr int32_t kMaxGroups = 64;
  static constexpr double kDefaultMaxPinnedFraction = 0.5;

  int32_t num_blocks = 0;                    // GPU blocks, all usable (> 0)
  int32_t block_size = 0;                    // tokens per block (> 0)
  int32_t num_cpu_blocks = 0;                // swap space (>= 0)
  bool enable_prefix_caching = true;
  double watermark = 0.0;                    // fraction of num_blocks admission leaves free, in [0, 1)
  HashAlgo hash_algo = HashAlgo::kXXH64;     // the block hashes of events and cached_blocks()
  bool enable_events = false;
  int64_t max_pending_events = kDefaultMaxPendingEvents;  // events kept until taken (>= 1)
  int32_t default_priority = kDefaultPriority;  // retention of prompt blocks no range covers
  int32_t decode_priority = kDefaultPriority;   // ... and of blocks past the prompt
  double max_pinned_fraction = kDefaultMaxPinnedFraction;  // of num_blocks, in [0, 1)
  std::vector<int64_t> group_windows = {kFullAttention};  // one window (tokens) per group of layers
  int32_t num_host_blocks = 0;               // host tier slots of the prefix cache (>= 0; 0: no tier)
  int32_t host_offload_min_priority = kMinPriority;  // blocks below this priority are dropped, not offloaded
  int32_t num_disk_blocks = 0;               // disk tier records below the host tier (>= 0; 0: no tier)
};

// How many leading blocks of a prompt hit, and how many of those the host tier serves (they are loaded).
// With several groups a hit position may be served by a load in one group and a device block in another:
// host_blocks counts the hit from the first position any group loads.
struct TierHits {
  int32_t device_blocks = 0;  // leading hit blocks no group loads (taken as they are)
  int32_t host_blocks = 0;    // the rest of the hit: some group loads these from the host tier
  int32_t disk_blocks = 0;    // blocks after the hit that would hit once the disk tier's reads are confirmed
};

class BlockManager {
 public:
  explicit BlockManager(BlockManagerConfig config);  // ValueError naming the first bad field
  // A manager with the defaults of everything else.
  BlockManager(int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks = 0);
  // Parts point at each other: a manager stays where it was made.
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;
  static constexpr int64_t kDefaultMaxPendingEvents = BlockManagerConfig::kDefaultMaxPendingEvents;
  // Groups of layers (hybrid models): each has its own block table per sequence and a window in tokens
  // (kFullAttention: none). The token at position p attends to positions (p - window, p], so once the
  // KV of the first n tokens is computed, the leading max(0, n - window + 1) / block_size blocks of a
  // windowed group are never read again: mark_computed releases them from its table, which keeps a pad
  // (kPad) in their place.
  static constexpr int64_t kFullAttention = BlockManagerConfig::kFullAttention;
  static constexpr int32_t kPad = 0;
  static constexpr int32_t kMaxGroups = BlockManagerConfig::kMaxGroups;
  static constexpr double kDefaultMaxPinnedFraction = BlockManagerConfig::kDefaultMaxPinnedFraction;

  // num_new_tokens (kWholePrompt: all): admit the prompt for its first chunk only, blocks for the cached
  // tokens and the next num_new_tokens; reserve() allocates each later chunk's. NEVER then means the
  // most the sequence holds over a prefill in such chunks cannot fit.
  static constexpr int64_t kWholePrompt = -1;
  AllocStatus can_allocate(Span<int64_t> tokens, std::string_view salt = {}, int64_t num_new_tokens = kWholePrompt) const;
  // Gives seq_id a block table for its prompt; returns how many leading tokens are already cached.
  // `retention` ranges set its blocks' eviction priority (validated: 0 <= start <= end, priority in
  // [0, 100], duration >= 0); blocks no range overlaps take default_priority (decode_priority for
  // blocks that start past the prompt). A block held by several sequences keeps the highest.
  int64_t allocate(int64_t seq_id, Span<int64_t> tokens, std::string_view salt = {},
                   const std::vector<RetentionRange>& retention = {}, int64_t num_new_tokens = kWholePrompt);
  // Chunked prefill: sequence i gets the blocks of its first num_tokens[i] tokens in every group (no-op
  // for what it has). Call after mark_computed of the previous chunk, which let the window release its
  // earlier blocks. can_reserve: whether the free blocks suffice.
  bool can_reserve(Span<int64_t> seq_ids, Span<int64_t> num_tokens) const;
  void reserve(Span<int64_t> seq_ids, Span<int64_t> num_tokens);
  // Tokens whose slots exist: the whole sequence once every chunk is reserved.
  int64_t num_allocated_tokens(int64_t seq_id) const;
  // Admits prompts in order while can_allocate says OK and returns the cached-token count of each admitted
  // one (prompts [0, result.size()) were admitted). The whole batch is validated first (ids distinct and
  // new, prompts non-empty, one salt per prompt or none), so a bad batch changes nothing.
  std::vector<int64_t> allocate_batch(Span<int64_t> seq_ids, Span<Span<int64_t>> prompts,
                                      const std::vector<std::string>& salts = {},
                                      const std::vector<std::vector<RetentionRange>>& retentions = {});

  // The manager's clock (any unit, the one of the durations; starts at 0, never read from the wall).
  // Advancing it moves the free blocks whose priority duration has run out to the default priority.
  void set_time(double now);
  double now() const { return gpu_.now(); }

  // Pinning: pin(seq_id) holds the sequence's full blocks whose KV the prefix cache has now (call it
  // after mark_computed; again to take in more), so that they stay cached after free() until unpin.
  // Pinned blocks are never free nor evictable; a pin that would hold more than pins().max_pinned()
  // is refused (OutOfBlocks) and changes nothing. Returns the number of blocks the pin holds.
  int32_t pin(int64_t seq_id);
  void unpin(int64_t seq_id);   // KeyError unless pinned; works after the sequence is freed
  // The eviction priority a block has now (tests and check_invariants).
  int32_t block_priority(int32_t block) const;
  // The KV of the first num_tokens[i] (all tokens when num_tokens is none) of each sequence is written:
  // full blocks among them enter the prefix cache. seq_ids must be distinct.
  void mark_computed(Span<int64_t> seq_ids, std::optional<Span<int64_t>> num_tokens = std::nullopt);

  // Room for every sequence to append 1 + num_lookahead_slots tokens now.
  bool can_append(Span<int64_t> seq_ids, int64_t num_lookahead_slots = 0) const;
  // Appends to every group's table; the slots returned are group 0's (slot_mappings(group=g) for the others).
  int64_t append_token(int64_t seq_id, int64_t token_id);
  // Sequence i appends counts[i] tokens (one each when counts is none, each in [0, kMaxTokensPerAppend]),
  // the next ones of token_ids (as many as the counts add up to); slots gets a slot per token, in order.
  // Speculative decoding appends its input and draft tokens.
  void append_tokens(Span<int64_t> seq_ids, Span<int64_t> token_ids, std::optional<Span<int64_t>> counts,
                     const Out<int64_t>& slots);
  // Rolls sequence i back to its first num_tokens[i] tokens (rejected draft tokens): blocks past them
  // leave its table (cached ones stay cached); the next append into a block left partial copies it first
  // if it is shared or cached.
  void truncate(Span<int64_t> seq_ids, Span<int64_t> num_tokens);
  static constexpr int64_t kMaxTokensPerAppend = pagedkv::kMaxTokensPerAppend;
  // Copy-on-write copies queued by append_tokens, to perform before the next KV write; they are
  // independent (no copy reads another's destination). Until they are taken, a copy's source is never
  // handed out again, a copy whose destination is freed (its sequence freed or swapped out) is dropped,
  // and a swap-out of a destination reads the copy's source instead.
  std::vector<BlockPair> take_copies();

  void free(int64_t seq_id);
  void fork(int64_t parent_seq_id, int64_t child_seq_id);

  // Distinct blocks the sequences hold over every group (a block they share counts once; entries a window
  // released excepted): what swap_out / swap_in moves. The sequences are all resident or all swapped out.
  int32_t distinct_blocks(Span<int64_t> seq_ids) const;
  bool can_swap_out(Span<int64_t> seq_ids) const;
  std::vector<BlockPair> swap_out(Span<int64_t> seq_ids);  // (gpu, cpu)
  AllocStatus can_swap_in(Span<int64_t> seq_ids, int64_t num_lookahead_slots = 0) const;
  std::vector<BlockPair> swap_in(Span<int64_t> seq_ids);   // (cpu, gpu)

  // Group `group`'s table: released entries hold kPad.
  const std::vector<int32_t>& block_table(int64_t seq_id, int32_t group = 0) const;
  // Rows of block ids padded with `pad` to max_blocks (default: the longest table); released entries are
  // `pad` too. Returns the width; the rows go into rows(seq_ids.size * width), row after row.
  int32_t block_tables(Span<int64_t> seq_ids, std::optional<int32_t> max_blocks, int32_t pad,
                       const Out<int32_t>& rows, int32_t group = 0) const;
  // Slots of positions [start, end) of one sequence.
  void slot_mapping(int64_t seq_id, int64_t start, int64_t end, const Out<int64_t>& slots, int32_t group = 0) const;
  // Concatenated slots of positions [starts[i], ends[i]) (ends none: each sequence's length). Validates
  // every range before it writes (or allocates) anything; a position whose block the window released
  // is a ValueError. `what` names the call in messages.
  void slot_mappings(Span<int64_t> seq_ids, Span<int64_t> starts, std::optional<Span<int64_t>> ends,
                     const Out<int64_t>& slots, int32_t group = 0, const char* what = "slot_mappings") const;
  // Leading entries of the sequence's table in `group` that the window released.
  int32_t num_released_blocks(int64_t seq_id, int32_t group = 0) const;
  // Blocks a sequence of num_tokens tokens, the first num_computed of them computed, holds over all groups.
  int64_t blocks_held(int64_t num_tokens, int64_t num_computed = 0) const;
  int32_t num_groups() const { return static_cast<int32_t>(config_.group_windows.size()); }
  bool has_windows() const { return has_windows_; }
  int64_t num_tokens(int64_t seq_id) const;
  int64_t num_computed_tokens(int64_t seq_id) const;
  bool is_swapped(int64_t seq_id) const;
  bool contains(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  std::vector<int64_t> token_ids(int64_t seq_id) const;

  // What the manager was built with, and its parts, read-only (sizes, free counts, pins).
  const BlockManagerConfig& config() const { return config_; }
  const BlockPool& gpu_pool() const { return gpu_; }
  const BlockPool& cpu_pool() const { return cpu_; }
  const Pins& pins() const { return pins_; }
  int32_t block_size() const { return block_size_; }
  int32_t watermark_blocks() const { return watermark_blocks_; }

  BlockManagerStats stats() const;
  // The counters accumulated since the previous call (gauges: current values).
  BlockManagerStats take_step_stats();

  // KV events (only with enable_events): drained in order.
  std::vector<KvEvent> take_events();
  // (block hash, parent block hash) of every block the prefix cache holds KV for now on `medium`.
  std::vector<std::pair<uint64_t, std::optional<uint64_t>>> cached_blocks(Medium medium = Medium::kGpu) const;

  // The host tier (num_host_blocks > 0; used by managers with prefix caching, any groups and windows). Each step the runner takes the offloads and loads, performs the copies before the step's KV
  // writes, then confirms them. See docs/design.md, "Tiers".
  bool host_tier_enabled() const { return host_.enabled(); }
  const BlockPool& host_pool() const { return host_.pool(); }
  // The prompt's hit as allocate() would take it now: leading blocks, and how many of them are loaded.
  TierHits lookup(Span<int64_t> tokens, std::string_view salt = {}) const;
  // Clean ahead: of the max_blocks cached free device blocks the pool would evict first, queues copies of
  // those the host tier lacks, so that reusing them later needs no copy (O(max_blocks)). Returns how many
  // it queued.
  int32_t plan_offloads(int32_t max_blocks);
  std::vector<BlockPair> take_offloads();  // (device block, host slot), to copy device -> host
  // One outcome per offload taken and not yet completed, in the order taken: a failed copy leaves no
  // host entry. Until then the device blocks are never handed out.
  void complete_offloads(const std::vector<bool>& ok);
  std::vector<BlockPair> take_loads();     // (host slot, device block), to copy host -> device
  // One outcome per load taken and not yet completed, in the order taken. A sequence whose load failed
  // keeps as computed the tokens before the first failed block (num_computed_tokens drops; the rest is
  // recomputed in place, in blocks private to it); its loaded blocks are registered once all its loads are
  // confirmed. When no such point is safe (a window would need blocks it released, or no fresh block is
  // free to replace a shared one), the sequence must be re-admitted: its id is returned, its
  // num_computed_tokens is 0 and it refuses everything but free (free it and allocate it again).
  std::vector<int64_t> complete_loads(const std::vector<bool>& ok);
  // Blocks of the sequence whose loads are not confirmed yet (mark_computed, append, truncate, fork,
  // swap_out and pin wait for them).
  int32_t num_loading_blocks(int64_t seq_id) const;
  // Whether a failed load left the sequence to be freed and re-admitted (complete_loads returned its id).
  bool must_readmit(int64_t seq_id) const { return get(seq_id).readmit; }
  int32_t num_offloads_in_flight() const { return host_.num_offloads_in_flight(); }  // taken, not completed
  int32_t num_loads_in_flight() const { return host_.num_loads_in_flight(); }

  // The disk tier (num_disk_blocks > 0, below the host tier). The runner writes and reads its records'
  // files on a background thread and confirms each transfer. See docs/design.md, "Tiers".
  bool disk_tier_enabled() const { return disk_.enabled(); }
  const BlockPool& disk_pool() const { return disk_.pool(); }
  // Clean ahead: of the max_slots cached free host slots the host tier would evict first, queues writes
  // of those the disk tier lacks. Returns how many it queued.
  int32_t plan_disk_writes(int32_t max_slots);
  std::vector<BlockPair> take_disk_writes();  // (host slot, disk record); the slots are held until completed
  // One outcome per write taken and not yet completed, in the order taken: a failed write leaves no disk
  // entry.
  void complete_disk_writes(const std::vector<bool>& ok);
  // Queues reads into host slots of the prompt's blocks after its device/host hit that only the disk
  // holds (up to the first block no tier holds; stops when no host slot can be taken without evicting a
  // stronger entry). Returns how many it queued.
  int32_t prefetch(Span<int64_t> tokens, std::string_view salt = {});
  std::vector<BlockPair> take_disk_reads();  // (disk record, host slot)
  // One outcome per read taken and not yet completed, in the order taken: a confirmed read gives the entry
  // its host slot; a failed one drops the disk entry.
  void complete_disk_reads(const std::vector<bool>& ok);
  // What the record's file holds besides the KV (stored, or being written or read): ValueError for a
  // record out of range, KeyError for one that holds nothing.
  DiskTier::Identity disk_record_identity(int32_t record) const;
  // Re-registers a record an earlier run of the same model wrote (the runner checked its header): the block
  // `tokens` whose chained hash is `hash`, after the block disk record `parent_record` holds (-1: block 0,
  // with `salt`). Returns false and changes nothing when the hash is not that block's, the record is in
  // use or holds something, the parent record holds nothing, or the block has a disk copy already.
  // ValueError: no disk tier, a record out of range, not one block of tokens, a salt after block 0, or a
  // hash algorithm whose hashes cannot link a chain (weak8).
  // `group`: the group of a block 0 (a child is in its parent's group; another group refuses it).
  bool restore_disk_record(int32_t record, uint64_t hash, int32_t parent_record, Span<int64_t> tokens,
                           std::string_view salt = {}, int32_t group = 0);
  int32_t num_disk_writes_in_flight() const { return disk_.num_writes_in_flight(); }
  int32_t num_disk_reads_in_flight() const { return disk_.num_reads_in_flight(); }
  int32_t num_pending_disk_reads() const { return disk_.num_reads_pending(); }  // queued or taken
  void reset_prefix_cache();
  void check_invariants() const;  // throws InvariantError naming the first violation


 private:
  // Shorthands of config() and the parts for the manager's own code.
  bool is_pinned(int64_t seq_id) const { return pins_.is_pinned(seq_id); }
  const std::vector<int32_t>& pinned_blocks(int64_t seq_id) const { return pins_.blocks(seq_id); }
  int32_t num_pinned_blocks() const { return pins_.num_pinned(); }
  int32_t max_pinned_blocks() const { return pins_.max_pinned(); }
  int32_t default_priority() const { return config_.default_priority; }
  int32_t decode_priority() const { return config_.decode_priority; }
  const std::vector<int64_t>& group_windows() const { return config_.group_windows; }
  int32_t num_blocks() const { return config_.num_blocks; }
  int32_t num_cpu_blocks() const { return config_.num_cpu_blocks; }
  bool prefix_caching() const { return config_.enable_prefix_caching; }
  HashAlgo hash_algo() const { return config_.hash_algo; }
  int32_t num_free_blocks() const { return gpu_.num_free(); }
  int32_t num_free_cpu_blocks() const { return cpu_.num_free(); }
  bool events_enabled() const { return events_.enabled(); }
  // One group's block table of a sequence.
  struct GroupTable {
    std::vector<int32_t> blocks;        // GPU block ids, or CPU block ids while swapped; [0, released): kPad
    int32_t released = 0;               // leading entries the window released
    int32_t num_registered = 0;         // leading full blocks registered in the prefix cache (or released)
  };
  struct Sequence {
    std::vector<int64_t> tokens;
    // Prefix-cache index keys of the leading full blocks (a pure function of the tokens, extended on
    // demand by block_keys_upto): computed once, when the prompt is looked up, and reused to register.
    std::vector<uint64_t> block_keys;
    std::vector<GroupTable> groups;     // one per group of layers
    int32_t loading = 0;                // loads from the host tier not yet confirmed (next to what every call reads)
    bool readmit = false;               // a failed load left no safe point to recompute from: free and re-admit
    int32_t load_failed_at = -1;        // the first block index a load failed at (-1: none), while loading
    int64_t num_computed = 0;           // tokens whose KV is written
    uint64_t serial = 0;                // identifies this sequence's loads (ids may be reused)
    std::string salt;
    bool swapped = false;
    int64_t prompt_len = 0;
    std::vector<RetentionRange> retention;
  };
  void check_loaded(const Sequence& seq, int64_t seq_id, const char* what) const;
  // The same for a batch; free while no sequence is loading (always, without the tier).
  template <typename Seqs>
  void check_loaded(const Seqs& seqs, Span<int64_t> seq_ids, const char* what) const {
    if (loading_seqs_.empty() && num_readmit_ == 0) return;
    for (size_t i = 0; i < seqs.size(); ++i) check_loaded(*seqs[i], seq_ids[i], what);
  }
  // Write-backs of cached blocks to the host tier may hold the free blocks beyond `needed` (and the
  // watermark) while the next fresh blocks are taken.
  void allow_write_backs(int32_t needed) {
    if (host_.enabled()) gpu_.allow_write_backs(&host_, std::max(0, gpu_.num_free() - needed - watermark_blocks_));
  }
  void end_write_backs() { gpu_.allow_write_backs(nullptr, 0); }
  BlockRetention retention_of(const Sequence& seq, int32_t index) const;  // of the seq's index-th block
  enum class Where { kResident, kSwapped };

  static BlockManagerConfig validated(BlockManagerConfig config);
  Sequence& get(int64_t seq_id);
  const Sequence& get(int64_t seq_id) const;
  const Sequence& get_resident(int64_t seq_id, const char* what) const;
  // Looks up a batch of ids once: KeyError if unknown, ValueError if in the wrong place or, when `unique`,
  // repeated.
  std::vector<Sequence*> resolve(Span<int64_t> seq_ids, const char* what, bool unique, Where where = Where::kResident);
  std::vector<const Sequence*> resolve(Span<int64_t> seq_ids, const char* what, bool unique,
                                       Where where = Where::kResident) const;
  template <typename Map>
  static auto resolve_in(Map& seqs, Span<int64_t> seq_ids, const char* what, bool unique, Where where)
      -> std::vector<decltype(&seqs.begin()->second)>;
  static void check_distinct(Span<int64_t> seq_ids, const char* what);

  int32_t blocks_for_tokens(int64_t num_tokens) const {
    return static_cast<int32_t>(ceil_div(num_tokens, block_size_));
  }
  // Blocks a windowed group holds at most: its window's, the one being written, and `extra`.
  int64_t window_blocks(int32_t group, int64_t extra) const {
    return ceil_div(group_windows()[group] - 1, block_size_) + 1 + extra;
  }
  // Entries of a windowed group's table released once num_computed tokens are computed.
  int64_t released_for(int32_t group, int64_t num_computed) const {
    const int64_t w = group_windows()[group];
    if (w == kFullAttention || num_computed < w) return 0;
    return (num_computed - w + 1) / block_size_;
  }
  // Appends fresh blocks to the table until it has `size` entries (the caller checked they are free).
  void grow_table(const Sequence& seq, GroupTable& t, size_t size);
  // A prefix-cache hit: the leading num_blocks blocks (at most ceil(n/bs) - 1) are computed, and every
  // group holds the cached blocks its window needs, [released_for(g, num_blocks * bs), num_blocks).
  static constexpr int32_t kHostHit = -3;  // a held entry the host tier serves (a fresh block is loaded)
  struct PrefixMatch {
    int32_t num_blocks = 0;
    int32_t host_blocks = 0;                  // entries of held (all groups) that are kHostHit
    int32_t first_loaded = 0;                 // the first block index any group loads (num_blocks: none)
    std::vector<uint64_t> keys;               // index keys of the prompt's leading full blocks (those walked)
    std::vector<std::vector<int32_t>> held;   // per group
    std::vector<std::vector<int32_t>> held_slots;  // per group, along held: the host slot of each kHostHit
    std::vector<std::vector<int32_t>> chain;  // per group: scratch of the walk (kept for its capacity)
    std::vector<std::vector<int32_t>> slots;  // per group, along chain: host slots (tiered walks only)
  };
  void match_prefix(Span<int64_t> tokens, std::string_view salt, PrefixMatch* out) const;
  // The prompt's prefix-cache nodes from block 0 through the hit and the run after it that the host or
  // disk tier holds (or is reading), up to the first block neither holds. Returns the hit's length.
  // Per group, nodes[g] are the nodes the longest such extension of the hit needs in group g (a windowed
  // group: those its window reads); the extension's length is returned in *reach.
  int32_t tier_walk(Span<int64_t> tokens, std::string_view salt, std::vector<std::vector<PrefixCache::NodeId>>* nodes,
                    int32_t* reach) const;
  // After a failed load: recomputes from the largest safe point, or marks the sequence for re-admission.
  void recover_failed_load(Sequence& seq);
  // Cached: allocate() right after can_allocate() for the same prompt reuses the lookup.
  const PrefixMatch& match_prefix_memo(Span<int64_t> tokens, std::string_view salt) const;
  int32_t from_free_for(const PrefixMatch& m, int32_t num_blocks) const;  // free blocks allocate takes
  // More blocks than the pool can ever give one prompt (admitted whole, or by chunks of num_new_tokens).
  bool never_fits(int64_t num_tokens, int64_t num_new_tokens) const;
  // Where the tokens allocated at admission end: the whole prompt, or the cached ones and the first chunk.
  int64_t first_chunk_end(int64_t num_tokens, const PrefixMatch& m, int64_t num_new_tokens) const;
  AllocStatus fits(int64_t num_tokens, const PrefixMatch& m, int64_t num_new_tokens) const;  // given the lookup
  // allocate() once the prompt's lookup m is done and fits; the arguments are validated.
  int64_t admit(int64_t seq_id, Span<int64_t> tokens, std::string_view salt, const std::vector<RetentionRange>& retention,
                const PrefixMatch& m, int64_t num_new_tokens);
  int32_t group_arg(int32_t group, const char* what) const;  // validated
  int64_t allocated_tokens(const Sequence& seq) const {
    return std::min<int64_t>(static_cast<int64_t>(seq.tokens.size()), int64_t(seq.groups[0].blocks.size()) * block_size_);
  }
  // Fresh blocks reserve() takes for these sequences (validates num_tokens).
  int32_t blocks_to_reserve(const std::vector<const Sequence*>& seqs, Span<int64_t> seq_ids,
                            Span<int64_t> num_tokens) const;
  // The most blocks a prompt holds: admitted whole, or prefilled in chunks of num_new_tokens.
  int64_t max_blocks_held(int64_t num_tokens, int64_t num_new_tokens) const;
  void check_complete(const Sequence& seq, int64_t seq_id, const char* what) const;
  // The prefix-cache node of the sequence's block i in group g, created (with its ancestors, without KV)
  // when missing: the parent of a block registered after the one before it was released.
  PrefixCache::NodeId chain_node(Sequence& seq, int32_t group, int32_t i);
  // The index keys of the sequence's first num_blocks full blocks (computes the missing ones).
  const std::vector<uint64_t>& block_keys_upto(Sequence& seq, int32_t num_blocks) const;
  // Extends keys, the index keys of the leading full blocks of `tokens`, to num_blocks blocks (each new
  // key's bucket prefetched).
  void extend_keys(const int64_t* tokens, std::string_view salt, int32_t num_blocks, std::vector<uint64_t>* keys) const;
  void release_out_of_window(Sequence& seq);
  int32_t blocks_needed_to_append(const Sequence* const* seqs, size_t n, const int64_t* counts, int64_t extra) const;
  bool must_copy_before_write(int32_t block) const;
  int32_t distinct_blocks(Span<int64_t> seq_ids, const char* what, Where where) const;
  // Swap: moves the sequences' held blocks from one pool to the other (the sequences are in `from`).
  std::vector<BlockPair> move_blocks(Span<int64_t> seq_ids, BlockPool& from, BlockPool& to);
  void register_computed_blocks(Sequence& seq, int32_t group);
  std::optional<uint64_t> parent_hash(PrefixCache::NodeId node) const;

  // check_invariants, part by part: one sequence's tables (counting the blocks they hold in uses), the
  // content chain of one group's registered blocks, and the prefix cache against the blocks' tags.
  void check_sequence(int64_t id, const Sequence& seq, std::vector<int32_t>* gpu_uses,
                      std::vector<int32_t>* cpu_uses) const;
  void check_registered_chain(int64_t id, const Sequence& seq, int32_t group) const;
  void check_prefix_cache() const;

  BlockManagerConfig config_;  // validated
  int32_t block_size_;
  int32_t watermark_blocks_;
  bool has_windows_ = false;
  BlockManagerStats counters_;
  BlockManagerStats step_start_;  // counters_ at the last take_step_stats

  // The parts (in construction order: the pools point at the cache, the log and the copies).
  PrefixCache cache_;
  KvEventLog events_;
  PendingCopies copies_;
  BlockPool gpu_;
  BlockPool cpu_;
  Pins pins_;
  HostTier host_;
  DiskTier disk_;
  uint64_t next_serial_ = 1;
  std::unordered_map<uint64_t, int64_t> loading_seqs_;  // serial -> id of sequences with loads pending
  int32_t num_readmit_ = 0;  // sequences waiting to be freed and re-admitted

  std::unordered_map<int64_t, Sequence> seqs_;
  struct MatchMemo {
    uint64_t cache_version = ~uint64_t(0);
    std::vector<int64_t> tokens;
    std::string salt;
    PrefixMatch match;
  };
  mutable MatchMemo memo_;
  PrefixMatch batch_match_;  // allocate_batch's lookup of each prompt (kept for its vectors' capacity)
};

}  // namespace pagedkv
