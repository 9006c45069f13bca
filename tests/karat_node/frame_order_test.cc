#include "karat_node/frame_order.h"

#include <catch2/catch.hpp>

#include "common/model_config.h"

namespace karat {
namespace {

FrameKey Key(uint64_t turn, uint32_t pos, uint32_t layer, uint8_t kind) {
  return FrameKey{turn, pos, layer, kind};
}

TEST_CASE("frames apply once, in turn, position, layer and kind order",
          "[frame_order]") {
  const std::optional<FrameKey> none;
  CHECK(JudgeFrame(Key(3, 10, 0, 0), 3, none) == FrameVerdict::kApply);
  const FrameKey last = Key(3, 10, 2, 1);  // attention of layer 2 at pos 10
  // Later layers, kinds, positions and turns apply.
  CHECK(JudgeFrame(Key(3, 10, 3, 0), 3, last) == FrameVerdict::kApply);
  CHECK(JudgeFrame(Key(3, 11, 0, 0), 3, last) == FrameVerdict::kApply);
  CHECK(JudgeFrame(Key(4, 0, 0, 0), 3, last) == FrameVerdict::kApply);
  // The same frame again: its answer was lost.
  CHECK(JudgeFrame(last, 3, last) == FrameVerdict::kRepeat);
  // The index frame of the same layer, an earlier layer, an earlier
  // position: copies that arrived late.
  CHECK(JudgeFrame(Key(3, 10, 2, 0), 3, last) == FrameVerdict::kStale);
  CHECK(JudgeFrame(Key(3, 10, 1, 1), 3, last) == FrameVerdict::kStale);
  CHECK(JudgeFrame(Key(3, 9, 5, 1), 3, last) == FrameVerdict::kStale);
  // A turn older than the fence is refused, whatever the last frame.
  CHECK(JudgeFrame(Key(2, 50, 0, 0), 3, last) == FrameVerdict::kSuperseded);
  CHECK(JudgeFrame(Key(2, 50, 0, 0), 3, none) == FrameVerdict::kSuperseded);
}

TEST_CASE("the selection an attention frame needs", "[frame_order]") {
  ModelConfig c;
  c.attention.type = AttentionType::kMlaDsa;
  c.index_reuse_freq = 2;  // layers 0, 2, 4 run the indexer
  CHECK(SelectionLayer(c, 0) == 0);
  CHECK(SelectionLayer(c, 1) == 0);
  CHECK(SelectionLayer(c, 3) == 2);
  const auto need = NeededSelection(c, Key(7, 40, 3, 1));
  REQUIRE(need.has_value());
  CHECK(*need == Key(7, 40, 2, 0));
  c.attention.type = AttentionType::kGqaDense;
  CHECK(SelectionLayer(c, 3) == -1);
  CHECK_FALSE(NeededSelection(c, Key(7, 40, 3, 1)).has_value());
}

}  // namespace
}  // namespace karat
