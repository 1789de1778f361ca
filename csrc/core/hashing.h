// Chained block hashes: h_i = H(h_{i-1}, tokens_i). The hash only speeds up prefix-cache lookup;
// hits are confirmed by exact comparison (see prefix_cache.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pagedkv {

enum class HashAlgo {
  kXXH64,   // xxh64(seed 0, parent as 8 little-endian bytes + tokens as int64 little-endian)
  kSHA256,  // first 8 bytes (little-endian) of sha256 over the same bytes
  kWeak8,   // xxh64 truncated to 8 bits: forces collisions, for tests
};

HashAlgo parse_hash_algo(std::string_view name);  // throws ValueError on an unknown name
const char* hash_algo_name(HashAlgo algo);
bool sha256_available();

// Hash of one block. `parent` is the previous block's hash (none for block 0). A non-empty `salt`
// (block 0 only) acts as a virtual parent, so salted and unsalted chains never meet.
uint64_t hash_block_tokens(const int64_t* tokens, size_t num_tokens, std::optional<uint64_t> parent,
                           HashAlgo algo, std::string_view salt = {});

}  // namespace pagedkv
