#include "common/frame.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace karat {
namespace {

constexpr size_t kHeaderSize = 128;

FrameHeader SampleHeader() {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
  h.src_node = 7;
  h.layer = 3;
  h.micro_batch = 1;
  h.device = 2;
  h.step = 0x0102030405060708ull;
  h.session = 0xfedcba9876543210ull;
  h.turn = 0x1122334455667788ull;
  h.pos_start = 4096;
  h.n_tokens = 17;
  h.status = 0;
  return h;
}

std::string SampleFrame() {
  const std::string a = "query";
  const std::string b(13, 'k');
  const std::string c(24, 'v');
  std::string out;
  EncodeFrame(SampleHeader(), {a, b, "", c}, &out);
  return out;
}

// Overwrites `bytes.size()` bytes at `offset` with little-endian `value`.
void PutLe(std::string* frame, size_t offset, uint64_t value, int width) {
  for (int i = 0; i < width; ++i)
    (*frame)[offset + i] = static_cast<char>(value >> (8 * i));
}

void CheckViewsInside(const FrameView& view, std::string_view message) {
  REQUIRE(view.header.n_sections <= static_cast<uint32_t>(kMaxSections));
  for (uint32_t i = 0; i < view.header.n_sections; ++i) {
    const std::string_view s = view.sections[i];
    if (s.empty()) continue;
    REQUIRE(s.data() >= message.data());
    REQUIRE(s.data() + s.size() <= message.data() + message.size());
  }
}

TEST_CASE("frame round trip keeps every header field and section", "[frame]") {
  const std::vector<std::string> payloads = {"",
                                             "x",
                                             std::string(7, 'a'),
                                             std::string(8, 'b'),
                                             std::string(9, 'c'),
                                             std::string(1000, 'd')};
  std::vector<std::string_view> sections(payloads.begin(), payloads.end());
  std::vector<size_t> lens;
  for (const auto& p : payloads) lens.push_back(p.size());

  std::string out;
  EncodeFrame(SampleHeader(), sections, &out);
  REQUIRE(out.size() == EncodedFrameSize(lens));
  REQUIRE(out.size() % 8 == 0);

  auto view = DecodeFrame(out);
  REQUIRE(view.ok());
  const FrameHeader& h = view->header;
  const FrameHeader want = SampleHeader();
  CHECK(h.magic == kFrameMagic);
  CHECK(h.version == kFrameVersion);
  CHECK(h.type == want.type);
  CHECK(h.src_node == want.src_node);
  CHECK(h.layer == want.layer);
  CHECK(h.micro_batch == want.micro_batch);
  CHECK(h.device == want.device);
  CHECK(h.step == want.step);
  CHECK(h.session == want.session);
  CHECK(h.turn == want.turn);
  CHECK(h.pos_start == want.pos_start);
  CHECK(h.n_tokens == want.n_tokens);
  CHECK(h.n_sections == payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    CHECK(h.section_len[i] == payloads[i].size());
    CHECK(view->sections[i] == payloads[i]);
    // Every section starts 8-byte aligned relative to the message.
    if (!payloads[i].empty())
      CHECK((view->sections[i].data() - out.data()) % 8 == 0);
  }
  CheckViewsInside(*view, out);
}

TEST_CASE("frame with no sections and with the maximum section count",
          "[frame]") {
  std::string out;
  EncodeFrame(SampleHeader(), {}, &out);
  REQUIRE(out.size() == kHeaderSize);
  REQUIRE(EncodedFrameSize({}) == kHeaderSize);
  auto view = DecodeFrame(out);
  REQUIRE(view.ok());
  CHECK(view->header.n_sections == 0);

  std::vector<std::string> payloads;
  for (int i = 0; i < kMaxSections; ++i)
    payloads.push_back(std::string(i + 1, 'a' + i));
  std::vector<std::string_view> sections(payloads.begin(), payloads.end());
  EncodeFrame(SampleHeader(), sections, &out);
  view = DecodeFrame(out);
  REQUIRE(view.ok());
  for (int i = 0; i < kMaxSections; ++i)
    CHECK(view->sections[i] == payloads[i]);
}

TEST_CASE("frame header is little-endian, field by field", "[frame]") {
  const std::string out = SampleFrame();
  CHECK(out.substr(0, 4) == "KTRF");
  CHECK(static_cast<unsigned char>(out[4]) == kFrameVersion);
  CHECK(static_cast<unsigned char>(out[5]) == 0);
  CHECK(static_cast<unsigned char>(out[6]) ==
        static_cast<int>(FrameType::kAttnQKV));
  // step at offset 24, least significant byte first.
  CHECK(static_cast<unsigned char>(out[24]) == 0x08);
  CHECK(static_cast<unsigned char>(out[31]) == 0x01);
  // n_sections at offset 60, section_len[0] at 64.
  CHECK(static_cast<unsigned char>(out[60]) == 4);
  CHECK(static_cast<unsigned char>(out[64]) == 5);
  // The first section follows the 128-byte header.
  CHECK(out.substr(kHeaderSize, 5) == "query");
}

TEST_CASE("every truncation and any trailing bytes are rejected", "[frame]") {
  const std::string frame = SampleFrame();
  for (size_t len = 0; len < frame.size(); ++len) {
    // A copy of exactly `len` bytes, so that reading past it is detectable
    // by sanitizers.
    const std::string cut = frame.substr(0, len);
    auto view = DecodeFrame(cut);
    INFO("length " << len);
    REQUIRE_FALSE(view.ok());
    CHECK(view.status().code() == absl::StatusCode::kDataLoss);
    CHECK_FALSE(view.status().message().empty());
  }
  for (const std::string& tail : {std::string(1, '\0'), std::string(8, '\0')}) {
    auto view = DecodeFrame(frame + tail);
    REQUIRE_FALSE(view.ok());
    CHECK(view.status().code() == absl::StatusCode::kDataLoss);
  }
}

TEST_CASE("bad magic, version, type and section counts are rejected",
          "[frame]") {
  const std::string good = SampleFrame();
  REQUIRE(DecodeFrame(good).ok());

  auto expect_invalid = [](const std::string& frame,
                           const std::string& needle) {
    auto view = DecodeFrame(frame);
    REQUIRE_FALSE(view.ok());
    CHECK(view.status().code() == absl::StatusCode::kInvalidArgument);
    INFO(view.status().message());
    CHECK(std::string(view.status().message()).find(needle) !=
          std::string::npos);
  };

  std::string f = good;
  f[0] = 'X';
  expect_invalid(f, "magic");

  f = good;
  PutLe(&f, 4, kFrameVersion + 1, 2);
  expect_invalid(f, "version");

  for (uint64_t type : {0ull, 9ull, 0xffffull}) {
    f = good;
    PutLe(&f, 6, type, 2);
    expect_invalid(f, "type");
  }

  f = good;
  PutLe(&f, 60, kMaxSections + 1, 4);
  expect_invalid(f, "sections");

  f = good;
  PutLe(&f, 60, 0xffffffffull, 4);
  expect_invalid(f, "sections");

  // A length in a slot beyond n_sections.
  f = good;
  PutLe(&f, 64 + 8 * 6, 8, 8);
  expect_invalid(f, "unused");

  // Non-zero padding after the 5-byte first section.
  f = good;
  f[kHeaderSize + 5] = 1;
  expect_invalid(f, "padding");

  // An error frame must carry a real status code.
  std::string err;
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kError);
  h.status = 0;
  EncodeFrame(h, {"boom"}, &err);
  expect_invalid(err, "status");
  h.status = static_cast<uint32_t>(absl::StatusCode::kUnavailable);
  EncodeFrame(h, {"boom"}, &err);
  auto view = DecodeFrame(err);
  REQUIRE(view.ok());
  CHECK(view->sections[0] == "boom");
}

