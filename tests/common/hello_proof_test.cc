// The data-plane hello's proof (common/hello_proof.h): its wire layout, and
// that the MAC covers every field it names.
#include "common/hello_proof.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>

namespace karat {
namespace {

const std::string kSecret(32, 's');
const std::string kNonce = "0123456789abcdef";

TEST_CASE("a hello proof encodes and parses back", "[hello_proof]") {
  const HelloProof proof =
      MakeHelloProof(kSecret, FrameType::kHello, 3, 7, kNonce, "gpu-address");
  CHECK(proof.mac.size() == kHelloMacBytes);
  const std::string bytes = EncodeHelloProof(proof);
  REQUIRE(bytes.size() == kHelloProofBytes);
  absl::StatusOr<HelloProof> back = ParseHelloProof(bytes);
  REQUIRE(back.ok());
  CHECK(back->receiver == 7);
  CHECK(back->nonce == kNonce);
  CHECK(back->mac == proof.mac);

  // Wrong sizes and reserved bytes are refused, naming the problem.
  CHECK_THAT(std::string(ParseHelloProof(bytes.substr(1)).status().message()),
             Catch::Contains("55"));
  CHECK(!ParseHelloProof(bytes + "x").ok());
  CHECK(!ParseHelloProof("").ok());
  std::string reserved = bytes;
  reserved[5] = 1;
  CHECK_THAT(std::string(ParseHelloProof(reserved).status().message()),
             Catch::Contains("reserved"));
}

TEST_CASE("a hello proof verifies only with every field it was made over",
          "[hello_proof]") {
  const HelloProof proof =
      MakeHelloProof(kSecret, FrameType::kHello, 3, 7, kNonce, "gpu-address");
  CHECK(HelloProofValid(kSecret, FrameType::kHello, 3, "gpu-address", proof));
  // Another secret, type, sender or address.
  CHECK_FALSE(HelloProofValid(std::string(32, 't'), FrameType::kHello, 3,
                              "gpu-address", proof));
  CHECK_FALSE(
      HelloProofValid(kSecret, FrameType::kHelloAck, 3, "gpu-address", proof));
  CHECK_FALSE(
      HelloProofValid(kSecret, FrameType::kHello, 4, "gpu-address", proof));
  CHECK_FALSE(
      HelloProofValid(kSecret, FrameType::kHello, 3, "gpu-addresz", proof));
  // The receiver and the nonce travel in the proof: changed, the MAC fails.
  HelloProof other = proof;
  other.receiver = 8;
  CHECK_FALSE(
      HelloProofValid(kSecret, FrameType::kHello, 3, "gpu-address", other));
  other = proof;
  other.nonce[0] ^= 1;
  CHECK_FALSE(
      HelloProofValid(kSecret, FrameType::kHello, 3, "gpu-address", other));
  // No secret proves nothing, even a MAC made under the empty key.
  const HelloProof keyless =
      MakeHelloProof("", FrameType::kHello, 3, 7, kNonce, "gpu-address");
  CHECK_FALSE(
      HelloProofValid("", FrameType::kHello, 3, "gpu-address", keyless));
  // Field boundaries are part of the MAC: moving bytes between the nonce
  // and the address changes it.
  CHECK(HelloMac(kSecret, FrameType::kHello, 3, 7, "ab", "c") !=
        HelloMac(kSecret, FrameType::kHello, 3, 7, "a", "bc"));
}

// The fuzzer's seeds of the handshake frames (tests/fuzz/frame_corpus) are
// frames the decoder takes, with proofs of this layout.
TEST_CASE("the frame corpus holds proven handshake frames", "[hello_proof]") {
  auto read = [](const std::string& name) {
    std::ifstream in(std::string(KARAT_FRAME_CORPUS) + "/" + name,
                     std::ios::binary);
    REQUIRE(in);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    return bytes.str();
  };
  const std::string hello = read("hello_proof");
  auto h = DecodeFrame(hello);
  REQUIRE(h.ok());
  CHECK(h->header.type == uint16_t(FrameType::kHello));
  REQUIRE(h->header.n_sections == 2);
  CHECK(ParseHelloProof(h->sections[kHelloProofSection]).ok());
  const std::string ack = read("hello_ack_proof");
  auto a = DecodeFrame(ack);
  REQUIRE(a.ok());
  CHECK(a->header.type == uint16_t(FrameType::kHelloAck));
  REQUIRE(a->header.n_sections == 1);
  CHECK(ParseHelloProof(a->sections[kHelloAckProofSection]).ok());
}

}  // namespace
}  // namespace karat
