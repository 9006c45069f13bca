#include "coordinator/admission_policy.h"

#include <catch2/catch.hpp>

namespace karat::coordinator {
namespace {

const absl::Time t0 = absl::FromUnixSeconds(1000);

TEST_CASE("turns try in order, each after those ahead found no room",
          "[admission]") {
  std::deque<QueuedTurn> q = {{1, t0, 0}, {2, t0, 0}, {3, t0, 0}};
  const absl::Duration bypass = absl::Seconds(5);
  const absl::Time now = t0 + absl::Seconds(1);
  // Room changed (epoch 7): the head tries first, alone.
  CHECK(MayTryAdmission(q, 0, 7, now, bypass));
  CHECK_FALSE(MayTryAdmission(q, 1, 7, now, bypass));
  // The head found no room: the next may pass it, not the third yet.
  q[0].waited_at = 7;
  CHECK_FALSE(MayTryAdmission(q, 0, 7, now, bypass));
  CHECK(MayTryAdmission(q, 1, 7, now, bypass));
  CHECK_FALSE(MayTryAdmission(q, 2, 7, now, bypass));
  q[1].waited_at = 7;
  CHECK(MayTryAdmission(q, 2, 7, now, bypass));
  // New room (epoch 8): the head again first.
  CHECK(MayTryAdmission(q, 0, 8, now, bypass));
  CHECK_FALSE(MayTryAdmission(q, 1, 8, now, bypass));
  CHECK_FALSE(MayTryAdmission(q, 5, 8, now, bypass));
}

TEST_CASE("nobody passes a turn that has waited the bypass bound",
          "[admission]") {
  std::deque<QueuedTurn> q = {{1, t0, 7}, {2, t0 + absl::Seconds(4), 0}};
  const absl::Duration bypass = absl::Seconds(5);
  CHECK(MayTryAdmission(q, 1, 7, t0 + absl::Seconds(4), bypass));
  CHECK_FALSE(MayTryAdmission(q, 1, 7, t0 + absl::Seconds(5), bypass));
  // The aged head itself still tries whenever room changes.
  CHECK(MayTryAdmission(q, 0, 8, t0 + absl::Seconds(30), bypass));
}

TEST_CASE("a negative bypass is strict FIFO", "[admission]") {
  std::deque<QueuedTurn> q = {{1, t0, 7}, {2, t0, 0}};
  CHECK_FALSE(MayTryAdmission(q, 1, 7, t0, QueueBypass(-1)));
  CHECK(MayTryAdmission(q, 0, 8, t0, QueueBypass(-1)));
  CHECK(QueueBypass(0) == absl::Seconds(5));
  CHECK(QueueBypass(250) == absl::Milliseconds(250));
}

}  // namespace
}  // namespace karat::coordinator
