// KaratNode.Reserve's request check (karat_node/reserve_request.h).
#include "karat_node/reserve_request.h"

#include <catch2/catch.hpp>
#include <limits>
#include <string>

namespace karat {
namespace {

TEST_CASE("Reserve: a device of the node and tokens > 0", "[reserve]") {
  CHECK(ValidateReserve(0, 2, 1).ok());
  CHECK(ValidateReserve(1, 2, std::numeric_limits<int>::max()).ok());
  for (int device : {-1, 2, std::numeric_limits<int>::min()}) {
    const absl::Status st = ValidateReserve(device, 2, 16);
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(st.message()).find("the node has 2") !=
          std::string::npos);
  }
  CHECK(ValidateReserve(0, 0, 16).code() == absl::StatusCode::kInvalidArgument);
  for (int tokens : {0, -1, std::numeric_limits<int>::min()}) {
    CHECK(ValidateReserve(0, 2, tokens).code() ==
          absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace karat
