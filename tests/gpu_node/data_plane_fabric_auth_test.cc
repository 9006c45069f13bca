// The authenticated data plane over real libfabric endpoints (shm, and tcp
// on 127.0.0.1), docs/security.md "Data plane": a GPU node and a KARAT node
// of one cluster (same secret, the GPU node announced) serve a turn's steps
// with the reference's logits, while a third endpoint that no coordinator
// registered, claiming the GPU node's id, gets no attention output, writes
// no KV and draws no answer to the GPU node: its hellos (without a proof,
// or with one under another secret) and its attention frames, before and
// after the genuine handshake, are refused and counted. What attributes its
// frames to it after the handshake is the provider's source address.
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

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
constexpr uint64_t kSession = 5;
const std::string kSecret(32, 'f');

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

// Received messages, copied.
struct Inbox {
  absl::Mutex mu;
  std::vector<std::string> messages;
  size_t size() {
    absl::MutexLock lock(&mu);
    return messages.size();
  }
};

std::unique_ptr<Transport> Open(const std::string& provider) {
  FabricOptions o;
  o.provider = provider;
  if (provider == "tcp") o.node = "127.0.0.1";
  o.use_rma = false;  // as the daemons on shm; nothing sends on its own
  o.receive_buffers = 8;
  absl::StatusOr<std::unique_ptr<Transport>> t = OpenFabricTransport(o);
  if (!t.ok()) {
    WARN("libfabric provider '" << provider
                                << "' unavailable, skipping: " << t.status());
    return nullptr;
  }
  return std::move(*t);
}

std::string Hello(uint32_t src, const std::string& secret,
                  const std::string& address) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kHello);
  h.src_node = src;
  h.step = 1;
  std::string bytes;
  if (secret.empty()) {
    EncodeFrame(h, {address}, &bytes);
  } else {
    const std::string proof = EncodeHelloProof(MakeHelloProof(
        secret, FrameType::kHello, src, kKaratId, "nonce-intruder00", address));
    EncodeFrame(h, {address, proof}, &bytes);
  }
  return bytes;
}

// A kAttnQKV of one token of kSession at `pos`, claiming the GPU node.
std::string AttnFrame(int pos) {
  const AttnShapes& s = Runner().shapes();
  std::vector<float> q(size_t(s.heads) * s.q_dim, 0.5f);
  std::vector<uint16_t> kv(size_t(s.kv_dim), 0x3f80);
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
  h.src_node = kGpuId;
  h.session = kSession;
  h.step = 1000;
  h.pos_start = uint32_t(pos);
  h.n_tokens = 1;
  std::string bytes;
  EncodeFrame(h,
              {SectionBytes(q.data(), q.size() * 4),
               SectionBytes(kv.data(), kv.size() * 2)},
              &bytes);
  return bytes;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("an endpoint no coordinator registered gets no attention output",
          "[gpu_node][security][fabric]") {
  const std::string provider =
      GENERATE(Catch::Generators::as<std::string>{}, "shm", "tcp");
  INFO("provider " << provider);
  Inbox intruder_inbox;
  std::unique_ptr<Transport> karat = Open(provider);
  if (karat == nullptr) return;
  std::unique_ptr<Transport> gpu = Open(provider);
  std::unique_ptr<Transport> intruder = Open(provider);
  REQUIRE(gpu != nullptr);
  REQUIRE(intruder != nullptr);
  intruder->SetReceiveHandler([&](std::string_view m) {
    absl::MutexLock lock(&intruder_inbox.mu);
    intruder_inbox.messages.emplace_back(m);
  });

  // The KARAT node: registered (its id, the secret) and told of the GPU
  // node.
  DataPlaneOptions plane;
  plane.tokens_per_page = 16;
  plane.devices = {DeviceOptions{size_t(8) << 20, 1}};
  auto created =
      DataPlaneHandler::Create(Runner().config(), plane, karat.get());
  REQUIRE(created.ok());
  std::unique_ptr<DataPlaneHandler> handler = std::move(*created);
  handler->set_node_id(kKaratId);
  handler->admission().SetSecret(kSecret);
  handler->admission().SetAnnounced(
      {{kGpuId, {"gpu0", "gpu"}}, {kKaratId, {"karat0", "karat"}}});
  REQUIRE(handler->Reserve(kSession, 0, 64).ok());
  auto counter = [&](const std::string& name) {
    return handler->Counters().at(name);
  };
  auto wait_counter = [&](const std::string& name, double value) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (counter(name) < value) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return true;
  };

  // The GPU node of the same cluster. Nothing is lost on these links: no
  // segment is sent again on a timer however slow the build (a sanitized
  // one), so every answer that reaches it is to its own frames, once.
  RemoteAttentionOptions options;
  options.rto_initial_decode = options.rto_initial_prefill =
      options.rto_min = options.rto_max_decode = options.rto_max =
          absl::Seconds(20);
  auto backend = std::make_unique<RemoteAttentionBackend>(
      Runner().shapes(), gpu.get(), options);
  backend->set_data_plane_secret(kSecret);
  backend->set_node_id(kGpuId);
  cluster::KaratPlacement placement;
  placement.set_node_id(kKaratId);
  placement.set_node_name("karat0");
  placement.set_device(0);
  placement.set_fabric_address(karat->LocalAddress());
  backend->SetPlacement(kSession, placement, 0);

  // The intruder knows the KARAT node's address and the GPU node's id.
  auto to_karat = intruder->AddPeer("karat0", karat->LocalAddress());
  REQUIRE(to_karat.ok());
  auto send = [&](const std::string& bytes) {
    REQUIRE(intruder->Send(*to_karat, bytes.data(), bytes.size()).ok());
  };
  const std::string own = intruder->LocalAddress();
  send(Hello(kGpuId, "", own));                    // plaintext hello
  send(Hello(kGpuId, std::string(32, 'x'), own));  // another cluster's
  send(AttnFrame(0));
  REQUIRE(wait_counter("frames_refused.no_proof", 1));
  REQUIRE(wait_counter("frames_refused.bad_proof", 1));
  REQUIRE(wait_counter("frames_refused.unauthenticated", 1));

  // The turn: a prefill and a decode step, each the reference's bits.
  std::vector<int32_t> prompt = {256};
  for (int i = 1; i < 12; ++i) prompt.push_back((i * 5 + 1) % 256);
  const std::vector<std::vector<Segment>> steps = {
      {{kSession, 0, prompt, true}},
      {{kSession, int(prompt.size()), {66}, false}}};
  LocalAttentionBackend local(Runner().config(), 16, size_t(64) << 20);
  REQUIRE(local.Init().ok());
  REQUIRE(local.Reserve(kSession, 64).ok());
  for (size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i);
    backend->BeginStep();
    auto got = Runner().Step(steps[i], backend.get());
    auto want = Runner().Step(steps[i], &local);
    REQUIRE(got.ok());
    REQUIRE(want.ok());
    CHECK(SameBits((*got)[0], (*want)[0]));
    if (i == 0) {
      // Now that the GPU node is greeted, the intruder claims its id again.
      send(AttnFrame(int(prompt.size())));
      REQUIRE(wait_counter("frames_refused.unauthenticated", 2));
    }
  }
  CHECK(counter("frames_refused") == 4);
  CHECK(intruder_inbox.size() == 0);
  // No answer to the intruder's frames reached the GPU node either.
  CHECK(backend->Counters().at("attention_stale_answers") == 0);

  backend->Abort();
  handler->Stop();
  intruder->Shutdown();
  gpu->Shutdown();
  karat->Shutdown();
  backend.reset();
}

}  // namespace
}  // namespace karat
