// FreeList: O(1) LRU list operations keep order and membership.
#include <gtest/gtest.h>

#include <vector>

#include "core/free_list.h"

using pagedkv::FreeList;

static std::vector<int32_t> contents(const FreeList& l) {
  std::vector<int32_t> out;
  l.for_each([&](int32_t id) { out.push_back(id); });
  return out;
}

TEST(FreeList, PushPopKeepsFifoOrder) {
  FreeList l(5);
  for (int i = 0; i < 5; ++i) l.push_back(i);
  EXPECT_EQ(l.size(), 5);
  EXPECT_EQ(l.pop_front(), 0);
  EXPECT_EQ(l.pop_front(), 1);
  l.push_back(0);
  EXPECT_EQ(contents(l), (std::vector<int32_t>{2, 3, 4, 0}));
}

TEST(FreeList, RemoveFromMiddleAndPushFront) {
  FreeList l(6);
  for (int i = 0; i < 6; ++i) l.push_back(i);
  l.remove(3);
  l.remove(0);
  l.remove(5);
  EXPECT_FALSE(l.contains(3));
  EXPECT_TRUE(l.contains(4));
  l.push_front(3);
  EXPECT_EQ(contents(l), (std::vector<int32_t>{3, 1, 2, 4}));
  EXPECT_EQ(l.size(), 4);
  while (!l.empty()) l.pop_front();
  EXPECT_EQ(l.front(), FreeList::kNone);
}

TEST(FreeList, LowestLevelFirstLruWithinALevel) {
  FreeList l(8, /*num_levels=*/102);
  l.push_back(0, 90);
  l.push_back(1, 36);
  l.push_back(2, 36);
  l.push_back(3, 101);
  l.push_front(4, 0);
  EXPECT_EQ(contents(l), (std::vector<int32_t>{4, 1, 2, 0, 3}));
  EXPECT_EQ(l.level(0), 90);
  EXPECT_EQ(l.pop_front(), 4);
  l.remove(1);
  EXPECT_EQ(l.front(), 2);
  EXPECT_EQ(l.pop_front(), 2);
  EXPECT_EQ(l.pop_front(), 0) << "level 36 emptied: the next non-empty level is 90";
  l.push_back(5, 64);  // levels in the second bitmap word and across words
  EXPECT_EQ(l.pop_front(), 5);
  EXPECT_EQ(l.pop_front(), 3);
  EXPECT_TRUE(l.empty());
  EXPECT_EQ(l.front(), FreeList::kNone);
}
