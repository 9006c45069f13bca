// The KARAT node's data plane without gRPC: a GPU-side fake on a FakeFabric
// endpoint sends kHello, kIndexQK and kAttnQKV frames built from the traffic
// of a real ModelRunner step, and the kAttnOut it gets back must equal what
// LocalAttentionBackend computed for the same inputs.
#include "karat_node/data_plane.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "common/weights.h"
#include "karat_node/karat_node.h"

namespace karat {
namespace {

constexpr uint32_t kKaratId = 7;
constexpr uint32_t kGpuId = 3;

// Records each layer's traffic (inputs and the outputs LocalAttentionBackend
// computed) so that it can be replayed as frames.
class RecordingBackend : public AttentionBackend {
 public:
  struct Record {
    int layer;
    std::vector<Segment> segs;
    LayerTraffic traffic;
  };
  explicit RecordingBackend(const ModelConfig& config)
      : local_(config, 16, size_t(64) << 20) {}
  absl::Status Init() { return local_.Init(); }
  absl::Status Reserve(uint64_t session, int tokens) {
    return local_.Reserve(session, tokens);
  }
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* traffic) override {
    absl::Status s = local_.RunLayer(layer, segs, traffic);
    records.push_back({layer, segs, *traffic});
    return s;
  }
  std::vector<Record> records;

 private:
  LocalAttentionBackend local_;
};

// The GPU side: an endpoint whose received frames queue up.
class GpuFake {
 public:
  explicit GpuFake(FakeFabric* fabric) : ep_(fabric->NewEndpoint("gpu")) {
    ep_->SetReceiveHandler([this](std::string_view m) {
      absl::MutexLock lock(&mu_);
      inbox_.emplace_back(m);
    });
  }
  ~GpuFake() { ep_->Shutdown(); }

  void Connect(Transport* karat) {
    auto peer = ep_->AddPeer("karat", karat->LocalAddress());
    REQUIRE(peer.ok());
    peer_ = *peer;
  }
  void SendRaw(const std::string& bytes) {
    REQUIRE(ep_->Send(peer_, bytes.data(), bytes.size()).ok());
  }
  void Send(FrameHeader h, FrameType type,
            const std::vector<std::string_view>& sections) {
    h.type = static_cast<uint16_t>(type);
    h.src_node = kGpuId;
    std::string buffer;
    EncodeFrame(h, sections, &buffer);
    SendRaw(buffer);
  }
  // The next received frame (copied), or fails after a few seconds.
  std::string Next() {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !inbox_.empty();
    };
    REQUIRE(mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(10)));
    std::string m = std::move(inbox_.front());
    inbox_.pop_front();
    return m;
  }
  size_t pending() {
    absl::MutexLock lock(&mu_);
    return inbox_.size();
  }
  Transport* ep() { return ep_.get(); }

  void Hello() {
    FrameHeader h;
    h.step = 99;
    const std::string address = ep_->LocalAddress();
    Send(h, FrameType::kHello, {address});
    const std::string m = Next();
    auto f = DecodeFrame(m);
    REQUIRE(f.ok());
    REQUIRE(f->header.type == uint16_t(FrameType::kHelloAck));
    REQUIRE(f->header.step == 99);
    REQUIRE(f->header.src_node == kKaratId);
  }

 private:
  std::unique_ptr<Transport> ep_;
  PeerId peer_ = kUnknownPeer;
  absl::Mutex mu_;
  std::deque<std::string> inbox_ ABSL_GUARDED_BY(mu_);
};

std::string_view Bytes(const void* p, size_t n) {
  return std::string_view(static_cast<const char*>(p), n);
}

struct Fixture {
  explicit Fixture(int inline_max_context = kDefaultInlineMaxContext) {
    auto c = PresetConfig("dsa-small");
    REQUIRE(c.ok());
    config = *c;
    shapes = MakeAttnShapes(config);
    karat_ep = fabric.NewEndpoint("karat");
    DataPlaneOptions options;
    options.tokens_per_page = 16;
    options.inline_max_context = inline_max_context;
    options.devices = {DeviceOptions{size_t(8) << 20, 2},
                       DeviceOptions{size_t(8) << 20, 2}};
    auto h = DataPlaneHandler::Create(config, options, karat_ep.get());
    REQUIRE(h.ok());
    handler = std::move(h).value();
    handler->set_node_id(kKaratId);
    gpu = std::make_unique<GpuFake>(&fabric);
    gpu->Connect(karat_ep.get());
  }
  ~Fixture() {
    handler->Stop();
    karat_ep->Shutdown();
    gpu.reset();
  }

