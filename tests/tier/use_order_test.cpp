// The learned order of uses (tier/use_order.hpp): what the offload engine reads "when is
// this chunk needed next" from.
#include "tier/use_order.hpp"

#include <gtest/gtest.h>

namespace zeroalloc {
namespace {

constexpr std::uintptr_t kA = 0x1000;
constexpr std::uintptr_t kB = 0x2000;
constexpr std::uintptr_t kC = 0x3000;

// One step of a two-layer model: A's forward, B's forward, B's backward, A's backward, then
// C used in place (marked), as the windowed step uses a state.
void one_step(use_order& order) {
  for (std::uintptr_t address : {kA, kB, kB, kA}) order.record(address, /*reopened=*/true);
  order.record(kC, /*reopened=*/true, /*marked=*/true);
}

TEST(UseOrderTest, NothingIsKnownBeforeTheFirstBoundary) {
  use_order order;
  one_step(order);
  EXPECT_TRUE(order.empty());
  EXPECT_EQ(order.distance(kA, false), use_order::kNever);
}

TEST(UseOrderTest, EachReopenedUseIsAPositionAndTheCursorWalksThemInTurn) {
  use_order order;
  one_step(order);
  order.boundary();
  ASSERT_EQ(order.size(), 5u);
  EXPECT_EQ(order.at(1), kB);
  EXPECT_EQ(order.at(2), kB) << "the backward's use is a position of its own";
  // The next step: A's forward use, then B's: the cursor stands on B's first position.
  order.record(kA, true);
  EXPECT_EQ(order.distance(kA, /*in_use=*/true), 0u) << "the use in progress";
  EXPECT_EQ(order.distance(kA, /*in_use=*/false), 3u) << "A's backward comes three uses later";
  order.record(kB, true);
  EXPECT_EQ(order.cursor(), 1u);
  order.record(kA, true);  // A's backward: the cursor goes to A's next position, not back
  EXPECT_EQ(order.cursor(), 3u);
  EXPECT_EQ(order.distance(kC, false), 1u);
  // A position behind the cursor counts in the next step.
  EXPECT_EQ(order.distance(kB, false), 1u + order.size() - 3u);
}

TEST(UseOrderTest, AUseNestedInAnOpenOneRecordsNothingAndMovesNoCursor) {
  use_order order;
  one_step(order);
  order.boundary();
  order.record(kA, true);
  order.record(kA, /*reopened=*/false);  // a second allocation of A's chunk, A still open
  EXPECT_EQ(order.cursor(), 0u) << "jumped to A's backward";
  order.boundary();
  EXPECT_EQ(order.size(), 1u) << "the nested use was recorded";
}

TEST(UseOrderTest, MarkedPositionsAreFoundFromAnyPosition) {
  use_order order;
  one_step(order);
  order.boundary();
  EXPECT_FALSE(order.marked(0));
  EXPECT_TRUE(order.marked(4));
  EXPECT_EQ(order.next_marked(0), 4u);
  EXPECT_EQ(order.next_marked(4), 4u);
  EXPECT_EQ(order.next_marked(5), order.size()) << "none after the last";
  EXPECT_EQ(order.next_marked(99), order.size());
}

}  // namespace
}  // namespace zeroalloc
