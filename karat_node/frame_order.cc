#include "karat_node/frame_order.h"

namespace karat {

FrameKey KeyOf(const FrameHeader& h) {
  FrameKey k;
  k.turn = h.turn;
  k.pos_start = h.pos_start;
  k.layer = h.layer;
  k.kind = h.type == static_cast<uint16_t>(FrameType::kAttnQKV) ? 1 : 0;
  return k;
}

FrameVerdict JudgeFrame(const FrameKey& key, uint64_t fence,
                        const std::optional<FrameKey>& last) {
  if (key.turn < fence) return FrameVerdict::kSuperseded;
  if (!last.has_value() || key > *last) return FrameVerdict::kApply;
  if (key == *last) return FrameVerdict::kRepeat;
  return FrameVerdict::kStale;
}

int SelectionLayer(const ModelConfig& config, int layer) {
  if (config.attention.type != AttentionType::kMlaDsa) return -1;
  for (int l = layer; l >= 0; --l) {
    if (config.HasIndexer(l)) return l;
  }
  return -1;
}

std::optional<FrameKey> NeededSelection(const ModelConfig& config,
                                        const FrameKey& attention) {
  const int layer = SelectionLayer(config, int(attention.layer));
  if (layer < 0) return std::nullopt;
  FrameKey k = attention;
  k.layer = uint32_t(layer);
  k.kind = 0;
  return k;
}

}  // namespace karat
