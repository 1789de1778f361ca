// The LRU free list of physical blocks: an intrusive doubly linked list over block ids with a sentinel.
// pop_front, push_back, push_front and remove (from the middle) are O(1) and allocate nothing.
#pragma once
#include <cstdint>
#include <vector>

namespace pagedkv {

class FreeList {
 public:
  explicit FreeList(int32_t capacity)
      : next_(capacity + 1, kNone), prev_(capacity + 1, kNone), sentinel_(capacity) {
    next_[sentinel_] = prev_[sentinel_] = sentinel_;
  }

  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool contains(int32_t id) const { return next_[id] != kNone; }
  int32_t front() const { return empty() ? kNone : next_[sentinel_]; }

  // Least recently freed block first.
  int32_t pop_front() {
    const int32_t id = next_[sentinel_];
    remove(id);
    return id;
  }
  void push_back(int32_t id) { link(id, prev_[sentinel_], sentinel_); }
  void push_front(int32_t id) { link(id, sentinel_, next_[sentinel_]); }
  void remove(int32_t id) {
    next_[prev_[id]] = next_[id];
    prev_[next_[id]] = prev_[id];
    next_[id] = prev_[id] = kNone;
    --size_;
  }

  // Walks the list front to back; used by check_invariants and tests.
  template <typename F>
  void for_each(F&& f) const {
    for (int32_t id = next_[sentinel_]; id != sentinel_; id = next_[id]) f(id);
  }

  static constexpr int32_t kNone = -1;

 private:
  void link(int32_t id, int32_t before, int32_t after) {
    prev_[id] = before;
    next_[id] = after;
    next_[before] = id;
    prev_[after] = id;
    ++size_;
  }

  std::vector<int32_t> next_, prev_;
  int32_t sentinel_;
  int32_t size_ = 0;
};

}  // namespace pagedkv
