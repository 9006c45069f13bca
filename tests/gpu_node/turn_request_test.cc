// GpuNode.RunTurn's request check (gpu_node/turn_request.h).
#include "gpu_node/turn_request.h"

#include <catch2/catch.hpp>

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

}  // namespace
}  // namespace karat
