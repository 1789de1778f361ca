// Retention: how long a token range's blocks keep their cached KV once no sequence uses them. Free blocks
// are evicted lowest priority first, least recently freed first within a priority.
#pragma once
#include <cstdint>
#include <limits>

namespace pagedkv {

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

// The retention a block holds: what it falls back to the default from once free.
struct BlockRetention {
  int32_t priority;
  double duration;
};

// Whether a outlasts b: a higher priority, or the same priority for longer.
inline bool stronger(const BlockRetention& a, const BlockRetention& b) {
  return a.priority != b.priority ? a.priority > b.priority : a.duration > b.duration;
}

}  // namespace pagedkv
