// Argument checks the core and the bindings share (outside BlockManager's public surface). Each throws
// ValueError naming the offending entry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/retention.h"

namespace pagedkv {

// The most tokens one append_tokens call appends to a sequence (and the most lookahead slots).
constexpr int64_t kMaxTokensPerAppend = 1 << 20;

// Each range: 0 <= start <= end, priority in [kMinPriority, kMaxPriority], duration >= 0. `what` names the call.
void validate_retention(const std::vector<RetentionRange>& ranges, const char* what);

// The total of append_tokens' counts, each checked to be in [0, kMaxTokensPerAppend].
size_t append_count_total(const int64_t* counts, size_t n);

}  // namespace pagedkv
