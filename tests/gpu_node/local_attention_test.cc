// The GPU rank's own KV store of gpu_only mode (gpu_node/local_attention.h):
// the bytes each session holds, which GpuNode.Reserve reports for the
// coordinator's max_kv_bytes.
#include "gpu_node/local_attention.h"

#include <catch2/catch.hpp>

#include "common/model_config.h"

namespace karat {
namespace {

TEST_CASE("gpu_only KV: each session's bytes, page-granular") {
  auto config = PresetConfig("dsa-small");
  REQUIRE(config.ok());
  auto local =
      GpuLocalAttention::Create(*config, MethodWeights(), 16, size_t(64) << 20);
  REQUIRE(local.ok());
  GpuLocalAttention& kv = **local;
  CHECK(kv.session_bytes(1) == 0);
  REQUIRE(kv.Reserve(1, 16).ok());
  const size_t one_page = kv.session_bytes(1);  // a page in every layer
  CHECK(one_page > 0);
  REQUIRE(kv.Reserve(2, 17).ok());
  CHECK(kv.session_bytes(2) == 2 * one_page);
  CHECK(kv.session_bytes(1) == one_page);
  CHECK(kv.used_bytes() == 3 * one_page);
  // A smaller reservation keeps what the session holds.
  REQUIRE(kv.Reserve(2, 4).ok());
  CHECK(kv.session_bytes(2) == 2 * one_page);
  kv.Free(2);
  CHECK(kv.session_bytes(2) == 0);
  CHECK(kv.used_bytes() == one_page);
}

}  // namespace
}  // namespace karat
