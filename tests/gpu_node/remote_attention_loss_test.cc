// Attention over lossy and broken links: a RemoteAttentionBackend and KARAT
// data-plane handlers over an in-process FakeFabric, every endpoint behind
// a LinkEmulator. Steps through ModelRunner::Step must give the logits of
// LocalAttentionBackend bit for bit however many frames the links lose
// (segments are sent again; the devices apply each frame once); a link
// that is down for a while only stalls the step; a KARAT node that never
// answers fails its own segments after the configured timeout while the
// step's other sessions complete.
#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/link_emulation.h"
#include "common/link_rules.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "common/weights.h"
#include "gpu_node/remote_attention.h"
#include "karat_node/data_plane.h"

namespace karat {
namespace {

constexpr uint32_t kGpuId = 3;
constexpr uint64_t kTurn = 1;

const ModelRunner& Runner() {
  static const ModelRunner* runner = [] {
    ModelFiles files;
    files.config = *PresetConfig("dsa-small");
    files.tensors = GenerateWeights(files.config, 1);
    auto r = ModelRunner::Create(files);
    REQUIRE(r.ok());
    return r->release();
  }();
  return *runner;
}

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> t = {256};
  for (int i = 1; i < n; ++i) t.push_back((i * 13 + salt * 31) % 256);
  return t;
}

// Two sessions: a prefill in two chunks next to a short one, then decode
// steps of both (the decode feeds are fixed tokens: what is compared is
// the logits).
using Script = std::vector<std::vector<Segment>>;
Script TwoSessions(uint64_t s1, uint64_t s2, int decodes) {
  const std::vector<int32_t> p1 = Tokens(45, 1), p2 = Tokens(12, 2);
  Script script;
  script.push_back({{s1, 0, {p1.begin(), p1.begin() + 20}, false},
                    {s2, 0, p2, true}});
  script.push_back({{s1, 20, {p1.begin() + 20, p1.end()}, true},
                    {s2, 12, {40}, false}});
  for (int d = 0; d < decodes; ++d) {
    script.push_back({{s1, 45 + d, {int32_t(50 + d)}, false},
                      {s2, 13 + d, {int32_t(90 + d)}, false}});
  }
  return script;
}

// Every step's logits with the reference engine's backend.
std::vector<std::vector<std::vector<float>>> Reference(const Script& script) {
  LocalAttentionBackend local(Runner().config(), 16, size_t(64) << 20);
  REQUIRE(local.Init().ok());
  std::vector<std::vector<std::vector<float>>> out;
  for (const auto& step : script) {
    for (const Segment& s : step) REQUIRE(local.Reserve(s.session, 128).ok());
    auto logits = Runner().Step(step, &local);
    REQUIRE(logits.ok());
    out.push_back(std::move(*logits));
  }
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

LinkSettings Lossy(double loss) {
  LinkSettings s;
  s.loss = loss;
  return s;
}

LinkSettings Down() {
  LinkSettings s;
  s.down = true;
  return s;
}

std::unique_ptr<LinkEmulator> Emulated(FakeFabric* fabric,
                                       const std::string& name,
                                       uint64_t seed) {
  LinkEmulatorOptions o;
  o.local_name = name;
  o.seed = seed;
  return std::make_unique<LinkEmulator>(fabric->NewEndpoint(name), o);
}

uint64_t Sum(const LinkEmulator& links, uint64_t LinkCounters::*field) {
  uint64_t n = 0;
  for (const auto& [peer, c] : links.stats()->Snapshot()) n += c.*field;
  return n;
}

// A KARAT node: a data-plane handler with two devices behind its own link
// emulator.
struct KaratNode {
  KaratNode(FakeFabric* fabric, const std::string& name, uint32_t id,
            uint64_t seed) {
    auto ep = Emulated(fabric, name, seed);
    links = ep.get();
    transport = std::move(ep);
    DataPlaneOptions options;
    options.tokens_per_page = 16;
    options.devices = {DeviceOptions{size_t(8) << 20, 1},
                       DeviceOptions{size_t(8) << 20, 1}};
    auto h =
        DataPlaneHandler::Create(Runner().config(), options, transport.get());
    REQUIRE(h.ok());
    handler = std::move(*h);
    handler->set_node_id(id);
    placement_name = name;
    node_id = id;
  }
  cluster::KaratPlacement Placement(int device) const {
    cluster::KaratPlacement p;
    p.set_node_id(node_id);
    p.set_node_name(placement_name);
    p.set_device(device);
    p.set_fabric_address(transport->LocalAddress());
    return p;
  }
  DeviceMetrics Devices() const {
    DeviceMetrics sum;
    for (int d = 0; d < handler->num_devices(); ++d) {
      const DeviceMetrics m = handler->device(d)->Metrics();
      sum.frames += m.frames;
      sum.frame_errors += m.frame_errors;
      sum.frames_stale += m.frames_stale;
      sum.frames_repeated += m.frames_repeated;
      sum.frames_superseded += m.frames_superseded;
      sum.frames_without_index += m.frames_without_index;
    }
    return sum;
  }

  std::unique_ptr<Transport> transport;
  LinkEmulator* links = nullptr;
  std::unique_ptr<DataPlaneHandler> handler;
  std::string placement_name;
  uint32_t node_id = 0;
};

// The GPU side: a RemoteAttentionBackend behind its link emulator, and KARAT
// nodes.
struct Fixture {
  explicit Fixture(const RemoteAttentionOptions& options, uint64_t seed = 1) {
    auto ep = Emulated(&fabric, "gpu", seed);
    gpu_links = ep.get();
    gpu = std::move(ep);
    backend = std::make_unique<RemoteAttentionBackend>(Runner().shapes(),
                                                       gpu.get(), options);
    backend->set_node_id(kGpuId);
    node = std::make_unique<KaratNode>(&fabric, "karat-a", 7, seed);
  }
  ~Fixture() {
    backend->Abort();
    node->handler->Stop();
    // Deliveries and send outcomes stop before the backend goes.
    gpu->Shutdown();
    node->transport->Shutdown();
    backend.reset();
  }
  // Places `session` on device `device` of the node.
  void Place(uint64_t session, int device) {
    REQUIRE(node->handler->Reserve(session, device, 128, kTurn).ok());
    backend->SetPlacement(session, node->Placement(device), kTurn);
  }
  // Runs one step over `segs`; its logits must be `want`'s bits and no
  // segment may fail.
  absl::Status Step(const std::vector<Segment>& segs,
                    const std::vector<std::vector<float>>& want) {
    backend->BeginStep();
    std::vector<absl::Status> failed;
    auto logits = Runner().Step(segs, backend.get(), nullptr, &failed);
    if (!logits.ok()) return logits.status();
    for (const absl::Status& f : failed) {
      if (!f.ok()) return f;
    }
    for (size_t i = 0; i < segs.size(); ++i) {
      if (!SameBits((*logits)[i], want[i])) {
        return absl::DataLossError("logits differ from the reference");
      }
    }
    return absl::OkStatus();
  }
  double Counter(const std::string& name) const {
    return backend->Counters().at(name);
  }

  FakeFabric fabric;
  std::unique_ptr<Transport> gpu;
  LinkEmulator* gpu_links = nullptr;
  std::unique_ptr<KaratNode> node;
  std::unique_ptr<RemoteAttentionBackend> backend;
};

// KV and index-key bytes the devices store for `script`: each token's
// entries once in every layer (every dsa-small layer runs the indexer).
double IngestedOnce(const Script& script) {
  const AttnShapes& s = Runner().shapes();
  size_t tokens = 0;
  for (const auto& step : script) {
    for (const Segment& seg : step) tokens += seg.tokens.size();
  }
  return double(tokens * Runner().config().num_hidden_layers *
                (size_t(s.kv_dim) * 2 + size_t(s.index_dim) + 4));
}

TEST_CASE(
    "attention over links losing 10% both ways gives the lossless logits; "
    "each frame applied once",
    "[gpu_node][links]") {
  REQUIRE(Runner().config().index_reuse_freq == 1);
  RemoteAttentionOptions options;
  options.timeout = absl::Seconds(120);  // a bound: loss must not fail steps
  options.rto_initial_prefill = absl::Milliseconds(200);
  Fixture fx(options, /*seed=*/11);
  REQUIRE(fx.gpu_links->SetLinks({{"*", "*", Lossy(0.1)}}).ok());
  REQUIRE(fx.node->links->SetLinks({{"*", "*", Lossy(0.1)}}).ok());
  fx.Place(21, 0);
  fx.Place(22, 1);
  const Script script = TwoSessions(21, 22, 8);
  const auto want = Reference(script);
  for (size_t i = 0; i < script.size(); ++i) {
    INFO("step " << i);
    const absl::Status st = fx.Step(script[i], want[i]);
    INFO(st);
    REQUIRE(st.ok());
  }
  const uint64_t dropped =
      Sum(*fx.gpu_links, &LinkCounters::dropped) +
      Sum(*fx.node->links, &LinkCounters::dropped);
  INFO("frames dropped " << dropped);
  CHECK(dropped > 0);
  CHECK(fx.Counter("attention_retransmits") > 0);
  CHECK(fx.Counter("attention_segments_failed") == 0);
  // Copies of frames reached the devices, which recognised them ...
  const DeviceMetrics dm = fx.node->Devices();
  INFO("repeated " << dm.frames_repeated << " stale " << dm.frames_stale
                   << " without index " << dm.frames_without_index);
  CHECK(dm.frames_repeated + dm.frames_stale > 0);
  CHECK(dm.frames_superseded == 0);
  // ... and stored every token's entries exactly once.
  const auto c = fx.node->handler->Counters();
  CHECK(c.at("kv_bytes_ingested") == IngestedOnce(script));
  CHECK(c.at("frames_invalid") == 0);
}

// Runs `steps` of `script` on a thread while `fault` holds on `faulty`;
// once the fault has refused a send (`faulty`'s failed counter), it holds
// a second more, then the links are plain again. The steps must complete
// after that with the reference bits.
void RunThroughOutage(Fixture& fx, LinkEmulator* faulty, const Script& script,
                      const std::vector<std::vector<std::vector<float>>>& want,
                      size_t from) {
  REQUIRE(faulty->SetLinks({{"*", "*", Down()}}).ok());
  absl::Status status = absl::UnknownError("not run");
  absl::Time finished;
  std::thread run([&] {
    status = absl::OkStatus();
    for (size_t i = from; i < script.size() && status.ok(); ++i) {
      status = fx.Step(script[i], want[i]);
    }
    finished = absl::Now();
  });
  bool refused = false;
  for (int i = 0; i < 3000 && !refused; ++i) {  // at most 30 s
    refused = Sum(*faulty, &LinkCounters::failed) > 0;
    if (!refused) absl::SleepFor(absl::Milliseconds(10));
  }
  absl::SleepFor(absl::Seconds(1));
  const absl::Time restored = absl::Now();
  REQUIRE(faulty->SetLinks({}).ok());
  run.join();
  REQUIRE(refused);
  INFO(status);
  REQUIRE(status.ok());
  // It could not complete while the link was down: it waited for it.
  CHECK(finished >= restored);
  CHECK(fx.Counter("attention_retransmits") > 0);
  CHECK(fx.Counter("attention_segments_failed") == 0);
  CHECK(fx.node->handler->Counters().at("kv_bytes_ingested") ==
        IngestedOnce(script));
}

TEST_CASE("a link down for a second stalls the step, which then completes",
          "[gpu_node][links]") {
  RemoteAttentionOptions options;
  options.timeout = absl::Seconds(120);  // a bound: the outage must not fail
  options.rto_initial_prefill = absl::Milliseconds(200);
  Fixture fx(options);
  fx.Place(31, 0);
  fx.Place(32, 1);
  const Script script = TwoSessions(31, 32, 2);
  const auto want = Reference(script);
  // The first step with the links up: the nodes have greeted each other.
  REQUIRE(fx.Step(script[0], want[0]).ok());
  SECTION("GPU -> KARAT down: refused sends are tried again") {
    RunThroughOutage(fx, fx.gpu_links, script, want, 1);
  }
  SECTION("KARAT -> GPU down: the answers are computed once, sent again") {
    RunThroughOutage(fx, fx.node->links, script, want, 1);
    // The resent frames found their work done: answered again, not redone.
    CHECK(fx.node->Devices().frames_repeated > 0);
  }
}

// A KARAT node that answers handshakes and nothing else; it records the
// data frames it gets.
class SilentNode {
 public:
  SilentNode(FakeFabric* fabric, uint32_t id)
      : id_(id), ep_(fabric->NewEndpoint("silent")) {
    ep_->SetReceiveHandler([this](std::string_view m) { OnMessage(m); });
  }
  ~SilentNode() { ep_->Shutdown(); }
  cluster::KaratPlacement Placement(int device) const {
    cluster::KaratPlacement p;
    p.set_node_id(id_);
    p.set_node_name("karat-silent");
    p.set_device(device);
    p.set_fabric_address(ep_->LocalAddress());
    return p;
  }
  // The layers of the kAttnQKV frames received.
  std::vector<uint32_t> attention_layers() {
    absl::MutexLock lock(&mu_);
    return layers_;
  }

 private:
  void OnMessage(std::string_view m) {
    auto f = DecodeFrame(m);
    if (!f.ok()) return;
    if (f->header.type == uint16_t(FrameType::kHello)) {
      auto peer = ep_->AddPeer("gpu", std::string(f->sections[0]));
      if (!peer.ok()) return;
      FrameHeader ack;
      ack.type = uint16_t(FrameType::kHelloAck);
      ack.src_node = id_;
      ack.step = f->header.step;
      std::string bytes;
      EncodeFrame(ack, {}, &bytes);
      (void)ep_->Send(*peer, bytes.data(), bytes.size());
      return;
    }
    if (f->header.type == uint16_t(FrameType::kAttnQKV)) {
      absl::MutexLock lock(&mu_);
      layers_.push_back(f->header.layer);
    }
  }

  const uint32_t id_;
  std::unique_ptr<Transport> ep_;
  absl::Mutex mu_;
  std::vector<uint32_t> layers_ ABSL_GUARDED_BY(mu_);
};

TEST_CASE(
    "a KARAT node that never answers fails its segment after the timeout; "
    "the step's session on another node completes",
    "[gpu_node][links]") {
  RemoteAttentionOptions options;
  options.timeout = absl::Milliseconds(600);
  options.rto_initial_prefill = absl::Milliseconds(50);
  Fixture fx(options);
  SilentNode silent(&fx.fabric, 9);
  REQUIRE(fx.node->handler->Reserve(42, 1, 128, kTurn).ok());
  fx.backend->SetPlacement(41, silent.Placement(0), kTurn);
  fx.backend->SetPlacement(42, fx.node->Placement(1), kTurn);
  // Session 42 alone is the reference: its bits do not depend on the
  // failed session next to it.
  const std::vector<int32_t> p1 = Tokens(10, 3), p2 = Tokens(14, 4);
  const Script alone = {{{42, 0, p2, true}}, {{42, 14, {77}, false}}};
  const auto want = Reference(alone);

  fx.backend->BeginStep();
  std::vector<absl::Status> failed;
  auto logits = Runner().Step({{41, 0, p1, true}, {42, 0, p2, true}},
                              fx.backend.get(), nullptr, &failed);
  REQUIRE(logits.ok());
  REQUIRE(failed.size() == 2);
  INFO(failed[0]);
  CHECK(failed[0].code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(failed[0].message()),
             Catch::Contains("karat-silent") && Catch::Contains("600 ms"));
  CHECK(failed[1].ok());
  CHECK(SameBits((*logits)[1], want[0][0]));
  // The failed segment was sent again within the timeout, and left out of
  // the later layers of the step.
  const std::vector<uint32_t> layers = silent.attention_layers();
  CHECK(layers.size() >= 2);
  for (uint32_t l : layers) CHECK(l == 0);
  CHECK(fx.Counter("attention_segments_failed") == 1);
  // The other session goes on.
  CHECK(fx.Step(alone[1], want[1]).ok());

  // A caller that does not size `failed` gets the layer's failure.
  fx.backend->BeginStep();
  auto step = Runner().Step({{41, 10, {5}, false}, {42, 15, {6}, false}},
                            fx.backend.get());
  CHECK(step.status().code() == absl::StatusCode::kUnavailable);
  CHECK(fx.Counter("attention_segments_failed") == 2);
}

// A transport that refuses kIndexQK frames for good (INVALID_ARGUMENT, as
// for a message beyond its size limit) and passes everything else on.
class IndexRefusingTransport final : public Transport {
 public:
  explicit IndexRefusingTransport(std::unique_ptr<Transport> inner)
      : inner_(std::move(inner)) {}
  std::string LocalAddress() const override { return inner_->LocalAddress(); }
  absl::StatusOr<PeerId> AddPeer(const std::string& name,
                                 const std::string& address) override {
    return inner_->AddPeer(name, address);
  }
  absl::Status Send(PeerId peer, const void* data, size_t len) override {
    return inner_->Send(peer, data, len);
  }
  absl::Status SendShared(PeerId peer,
                          std::shared_ptr<const std::string> m) override {
    return inner_->SendShared(peer, std::move(m));
  }
  absl::Status SendSharedAsync(PeerId peer, std::shared_ptr<const std::string> m,
                               SendDone done) override {
    if (m != nullptr && PeekFrameType(*m) == uint16_t(FrameType::kIndexQK))
      return absl::InvalidArgumentError("index frames are refused here");
    return inner_->SendSharedAsync(peer, std::move(m), std::move(done));
  }
  absl::Status FailPeer(PeerId peer, const absl::Status& reason) override {
    return inner_->FailPeer(peer, reason);
  }
  void SetPeerReceiveHandler(PeerReceiveHandler handler) override {
    inner_->SetPeerReceiveHandler(std::move(handler));
  }
  std::string PeerName(PeerId peer) const override {
    return inner_->PeerName(peer);
  }
  size_t MaxMessageSize() const override { return inner_->MaxMessageSize(); }
  void Shutdown() override { inner_->Shutdown(); }

 private:
  std::unique_ptr<Transport> inner_;
};

TEST_CASE(
    "a segment whose frame the transport refuses for good fails at once; "
    "the backend can still be destroyed",
    "[gpu_node][links]") {
  FakeFabric fabric;
  KaratNode node(&fabric, "karat-a", 7, 1);
  auto gpu = std::make_unique<IndexRefusingTransport>(fabric.NewEndpoint("gpu"));
  RemoteAttentionOptions options;
  options.timeout = absl::Seconds(120);  // not what ends the segment
  auto backend = std::make_unique<RemoteAttentionBackend>(Runner().shapes(),
                                                          gpu.get(), options);
  backend->set_node_id(kGpuId);
  REQUIRE(node.handler->Reserve(51, 0, 128, kTurn).ok());
  backend->SetPlacement(51, node.Placement(0), kTurn);
  backend->BeginStep();
  std::vector<absl::Status> failed;
  auto logits = Runner().Step({{51, 0, Tokens(8, 5), true}}, backend.get(),
                              nullptr, &failed);
  REQUIRE(logits.ok());
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(failed[0].message()),
             Catch::Contains("IndexQK") && Catch::Contains("refused"));
  CHECK(backend->Counters().at("attention_retransmits") == 0);
  // No send is left counted as in flight: the destructor, which waits for
  // the outcomes of the sends, returns.
  node.handler->Stop();
  gpu->Shutdown();
  node.transport->Shutdown();
  auto destroyed = std::make_shared<absl::Notification>();
  std::thread([b = std::move(backend), destroyed]() mutable {
    b.reset();
    destroyed->Notify();
  }).detach();
  CHECK(destroyed->WaitForNotificationWithTimeout(absl::Seconds(60)));
}

}  // namespace
}  // namespace karat
