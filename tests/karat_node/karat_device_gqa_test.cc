// A KARAT device serving the GQA forms: kAttnQKV frames are validated
// against the GQA shapes, run the same kernels as the reference engine's
// backend (bit-identical outputs) and the methods' metadata is counted in
// the device's occupancy.
#include <catch2/catch.hpp>
#include <cstring>
#include <random>

#include "common/frame.h"
#include "common/numeric.h"
#include "common/sparse_attention.h"
#include "karat_node/karat_device.h"

namespace karat {
namespace {

struct Inputs {
  std::vector<float> q;
  std::vector<uint16_t> kv;
};

Inputs RandomInputs(const AttnShapes& s, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Inputs in;
  in.q.resize(size_t(n) * s.heads * s.q_dim);
  for (float& x : in.q) x = nd(rng);
  std::vector<float> kv(size_t(n) * s.kv_dim);
  for (float& x : kv) x = nd(rng);
  in.kv.resize(kv.size());
  FloatToBf16(kv.data(), kv.size(), in.kv.data());
  return in;
}

std::string Frame(int layer, int pos, int n, const Inputs& in,
                  const AttnShapes& s, const uint32_t* flags,
                  int kv_bytes_cut = 0) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
  h.layer = uint32_t(layer);
  h.session = 7;
  h.pos_start = uint32_t(pos);
  h.n_tokens = uint32_t(n);
  std::vector<std::string_view> sections = {
      {reinterpret_cast<const char*>(in.q.data()),
       size_t(n) * s.heads * s.q_dim * 4},
      {reinterpret_cast<const char*>(in.kv.data()),
       size_t(n) * s.kv_dim * 2 - kv_bytes_cut}};
  if (flags != nullptr) {
    sections.push_back({reinterpret_cast<const char*>(flags), 4});
  }
  std::string out;
  EncodeFrame(h, sections, &out);
  return out;
}

TEST_CASE("GQA device: same outputs as the local kernels; metadata counted",
          "[karat_node]") {
  for (const char* preset :
       {"llama-small-quest", "llama-small-clusterkv", "minimax-small"}) {
    INFO(preset);
    const ModelConfig c = *PresetConfig(preset);
    const AttnShapes s = MakeAttnShapes(c);
    auto device = KaratDevice::Create(0, c, 16, DeviceOptions{});
    REQUIRE(device.ok());
    REQUIRE((*device)->Reserve(7, 256).ok());
    const size_t pages_only = (*device)->used_bytes();

    // The local reference: the same calls on a private cache.
    KvLayout layout = MakeKvLayout(c, 16);
    auto arena = PageArena::Create(size_t(8) << 20, layout.page_bytes);
    REQUIRE(arena.ok());
    SessionCache cache(&layout, arena->get());
    REQUIRE(cache.Reserve(256).ok());
    auto method = NewSparseAttention(c, MethodWeights{});
    REQUIRE(method.ok());
    auto state = NewAttentionSessionState(**method, c.num_hidden_layers);

    const uint32_t ends = kAttnFlagEndsPrefill;
    // A prefill of 150 tokens in two segments, then three decode steps.
    const int segs[][3] = {
        {0, 100, 0}, {100, 50, 1}, {150, 1, 0}, {151, 1, 0}, {152, 1, 0}};
    uint32_t seed = 1;
    for (const auto& sg : segs) {
      for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
        const int pos = sg[0], n = sg[1];
        Inputs in = RandomInputs(s, n, seed++);
        const std::string msg =
            Frame(layer, pos, n, in, s, sg[2] ? &ends : nullptr);
        auto frame = DecodeFrame(msg);
        REQUIRE(frame.ok());
        std::vector<float> got;
        uint64_t ingested = 0;
        REQUIRE((*device)->Process(*frame, &got, &ingested).ok());
        CHECK(ingested == uint64_t(n) * s.kv_dim * 2);
        std::vector<float> want(size_t(n) * s.heads * s.out_dim);
        REQUIRE(RunAttentionLayer(**method, layer, pos, n,
                                  AttnInputs{in.q.data(), in.kv.data()},
                                  sg[2] != 0, &cache, state.get(), want.data())
                    .ok());
        REQUIRE(got.size() == want.size());
        CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
      }
    }
    CHECK((*device)->used_bytes() == pages_only + state->bytes());
    CHECK(state->bytes() > 0);
    REQUIRE((*device)->Free(7).ok());
    CHECK((*device)->used_bytes() == 0);
  }
}

TEST_CASE("GQA device: sections are validated against the GQA shapes",
          "[karat_node]") {
  const ModelConfig c = *PresetConfig("minimax-small");
  const AttnShapes s = MakeAttnShapes(c);
  auto device = KaratDevice::Create(0, c, 16, DeviceOptions{});
  REQUIRE(device.ok());
  REQUIRE((*device)->Reserve(7, 64).ok());
  Inputs in = RandomInputs(s, 3, 9);
  std::vector<float> out;
  uint64_t ingested = 0;
  auto run = [&](const std::string& msg) {
    auto frame = DecodeFrame(msg);
    REQUIRE(frame.ok());
    return (*device)->Process(*frame, &out, &ingested);
  };
  absl::Status st = run(Frame(0, 0, 3, in, s, nullptr, 2));
  CHECK(absl::IsInvalidArgument(st));
  CHECK(std::string(st.message()).find("kv") != std::string::npos);
  const uint32_t bad = 6;
  st = run(Frame(0, 0, 3, in, s, &bad));
  CHECK(absl::IsInvalidArgument(st));
  CHECK(std::string(st.message()).find("flags") != std::string::npos);
  CHECK(run(Frame(0, 0, 3, in, s, nullptr)).ok());
  CHECK(out.size() == size_t(3) * s.heads * s.head_dim);
  // The DSA indexer frame has no place in a GQA model.
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kIndexQK);
  h.session = 7;
  h.n_tokens = 1;
  std::string msg;
  EncodeFrame(h, {}, &msg);
  CHECK(absl::IsInvalidArgument(run(msg)));
}

TEST_CASE("a MagicPIG device without its hyperplanes is refused",
          "[karat_node]") {
  const ModelConfig c = *PresetConfig("llama-small-magicpig");
  auto device = KaratDevice::Create(0, c, 16, DeviceOptions{});
  CHECK(absl::IsInvalidArgument(device.status()));
}

}  // namespace
}  // namespace karat
