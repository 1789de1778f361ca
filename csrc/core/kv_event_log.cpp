// KV event log implementation (see kv_event_log.h).
#include "core/kv_event_log.h"

#include <iterator>
#include <utility>

namespace pagedkv {

KvEventLog::KvEventLog(bool enabled, size_t max_pending, int64_t* dropped)
    : enabled_(enabled), max_pending_(max_pending), dropped_(dropped) {}

void KvEventLog::record(KvEvent&& event) {
  run_open_ = false;
  event.seq = next_seq_++;
  if (events_.size() == max_pending_) {
    events_.pop_front();
    ++*dropped_;
  }
  events_.push_back(std::move(event));
}

void KvEventLog::stored(uint64_t hash, std::optional<uint64_t> parent, const int64_t* tokens, int32_t block_size,
                        std::string_view salt, Medium medium) {
  if (run_open_ && !events_.empty() && parent && events_.back().block_hashes.back() == *parent &&
      events_.back().medium == medium) {
    KvEvent& run = events_.back();  // the next block of the same chain: one event for both
    run.block_hashes.push_back(hash);
    run.token_ids.insert(run.token_ids.end(), tokens, tokens + block_size);
    return;
  }
  KvEvent event;
  event.kind = KvEvent::Kind::kStored;
  event.block_hashes.push_back(hash);
  event.parent_hash = parent;
  event.token_ids.assign(tokens, tokens + block_size);
  event.salt.assign(salt);
  event.medium = medium;
  record(std::move(event));
  run_open_ = true;
}

void KvEventLog::removed(uint64_t hash, Medium medium) {
  KvEvent event;
  event.kind = KvEvent::Kind::kRemoved;
  event.medium = medium;
  event.block_hashes.push_back(hash);
  record(std::move(event));
}

void KvEventLog::cleared() {
  KvEvent event;
  event.kind = KvEvent::Kind::kCleared;
  record(std::move(event));
}

std::vector<KvEvent> KvEventLog::take() {
  std::vector<KvEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  run_open_ = false;
  return out;
}

}  // namespace pagedkv
