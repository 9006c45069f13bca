#include "common/log_limiter.h"

#include <catch2/catch.hpp>

namespace karat {
namespace {

absl::Time g_now = absl::UnixEpoch();
absl::Time FakeNow() { return g_now; }

TEST_CASE("a limiter lets one line per interval and key through", "[log]") {
  g_now = absl::UnixEpoch();
  LogLimiter limiter(absl::Seconds(10), &FakeNow);
  CHECK(limiter.Admit("peer-a") == 0);  // the first line goes out
  CHECK(limiter.Admit("peer-a") == -1);
  CHECK(limiter.Admit("peer-a") == -1);
  CHECK(limiter.Admit("peer-b") == 0);  // keys are independent
  g_now += absl::Seconds(9);
  CHECK(limiter.Admit("peer-a") == -1);
  g_now += absl::Seconds(1);
  // The line that goes out counts those held back since the last one.
  CHECK(limiter.Admit("peer-a") == 3);
  CHECK(limiter.Admit("peer-a") == -1);
  CHECK(limiter.held_back() == 4);
  CHECK(HeldBackNote(3) == " (3 more like it held back)");
  CHECK(HeldBackNote(0).empty());
}

TEST_CASE("a limiter bounds the keys it tracks", "[log]") {
  g_now = absl::UnixEpoch();
  LogLimiter limiter(absl::Seconds(10), &FakeNow);
  for (size_t i = 0; i < LogLimiter::kMaxKeys; ++i)
    REQUIRE(limiter.Admit(std::to_string(i)) == 0);
  // Past the bound, new keys share one entry: the first goes out, the
  // next is held back.
  CHECK(limiter.Admit("new-1") == 0);
  CHECK(limiter.Admit("new-2") == -1);
}

}  // namespace
}  // namespace karat
