// Argument checks shared by the core and the bindings (see validation.h).
#include "core/validation.h"

#include "core/errors.h"
#include "core/util.h"

namespace pagedkv {

void validate_retention(const std::vector<RetentionRange>& ranges, const char* what) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    const RetentionRange& r = ranges[i];
    if (r.start < 0 || r.end < r.start)
      throw ValueError(cat(what, ": retention[", i, "] covers tokens [", r.start, ", ", r.end,
                           "); need 0 <= start <= end"));
    if (r.priority < kMinPriority || r.priority > kMaxPriority)
      throw ValueError(cat(what, ": retention[", i, "] has priority ", r.priority, "; need ", kMinPriority,
                           " <= priority <= ", kMaxPriority));
    if (!(r.duration >= 0.0))
      throw ValueError(cat(what, ": retention[", i, "] has duration ", r.duration, "; need >= 0 (or none)"));
  }
}

size_t append_count_total(const int64_t* counts, size_t n) {
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    if (counts[i] < 0 || counts[i] > kMaxTokensPerAppend)
      throw ValueError(cat("append_tokens: counts[", i, "]=", counts[i], " must be in [0, ", kMaxTokensPerAppend, "]"));
    total += static_cast<size_t>(counts[i]);
  }
  return total;
}

}  // namespace pagedkv
