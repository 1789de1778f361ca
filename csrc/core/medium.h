// Where a prefix-cache entry's KV lives: the device's blocks or the host tier's slots (a disk tier would
// be a third medium). Events name the medium as vLLM's KV events do ("GPU", "CPU").
#pragma once
#include <cstdint>

namespace pagedkv {

enum class Medium : uint8_t { kGpu = 0, kCpu = 1 };
constexpr int32_t kNumMedia = 2;

inline const char* medium_name(Medium m) { return m == Medium::kGpu ? "GPU" : "CPU"; }

}  // namespace pagedkv
