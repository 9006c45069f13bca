// GpuNode.RunTurn's request check (gpu_node/turn_request.h).
#include "gpu_node/turn_request.h"

#include <catch2/catch.hpp>
#include <limits>

namespace karat {
namespace {

TEST_CASE("RunTurn validation", "[gpu_node]") {
  cluster::RunTurnRequest r;
  r.add_feed_tokens(256);
  r.set_max_new_tokens(4);
  r.mutable_placement()->set_fabric_address("addr");
  CHECK(ValidateTurnRequest(r, 258).ok());
  auto bad = [&](auto mutate) {
    cluster::RunTurnRequest b = r;
    mutate(&b);
    return ValidateTurnRequest(b, 258).code() ==
           absl::StatusCode::kInvalidArgument;
  };
  CHECK(bad([](cluster::RunTurnRequest* b) { b->clear_feed_tokens(); }));
  CHECK(bad([](cluster::RunTurnRequest* b) { b->add_feed_tokens(258); }));
  CHECK(bad([](cluster::RunTurnRequest* b) { b->add_feed_tokens(-1); }));
  CHECK(bad([](cluster::RunTurnRequest* b) { b->set_max_new_tokens(0); }));
  CHECK(bad([](cluster::RunTurnRequest* b) { b->clear_placement(); }));
  CHECK(bad([](cluster::RunTurnRequest* b) { b->set_temperature(-1); }));
  CHECK(bad([](cluster::RunTurnRequest* b) { b->set_pos_start(-2); }));
}

TEST_CASE("RunTurn validation: the turn's positions fit in an int",
          "[gpu_node]") {
  constexpr int kMax = std::numeric_limits<int>::max();
  cluster::RunTurnRequest r;
  r.add_feed_tokens(65);
  r.add_feed_tokens(66);
  r.set_max_new_tokens(3);
  r.set_pos_start(kMax - 5);  // last position kMax
  CHECK(ValidateTurnRequest(r, 258, /*need_placement=*/false).ok());
  r.set_pos_start(kMax - 4);
  absl::Status st = ValidateTurnRequest(r, 258, false);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(st.message()).find("2147483648") != std::string::npos);
  // The fuzz target's input (tests/fuzz/run_turn_corpus/
  // regression_pos_overflow): pos_start at the int limit, with prefill ends
  // that the old check added to it.
  r.set_pos_start(kMax);
  r.add_prefill_ends(32);
  r.add_prefill_ends(127);
  CHECK(ValidateTurnRequest(r, 258, false).code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace karat
