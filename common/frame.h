// Versioned frame format of data-plane messages. A frame is a fixed header
// followed by up to kMaxSections payload sections, each 8-byte aligned.
// Decoding validates everything (magic, version, type, section count and
// lengths against the message size) and never reads out of bounds.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace karat {

constexpr uint32_t kFrameMagic = 0x4652544B;  // "KTRF" little-endian
constexpr uint16_t kFrameVersion = 2;
constexpr int kMaxSections = 8;

enum class FrameType : uint16_t {
  // The handshake (docs/security.md "Data plane"; the proof's layout and
  // MAC in common/hello_proof.h, absent in plaintext mode):
  kHello = 1,     // GPU node -> KARAT node: sections[0] = sender address,
                  // sections[1] = proof
  kHelloAck = 2,  // KARAT node -> GPU node: sections[0] = proof
  kIndexQK = 3,   // indexer Q/K of a segment for one layer
  kAttnQKV = 4,   // attention Q and new KV entries of a segment
  kAttnOut = 5,   // attention output of a segment
  kError = 6,     // sections[0] = message text; `status` = absl code
  // GPU rank -> GPU rank (expert-parallel MoE, gpu_node/expert_parallel.h):
  kMoeDispatch = 7,  // rows of one layer for experts the receiver owns
  kMoeCombine = 8,   // the experts' outputs for a kMoeDispatch
};

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kFrameVersion;
  uint16_t type = 0;
  uint32_t src_node = 0;  // sender's node id (from registration)
  uint32_t layer = 0;
  uint32_t micro_batch = 0;
  uint32_t device = 0;     // KARAT device on the receiving node
  uint64_t step = 0;       // sender's step counter
  uint64_t session = 0;    // numeric session key
  // The coordinator's turn epoch of the session's turn the frame belongs
  // to (RunTurnRequest.turn_epoch, increasing): a KARAT device refuses the
  // frames of a turn older than the last it was told of (KaratNode.Reserve),
  // so that a cancelled or failed turn still in a GPU step cannot write a
  // session's KV after its next turn began. 0 in frames outside a turn.
  uint64_t turn = 0;
  uint32_t pos_start = 0;  // first position of the segment
  uint32_t n_tokens = 0;   // tokens in the segment
  uint32_t status = 0;     // kError: absl::StatusCode
  uint32_t n_sections = 0;
  std::array<uint64_t, kMaxSections> section_len{};
};

// A decoded frame: the header and views into the message bytes.
struct FrameView {
  FrameHeader header;
  std::array<std::string_view, kMaxSections> sections{};
};

// Encodes a frame into `out` (cleared first). header.n_sections and
// section_len are set from `sections`.
void EncodeFrame(FrameHeader header,
                 const std::vector<std::string_view>& sections,
                 std::string* out);
// Size EncodeFrame would produce.
size_t EncodedFrameSize(const std::vector<size_t>& section_lens);

// Validates and decodes; the views point into `message`.
absl::StatusOr<FrameView> DecodeFrame(std::string_view message);

const char* FrameTypeName(uint16_t type);

// The type field of `message` without validating the rest (for routing a
// message to its decoder), or 0 when it is too short or lacks the magic.
uint16_t PeekFrameType(std::string_view message);

// `len` bytes at `data` as a frame section.
inline std::string_view SectionBytes(const void* data, size_t len) {
  return std::string_view(static_cast<const char*>(data), len);
}

// A kError frame's `status` as an absl code (kUnknown for 0 or a value
// absl does not define).
absl::StatusCode StatusCodeFromWire(uint32_t code);

}  // namespace karat
