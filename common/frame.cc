#include "common/frame.h"

#include <cstdlib>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace karat {
namespace {

// Wire layout of the fixed header, little-endian, no implicit padding:
//   u32 magic, u16 version, u16 type, u32 src_node, u32 layer,
//   u32 micro_batch, u32 device, u64 step, u64 session, u64 turn,
//   u32 pos_start, u32 n_tokens, u32 status, u32 n_sections,
//   u64 section_len[kMaxSections]
// 128 bytes, a multiple of 8, so the first section starts aligned.
constexpr size_t kHeaderSize =
    4 + 2 + 2 + 4 * 4 + 8 + 8 + 8 + 4 * 4 + 8 * kMaxSections;
static_assert(kHeaderSize % 8 == 0);

constexpr uint16_t kMinFrameType = static_cast<uint16_t>(FrameType::kHello);
constexpr uint16_t kMaxFrameType =
    static_cast<uint16_t>(FrameType::kMoeCombine);
// absl::StatusCode values run from kOk (0) to kUnauthenticated (16).
constexpr uint32_t kMaxStatusCode = 16;

size_t PaddedLength(size_t len) { return (len + 7) & ~size_t{7}; }

class ByteWriter {
 public:
  explicit ByteWriter(std::string* out) : out_(out) {}
  template <typename T>
  void Put(T value) {
    for (size_t i = 0; i < sizeof(T); ++i) {
      out_->push_back(
          static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
    }
  }

 private:
  std::string* out_;
};

// Reads fixed-width little-endian integers from a buffer whose size the
// caller has already checked against kHeaderSize.
class ByteReader {
 public:
  explicit ByteReader(std::string_view bytes) : bytes_(bytes) {}
  template <typename T>
  T Get() {
    uint64_t value = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      value |=
          static_cast<uint64_t>(static_cast<unsigned char>(bytes_[pos_ + i]))
          << (8 * i);
    }
    pos_ += sizeof(T);
    return static_cast<T>(value);
  }
  size_t position() const { return pos_; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace

size_t EncodedFrameSize(const std::vector<size_t>& section_lens) {
  size_t total = kHeaderSize;
  for (size_t len : section_lens) total += PaddedLength(len);
  return total;
}

void EncodeFrame(FrameHeader header,
                 const std::vector<std::string_view>& sections,
                 std::string* out) {
  if (sections.size() > static_cast<size_t>(kMaxSections)) {
    // A programming error, not a run-time condition: the section count is
    // fixed by the frame type.
    KLOG(Error, "frame") << "EncodeFrame: " << sections.size()
                         << " sections, at most " << kMaxSections << " allowed";
    std::abort();
  }
  header.magic = kFrameMagic;
  header.version = kFrameVersion;
  header.n_sections = static_cast<uint32_t>(sections.size());
  header.section_len.fill(0);
  std::vector<size_t> lens;
  lens.reserve(sections.size());
  for (size_t i = 0; i < sections.size(); ++i) {
    header.section_len[i] = sections[i].size();
    lens.push_back(sections[i].size());
  }

  out->clear();
  out->reserve(EncodedFrameSize(lens));
  ByteWriter w(out);
  w.Put<uint32_t>(header.magic);
  w.Put<uint16_t>(header.version);
  w.Put<uint16_t>(header.type);
  w.Put<uint32_t>(header.src_node);
  w.Put<uint32_t>(header.layer);
  w.Put<uint32_t>(header.micro_batch);
  w.Put<uint32_t>(header.device);
  w.Put<uint64_t>(header.step);
  w.Put<uint64_t>(header.session);
  w.Put<uint64_t>(header.turn);
  w.Put<uint32_t>(header.pos_start);
  w.Put<uint32_t>(header.n_tokens);
  w.Put<uint32_t>(header.status);
  w.Put<uint32_t>(header.n_sections);
  for (uint64_t len : header.section_len) w.Put<uint64_t>(len);
  for (std::string_view section : sections) {
    out->append(section.data(), section.size());
    out->append(PaddedLength(section.size()) - section.size(), '\0');
  }
}

absl::StatusOr<FrameView> DecodeFrame(std::string_view message) {
  if (message.size() < kHeaderSize) {
    return absl::DataLossError(absl::StrCat("frame truncated: ", message.size(),
                                            " bytes, the header alone is ",
                                            kHeaderSize));
  }
  FrameView view;
  FrameHeader& h = view.header;
  ByteReader r(message);
  h.magic = r.Get<uint32_t>();
  h.version = r.Get<uint16_t>();
  h.type = r.Get<uint16_t>();
  h.src_node = r.Get<uint32_t>();
  h.layer = r.Get<uint32_t>();
  h.micro_batch = r.Get<uint32_t>();
  h.device = r.Get<uint32_t>();
  h.step = r.Get<uint64_t>();
  h.session = r.Get<uint64_t>();
  h.turn = r.Get<uint64_t>();
  h.pos_start = r.Get<uint32_t>();
  h.n_tokens = r.Get<uint32_t>();
  h.status = r.Get<uint32_t>();
  h.n_sections = r.Get<uint32_t>();
  for (uint64_t& len : h.section_len) len = r.Get<uint64_t>();

  if (h.magic != kFrameMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a frame: magic 0x", absl::Hex(h.magic),
                     ", expected 0x", absl::Hex(kFrameMagic)));
  }
  if (h.version != kFrameVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported frame version ", h.version,
                     ", this build reads ", kFrameVersion));
  }
  if (h.type < kMinFrameType || h.type > kMaxFrameType) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown frame type ", h.type));
  }
  if (h.type == static_cast<uint16_t>(FrameType::kError) &&
      (h.status == 0 || h.status > kMaxStatusCode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("error frame carries invalid status code ", h.status));
  }
  if (h.n_sections > static_cast<uint32_t>(kMaxSections)) {
    return absl::InvalidArgumentError(
        absl::StrCat(FrameTypeName(h.type), " frame declares ", h.n_sections,
                     " sections, at most ", kMaxSections, " allowed"));
  }
  for (int i = static_cast<int>(h.n_sections); i < kMaxSections; ++i) {
    if (h.section_len[i] != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          FrameTypeName(h.type), " frame has ", h.n_sections,
          " sections but length ", h.section_len[i], " in unused slot ", i));
    }
  }

  // Every length is bounded by the message size before it is rounded up or
  // summed, so none of the arithmetic below can overflow.
  const size_t body = message.size() - kHeaderSize;
  size_t offset = kHeaderSize;
  for (uint32_t i = 0; i < h.n_sections; ++i) {
    const uint64_t len = h.section_len[i];
    const size_t remaining = message.size() - offset;
    if (len > body || PaddedLength(static_cast<size_t>(len)) > remaining) {
      return absl::DataLossError(absl::StrCat(
          FrameTypeName(h.type), " frame section ", i, " of ", len,
          " bytes (padded to 8) ", "does not fit in the ", remaining,
          " bytes left of a ", message.size(), "-byte message"));
    }
    view.sections[i] = message.substr(offset, static_cast<size_t>(len));
    const size_t padded = PaddedLength(static_cast<size_t>(len));
    for (size_t p = offset + len; p < offset + padded; ++p) {
      if (message[p] != '\0') {
        return absl::InvalidArgumentError(
            absl::StrCat(FrameTypeName(h.type), " frame section ", i,
                         " has non-zero padding"));
      }
    }
    offset += padded;
  }
  if (offset != message.size()) {
    return absl::DataLossError(absl::StrCat(
        FrameTypeName(h.type),
        " frame size mismatch: ", "header and sections account for ", offset,
        " bytes, the message has ", message.size()));
  }
  return view;
}

uint16_t PeekFrameType(std::string_view message) {
  if (message.size() < 8) return 0;
  const auto* p = reinterpret_cast<const unsigned char*>(message.data());
  const uint32_t magic = uint32_t(p[0]) | uint32_t(p[1]) << 8 |
                         uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  if (magic != kFrameMagic) return 0;
  return uint16_t(p[6] | p[7] << 8);
}

absl::StatusCode StatusCodeFromWire(uint32_t code) {
  if (code == 0 || code > uint32_t(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(code);
}

const char* FrameTypeName(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::kHello:
      return "Hello";
    case FrameType::kHelloAck:
      return "HelloAck";
    case FrameType::kIndexQK:
      return "IndexQK";
    case FrameType::kAttnQKV:
      return "AttnQKV";
    case FrameType::kAttnOut:
      return "AttnOut";
    case FrameType::kMoeDispatch:
      return "MoeDispatch";
    case FrameType::kMoeCombine:
      return "MoeCombine";
    case FrameType::kError:
      return "Error";
  }
  return "Unknown";
}

}  // namespace karat
