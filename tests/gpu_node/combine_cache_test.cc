// The serving rank's duplicate cache: in-progress dispatches, kept
// combines, bounds per sender, forgetting senders.
#include "gpu_node/combine_cache.h"

#include <catch2/catch.hpp>
#include <memory>
#include <string>

namespace karat {
namespace {

using State = CombineCache::State;

std::shared_ptr<const std::string> Answer(size_t bytes, char fill = 'x') {
  return std::make_shared<const std::string>(bytes, fill);
}

DispatchKey Key(uint64_t request) { return {request, 3, 1, 0}; }

TEST_CASE("a dispatch is new once, then in progress, then answered",
          "[combine_cache]") {
  CombineCache cache;
  CHECK(cache.Begin(7, Key(1)).state == State::kNew);
  CHECK(cache.in_progress() == 1);
  // A copy while the first is queued or computed.
  CHECK(cache.Begin(7, Key(1)).state == State::kInProgress);
  // Another sender's request 1 is another dispatch.
  CHECK(cache.Begin(8, Key(1)).state == State::kNew);
  const auto answer = Answer(100);
  cache.Finish(7, Key(1), answer);
  CHECK(cache.in_progress() == 1);
  const CombineCache::Seen again = cache.Begin(7, Key(1));
  CHECK(again.state == State::kAnswered);
  CHECK(again.answer == answer);  // the same bytes, not a copy
  CHECK(cache.entries() == 1);
  CHECK(cache.bytes() == 100);
}

TEST_CASE("a reused request id for other work is not a duplicate",
          "[combine_cache]") {
  CombineCache cache;
  REQUIRE(cache.Begin(7, Key(1)).state == State::kNew);
  cache.Finish(7, Key(1), Answer(10));
  DispatchKey other = Key(1);
  other.layer = 2;
  CHECK(cache.Begin(7, other).state == State::kNew);
  other = Key(1);
  other.step = 4;
  CHECK(cache.Begin(7, other).state == State::kNew);
  other = Key(1);
  other.micro_batch = 1;
  CHECK(cache.Begin(7, other).state == State::kNew);
}

TEST_CASE("each sender keeps at most its entry and byte bounds, oldest first",
          "[combine_cache]") {
  CombineCacheLimits limits;
  limits.max_entries = 3;
  limits.max_bytes = 1000;
  CombineCache cache(limits);
  for (uint64_t r = 1; r <= 5; ++r) {
    REQUIRE(cache.Begin(7, Key(r)).state == State::kNew);
    cache.Finish(7, Key(r), Answer(100));
  }
  CHECK(cache.entries() == 3);
  CHECK(cache.evictions() == 2);
  CHECK(cache.Begin(7, Key(2)).state == State::kNew);  // evicted
  cache.Abandon(7, Key(2));
  for (uint64_t r = 3; r <= 5; ++r) {
    CHECK(cache.Begin(7, Key(r)).state == State::kAnswered);
  }
  // Another sender has bounds of its own.
  REQUIRE(cache.Begin(9, Key(1)).state == State::kNew);
  cache.Finish(9, Key(1), Answer(100));
  CHECK(cache.entries() == 4);
  CHECK(cache.Begin(7, Key(3)).state == State::kAnswered);

  // Bytes: a 900-byte answer pushes out two of sender 7's 100-byte ones.
  REQUIRE(cache.Begin(7, Key(6)).state == State::kNew);
  cache.Finish(7, Key(6), Answer(900));
  CHECK(cache.Begin(7, Key(6)).state == State::kAnswered);
  CHECK(cache.Begin(7, Key(5)).state == State::kAnswered);
  CHECK(cache.Begin(7, Key(4)).state == State::kNew);
  cache.Abandon(7, Key(4));
  CHECK(cache.bytes() == 100 + 900 + 100);  // sender 9's, 6, 5

  // One larger than the budget alone is not kept (and evicts nothing).
  REQUIRE(cache.Begin(7, Key(7)).state == State::kNew);
  cache.Finish(7, Key(7), Answer(1001));
  CHECK(cache.Begin(7, Key(7)).state == State::kNew);
  CHECK(cache.Begin(7, Key(6)).state == State::kAnswered);
  CHECK(cache.in_progress() == 1);  // the last Begin(7, 7)
}

TEST_CASE("senders that leave the table are forgotten", "[combine_cache]") {
  CombineCache cache;
  REQUIRE(cache.Begin(7, Key(1)).state == State::kNew);
  cache.Finish(7, Key(1), Answer(10));
  REQUIRE(cache.Begin(8, Key(1)).state == State::kNew);
  cache.Finish(8, Key(1), Answer(20));
  REQUIRE(cache.Begin(8, Key(2)).state == State::kNew);  // in progress
  cache.RetainSenders({7});
  CHECK(cache.entries() == 1);
  CHECK(cache.bytes() == 10);
  CHECK(cache.in_progress() == 0);
  // The service finishing a forgotten sender's dispatch keeps nothing.
  cache.Finish(8, Key(2), Answer(30));
  CHECK(cache.entries() == 1);
  CHECK(cache.Begin(7, Key(1)).state == State::kAnswered);
  cache.Clear();
  CHECK(cache.entries() == 0);
  CHECK(cache.bytes() == 0);
  CHECK(cache.Begin(7, Key(1)).state == State::kNew);
}

}  // namespace
}  // namespace karat
