// The block manager: which physical block holds every token's KV. Owns the GPU block pool (with the
// prefix cache and its LRU free list), the CPU block pool used for swapping, and each sequence's block
// table. Every public call validates its arguments before changing anything, so an exception leaves the
// manager exactly as it was.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/free_list.h"
#include "core/hashing.h"
#include "core/prefix_cache.h"

namespace pagedkv {

enum class AllocStatus { kOk = 0, kLater = 1, kNever = 2 };

using BlockPair = std::pair<int32_t, int32_t>;  // (src block, dst block)

// A borrowed run of token ids (a prompt).
struct TokenSpan {
  const int64_t* data = nullptr;
  size_t size = 0;
};

// A change of what the prefix cache can hit, for consumers that mirror it (cache-aware routers).
// Replaying every event from the first (stored adds each hash, removed deletes one, cleared empties)
// gives exactly cached_blocks(), as a multiset, at any moment.
struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  uint64_t seq = 0;                       // consecutive; a gap means events were dropped (buffer full)
  Kind kind = Kind::kStored;
  std::vector<uint64_t> block_hashes;     // consecutive blocks of one sequence (stored), or one (removed)
  std::optional<uint64_t> parent_hash;    // stored: the hash of the block before the first one
  std::vector<int64_t> token_ids;         // stored: the blocks' tokens
  std::string salt;                       // stored from block 0: the cache salt
};

// Retention: how long a token range's blocks keep their cached KV once no sequence uses them. Free blocks
// are evicted lowest priority first, least recently freed first within a priority.
constexpr int32_t kMinPriority = 0;
constexpr int32_t kMaxPriority = 100;
constexpr int32_t kDefaultPriority = 35;  // blocks no range covers (as TensorRT-LLM)
constexpr double kForever = std::numeric_limits<double>::infinity();
constexpr int64_t kToTheEnd = std::numeric_limits<int64_t>::max();

// Tokens [start, end) of a sequence. A block takes the priority of the ranges that overlap it (the
// highest wins); `duration` (of the manager's clock, from the moment the block is freed) later it falls
// back to the default priority. end = kToTheEnd covers every later token, decode tokens included.
struct RetentionRange {
  int64_t start = 0;
  int64_t end = kToTheEnd;
  int64_t priority = kDefaultPriority;
  double duration = kForever;
};

struct BlockManagerStats {
  int64_t queries = 0;      // prompt tokens looked up in the prefix cache
  int64_t hits = 0;         // of those, tokens whose KV was already cached
  int64_t query_blocks = 0;        // prompt blocks looked up
  int64_t hit_blocks = 0;          // of those, blocks hit ...
  int64_t hit_blocks_in_use = 0;   // ... that another sequence was using
  int64_t hit_blocks_revived = 0;  // ... taken back from the free list
  int64_t events_dropped = 0;      // KV events lost to a full buffer
  int64_t evictions = 0;    // cached blocks reused for other content
  int64_t cow_copies = 0;   // copy-on-write block copies queued
  int64_t swapped_out_blocks = 0;
  int64_t swapped_in_blocks = 0;
  int32_t used_blocks = 0;  // GPU blocks referenced by a sequence
  int32_t free_blocks = 0;
  int32_t cached_blocks = 0;       // GPU blocks registered in the prefix cache (used or free)
  int32_t cached_free_blocks = 0;  // free blocks that still hold reusable cached KV
  int32_t num_seqs = 0;
  int32_t num_swapped_seqs = 0;
  int32_t free_cpu_blocks = 0;
  int32_t pinned_blocks = 0;       // GPU blocks held by pins
};

