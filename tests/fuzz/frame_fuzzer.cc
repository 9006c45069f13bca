// libFuzzer target for the data-plane frame decoder: DecodeFrame() must
// accept or reject any byte string without reading out of bounds, and a
// frame it accepts must re-encode to the same bytes.
//
// Built with clang (-fsanitize=fuzzer,address) by the karat-frame-fuzzer
// target; `deploy/karat test` runs it for a bounded time from the seed
// corpus in tests/fuzz/frame_corpus/.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "common/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view message(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<karat::FrameView> frame = karat::DecodeFrame(message);
  if (!frame.ok()) return 0;
  // Every section lies inside the message.
  std::vector<std::string_view> sections;
  for (uint32_t i = 0; i < frame->header.n_sections; ++i) {
    const std::string_view s = frame->sections[i];
    if (s.size() > 0 && (s.data() < message.data() ||
                         s.data() + s.size() > message.data() + message.size())) {
      std::abort();
    }
    sections.push_back(s);
  }
  (void)karat::FrameTypeName(frame->header.type);
  // Re-encoding an accepted frame is accepted again with the same header.
  std::string again;
  karat::EncodeFrame(frame->header, sections, &again);
  absl::StatusOr<karat::FrameView> decoded = karat::DecodeFrame(again);
  if (!decoded.ok() || decoded->header.type != frame->header.type ||
      decoded->header.n_sections != frame->header.n_sections ||
      decoded->header.session != frame->header.session) {
    std::abort();
  }
  for (uint32_t i = 0; i < decoded->header.n_sections; ++i) {
    if (decoded->sections[i] != sections[i]) std::abort();
  }
  return 0;
}
