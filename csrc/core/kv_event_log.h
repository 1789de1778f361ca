// The KV event log: changes of what the prefix cache can hit, kept in order for consumers that mirror it
// (cache-aware routers) until they are taken. Consecutive stored blocks of one chain share an event.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/medium.h"

namespace pagedkv {

// Replaying every event of one medium from the first (stored adds each hash, removed deletes one, cleared
// empties every medium) gives exactly that medium's cached blocks, as a multiset, at any moment.
struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  uint64_t seq = 0;                       // consecutive; a gap means events were dropped (buffer full)
  Kind kind = Kind::kStored;
  std::vector<uint64_t> block_hashes;     // consecutive blocks of one sequence (stored), or one (removed)
  std::optional<uint64_t> parent_hash;    // stored: the hash of the block before the first one
  std::vector<int64_t> token_ids;         // stored: the blocks' tokens
  std::string salt;                       // stored from block 0: the cache salt
  Medium medium = Medium::kGpu;           // where the blocks were stored or removed
};

class KvEventLog {
 public:
  // Holds at most max_pending events (>= 1): on overflow the oldest is dropped and *dropped counts it.
  KvEventLog(bool enabled, size_t max_pending, int64_t* dropped);

  bool enabled() const { return enabled_; }
  // One full block of block_size tokens entered the cache: extends the open run when it continues its
  // chain (its parent is the run's last block), else starts a stored event.
  void stored(uint64_t hash, std::optional<uint64_t> parent, const int64_t* tokens, int32_t block_size,
              std::string_view salt, Medium medium = Medium::kGpu);
  void removed(uint64_t hash, Medium medium = Medium::kGpu);
  void cleared();
  void end_run() { run_open_ = false; }  // the next stored block starts an event of its own
  std::vector<KvEvent> take();           // drains the log, oldest first

 private:
  void record(KvEvent&& event);

  bool enabled_;
  size_t max_pending_;
  int64_t* dropped_;
  std::deque<KvEvent> events_;
  uint64_t next_seq_ = 0;
  bool run_open_ = false;  // the last event may take the next stored block of the same chain
};

}  // namespace pagedkv
