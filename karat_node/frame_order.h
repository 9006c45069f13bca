// The order of one session's data frames on its KARAT device, so that a
// lossy link cannot corrupt the session's KV (docs/data-plane.md, lossy
// links). A GPU node resends the frames of a segment whose attention output
// has not come back (the request, the output, or both may have been lost),
// and a link may delay a copy behind later frames. The device therefore
// applies each frame at most once in the order the turn produced them:
//
//   key = (turn epoch, first position, layer, kind: kIndexQK < kAttnQKV)
//
// Within one turn a GPU node feeds a session's positions in increasing
// order, layer after layer, the index keys of a layer before its attention
// frame; a new turn (or a resumed one) runs under a larger epoch. A frame
// whose key is below the last applied one is a stale copy and is skipped;
// one equal to it is the repeat of a frame whose answer was lost: an
// attention frame is answered with the output kept from the first copy
// (decode-sized frames, and a GQA frame that ends its turn's prefill,
// whose method metadata built at that end would change a recomputation)
// or computed again (the session is as it was right after the first copy,
// so the output is the same bits), and an index frame is skipped. A frame of a turn older than the epoch Reserve fenced in
// belongs to a turn that was cancelled or failed while still in a GPU
// step, and is refused. Pure functions.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>

#include "common/frame.h"
#include "common/model_config.h"

namespace karat {

struct FrameKey {
  uint64_t turn = 0;
  uint32_t pos_start = 0;
  uint32_t layer = 0;
  uint8_t kind = 0;  // 0: kIndexQK, 1: kAttnQKV
  friend auto operator<=>(const FrameKey&, const FrameKey&) = default;
};

// The key of a kIndexQK or kAttnQKV frame.
FrameKey KeyOf(const FrameHeader& header);

enum class FrameVerdict {
  kApply,       // new: apply it
  kRepeat,      // the last applied frame again
  kStale,       // below the last applied frame: skip it
  kSuperseded,  // of a turn older than the fence: refuse it
};

// Where `key` stands for a session whose newest fenced-in turn is `fence`
// and whose last applied frame is `last` (none yet: nullopt).
FrameVerdict JudgeFrame(const FrameKey& key, uint64_t fence,
                        const std::optional<FrameKey>& last);

// The layer whose indexer selection layer `layer` attends with: the layer
// itself when it runs the indexer, else the nearest one before it (index
// reuse); -1 when none does or the model has no indexer.
int SelectionLayer(const ModelConfig& config, int layer);

// The kIndexQK key whose selection a kAttnQKV frame of `key` needs, or
// nullopt when it needs none.
std::optional<FrameKey> NeededSelection(const ModelConfig& config,
                                        const FrameKey& attention);

}  // namespace karat