  // Sends the frames of segment `i` of a recorded layer to `device`.
  void SendSegment(const RecordingBackend::Record& r, int i, int device,
                   uint64_t step) {
    const size_t n = r.segs[i].tokens.size();
    FrameHeader h;
    h.layer = uint32_t(r.layer);
    h.device = uint32_t(device);
    h.step = step;
    h.session = r.segs[i].session;
    h.pos_start = uint32_t(r.segs[i].pos_start);
    h.n_tokens = uint32_t(n);
    if (r.traffic.has_indexer) {
      const IndexInputs in = r.traffic.IndexFor(i, shapes);
      const size_t hi = shapes.index_heads, di = shapes.index_dim;
      gpu->Send(h, FrameType::kIndexQK,
                {Bytes(in.q_codes, n * hi * di), Bytes(in.q_scales, n * hi * 4),
                 Bytes(in.weights, n * hi * 4), Bytes(in.k_codes, n * di),
                 Bytes(in.k_scales, n * 4)});
    }
    const AttnInputs in = r.traffic.AttnFor(i, shapes);
    gpu->Send(h, FrameType::kAttnQKV,
              {Bytes(in.q, n * shapes.heads * shapes.q_dim * 4),
               Bytes(in.kv, n * shapes.kv_dim * 2)});
  }

  ModelConfig config;
  AttnShapes shapes;
  FakeFabric fabric;
  std::unique_ptr<Transport> karat_ep;
  std::unique_ptr<DataPlaneHandler> handler;
  std::unique_ptr<GpuFake> gpu;
};

TEST_CASE("KARAT data plane reproduces LocalAttentionBackend", "[karat_node]") {
  // Decode frames run in the receive handler when their device is idle
  // (the default), or always on the device's worker (0).
  const int inline_max_context =
      GENERATE(Catch::Generators::as<int>{}, kDefaultInlineMaxContext, 0);
  INFO("inline_max_context " << inline_max_context);
  Fixture fx(inline_max_context);
  ModelFiles files;
  files.config = fx.config;
  files.tensors = GenerateWeights(fx.config, 1);
  auto runner = ModelRunner::Create(files);
  REQUIRE(runner.ok());

  // A prefill longer than index_topk (so Select really selects), then two
  // decode steps, for two sessions in one batch.
  RecordingBackend rec(fx.config);
  REQUIRE(rec.Init().ok());
  const uint64_t s1 = 42, s2 = 43;
  REQUIRE(rec.Reserve(s1, 64).ok());
  REQUIRE(rec.Reserve(s2, 64).ok());
  std::vector<int32_t> p1 = {256}, p2 = {256};
  for (int i = 0; i < 40; ++i) p1.push_back((i * 7 + 3) % 256);
  for (int i = 0; i < 9; ++i) p2.push_back((i * 11 + 5) % 256);
  REQUIRE((*runner)->Step({{s1, 0, p1}, {s2, 0, p2}}, &rec).ok());
  REQUIRE(
      (*runner)
          ->Step({{s1, int(p1.size()), {65}}, {s2, int(p2.size()), {66}}}, &rec)
          .ok());
  REQUIRE((*runner)->Step({{s1, int(p1.size()) + 1, {67}}}, &rec).ok());
  REQUIRE(rec.records.size() == size_t(3 * fx.config.num_hidden_layers));

  fx.gpu->Hello();
  REQUIRE(fx.handler->Reserve(s1, 0, 48).ok());
  REQUIRE(fx.handler->Reserve(s2, 1, 4).ok());  // grows on demand

  uint64_t step = 0;
  for (auto& r : rec.records) {
    ++step;
    for (int i = 0; i < int(r.segs.size()); ++i) {
      const int device = r.segs[i].session == s1 ? 0 : 1;
      fx.SendSegment(r, i, device, step);
      const std::string m = fx.gpu->Next();
      auto f = DecodeFrame(m);
      REQUIRE(f.ok());
      INFO("layer " << r.layer << " segment " << i);
      REQUIRE(f->header.type == uint16_t(FrameType::kAttnOut));
      CHECK(f->header.step == step);
      CHECK(f->header.layer == uint32_t(r.layer));
      CHECK(f->header.session == r.segs[i].session);
      CHECK(f->header.src_node == kKaratId);
      const size_t n = r.segs[i].tokens.size();
      const size_t bytes = n * fx.shapes.heads * fx.shapes.out_dim * 4;
      REQUIRE(f->sections[0].size() == bytes);
      CHECK(std::memcmp(f->sections[0].data(), r.traffic.OutFor(i, fx.shapes),
                        bytes) == 0);
    }
  }
  const auto c = fx.handler->Counters();
  CHECK(c.at("errors") == 0);
  CHECK(c.at("frames_invalid") == 0);
  CHECK(c.at("sessions") == 2);
  // The decode steps' frames (3 segments a layer, each kIndexQK +
  // kAttnQKV) may run inline: each waits for the previous reply, so the
  // device is idle unless its worker is still leaving the frame before.
  // The prefill segments (41 and 10 tokens) never do.
  const double decode_frames = 3.0 * 2 * fx.config.num_hidden_layers;
  if (inline_max_context == 0) {
    CHECK(c.at("frames_inline") == 0);
  } else {
    CHECK(c.at("frames_inline") > 0);
    CHECK(c.at("frames_inline") <= decode_frames);
  }
  const size_t tokens = (p1.size() + 2) + (p2.size() + 1);
  const size_t per_token =
      fx.config.num_hidden_layers *
      (size_t(fx.shapes.kv_dim) * 2 + size_t(fx.shapes.index_dim) + 4);
  CHECK(c.at("kv_bytes_ingested") == double(tokens * per_token));
  const auto devices = fx.handler->Devices();
  REQUIRE(devices.size() == 2);
  CHECK(devices[0].sessions() == 1);
  CHECK(devices[0].used_bytes() > 0);
  CHECK(devices[0].cores() == 2);
}

