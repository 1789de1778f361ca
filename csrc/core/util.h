// Small helpers the core shares: ceiling division (core/arith.h) and the text of exception messages.
#pragma once
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "core/arith.h"

namespace pagedkv {

// The arguments streamed one after the other into a string.
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

inline std::string seq_str(int64_t seq_id) { return "sequence " + std::to_string(seq_id); }

}  // namespace pagedkv
