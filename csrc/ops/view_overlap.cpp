// The exact overlap test of two strided views (view_overlap.h): a bounded search over index
// coefficients, largest stride first.
#include "ops/view_overlap.h"

#include <algorithm>
#include <map>

namespace pagedkv {
namespace {

// floor(a / b) and ceil(a / b) for b > 0.
int64_t floor_div(int64_t a, int64_t b) { return a / b - (a % b != 0 && a < 0); }
int64_t ceil_div_signed(int64_t a, int64_t b) { return a / b + (a % b != 0 && a > 0); }

// One stride of the equation and the range [lo, hi] of its integer coefficient.
struct Term {
  int64_t stride;
  int64_t lo;
  int64_t hi;
};

class OverlapSearch {
 public:
  OverlapSearch(std::vector<Term> terms, int64_t max_steps) : terms_(std::move(terms)), steps_left_(max_steps) {
    // reach_[t]: the least and greatest sum the terms t.. can make.
    reach_lo_.assign(terms_.size() + 1, 0);
    reach_hi_.assign(terms_.size() + 1, 0);
    for (size_t t = terms_.size(); t-- > 0;) {
      reach_lo_[t] = reach_lo_[t + 1] + terms_[t].lo * terms_[t].stride;
      reach_hi_[t] = reach_hi_[t + 1] + terms_[t].hi * terms_[t].stride;
    }
  }

  Overlap solve(int64_t target) {
    const bool found = search(0, target);
    if (out_of_steps_) return Overlap::kUnknown;
    return found ? Overlap::kShared : Overlap::kDisjoint;
  }

 private:
  // Whether terms t.. can sum to rest.
  bool search(size_t t, int64_t rest) {
    if (rest < reach_lo_[t] || rest > reach_hi_[t]) return false;
    if (t == terms_.size()) return true;  // rest == 0 here
    if (--steps_left_ < 0) {
      out_of_steps_ = true;
      return false;
    }
    const Term& term = terms_[t];
    // rest - k * stride must stay within what the smaller terms reach.
    const int64_t k_lo = std::max(term.lo, ceil_div_signed(rest - reach_hi_[t + 1], term.stride));
    const int64_t k_hi = std::min(term.hi, floor_div(rest - reach_lo_[t + 1], term.stride));
    for (int64_t k = k_lo; k <= k_hi && !out_of_steps_; ++k) {
      if (search(t + 1, rest - k * term.stride)) return true;
    }
    return false;
  }

  std::vector<Term> terms_;
  std::vector<int64_t> reach_lo_, reach_hi_;
  int64_t steps_left_;
  bool out_of_steps_ = false;
};

}  // namespace

Overlap views_overlap(const ByteView& a, const ByteView& b, int64_t max_steps) {
  for (const ByteView* v : {&a, &b}) {
    for (const int64_t size : v->sizes) {
      if (size == 0) return Overlap::kDisjoint;  // no elements
    }
  }
  // Coefficient ranges grouped by stride: a's indices count up, b's down, and c (the byte offset of
  // b's element start relative to a's) spans the two elements' widths.
  std::map<int64_t, Term> by_stride;
  auto add = [&](int64_t stride, int64_t lo, int64_t hi) {
    if (stride == 0 || (lo == 0 && hi == 0)) return;
    Term& term = by_stride.try_emplace(stride, Term{stride, 0, 0}).first->second;
    term.lo += lo;
    term.hi += hi;
  };
  for (size_t d = 0; d < a.sizes.size(); ++d) add(a.strides[d], 0, a.sizes[d] - 1);
  for (size_t d = 0; d < b.sizes.size(); ++d) add(b.strides[d], -(b.sizes[d] - 1), 0);
  add(1, -(b.elem_size - 1), a.elem_size - 1);
  std::vector<Term> terms;
  for (auto it = by_stride.rbegin(); it != by_stride.rend(); ++it) terms.push_back(it->second);
  return OverlapSearch(std::move(terms), max_steps).solve(b.base - a.base);
}

}  // namespace pagedkv