class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size, int32_t num_cpu_blocks = 0,
               bool enable_prefix_caching = true, double watermark = 0.0,
               HashAlgo hash_algo = HashAlgo::kXXH64, bool enable_events = false,
               int64_t max_pending_events = kDefaultMaxPendingEvents, int32_t default_priority = kDefaultPriority,
               int32_t decode_priority = kDefaultPriority, double max_pinned_fraction = kDefaultMaxPinnedFraction,
               std::vector<int64_t> group_windows = {kFullAttention});
  static constexpr int64_t kDefaultMaxPendingEvents = 1 << 16;
  // Groups of layers (hybrid models): each has its own block table per sequence and a window in tokens
  // (kFullAttention: none). The token at position p attends to positions (p - window, p], so once the
  // KV of the first n tokens is computed, the leading max(0, n - window + 1) / block_size blocks of a
  // windowed group are never read again: mark_computed releases them from its table, which keeps a pad
  // (kPad) in their place.
  static constexpr int64_t kFullAttention = 0;
  static constexpr int32_t kPad = 0;
  static constexpr int32_t kMaxGroups = 64;
  static constexpr double kDefaultMaxPinnedFraction = 0.5;

  // num_new_tokens (kWholePrompt: all): admit the prompt for its first chunk only, blocks for the cached
  // tokens and the next num_new_tokens; reserve() allocates each later chunk's. NEVER then means the
  // most the sequence holds over a prefill in such chunks cannot fit.
  static constexpr int64_t kWholePrompt = -1;
  AllocStatus can_allocate(const int64_t* tokens, size_t num_tokens, std::string_view salt = {},
                           int64_t num_new_tokens = kWholePrompt) const;
  // Gives seq_id a block table for its prompt; returns how many leading tokens are already cached.
  // `retention` ranges set its blocks' eviction priority (validated: 0 <= start <= end, priority in
  // [0, 100], duration >= 0); blocks no range overlaps take default_priority (decode_priority for
  // blocks that start past the prompt). A block held by several sequences keeps the highest.
  int64_t allocate(int64_t seq_id, const int64_t* tokens, size_t num_tokens, std::string_view salt = {},
                   const std::vector<RetentionRange>& retention = {}, int64_t num_new_tokens = kWholePrompt);
  // Chunked prefill: sequence i gets the blocks of its first num_tokens[i] tokens in every group (no-op
  // for what it has). Call after mark_computed of the previous chunk, which let the window release its
  // earlier blocks. can_reserve: whether the free blocks suffice.
  bool can_reserve(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& num_tokens) const;
  void reserve(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& num_tokens);
  // Tokens whose slots exist: the whole sequence once every chunk is reserved.
  int64_t num_allocated_tokens(int64_t seq_id) const;
  // Admits prompts in order while can_allocate says OK and returns the cached-token count of each admitted
  // one (prompts [0, result.size()) were admitted). The whole batch is validated first (ids distinct and
  // new, prompts non-empty, one salt per prompt or none), so a bad batch changes nothing.
  std::vector<int64_t> allocate_batch(const std::vector<int64_t>& seq_ids, const std::vector<TokenSpan>& prompts,
                                      const std::vector<std::string>& salts = {},
                                      const std::vector<std::vector<RetentionRange>>& retentions = {});
  void validate_retention(const std::vector<RetentionRange>& ranges, const char* what) const;

  // The manager's clock (any unit, the one of the durations; starts at 0, never read from the wall).
  // Advancing it moves the free blocks whose priority duration has run out to the default priority.
  void set_time(double now);
  double now() const { return now_; }

  // Pinning: pin(seq_id) holds the sequence's full blocks whose KV the prefix cache has now (call it
  // after mark_computed; again to take in more), so that they stay cached after free() until unpin.
  // Pinned blocks are never free nor evictable; a pin that would hold more than max_pinned_blocks()
  // is refused (OutOfBlocks) and changes nothing. Returns the number of blocks the pin holds.
  int32_t pin(int64_t seq_id);
  void unpin(int64_t seq_id);   // KeyError unless pinned; works after the sequence is freed
  bool is_pinned(int64_t seq_id) const { return pins_.count(seq_id) != 0; }
  const std::vector<int32_t>& pinned_blocks(int64_t seq_id) const;
  int32_t num_pinned_blocks() const { return pinned_blocks_; }
  int32_t max_pinned_blocks() const { return max_pinned_blocks_; }
  int32_t default_priority() const { return default_priority_; }
  int32_t decode_priority() const { return decode_priority_; }
  // The eviction priority a block has now (tests and check_invariants).
  int32_t block_priority(int32_t block) const;
  // The KV of the first num_tokens[i] (all tokens when num_tokens is null) of each sequence is written:
  // full blocks among them enter the prefix cache. seq_ids must be distinct.
  void mark_computed(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>* num_tokens = nullptr);

  // Room for every sequence to append 1 + num_lookahead_slots tokens now.
  bool can_append(const int64_t* seq_ids, size_t n, int64_t num_lookahead_slots = 0) const;
  // Appends to every group's table; the slots returned are group 0's (slot_mappings(group=g) for the others).
  int64_t append_token(int64_t seq_id, int64_t token_id);
  void append_tokens(const int64_t* seq_ids, const int64_t* token_ids, size_t n, int64_t* slots_out);
  // Sequence i appends counts[i] tokens (one each when counts is null), the next ones of token_ids;
  // slots_out gets a slot per token, in order. Speculative decoding appends its input and draft tokens.
  void append_tokens(const int64_t* seq_ids, size_t n, const int64_t* token_ids, const int64_t* counts,
                     int64_t* slots_out);
  // Total of counts (validated: each in [0, kMaxTokensPerAppend]).
  size_t append_count_total(const int64_t* counts, size_t n) const;
  // Rolls sequence i back to its first num_tokens[i] tokens (rejected draft tokens): blocks past them
  // leave its table (cached ones stay cached); the next append into a block left partial copies it first
  // if it is shared or cached.
  void truncate(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& num_tokens);
  static constexpr int64_t kMaxTokensPerAppend = 1 << 20;
  // Copy-on-write copies queued by append_tokens, to perform before the next KV write; they are
  // independent (no copy reads another's destination). Until they are taken, a copy's source is never
  // handed out again, a copy whose destination is freed (its sequence freed or swapped out) is dropped,
  // and a swap-out of a destination reads the copy's source instead.
  std::vector<BlockPair> take_copies();

  void free(int64_t seq_id);
  void fork(int64_t parent_seq_id, int64_t child_seq_id);

  // Distinct blocks the sequences hold over every group (a block they share counts once; entries a window
  // released excepted): what swap_out / swap_in moves. The sequences are all resident or all swapped out.
  int32_t distinct_blocks(const std::vector<int64_t>& seq_ids) const;
  bool can_swap_out(const std::vector<int64_t>& seq_ids) const;
  std::vector<BlockPair> swap_out(const std::vector<int64_t>& seq_ids);  // (gpu, cpu)
  AllocStatus can_swap_in(const std::vector<int64_t>& seq_ids, int64_t num_lookahead_slots = 0) const;
  std::vector<BlockPair> swap_in(const std::vector<int64_t>& seq_ids);   // (cpu, gpu)

  // Group `group`'s table: released entries hold kPad.
  const std::vector<int32_t>& block_table(int64_t seq_id, int32_t group = 0) const;
  // Rows of block ids padded with `pad` to max_blocks (default: the longest table); released entries are
  // `pad` too. Returns the width; the rows go into out(width), a buffer for n rows of `width` entries that
  // the caller allocates once the arguments are validated (e.g. a tensor's storage, no copy).
  int32_t block_tables(const int64_t* seq_ids, size_t n, const int32_t* max_blocks, int32_t pad,
                       const std::function<int32_t*(int32_t)>& out, int32_t group = 0) const;
  void slot_mapping(int64_t seq_id, int64_t start, int64_t end, int64_t* out, int32_t group = 0) const;
  // Concatenated slots of positions [starts[i], ends[i]) (ends null: each sequence's length). Validates
  // every range before it writes (or allocates) anything; a position whose block the window released
  // is a ValueError.
  void slot_mappings(const int64_t* seq_ids, const int64_t* starts, const int64_t* ends, size_t n,
                     std::vector<int64_t>* out, const char* what = "slot_mappings", int32_t group = 0) const;
  // The same, written into out(total): a buffer for `total` slots that the caller allocates once the
  // ranges are validated (e.g. a tensor's storage, no copy).
  void slot_mappings(const int64_t* seq_ids, const int64_t* starts, const int64_t* ends, size_t n,
                     const std::function<int64_t*(size_t)>& out, const char* what = "slot_mappings",
                     int32_t group = 0) const;
  // Leading entries of the sequence's table in `group` that the window released.
  int32_t num_released_blocks(int64_t seq_id, int32_t group = 0) const;
  // Blocks a sequence of num_tokens tokens, the first num_computed of them computed, holds over all groups.
  int64_t blocks_held(int64_t num_tokens, int64_t num_computed = 0) const;
  int32_t num_groups() const { return static_cast<int32_t>(windows_.size()); }
  const std::vector<int64_t>& group_windows() const { return windows_; }
  bool has_windows() const { return has_windows_; }
  int64_t num_tokens(int64_t seq_id) const;
  int64_t num_computed_tokens(int64_t seq_id) const;
  bool is_swapped(int64_t seq_id) const;
  bool contains(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  std::vector<int64_t> token_ids(int64_t seq_id) const;

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_cpu_blocks() const { return num_cpu_blocks_; }
  int32_t block_size() const { return block_size_; }
  int32_t watermark_blocks() const { return watermark_blocks_; }
  bool prefix_caching() const { return prefix_caching_; }
  HashAlgo hash_algo() const { return hash_algo_; }
  int32_t num_free_blocks() const { return gpu_free_.size(); }
  int32_t num_free_cpu_blocks() const { return cpu_free_.size(); }

  BlockManagerStats stats() const;
  // The counters accumulated since the previous call (gauges: current values).
  BlockManagerStats take_step_stats();

  // KV events (only with enable_events): drained in order.
  bool events_enabled() const { return events_enabled_; }
  std::vector<KvEvent> take_events();
  // (block hash, parent block hash) of every block the prefix cache holds KV for now.
  std::vector<std::pair<uint64_t, std::optional<uint64_t>>> cached_blocks() const;
  void reset_prefix_cache();
  void check_invariants() const;  // throws InvariantError naming the first violation

 private:
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
    int64_t num_computed = 0;           // tokens whose KV is written
    std::string salt;
    bool swapped = false;
    int64_t prompt_len = 0;
    std::vector<RetentionRange> retention;
  };
  // The retention a block holds: what it falls back to the default from once free.
  struct BlockRetention {
    int32_t priority;
    double duration;
  };
  BlockRetention retention_of(const Sequence& seq, int32_t index) const;  // of the seq's index-th block
  static bool stronger(const BlockRetention& a, const BlockRetention& b) {
    return a.priority != b.priority ? a.priority > b.priority : a.duration > b.duration;
  }
  void keep_stronger_retention(int32_t block, const BlockRetention& r) {
    if (stronger(r, block_retention_[block])) block_retention_[block] = r;
  }
  int32_t free_level(int32_t block) const { return holds_cached_kv(block) ? 1 + block_retention_[block].priority : 0; }
  void move_to_level(int32_t free_block, int32_t level);  // to the back of that level's list
  void expire_durations();  // free blocks whose duration ran out fall back to the default priority
  void drop_pin(std::vector<int32_t>& blocks);
  enum class Where { kResident, kSwapped };

  Sequence& get(int64_t seq_id);
  const Sequence& get(int64_t seq_id) const;
  const Sequence& get_resident(int64_t seq_id, const char* what) const;
  // Looks up a batch of ids once: KeyError if unknown, ValueError if in the wrong place or, when `unique`,
  // repeated.
  std::vector<Sequence*> resolve(const int64_t* seq_ids, size_t n, const char* what, bool unique,
                                 Where where = Where::kResident);
  std::vector<const Sequence*> resolve(const int64_t* seq_ids, size_t n, const char* what, bool unique,
                                       Where where = Where::kResident) const;
  template <typename Map>
  static auto resolve_in(Map& seqs, const int64_t* seq_ids, size_t n, const char* what, bool unique, Where where)
      -> std::vector<decltype(&seqs.begin()->second)>;
  static void check_distinct(const int64_t* seq_ids, size_t n, const char* what);

  int32_t blocks_for_tokens(int64_t num_tokens) const {
    return static_cast<int32_t>((num_tokens + block_size_ - 1) / block_size_);
  }
  // Entries of a windowed group's table released once num_computed tokens are computed.
  int64_t released_for(int32_t group, int64_t num_computed) const {
    const int64_t w = windows_[group];
    if (w == kFullAttention || num_computed < w) return 0;
    return (num_computed - w + 1) / block_size_;
  }
  // A prefix-cache hit: the leading num_blocks blocks (at most ceil(n/bs) - 1) are computed, and every
  // group holds the cached blocks its window needs, [released_for(g, num_blocks * bs), num_blocks).
  struct PrefixMatch {
    int32_t num_blocks = 0;
    std::vector<uint64_t> keys;               // index keys of the prompt's leading full blocks (those walked)
    std::vector<std::vector<int32_t>> held;   // per group
    std::vector<std::vector<int32_t>> chain;  // per group: scratch of the walk (kept for its capacity)
  };
  void match_prefix(const int64_t* tokens, size_t num_tokens, std::string_view salt, PrefixMatch* out) const;
  // Cached: allocate() right after can_allocate() for the same prompt reuses the lookup.
  const PrefixMatch& match_prefix_memo(const int64_t* tokens, size_t num_tokens, std::string_view salt) const;
  int32_t from_free_for(const PrefixMatch& m, int32_t num_blocks) const;  // free blocks allocate takes
  // More blocks than the pool can ever give one prompt (admitted whole, or by chunks of num_new_tokens).
  bool never_fits(int64_t num_tokens, int64_t num_new_tokens) const;
  // Where the tokens allocated at admission end: the whole prompt, or the cached ones and the first chunk.
  int64_t first_chunk_end(int64_t num_tokens, const PrefixMatch& m, int64_t num_new_tokens) const;
  AllocStatus fits(int64_t num_tokens, const PrefixMatch& m, int64_t num_new_tokens) const;  // given the lookup
  // allocate() once the prompt's lookup m is done and fits; the arguments are validated.
  int64_t admit(int64_t seq_id, const int64_t* tokens, size_t num_tokens, std::string_view salt,
                const std::vector<RetentionRange>& retention, const PrefixMatch& m, int64_t num_new_tokens);
  int32_t group_arg(int32_t group, const char* what) const;  // validated
  int64_t allocated_tokens(const Sequence& seq) const {
    return std::min<int64_t>(static_cast<int64_t>(seq.tokens.size()), int64_t(seq.groups[0].blocks.size()) * block_size_);
  }
  // Fresh blocks reserve() takes for these sequences (validates num_tokens).
  int32_t blocks_to_reserve(const std::vector<const Sequence*>& seqs, const std::vector<int64_t>& seq_ids,
                            const std::vector<int64_t>& num_tokens) const;
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
  int32_t distinct_blocks(const std::vector<int64_t>& seq_ids, const char* what, Where where) const;
  std::vector<BlockPair> move_blocks(const std::vector<int64_t>& seq_ids, bool to_cpu);  // swap out / in
  void register_computed_blocks(Sequence& seq, int32_t group);

  int32_t take_free_block();         // pops the LRU free block, evicting its cached content
  void release_block(int32_t block); // drops one reference; at zero the block joins the free list
  void return_to_free_list(int32_t block);
  bool holds_cached_kv(int32_t block) const;  // the prefix cache hits this block for its content
  // Pending copies: a freed destination drops its copy; a freed source stays out of the free list until
  // take_copies, so that nothing overwrites it before the copy is done.
  void drop_pending_copies_to(int32_t block);
  bool is_pending_copy_source(int32_t block) const;
  int32_t pending_copy_source(int32_t block) const;  // the source of the copy into block, or -1
  void untag_block(int32_t block);   // forgets the block's prefix-cache content
  int32_t take_cpu_block();
  void release_cpu_block(int32_t block);

  int32_t num_blocks_, block_size_, num_cpu_blocks_, watermark_blocks_;
  std::vector<int64_t> windows_;  // per group, kFullAttention or tokens
  bool has_windows_ = false;
  bool prefix_caching_;
  HashAlgo hash_algo_;

  std::vector<int32_t> gpu_ref_;          // block-table entries + pins holding each GPU block
  std::vector<PrefixCache::NodeId> block_node_;  // content of each GPU block, or kNoNode
  FreeList gpu_free_;
  std::vector<int32_t> cpu_ref_;
  FreeList cpu_free_;
  PrefixCache cache_;

  std::unordered_map<int64_t, Sequence> seqs_;
  std::vector<BlockPair> pending_copies_;
  struct MatchMemo {
    uint64_t cache_version = ~uint64_t(0);
    std::vector<int64_t> tokens;
    std::string salt;
    PrefixMatch match;
  };
  mutable MatchMemo memo_;
  PrefixMatch batch_match_;  // allocate_batch's lookup of each prompt (kept for its vectors' capacity)
  BlockManagerStats counters_;
  BlockManagerStats step_start_;  // counters_ at the last take_step_stats
  int32_t cached_free_blocks_ = 0;  // free blocks that still hold cached KV (kept, not counted per call)

  // Retention. Free blocks holding cached KV sit at free-list level 1 + priority (level 0: no reusable
  // content, handed out first). A free block with a finite duration has an entry in expiries_, a
  // min-heap on (time, order); an entry is live while its stamp is the block's (bumped whenever the
  // block enters the free list or changes level), so stale entries are skipped, never searched for.
  int32_t default_priority_, decode_priority_;
  double now_ = 0.0;
  std::vector<BlockRetention> block_retention_;
  std::vector<uint32_t> block_stamp_;
  struct Expiry {
    double time;
    uint64_t order;
    int32_t block;
    uint32_t stamp;
    bool operator>(const Expiry& o) const { return time != o.time ? time > o.time : order > o.order; }
  };
  std::vector<Expiry> expiries_;
  uint64_t next_expiry_order_ = 0;

  std::unordered_map<int64_t, std::vector<int32_t>> pins_;  // seq id -> the blocks its pin holds
  std::vector<int32_t> pin_count_;  // pins holding each GPU block
  int32_t pinned_blocks_ = 0;       // blocks with pin_count_ > 0
  int32_t max_pinned_blocks_;
  double max_pinned_fraction_;

  void record_event(KvEvent&& event);
  void record_stored(PrefixCache::NodeId node, const int64_t* tokens, std::string_view salt);
  void record_removed(PrefixCache::NodeId node);
  std::optional<uint64_t> parent_hash(PrefixCache::NodeId node) const;
  bool events_enabled_;
  size_t max_pending_events_;
  std::deque<KvEvent> events_;
  uint64_t next_event_seq_ = 0;
  bool stored_run_open_ = false;  // the last event may take the next stored block of the same chain
};

}  // namespace pagedkv