TEST_CASE("KARAT data plane answers bad frames with kError", "[karat_node]") {
  Fixture fx;
  fx.gpu->Hello();
  REQUIRE(fx.handler->Reserve(5, 0, 16).ok());
  const int n = 2;
  std::vector<float> q(size_t(n) * fx.shapes.heads * fx.shapes.q_dim, 0.5f);
  std::vector<uint16_t> kv(size_t(n) * fx.shapes.kv_dim, 0x3f80);
  FrameHeader h;
  h.layer = 0;
  h.step = 1;
  h.n_tokens = n;

  auto expect_error = [&](absl::StatusCode code) {
    const std::string m = fx.gpu->Next();
    auto f = DecodeFrame(m);
    REQUIRE(f.ok());
    REQUIRE(f->header.type == uint16_t(FrameType::kError));
    CHECK(f->header.status == uint32_t(code));
    REQUIRE(f->header.n_sections == 1);
    return std::string(f->sections[0]);
  };

  SECTION("unknown session") {
    h.session = 999;
    fx.gpu->Send(
        h, FrameType::kAttnQKV,
        {Bytes(q.data(), q.size() * 4), Bytes(kv.data(), kv.size() * 2)});
    CHECK(expect_error(absl::StatusCode::kNotFound).find("999") !=
          std::string::npos);
  }
  SECTION("truncated sections") {
    h.session = 5;
    fx.gpu->Send(
        h, FrameType::kAttnQKV,
        {Bytes(q.data(), q.size() * 4 - 4), Bytes(kv.data(), kv.size() * 2)});
    expect_error(absl::StatusCode::kInvalidArgument);
    fx.gpu->Send(h, FrameType::kAttnQKV, {Bytes(q.data(), q.size() * 4)});
    expect_error(absl::StatusCode::kInvalidArgument);
    std::vector<uint8_t> codes(size_t(n) * fx.shapes.index_heads *
                               fx.shapes.index_dim);
    fx.gpu->Send(
        h, FrameType::kIndexQK,
        {Bytes(codes.data(), codes.size()), Bytes(q.data(), 8),
         Bytes(q.data(), 8), Bytes(codes.data(), 4), Bytes(q.data(), 8)});
    expect_error(absl::StatusCode::kInvalidArgument);
  }
  SECTION("bad layer, device and position") {
    h.session = 5;
    h.layer = 100;
    fx.gpu->Send(
        h, FrameType::kAttnQKV,
        {Bytes(q.data(), q.size() * 4), Bytes(kv.data(), kv.size() * 2)});
    expect_error(absl::StatusCode::kInvalidArgument);
    h.layer = 0;
    h.device = 9;
    fx.gpu->Send(
        h, FrameType::kAttnQKV,
        {Bytes(q.data(), q.size() * 4), Bytes(kv.data(), kv.size() * 2)});
    expect_error(absl::StatusCode::kInvalidArgument);
    h.device = 0;
    h.pos_start = 10;  // nothing stored yet: a gap
    fx.gpu->Send(
        h, FrameType::kAttnQKV,
        {Bytes(q.data(), q.size() * 4), Bytes(kv.data(), kv.size() * 2)});
    expect_error(absl::StatusCode::kFailedPrecondition);
  }
  SECTION("undecodable frames are dropped and counted") {
    fx.gpu->SendRaw("not a frame at all");
    h.session = 999;
    fx.gpu->Send(h, FrameType::kAttnQKV, {});
    expect_error(absl::StatusCode::kNotFound);
    const auto c = fx.handler->Counters();
    CHECK(c.at("frames_invalid") == 1);
    // Counted under the name the kHello gave the sender.
    REQUIRE(c.count(absl::StrCat("frames_invalid.node-", kGpuId)) == 1);
    CHECK(c.at(absl::StrCat("frames_invalid.node-", kGpuId)) == 1);
  }
  SECTION("undecodable frames from a node that sent no kHello") {
    GpuFake stranger(&fx.fabric);
    stranger.Connect(fx.karat_ep.get());
    stranger.SendRaw("garbage");
    stranger.SendRaw("more garbage");
    // Delivered in order with the stranger's later frame, which no one can
    // answer: wait for the counter instead of a reply.
    for (int i = 0; i < 1000; ++i) {
      if (fx.handler->Counters().at("frames_invalid") == 2) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    const auto c = fx.handler->Counters();
    CHECK(c.at("frames_invalid") == 2);
    REQUIRE(c.count("frames_invalid.unknown peer") == 1);
    CHECK(c.at("frames_invalid.unknown peer") == 2);
    // A frame from a known sender afterwards still works.
    h.session = 999;
    fx.gpu->Send(h, FrameType::kAttnQKV, {});
    expect_error(absl::StatusCode::kNotFound);
  }
  CHECK(fx.handler->Counters().at("errors") >= 1);
  CHECK(fx.gpu->pending() == 0);
}

TEST_CASE("a negative inline_max_context is refused, naming the field",
          "[karat_node]") {
  auto c = PresetConfig("dsa-small");
  REQUIRE(c.ok());
  DataPlaneOptions options;
  options.devices = {DeviceOptions{size_t(8) << 20, 1}};
  options.inline_max_context = -1;
  auto h = DataPlaneHandler::Create(*c, options, nullptr);
  REQUIRE(h.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(h.status().message()),
             Catch::Contains("inline_max_context"));
}

TEST_CASE("Reserve reports the session's bytes beside the device's",
          "[karat_node]") {
  auto c = PresetConfig("dsa-small");
  REQUIRE(c.ok());
  const KvLayout layout = MakeKvLayout(*c, 16);
  const int64_t session =
      int64_t(layout.page_bytes) * c->num_hidden_layers * layout.PagesFor(16);
  DataPlaneOptions options;
  options.tokens_per_page = 16;
  options.devices = {DeviceOptions{size_t(4 * session), 1}};
  auto h = DataPlaneHandler::Create(*c, options, nullptr);
  REQUIRE(h.ok());
  auto first = (*h)->Reserve(1, 0, 16);
  REQUIRE(first.ok());
  CHECK(first->session_bytes == session);
  auto second = (*h)->Reserve(2, 0, 32);
  REQUIRE(second.ok());
  CHECK(second->session_bytes == int64_t(layout.page_bytes) *
                                     c->num_hidden_layers *
                                     layout.PagesFor(32));
  CHECK(second->used_bytes == session + second->session_bytes);
  REQUIRE((*h)->FreeSession(2).ok());
  auto again = (*h)->Reserve(1, 0, 8);  // already room: unchanged
  REQUIRE(again.ok());
  CHECK(again->session_bytes == session);
  CHECK(again->used_bytes == session);
}

TEST_CASE("Reserve is all or nothing", "[karat_node]") {
  auto c = PresetConfig("dsa-small");
  REQUIRE(c.ok());
  const KvLayout layout = MakeKvLayout(*c, 16);
  // 16 tokens of a layer: a KV page and an index page.
  const int pages = c->num_hidden_layers * layout.PagesFor(16);
  REQUIRE(layout.PagesFor(16) == 2);
  DataPlaneOptions options;
  options.tokens_per_page = 16;
  // Room for 16 tokens of every layer plus one more page.
  options.devices = {DeviceOptions{layout.page_bytes * (pages + 1), 1},
                     DeviceOptions{layout.page_bytes * (pages + 1), 1}};
  auto h = DataPlaneHandler::Create(*c, options, nullptr);
  REQUIRE(h.ok());
  DataPlaneHandler& handler = **h;

  auto used = handler.Reserve(1, 0, 16);
  REQUIRE(used.ok());
  CHECK(used->used_bytes == int64_t(layout.page_bytes * pages));
  CHECK(used->session_bytes == int64_t(layout.page_bytes * pages));
  CHECK_FALSE(used->kv_dropped);

  // 32 tokens need twice the pages the device holds even empty.
  auto more = handler.Reserve(1, 0, 32);
  CHECK(more.status().code() == absl::StatusCode::kOutOfRange);
  auto other = handler.Reserve(2, 0, 16);
  CHECK(other.status().code() == absl::StatusCode::kResourceExhausted);
  auto devices = handler.Devices();
  CHECK(devices[0].used_bytes() == int64_t(layout.page_bytes * pages));
  CHECK(devices[0].sessions() == 1);

  CHECK(handler.Reserve(1, 1, 16).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(handler.Reserve(1, 5, 16).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(handler.Reserve(1, 0, 0).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(handler.Reserve(1, 0, 10).ok());  // already room: unchanged
  CHECK(handler.Devices()[0].used_bytes() ==
        int64_t(layout.page_bytes * pages));

  // The failed new session left no trace: it can go elsewhere.
  CHECK(handler.Reserve(2, 1, 16).ok());
  CHECK(handler.FreeSession(1).ok());
  CHECK(handler.Devices()[0].used_bytes() == 0);
  CHECK(handler.Devices()[0].sessions() == 0);
  CHECK(handler.FreeSession(1).code() == absl::StatusCode::kNotFound);
  CHECK(handler.Reserve(1, 0, 16).ok());

  // Registering again frees every session (sessions 1 and 2 here).
  CHECK(handler.FreeAllSessions() == 2);
  for (const auto& d : handler.Devices()) {
    CHECK(d.used_bytes() == 0);
    CHECK(d.sessions() == 0);
  }
  CHECK(handler.FreeSession(2).code() == absl::StatusCode::kNotFound);
  CHECK(handler.FreeAllSessions() == 0);
  CHECK(handler.Reserve(2, 0, 16).ok());  // any device again
}

TEST_CASE("ParseByteSize", "[karat_node]") {
  CHECK(*ParseByteSize("1024") == 1024);
  CHECK(*ParseByteSize("512M") == size_t(512) << 20);
  CHECK(*ParseByteSize("2G") == size_t(2) << 30);
  CHECK(*ParseByteSize("2gib") == size_t(2) << 30);
  CHECK(*ParseByteSize("4KB") == 4096);
  CHECK(!ParseByteSize("").ok());
  CHECK(!ParseByteSize("12X").ok());
  CHECK(!ParseByteSize("-1G").ok());
  CHECK(!ParseByteSize("G").ok());
}

}  // namespace
}  // namespace karat
