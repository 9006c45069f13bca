// Which senders a KARAT node's data plane takes (karat_node/peer_admission.h):
// the verdict on a hello as a pure function, and the admission state (modes,
// bound peers, the coordinator's table, counters).
#include "karat_node/peer_admission.h"

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "common/frame.h"
#include "common/hello_proof.h"

namespace karat {
namespace {

constexpr uint32_t kKarat = 7, kGpu = 3, kOtherKarat = 8;
const std::string kSecret(32, 'k');
const std::string kAddress = "gpu-fabric-address";

const AnnouncedNodes kAnnounced = {{kGpu, {"gpu0", "gpu"}},
                                   {kKarat, {"karat0", "karat"}},
                                   {kOtherKarat, {"karat1", "karat"}}};

const NonceWindow kNoNonces;

// A hello's bytes; view() decodes them (the views point into `bytes`).
struct Hello {
  std::string bytes;
  FrameView view() const {
    auto v = DecodeFrame(bytes);
    REQUIRE(v.ok());
    return *v;
  }
};

// A kHello from `src` to `receiver`, with a proof under `secret` (none when
// `secret` is empty).
Hello MakeHello(uint32_t src, uint32_t receiver, const std::string& secret,
                const std::string& nonce = "nonce-0123456789") {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kHello);
  h.src_node = src;
  h.step = 1;
  Hello hello;
  if (secret.empty()) {
    EncodeFrame(h, {kAddress}, &hello.bytes);
  } else {
    const std::string proof = EncodeHelloProof(MakeHelloProof(
        secret, FrameType::kHello, src, receiver, nonce, kAddress));
    EncodeFrame(h, {kAddress, proof}, &hello.bytes);
  }
  return hello;
}

Refusal Check(const Hello& hello, const NonceWindow& seen = kNoNonces) {
  return CheckHello(HelloContext{kSecret, kKarat, &kAnnounced, &seen},
                    hello.view());
}

TEST_CASE("CheckHello takes a proven hello from an announced GPU node only",
          "[peer_admission]") {
  CHECK(Check(MakeHello(kGpu, kKarat, kSecret)) == Refusal::kNone);
  // Another secret: the MAC does not verify.
  CHECK(Check(MakeHello(kGpu, kKarat, std::string(32, 'x'))) ==
        Refusal::kBadProof);
  // No proof at all, under the id of a real GPU node.
  CHECK(Check(MakeHello(kGpu, kKarat, "")) == Refusal::kNoProof);
  // Proven, but the id is not announced, or not as a GPU node.
  CHECK(Check(MakeHello(42, kKarat, kSecret)) == Refusal::kUnknownNode);
  CHECK(Check(MakeHello(kOtherKarat, kKarat, kSecret)) == Refusal::kNotGpu);
  // A genuine hello made for another KARAT node, replayed to this one.
  CHECK(Check(MakeHello(kGpu, kOtherKarat, kSecret)) ==
        Refusal::kOtherReceiver);
  // The same, with its receiver rewritten: the MAC covers it.
  {
    const Hello captured = MakeHello(kGpu, kOtherKarat, kSecret);
    const FrameView v = captured.view();
    auto proof = ParseHelloProof(v.sections[kHelloProofSection]);
    REQUIRE(proof.ok());
    proof->receiver = kKarat;
    Hello rewritten;
    EncodeFrame(v.header, {v.sections[0], EncodeHelloProof(*proof)},
                &rewritten.bytes);
    CHECK(Check(rewritten) == Refusal::kBadProof);
  }
  // A claimed address other than the one proven (the proof of the real
  // GPU node, another sender's address).
  {
    const Hello genuine = MakeHello(kGpu, kKarat, kSecret);
    const FrameView v = genuine.view();
    Hello moved;
    EncodeFrame(
        v.header,
        {std::string_view("intruder-address"), v.sections[kHelloProofSection]},
        &moved.bytes);
    CHECK(Check(moved) == Refusal::kBadProof);
  }
  // A proof section of the wrong size.
  {
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kHello);
    h.src_node = kGpu;
    Hello malformed;
    EncodeFrame(h, {kAddress, std::string_view("short")}, &malformed.bytes);
    CHECK(Check(malformed) == Refusal::kMalformedProof);
  }
  // A nonce seen before.
  NonceWindow seen;
  seen.Insert("nonce-0123456789");
  CHECK(Check(MakeHello(kGpu, kKarat, kSecret), seen) == Refusal::kReplayed);
  CHECK(Check(MakeHello(kGpu, kKarat, kSecret, "nonce-fresh-0000"), seen) ==
        Refusal::kNone);
}

