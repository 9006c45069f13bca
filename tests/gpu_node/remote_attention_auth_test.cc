// RemoteAttentionBackend with a data-plane secret on the in-process
// FakeFabric (docs/security.md "Data plane"): a step through a KARAT node of
// the same cluster gives the reference's logits; a KARAT node with another
// secret, or one that has not been told of this GPU node, refuses the
// handshake, and the step fails naming why; a KARAT node whose answers'
// proofs do not verify is not taken; an attention output from a sender
// other than the KARAT node's transport peer is dropped.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/hello_proof.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "common/weights.h"
#include "gpu_node/remote_attention.h"
#include "karat_node/data_plane.h"

namespace karat {
namespace {

constexpr uint32_t kGpuId = 3, kKaratId = 7;
const std::string kSecret(32, 'g');

const ModelRunner& Runner() {
  static const ModelRunner* runner = [] {
    ModelFiles files;
    files.config = *PresetConfig("llama-tiny");
    files.tensors = GenerateWeights(files.config, 1);
    auto r = ModelRunner::Create(files);
    REQUIRE(r.ok());
    return r->release();
  }();
  return *runner;
}

std::vector<Segment> Prefill(uint64_t session) {
  std::vector<int32_t> tokens = {256};
  for (int i = 1; i < 20; ++i) tokens.push_back((i * 7 + 3) % 256);
  return {{session, 0, tokens, true}};
}

std::vector<std::vector<float>> Reference(const std::vector<Segment>& segs) {
  LocalAttentionBackend local(Runner().config(), 16, size_t(64) << 20);
  REQUIRE(local.Init().ok());
  for (const Segment& s : segs) REQUIRE(local.Reserve(s.session, 64).ok());
  auto logits = Runner().Step(segs, &local);
  REQUIRE(logits.ok());
  return *logits;
}

// A GPU node's backend with the cluster's secret, and a KARAT node's data
// plane told `karat_secret` and (with `announce`) of the GPU node.
struct Fixture {
  Fixture(const std::string& karat_secret, bool announce,
          absl::Duration timeout = absl::Seconds(30)) {
    gpu = fabric.NewEndpoint("gpu");
    karat = fabric.NewEndpoint("karat");
    RemoteAttentionOptions options;
    options.timeout = timeout;
    backend = std::make_unique<RemoteAttentionBackend>(Runner().shapes(),
                                                       gpu.get(), options);
    backend->set_data_plane_secret(kSecret);
    backend->set_node_id(kGpuId);
    DataPlaneOptions plane;
    plane.tokens_per_page = 16;
    plane.devices = {DeviceOptions{size_t(8) << 20, 1}};
    auto h = DataPlaneHandler::Create(Runner().config(), plane, karat.get());
    REQUIRE(h.ok());
    handler = std::move(*h);
    handler->set_node_id(kKaratId);
    handler->admission().SetSecret(karat_secret);
    AnnouncedNodes nodes = {{kKaratId, {"karat0", "karat"}}};
    if (announce) nodes[kGpuId] = {"gpu0", "gpu"};
    handler->admission().SetAnnounced(nodes);
  }
  ~Fixture() {
    backend->Abort();
    handler->Stop();
    gpu->Shutdown();
    karat->Shutdown();
    backend.reset();
  }
  void Place(uint64_t session) {
    REQUIRE(handler->Reserve(session, 0, 64).ok());
    cluster::KaratPlacement p;
    p.set_node_id(kKaratId);
    p.set_node_name("karat0");
    p.set_device(0);
    p.set_fabric_address(karat->LocalAddress());
    backend->SetPlacement(session, p, 0);
  }