TEST_CASE("oversized section lengths never overflow", "[frame]") {
  const std::string good = SampleFrame();
  for (uint64_t len : std::vector<uint64_t>{
           0xffffffffffffffffull, 0xfffffffffffffff9ull, 0x8000000000000000ull,
           static_cast<uint64_t>(good.size()),
           static_cast<uint64_t>(good.size()) - 1}) {
    std::string f = good;
    PutLe(&f, 64, len, 8);
    auto view = DecodeFrame(f);
    INFO("section length " << len);
    REQUIRE_FALSE(view.ok());
    CHECK(view.status().code() == absl::StatusCode::kDataLoss);
  }
}

TEST_CASE("random byte flips and random bytes never crash the decoder",
          "[frame]") {
  std::mt19937_64 rng(20240611);
  const std::string good = SampleFrame();
  int accepted = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    std::string f = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      f[rng() % f.size()] ^= static_cast<char>(1 + rng() % 255);
    }
    // Sometimes also cut or extend the message.
    if (rng() % 4 == 0) f.resize(rng() % (f.size() + 16), '\0');
    auto view = DecodeFrame(f);
    if (view.ok()) {
      ++accepted;
      CheckViewsInside(*view, f);
    } else {
      CHECK_FALSE(view.status().message().empty());
    }
  }
  // Flips inside section payloads leave a valid frame.
  CHECK(accepted > 0);

  for (int iter = 0; iter < 2000; ++iter) {
    std::string f(rng() % 512, '\0');
    for (char& c : f) c = static_cast<char>(rng());
    if (f.size() >= 8 && rng() % 2 == 0) {
      PutLe(&f, 0, kFrameMagic, 4);
      PutLe(&f, 4, kFrameVersion, 2);
    }
    auto view = DecodeFrame(f);
    if (view.ok()) CheckViewsInside(*view, f);
  }
}

TEST_CASE("frame type names", "[frame]") {
  CHECK(std::string(FrameTypeName(static_cast<uint16_t>(FrameType::kHello))) ==
        "Hello");
  CHECK(std::string(FrameTypeName(
            static_cast<uint16_t>(FrameType::kAttnOut))) == "AttnOut");
  CHECK(std::string(FrameTypeName(static_cast<uint16_t>(FrameType::kError))) ==
        "Error");
  CHECK(std::string(FrameTypeName(0)) == "Unknown");
  CHECK(std::string(FrameTypeName(999)) == "Unknown");
}

}  // namespace
}  // namespace karat
