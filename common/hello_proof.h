// The proof a data-plane handshake frame carries (docs/security.md "Data
// plane"): an HMAC-SHA256, under the cluster's data-plane secret
// (RegisterNodeResponse.data_plane_secret), over the frame type, the
// sender's node id, the receiver's node id, a fresh random nonce and a
// fabric address. Only a daemon the coordinator registered knows the
// secret, so only it can greet a node, and a captured frame names the one
// receiver it was made for.
//
//   kHello     (GPU node -> KARAT node) sections [sender's address, proof];
//              the MAC covers kHello, the GPU node's id, the KARAT node's
//              id (proof.receiver), the nonce and the sender's address.
//   kHelloAck  (KARAT node -> GPU node) sections [proof]; the MAC covers
//              kHelloAck, the KARAT node's id, the GPU node's id
//              (proof.receiver), the hello's nonce and the KARAT node's own
//              address, so the GPU node knows that the node it meant
//              answered this very hello.
//
// In plaintext mode (no secret) neither frame carries a proof. Pure
// functions, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/frame.h"

namespace karat {

inline constexpr size_t kHelloNonceBytes = 16;
inline constexpr size_t kHelloMacBytes = 32;
// Wire layout of a proof section, little-endian: u32 receiver, u32 zero,
// nonce, MAC.
inline constexpr size_t kHelloProofBytes =
    4 + 4 + kHelloNonceBytes + kHelloMacBytes;
// Where the proof sits in each frame.
inline constexpr uint32_t kHelloProofSection = 1;
inline constexpr uint32_t kHelloAckProofSection = 0;

struct HelloProof {
  uint32_t receiver = 0;  // the node id the frame is meant for
  std::string nonce;      // kHelloNonceBytes
  std::string mac;        // kHelloMacBytes
};

std::string EncodeHelloProof(const HelloProof& proof);
// INVALID_ARGUMENT naming what is wrong (size, reserved bytes).
absl::StatusOr<HelloProof> ParseHelloProof(std::string_view section);

// The HMAC-SHA256 under `secret` of the fields a proof covers.
std::string HelloMac(const std::string& secret, FrameType type,
                     uint32_t src_node, uint32_t receiver,
                     std::string_view nonce, std::string_view address);

// A proof for a frame of `type` from `src_node` to `receiver`, with
// `nonce` (kHelloNonceBytes fresh random bytes) and `address` as above.
HelloProof MakeHelloProof(const std::string& secret, FrameType type,
                          uint32_t src_node, uint32_t receiver,
                          std::string_view nonce, std::string_view address);

// Whether `proof` is the MAC of a frame of `type` from `src_node` with
// `address`, under `secret` (compared in constant time).
bool HelloProofValid(const std::string& secret, FrameType type,
                     uint32_t src_node, std::string_view address,
                     const HelloProof& proof);

}  // namespace karat
