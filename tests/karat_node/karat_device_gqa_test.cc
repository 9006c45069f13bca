// A KARAT device serving the GQA forms: kAttnQKV frames are validated
// against the GQA shapes, run the same kernels as the reference engine's
// backend (bit-identical outputs), also when the session's pages spill to
// another device of the node, and the methods' metadata is charged to the
// arena in whole pages (counted in occupancy, never beyond capacity).
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

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
                  int kv_bytes_cut = 0, uint64_t session = 7) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
  h.layer = uint32_t(layer);
  h.session = session;
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
    // The metadata holds whole pages of the arena.
    const size_t page = layout.page_bytes;
    CHECK((*device)->used_bytes() ==
          pages_only + (state->bytes() + page - 1) / page * page);
    CHECK((*device)->Metrics().metadata_bytes == state->bytes());
    CHECK(state->bytes() > 0);
    REQUIRE((*device)->Free(7).ok());
    CHECK((*device)->used_bytes() == 0);
  }
}

// Runs one frame; the attention output, or the status when it fails.
absl::StatusOr<std::vector<float>> RunFrame(KaratDevice* device,
                                            const std::string& msg) {
  auto frame = DecodeFrame(msg);
  if (!frame.ok()) return frame.status();
  std::vector<float> out;
  uint64_t ingested = 0;
  absl::Status st = device->Process(*frame, &out, &ingested);
  if (!st.ok()) return st;
  return out;
}

TEST_CASE(
    "GQA device: a spilled session attends bit for bit like an "
    "unspilled one",
    "[karat_node][spill]") {
  for (const char* preset : {"llama-small-quest", "minimax-small"}) {
    INFO(preset);
    const ModelConfig c = *PresetConfig(preset);
    const AttnShapes s = MakeAttnShapes(c);
    const KvLayout layout = MakeKvLayout(c, 16);
    const int layers = c.num_hidden_layers;
    auto memory = std::make_shared<NodeMemory>();
    DeviceOptions small;
    small.capacity_bytes = layout.page_bytes * layers * 4;  // 64 tokens
    small.memory = memory;
    DeviceOptions big;
    big.memory = memory;
    auto home = KaratDevice::Create(0, c, 16, small);
    auto other = KaratDevice::Create(1, c, 16, big);
    auto alone = KaratDevice::Create(0, c, 16, DeviceOptions{});
    REQUIRE(home.ok());
    REQUIRE(other.ok());
    REQUIRE(alone.ok());
    REQUIRE((*home)->Reserve(7, 64).ok());
    CHECK((*other)->used_bytes() == 0);
    // Past the home's capacity, and grown further by the frames.
    REQUIRE((*home)->Reserve(7, 128).ok());
    REQUIRE((*alone)->Reserve(7, 128).ok());
    CHECK((*home)->used_bytes() == (*home)->capacity_bytes());
    CHECK((*other)->used_bytes() > 0);

    const uint32_t ends = kAttnFlagEndsPrefill;
    const int segs[][3] = {
        {0, 100, 0}, {100, 50, 1}, {150, 1, 0}, {151, 1, 0}, {152, 1, 0}};
    uint32_t seed = 1;
    for (const auto& sg : segs) {
      for (int layer = 0; layer < layers; ++layer) {
        Inputs in = RandomInputs(s, sg[1], seed++);
        const std::string msg =
            Frame(layer, sg[0], sg[1], in, s, sg[2] ? &ends : nullptr);
        auto got = RunFrame(home->get(), msg);
        auto want = RunFrame(alone->get(), msg);
        REQUIRE(got.ok());
        REQUIRE(want.ok());
        REQUIRE(got->size() == want->size());
        CHECK(std::memcmp(got->data(), want->data(), got->size() * 4) == 0);
      }
    }
    const DeviceMetrics m = (*home)->Metrics();
    CHECK(m.cross_device_bytes > 0);
    CHECK(m.kernel_bytes == (*alone)->Metrics().kernel_bytes);
    CHECK((*alone)->Metrics().cross_device_bytes == 0);
    CHECK(m.spilled_bytes == (*other)->Metrics().hosted_bytes);
    CHECK((*home)->used_bytes() + m.spilled_bytes == (*alone)->used_bytes());
    REQUIRE((*home)->Free(7).ok());
    CHECK((*home)->used_bytes() == 0);
    CHECK((*other)->used_bytes() == 0);
  }
}

TEST_CASE(
    "GQA device: metadata is charged to the arena; a device that only "
    "fits the KV refuses",
    "[karat_node]") {
  const ModelConfig c = *PresetConfig("llama-small-quest");
  const AttnShapes s = MakeAttnShapes(c);
  const KvLayout layout = MakeKvLayout(c, 16);
  const int layers = c.num_hidden_layers;
  // Exactly the KV pages of 256 tokens.
  DeviceOptions o;
  o.capacity_bytes = layout.page_bytes * layers * 16;

  SECTION("reservation") {
    auto device = KaratDevice::Create(0, c, 16, o);
    REQUIRE(device.ok());
    REQUIRE((*device)->Reserve(7, 128).ok());
    const uint32_t ends = kAttnFlagEndsPrefill;
    for (int layer = 0; layer < layers; ++layer) {
      Inputs in = RandomInputs(s, 128, 40 + layer);
      REQUIRE(RunFrame(device->get(), Frame(layer, 0, 128, in, s, &ends)).ok());
    }
    const DeviceMetrics m = (*device)->Metrics();
    REQUIRE(m.metadata_bytes > 0);
    const size_t kv = layout.page_bytes * layers * 8;
    const size_t page = layout.page_bytes;
    const size_t meta = (m.metadata_bytes + page - 1) / page * page;
    CHECK((*device)->used_bytes() == kv + meta);
    // The KV of 256 tokens would fit the capacity; with the metadata it
    // does not, and nothing changes.
    absl::Status st = (*device)->Reserve(7, 256).status();
    CHECK(absl::IsResourceExhausted(st));
    CHECK((*device)->used_bytes() == kv + meta);
    // Nor does the KV of 128 more tokens for a new session, which leaves no
    // trace.
    CHECK(absl::IsResourceExhausted((*device)->Reserve(8, 128).status()));
    CHECK_FALSE((*device)->HasSession(8));
    CHECK((*device)->used_bytes() <= (*device)->capacity_bytes());
    REQUIRE((*device)->Free(7).ok());
    CHECK((*device)->used_bytes() == 0);
  }

  SECTION("growth during a frame") {
    auto device = KaratDevice::Create(0, c, 16, o);
    REQUIRE(device.ok());
    REQUIRE((*device)->Reserve(7, 256).ok());
    CHECK((*device)->used_bytes() == (*device)->capacity_bytes());
    // Layers 0 and 1 keep no metadata; layer 2's cannot be charged.
    Inputs in = RandomInputs(s, 64, 5);
    REQUIRE(RunFrame(device->get(), Frame(0, 0, 64, in, s, nullptr)).ok());
    auto failed = RunFrame(device->get(), Frame(2, 0, 64, in, s, nullptr));
    REQUIRE_FALSE(failed.ok());
    CHECK(absl::IsResourceExhausted(failed.status()));
    CHECK(std::string(failed.status().message()).find("metadata") !=
          std::string::npos);
    CHECK((*device)->used_bytes() == (*device)->capacity_bytes());
    CHECK((*device)->Metrics().frame_errors == 1);
    CHECK((*device)->Metrics().frames == 1);
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