TEST_CASE("NonceWindow keeps the latest nonces", "[peer_admission]") {
  NonceWindow window(2);
  window.Insert("a");
  window.Insert("b");
  window.Insert("a");  // already there
  CHECK(window.size() == 2);
  window.Insert("c");
  CHECK_FALSE(window.Contains("a"));
  CHECK(window.Contains("b"));
  CHECK(window.Contains("c"));
}

TEST_CASE("PeerAdmission: modes, bound peers and the announced table",
          "[peer_admission]") {
  PeerAdmission admission;
  const Hello plain = MakeHello(kGpu, kKarat, "");
  const Hello proven = MakeHello(kGpu, kKarat, kSecret);

  // Open (plaintext, the default): everything as before authentication.
  CHECK(admission.mode() == PeerAdmission::Mode::kOpen);
  CHECK(admission.AdmitHello(kKarat, plain.view()) == Refusal::kNone);
  CHECK(admission.AdmitFrame(kGpu, kUnknownPeer) == Refusal::kNone);

  // Closed: nothing before the registration.
  admission.Close();
  CHECK(admission.AdmitHello(kKarat, proven.view()) == Refusal::kNotRegistered);
  CHECK(admission.AdmitFrame(kGpu, 1) == Refusal::kNotRegistered);

  // Authenticated: a proven hello from an announced GPU node, once.
  admission.SetSecret(kSecret);
  CHECK(admission.mode() == PeerAdmission::Mode::kAuthenticated);
  CHECK(admission.AdmitHello(kKarat, proven.view()) == Refusal::kUnknownNode);
  admission.SetAnnounced(kAnnounced);
  CHECK(admission.AdmitHello(kKarat, plain.view()) == Refusal::kNoProof);
  CHECK(admission.AdmitHello(kKarat, proven.view()) == Refusal::kNone);
  CHECK(admission.AdmitHello(kKarat, proven.view()) == Refusal::kReplayed);
  // Frames only from the peer bound to the claimed id.
  CHECK(admission.AdmitFrame(kGpu, 5) == Refusal::kUnauthenticated);
  admission.Bind(kGpu, 5);
  CHECK(admission.PeerOf(kGpu) == 5);
  CHECK(admission.AdmitFrame(kGpu, 5) == Refusal::kNone);
  CHECK(admission.AdmitFrame(kGpu, 6) == Refusal::kUnauthenticated);
  CHECK(admission.AdmitFrame(kGpu, kUnknownPeer) == Refusal::kUnauthenticated);
  CHECK(admission.AdmitFrame(kOtherKarat, 5) == Refusal::kUnauthenticated);

  // A table without the node forgets its binding.
  AnnouncedNodes without = kAnnounced;
  without.erase(kGpu);
  admission.SetAnnounced(without);
  CHECK(admission.PeerOf(kGpu) == kUnknownPeer);
  CHECK(admission.AdmitFrame(kGpu, 5) == Refusal::kUnauthenticated);
  // A registration under the same secret keeps the bindings (a GPU node
  // whose id did not change does not greet again); under another secret
  // they are forgotten (every GPU node greets again with the new one).
  admission.SetAnnounced(kAnnounced);
  admission.Bind(kGpu, 5);
  admission.SetSecret(kSecret);
  CHECK(admission.PeerOf(kGpu) == 5);
  CHECK(admission.AdmitFrame(kGpu, 5) == Refusal::kNone);
  admission.SetSecret(std::string(kSecret) + "x");
  CHECK(admission.PeerOf(kGpu) == kUnknownPeer);
  // Registering without a secret (plaintext cluster) opens it.
  admission.SetSecret("");
  CHECK(admission.mode() == PeerAdmission::Mode::kOpen);
  CHECK(admission.AdmitHello(kKarat, plain.view()) == Refusal::kNone);

  // Every refusal is counted under its reason, all of them exported.
  admission.Count(Refusal::kBadProof);
  admission.Count(Refusal::kBadProof);
  admission.Count(Refusal::kUnauthenticated);
  admission.Count(Refusal::kNone);
  std::map<std::string, double> c;
  admission.ExportTo(&c);
  CHECK(c.at("frames_refused") == 3);
  CHECK(c.at("frames_refused.bad_proof") == 2);
  CHECK(c.at("frames_refused.unauthenticated") == 1);
  CHECK(c.at("frames_refused.no_proof") == 0);
  CHECK(c.size() == size_t(kRefusalKinds));  // the total and 9 reasons
}

}  // namespace
}  // namespace karat
