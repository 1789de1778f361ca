// Whether two strided views of one buffer share a byte: the exact aliasing check of the ops' in-place
// arguments (e.g. the K and V halves of vLLM's interleaved cache cells). Torch-free.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedkv {

// A strided view in bytes: element (i_0, ..., i_n) starts at base + sum_d i_d * stride_d and covers
// elem_size bytes. Strides are >= 0 (as torch's).
struct ByteView {
  int64_t base;
  int64_t elem_size;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  // bytes
};

enum class Overlap {
  kDisjoint,  // no byte is in both views
  kShared,    // some byte is in both views
  kUnknown,   // not decided within the search budget (treat as shared)
};

// Decides whether a and b share a byte by solving
//     b.base - a.base = sum_d i_d a.stride_d - sum_d j_d b.stride_d + c,  c in [-(b.elem_size - 1), a.elem_size - 1]
// over integer indices inside each view's sizes: the terms, grouped by stride, are tried largest stride
// first, and only coefficients that leave the rest reachable by the smaller terms are followed. When a
// and b have the same strides and neither has internal overlap (interleaved K|V cells, [pages, 2, ...]
// halves, HND transposes), at most two coefficients survive per stride, so the answer is exact within a
// few dozen steps; other mixes are searched up to max_steps and come back kUnknown past it.
Overlap views_overlap(const ByteView& a, const ByteView& b, int64_t max_steps = 1 << 14);

}  // namespace pagedkv