  FakeFabric fabric;
  std::unique_ptr<Transport> gpu, karat;
  std::unique_ptr<RemoteAttentionBackend> backend;
  std::unique_ptr<DataPlaneHandler> handler;
};

TEST_CASE("a step through a KARAT node of the same cluster",
          "[gpu_node][security]") {
  Fixture fx(kSecret, /*announce=*/true);
  fx.Place(5);
  const auto segs = Prefill(5);
  auto logits = Runner().Step(segs, fx.backend.get());
  REQUIRE(logits.ok());
  const auto want = Reference(segs);
  REQUIRE(logits->size() == want.size());
  CHECK(std::memcmp((*logits)[0].data(), want[0].data(),
                    want[0].size() * sizeof(float)) == 0);
  CHECK(fx.handler->Counters().at("frames_refused") == 0);
  CHECK(fx.backend->Counters().at("attention_frames_refused") == 0);
}

TEST_CASE("a KARAT node that refuses the hello fails the step, saying why",
          "[gpu_node][security]") {
  const bool same_secret = GENERATE(true, false);
  INFO((same_secret ? "the GPU node is not announced" : "another secret"));
  Fixture fx(same_secret ? kSecret : std::string(32, 'o'),
             /*announce=*/!same_secret, absl::Milliseconds(300));
  fx.Place(5);
  auto logits = Runner().Step(Prefill(5), fx.backend.get());
  REQUIRE(logits.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(logits.status().message()),
             Catch::Contains("frames_refused"));
  const auto c = fx.handler->Counters();
  CHECK(c.at(same_secret ? "frames_refused.unknown_node"
                         : "frames_refused.bad_proof") >= 1);
  CHECK(c.at("kv_bytes_ingested") == 0);
}

// A raw endpoint standing in for a KARAT node: answers each hello with a
// proof under `secret`, keeps the attention frames.
class FakeKarat {
 public:
  FakeKarat(FakeFabric* fabric, std::string secret)
      : ep_(fabric->NewEndpoint("karat")), secret_(std::move(secret)) {
    // No Catch2 assertions here: this runs on the endpoint's thread.
    ep_->SetPeerReceiveHandler([this](PeerId, std::string_view m) {
      auto f = DecodeFrame(m);
      if (!f.ok()) return;
      if (f->header.type == uint16_t(FrameType::kHello)) {
        Ack(*f);
        return;
      }
      absl::MutexLock lock(&mu_);
      frames_.emplace_back(m);
    });
  }
  ~FakeKarat() { ep_->Shutdown(); }
  Transport* ep() { return ep_.get(); }
  PeerId gpu() const { return gpu_; }
  // The next attention frame received.
  std::string Next() {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !frames_.empty();
    };
    REQUIRE(mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(30)));
    std::string m = std::move(frames_.front());
    frames_.pop_front();
    return m;
  }

 private:
  void Ack(const FrameView& hello) {
    auto proof = ParseHelloProof(hello.sections[kHelloProofSection]);
    auto peer = ep_->AddPeer("gpu", std::string(hello.sections[0]));
    if (!proof.ok() || !peer.ok()) return;
    gpu_ = *peer;
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kHelloAck);
    h.src_node = kKaratId;
    h.step = hello.header.step;
    const std::string ack = EncodeHelloProof(MakeHelloProof(
        secret_, FrameType::kHelloAck, kKaratId, hello.header.src_node,
        proof->nonce, ep_->LocalAddress()));
    std::string bytes;
    EncodeFrame(h, {ack}, &bytes);
    (void)ep_->Send(*peer, bytes.data(), bytes.size());
  }

  std::unique_ptr<Transport> ep_;
  const std::string secret_;
  std::atomic<PeerId> gpu_{kUnknownPeer};
  absl::Mutex mu_;
  std::deque<std::string> frames_ ABSL_GUARDED_BY(mu_);
};

