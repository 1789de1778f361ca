// Where a prefix-cache entry's KV lives: the device's blocks, the host tier's slots or the disk tier's
// records. Events name the medium as vLLM's KV events do ("GPU", "CPU", "DISK").
#pragma once
#include <cstdint>

namespace pagedkv {

enum class Medium : uint8_t { kGpu = 0, kCpu = 1, kDisk = 2 };
constexpr int32_t kNumMedia = 3;

inline const char* medium_name(Medium m) { return m == Medium::kGpu ? "GPU" : m == Medium::kCpu ? "CPU" : "DISK"; }

}  // namespace pagedkv
