// Block hashing: xxHash compiled in from its header, SHA-256 from core/sha256.h (no library linked).
#include "core/hashing.h"

#include <cstring>
#include <vector>

#include "core/errors.h"
#include "core/sha256.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pagedkv {
namespace {

static_assert(sizeof(int64_t) == 8, "token ids are hashed as int64");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
constexpr bool kLittleEndian = true;  // tokens are already little-endian int64 bytes
#else
constexpr bool kLittleEndian = false;
#endif

uint64_t load_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_le64(uint64_t v, unsigned char* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

uint64_t digest(const unsigned char* data, size_t len, HashAlgo algo) {
  if (algo == HashAlgo::kSHA256) return load_le64(sha256(data, len).data());
  uint64_t h = XXH64(data, len, 0);
  return algo == HashAlgo::kWeak8 ? (h & 0xFFu) : h;
}

}  // namespace

HashAlgo parse_hash_algo(std::string_view name) {
  if (name == "xxh64") return HashAlgo::kXXH64;
  if (name == "sha256") return HashAlgo::kSHA256;
  if (name == "weak8") return HashAlgo::kWeak8;
  throw ValueError("hash_algo must be 'xxh64', 'sha256' or 'weak8', got '" + std::string(name) + "'");
}

const char* hash_algo_name(HashAlgo algo) {
  switch (algo) {
    case HashAlgo::kXXH64: return "xxh64";
    case HashAlgo::kSHA256: return "sha256";
    case HashAlgo::kWeak8: return "weak8";
  }
  return "?";
}

bool sha256_available() { return true; }  // kept for callers that checked it: SHA-256 is always built in

uint64_t hash_block_tokens(const int64_t* tokens, size_t num_tokens, std::optional<uint64_t> parent,
                           HashAlgo algo, std::string_view salt) {
  if (!salt.empty() && !parent) {
    // The salt becomes the parent of block 0: a distinct chain per salt, never equal to an unsalted one
    // except by a hash collision (which exact matching turns into a miss).
    std::vector<unsigned char> salted(salt.size() + 1);
    salted[0] = 0xA5;  // domain tag: a salt is not a token sequence
    std::memcpy(salted.data() + 1, salt.data(), salt.size());
    parent = digest(salted.data(), salted.size(), algo);
  }
  if (!parent && kLittleEndian) return digest(reinterpret_cast<const unsigned char*>(tokens), num_tokens * 8, algo);
  // Small blocks hash from the stack; large ones from the heap.
  const size_t len = (parent ? 8 : 0) + num_tokens * 8;
  unsigned char stack_buf[8 + 64 * 8];
  std::vector<unsigned char> heap_buf;
  unsigned char* buf = stack_buf;
  if (len > sizeof(stack_buf)) {
    heap_buf.resize(len);
    buf = heap_buf.data();
  }
  unsigned char* p = buf;
  if (parent) {
    store_le64(*parent, p);
    p += 8;
  }
  if (kLittleEndian) {
    std::memcpy(p, tokens, num_tokens * 8);
  } else {
    for (size_t i = 0; i < num_tokens; ++i, p += 8) store_le64(static_cast<uint64_t>(tokens[i]), p);
  }
  return digest(buf, len, algo);
}

}  // namespace pagedkv