// One layer of one decode token through `backend` to the node of
// `placement`; returns the layer's status, the output in `*out`.
absl::Status RunOneLayer(RemoteAttentionBackend* backend,
                         const cluster::KaratPlacement& placement,
                         std::vector<float>* out) {
  const AttnShapes& s = Runner().shapes();
  backend->SetPlacement(9, placement, 0);
  backend->BeginStep();
  LayerTraffic traffic;
  traffic.offsets = {0};
  traffic.q.assign(size_t(s.heads) * s.q_dim, 0.5f);
  traffic.kv.assign(size_t(s.kv_dim), 0x3f80);
  traffic.out.assign(size_t(s.heads) * s.out_dim, 0.0f);
  absl::Status st = backend->RunLayer(0, {{9, 0, {65}, false}}, &traffic);
  *out = traffic.out;
  return st;
}

cluster::KaratPlacement PlacementOf(Transport* karat) {
  cluster::KaratPlacement p;
  p.set_node_id(kKaratId);
  p.set_node_name("karat0");
  p.set_fabric_address(karat->LocalAddress());
  return p;
}

TEST_CASE("an answer to the hello whose proof does not verify is not taken",
          "[gpu_node][security]") {
  FakeFabric fabric;
  FakeKarat karat(&fabric, std::string(32, 'w'));
  auto gpu = fabric.NewEndpoint("gpu");
  RemoteAttentionOptions options;
  options.timeout = absl::Milliseconds(300);
  RemoteAttentionBackend backend(Runner().shapes(), gpu.get(), options);
  backend.set_data_plane_secret(kSecret);
  backend.set_node_id(kGpuId);
  std::vector<float> out;
  absl::Status st = RunOneLayer(&backend, PlacementOf(karat.ep()), &out);
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(st.message()), Catch::Contains("did not verify"));
  CHECK(backend.Counters().at("attention_frames_refused.bad_proof") >= 1);
  backend.Abort();
  gpu->Shutdown();
}

TEST_CASE("an attention output from another sender is dropped",
          "[gpu_node][security]") {
  FakeFabric fabric;
  FakeKarat karat(&fabric, kSecret);
  auto gpu = fabric.NewEndpoint("gpu");
  auto stranger = fabric.NewEndpoint("stranger");
  RemoteAttentionBackend backend(Runner().shapes(), gpu.get(), {});
  backend.set_data_plane_secret(kSecret);
  backend.set_node_id(kGpuId);
  std::vector<float> out;
  absl::Status st;
  std::thread layer(
      [&] { st = RunOneLayer(&backend, PlacementOf(karat.ep()), &out); });
  const std::string request = karat.Next();
  auto f = DecodeFrame(request);
  REQUIRE(f.ok());
  REQUIRE(f->header.type == uint16_t(FrameType::kAttnQKV));
  // The answer's bytes: the stranger's are 9s, the KARAT node's 1s.
  const AttnShapes& s = Runner().shapes();
  auto answer = [&](float value) {
    FrameHeader h = f->header;
    h.type = static_cast<uint16_t>(FrameType::kAttnOut);
    h.src_node = kKaratId;
    std::vector<float> o(size_t(s.heads) * s.out_dim, value);
    std::string bytes;
    EncodeFrame(h, {SectionBytes(o.data(), o.size() * 4)}, &bytes);
    return bytes;
  };
  auto to_gpu = stranger->AddPeer("gpu", gpu->LocalAddress());
  REQUIRE(to_gpu.ok());
  const std::string forged = answer(9.0f);
  REQUIRE(stranger->Send(*to_gpu, forged.data(), forged.size()).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (backend.Counters().at("attention_frames_refused.unauthenticated") <
         1) {
    REQUIRE(absl::Now() < give_up);
    absl::SleepFor(absl::Milliseconds(2));
  }
  const std::string genuine = answer(1.0f);
  REQUIRE(karat.ep()->Send(karat.gpu(), genuine.data(), genuine.size()).ok());
  layer.join();
  REQUIRE(st.ok());
  CHECK(out == std::vector<float>(out.size(), 1.0f));
  backend.Abort();
  gpu->Shutdown();
  stranger->Shutdown();
}

}  // namespace
}  // namespace karat
