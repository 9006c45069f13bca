// The KARAT node's authenticated data plane on the in-process FakeFabric
// (docs/security.md "Data plane"): with a data-plane secret a GPU node's
// kHello is taken only with a proof under the secret, made for this node,
// from a node id the coordinator announced as a GPU node, with a nonce not
// seen before; its kHelloAck proves the secret back; frames from any sender
// other than the peer such a hello bound are dropped. Every refusal is
// counted per reason and never answered.
#include <catch2/catch.hpp>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/hello_proof.h"
#include "common/model_config.h"
#include "common/transport.h"
#include "karat_node/data_plane.h"

namespace karat {
namespace {

constexpr uint32_t kKaratId = 7, kOtherKaratId = 8, kGpuId = 3;
const std::string kSecret(32, 'q');

// An endpoint that sends hand-made frames and keeps what it receives.
class Endpoint {
 public:
  Endpoint(FakeFabric* fabric, const std::string& name)
      : ep_(fabric->NewEndpoint(name)) {
    ep_->SetReceiveHandler([this](std::string_view m) {
      absl::MutexLock lock(&mu_);
      inbox_.emplace_back(m);
    });
  }
  ~Endpoint() { ep_->Shutdown(); }

  void Connect(Transport* karat) {
    auto peer = ep_->AddPeer("karat", karat->LocalAddress());
    REQUIRE(peer.ok());
    peer_ = *peer;
  }
  void Send(const std::string& bytes) {
    REQUIRE(ep_->Send(peer_, bytes.data(), bytes.size()).ok());
  }
  // A kHello claiming `src` for `receiver`, proven under `secret` (no proof
  // when empty), with this endpoint's address.
  std::string Hello(uint32_t src, uint32_t receiver, const std::string& secret,
                    const std::string& nonce, uint64_t step = 1) {
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kHello);
    h.src_node = src;
    h.step = step;
    const std::string address = ep_->LocalAddress();
    std::string bytes;
    if (secret.empty()) {
      EncodeFrame(h, {address}, &bytes);
    } else {
      const std::string proof = EncodeHelloProof(MakeHelloProof(
          secret, FrameType::kHello, src, receiver, nonce, address));
      EncodeFrame(h, {address, proof}, &bytes);
    }
    return bytes;
  }
  // The next received frame (copied); fails after a generous bound.
  std::string Next() {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !inbox_.empty();
    };
    REQUIRE(mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(30)));
    std::string m = std::move(inbox_.front());
    inbox_.pop_front();
    return m;
  }
  size_t received() {
    absl::MutexLock lock(&mu_);
    return inbox_.size();
  }
  Transport* ep() { return ep_.get(); }

 private:
  std::unique_ptr<Transport> ep_;
  PeerId peer_ = kUnknownPeer;
  absl::Mutex mu_;
  std::deque<std::string> inbox_ ABSL_GUARDED_BY(mu_);
};

// A kAttnQKV of one token at position 0 of `session`, claiming `src`.
std::string AttnFrame(const AttnShapes& s, uint32_t src, uint64_t session) {
  std::vector<float> q(size_t(s.heads) * s.q_dim, 0.25f);
  std::vector<uint16_t> kv(size_t(s.kv_dim), 0x3f80);
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
  h.src_node = src;
  h.session = session;
  h.step = 1;
  h.n_tokens = 1;
  std::string bytes;
  EncodeFrame(h,
              {SectionBytes(q.data(), q.size() * 4),
               SectionBytes(kv.data(), kv.size() * 2)},
              &bytes);
  return bytes;
}

struct Fixture {
  Fixture() {
    auto c = PresetConfig("llama-tiny");
    REQUIRE(c.ok());
    config = *c;
    shapes = MakeAttnShapes(config);
    karat = fabric.NewEndpoint("karat");
    DataPlaneOptions options;
    options.tokens_per_page = 16;
    options.devices = {DeviceOptions{size_t(8) << 20, 1}};
    auto h = DataPlaneHandler::Create(config, options, karat.get());
    REQUIRE(h.ok());
    handler = std::move(*h);
    handler->set_node_id(kKaratId);
    handler->admission().SetSecret(kSecret);
    handler->admission().SetAnnounced({{kGpuId, {"gpu0", "gpu"}},
                                       {kKaratId, {"karat0", "karat"}},
                                       {kOtherKaratId, {"karat1", "karat"}}});
    REQUIRE(handler->Reserve(11, 0, 16).ok());
    gpu = std::make_unique<Endpoint>(&fabric, "gpu");
    gpu->Connect(karat.get());
  }
  ~Fixture() {
    handler->Stop();
    karat->Shutdown();
  }
  double Counter(const std::string& name) {
    return handler->Counters().at(name);
  }
  // Waits (bounded) until counter `name` reaches `value`.
  bool WaitCounter(const std::string& name, double value) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (Counter(name) < value) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return true;
  }
  // The genuine GPU node greets with a proven hello; checks the answer's
  // proof. Returns the hello's bytes after the handshake.
  std::string Greet(const std::string& nonce) {
    const std::string hello = gpu->Hello(kGpuId, kKaratId, kSecret, nonce, 77);
    gpu->Send(hello);
    const std::string m = gpu->Next();
    auto f = DecodeFrame(m);
    REQUIRE(f.ok());
    REQUIRE(f->header.type == uint16_t(FrameType::kHelloAck));
    CHECK(f->header.step == 77);
    CHECK(f->header.src_node == kKaratId);
    REQUIRE(f->header.n_sections == 1);
    auto proof = ParseHelloProof(f->sections[kHelloAckProofSection]);
    REQUIRE(proof.ok());
    CHECK(proof->receiver == kGpuId);
    CHECK(proof->nonce == nonce);
    CHECK(HelloProofValid(kSecret, FrameType::kHelloAck, kKaratId,
                          karat->LocalAddress(), *proof));
    CHECK_FALSE(HelloProofValid(std::string(32, 'x'), FrameType::kHelloAck,
                                kKaratId, karat->LocalAddress(), *proof));
    return hello;
  }

  ModelConfig config;
  AttnShapes shapes;
  FakeFabric fabric;
  std::unique_ptr<Transport> karat;
  std::unique_ptr<DataPlaneHandler> handler;
  std::unique_ptr<Endpoint> gpu;
};

