// The free list of physical blocks, one intrusive doubly linked LRU list per level over block ids (each
// with its own sentinel) and a bitmap of the non-empty levels. pop_front takes the front of the lowest
// non-empty level; it, push_back, push_front and remove (from the middle) are O(1) whatever the number
// of blocks, and allocate nothing. The GPU pool uses one level per retention priority; the CPU pool one.
#pragma once
#include <cstdint>
#include <vector>

namespace pagedkv {

class FreeList {
 public:
  static constexpr int32_t kNone = -1;

  explicit FreeList(int32_t capacity, int32_t num_levels = 1)  // num_levels <= 256
      : next_(capacity + num_levels, kNone),
        prev_(capacity + num_levels, kNone),
        level_(capacity, 0),
        non_empty_((num_levels + 63) / 64, 0),
        capacity_(capacity),
        num_levels_(num_levels) {
    for (int32_t l = 0; l < num_levels; ++l) next_[sentinel(l)] = prev_[sentinel(l)] = sentinel(l);
  }

  int32_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int32_t num_levels() const { return num_levels_; }
  bool contains(int32_t id) const { return next_[id] != kNone; }
  int32_t level(int32_t id) const { return level_[id]; }  // meaningful while contains(id)
  // The block pop_front would take, or kNone.
  int32_t front() const { return empty() ? kNone : next_[sentinel(lowest_level())]; }

  // The least recently pushed block of the lowest non-empty level.
  int32_t pop_front() {
    const int32_t id = next_[sentinel(lowest_level())];
    remove(id);
    return id;
  }
  void push_back(int32_t id, int32_t level = 0) { link(id, level, prev_[sentinel(level)], sentinel(level)); }
  void push_front(int32_t id, int32_t level = 0) { link(id, level, sentinel(level), next_[sentinel(level)]); }
  void remove(int32_t id) {
    next_[prev_[id]] = next_[id];
    prev_[next_[id]] = prev_[id];
    next_[id] = prev_[id] = kNone;
    --size_;
    const int32_t l = level_[id];
    if (next_[sentinel(l)] == sentinel(l)) non_empty_[l >> 6] &= ~(uint64_t(1) << (l & 63));
  }

  // Walks levels [first_level, num_levels) in the order pop_front would take them while f(id) is true.
  template <typename F>
  void for_each_from(int32_t first_level, F&& f) const {
    for (int32_t l = first_level; l < num_levels_; ++l)
      for (int32_t id = next_[sentinel(l)]; id != sentinel(l); id = next_[id])
        if (!f(id)) return;
  }
  // Walks the levels from the lowest, each front to back: the order pop_front would take them in.
  template <typename F>
  void for_each(F&& f) const {
    for (int32_t l = 0; l < num_levels_; ++l)
      for (int32_t id = next_[sentinel(l)]; id != sentinel(l); id = next_[id]) f(id);
  }

 private:
  int32_t sentinel(int32_t level) const { return capacity_ + level; }
  int32_t lowest_level() const {  // only called when not empty
    int32_t w = 0;
    while (non_empty_[w] == 0) ++w;
    return w * 64 + __builtin_ctzll(non_empty_[w]);
  }
  void link(int32_t id, int32_t level, int32_t before, int32_t after) {
    prev_[id] = before;
    next_[id] = after;
    next_[before] = id;
    prev_[after] = id;
    level_[id] = static_cast<uint8_t>(level);
    non_empty_[level >> 6] |= uint64_t(1) << (level & 63);
    ++size_;
  }

  std::vector<int32_t> next_, prev_;  // ids [0, capacity) are blocks, then one sentinel per level
  std::vector<uint8_t> level_;
  std::vector<uint64_t> non_empty_;   // bit l: level l's list is not empty
  int32_t capacity_, num_levels_;
  int32_t size_ = 0;
};

}  // namespace pagedkv
