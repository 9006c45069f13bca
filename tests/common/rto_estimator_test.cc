#include "common/rto_estimator.h"

#include <catch2/catch.hpp>

namespace karat {
namespace {

using absl::Milliseconds;

TEST_CASE("the retransmission timeout follows the answer times",
          "[rto]") {
  RtoEstimator e(Milliseconds(200), Milliseconds(1), absl::Seconds(1));
  CHECK(e.rto() == Milliseconds(200));  // no sample yet
  CHECK_FALSE(e.has_samples());
  e.Sample(Milliseconds(10));
  // First sample: srtt 10, rttvar 5: rto 10 + 4 * 5.
  CHECK(e.srtt() == Milliseconds(10));
  CHECK(e.rto() == Milliseconds(30));
  e.Sample(Milliseconds(10));
  // rttvar 3/4 * 5 + 1/4 * 0 = 3.75; srtt stays 10.
  CHECK(e.rto() == Milliseconds(25));
  // Steady answers shrink the deviation; the floor holds.
  for (int i = 0; i < 200; ++i) e.Sample(absl::Microseconds(100));
  CHECK(e.rto() == Milliseconds(1));
  // A slow answer widens it again.
  e.Sample(Milliseconds(50));
  CHECK(e.rto() > Milliseconds(20));
}

TEST_CASE("each resend doubles the wait, up to the bound", "[rto]") {
  RtoEstimator e(Milliseconds(100), Milliseconds(1), Milliseconds(700));
  CHECK(e.Backoff(1) == Milliseconds(100));
  CHECK(e.Backoff(2) == Milliseconds(200));
  CHECK(e.Backoff(3) == Milliseconds(400));
  CHECK(e.Backoff(4) == Milliseconds(700));
  CHECK(e.Backoff(40) == Milliseconds(700));
}

}  // namespace
}  // namespace karat