TEST_CASE("a proven hello is taken and answered with a proof; frames follow",
          "[karat_node][security]") {
  Fixture fx;
  fx.Greet("nonce-aaaaaaaaaa");
  fx.gpu->Send(AttnFrame(fx.shapes, kGpuId, 11));
  auto f = DecodeFrame(fx.gpu->Next());
  REQUIRE(f.ok());
  CHECK(f->header.type == uint16_t(FrameType::kAttnOut));
  CHECK(fx.Counter("frames_refused") == 0);
  CHECK(fx.Counter("kv_bytes_ingested") > 0);
}

TEST_CASE("refused hellos are counted per reason and never answered",
          "[karat_node][security]") {
  Fixture fx;
  struct Case {
    const char* what;
    uint32_t src, receiver;
    std::string secret;
    const char* counter;
  };
  const std::vector<Case> cases = {
      {"wrong secret", kGpuId, kKaratId, std::string(32, 'x'),
       "frames_refused.bad_proof"},
      {"no proof", kGpuId, kKaratId, "", "frames_refused.no_proof"},
      {"unknown node id", 42, kKaratId, kSecret, "frames_refused.unknown_node"},
      {"a KARAT node's id", kOtherKaratId, kKaratId, kSecret,
       "frames_refused.not_gpu"},
      {"made for another node", kGpuId, kOtherKaratId, kSecret,
       "frames_refused.other_receiver"},
  };
  double refused = 0;
  for (const Case& c : cases) {
    INFO(c.what);
    fx.gpu->Send(
        fx.gpu->Hello(c.src, c.receiver, c.secret, "nonce-bbbbbbbbbb"));
    // The sender was not bound: its data frame is refused too.
    fx.gpu->Send(AttnFrame(fx.shapes, c.src, 11));
    refused += 2;
    REQUIRE(fx.WaitCounter("frames_refused", refused));
    CHECK(fx.Counter(c.counter) == 1);
  }
  CHECK(fx.Counter("frames_refused.unauthenticated") == double(cases.size()));
  CHECK(fx.Counter("kv_bytes_ingested") == 0);
  CHECK(fx.gpu->received() == 0);

  // A hello taken once cannot be replayed: its nonce is spent.
  fx.Greet("nonce-cccccccccc");
  fx.gpu->Send(fx.gpu->Hello(kGpuId, kKaratId, kSecret, "nonce-cccccccccc"));
  REQUIRE(fx.WaitCounter("frames_refused.replayed", 1));
  CHECK(fx.gpu->received() == 0);
}

TEST_CASE("a sender other than the greeted peer gets nothing",
          "[karat_node][security]") {
  Fixture fx;
  const std::string captured = fx.Greet("nonce-dddddddddd");
  // A stranger claims the greeted GPU node's id, first with a data frame,
  // then by sending that node's own proven hello again.
  Endpoint stranger(&fx.fabric, "stranger");
  stranger.Connect(fx.karat.get());
  stranger.Send(AttnFrame(fx.shapes, kGpuId, 11));
  REQUIRE(fx.WaitCounter("frames_refused.unauthenticated", 1));
  stranger.Send(captured);
  REQUIRE(fx.WaitCounter("frames_refused.replayed", 1));
  // Neither wrote the session's KV nor drew an answer to anyone.
  CHECK(fx.Counter("kv_bytes_ingested") == 0);
  CHECK(stranger.received() == 0);
  CHECK(fx.gpu->received() == 0);
  // The greeted node's own frame is served.
  fx.gpu->Send(AttnFrame(fx.shapes, kGpuId, 11));
  auto f = DecodeFrame(fx.gpu->Next());
  REQUIRE(f.ok());
  CHECK(f->header.type == uint16_t(FrameType::kAttnOut));
  CHECK(stranger.received() == 0);
}

TEST_CASE("a closed data plane takes nothing before the registration",
          "[karat_node][security]") {
  Fixture fx;
  fx.handler->admission().Close();
  fx.gpu->Send(fx.gpu->Hello(kGpuId, kKaratId, kSecret, "nonce-eeeeeeeeee"));
  fx.gpu->Send(AttnFrame(fx.shapes, kGpuId, 11));
  REQUIRE(fx.WaitCounter("frames_refused.not_registered", 2));
  CHECK(fx.gpu->received() == 0);
  // The registration's secret opens it to proven hellos.
  fx.handler->admission().SetSecret(kSecret);
  fx.Greet("nonce-ffffffffff");
}

}  // namespace
}  // namespace karat
