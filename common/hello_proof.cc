#include "common/hello_proof.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "security/hmac.h"

namespace karat {
namespace {

// Distinguishes these MACs from any other use of the secret.
constexpr std::string_view kDomain = "KARAT data-plane hello v1";

template <typename T>
void PutLittleEndian(T value, std::string* out) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out->push_back(
        static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

uint32_t GetU32(std::string_view bytes, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) {
    v |= uint32_t(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  }
  return v;
}

}  // namespace

std::string EncodeHelloProof(const HelloProof& proof) {
  std::string out;
  out.reserve(kHelloProofBytes);
  PutLittleEndian<uint32_t>(proof.receiver, &out);
  PutLittleEndian<uint32_t>(0, &out);
  out.append(proof.nonce);
  out.append(proof.mac);
  return out;
}

absl::StatusOr<HelloProof> ParseHelloProof(std::string_view section) {
  if (section.size() != kHelloProofBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a hello proof is ", kHelloProofBytes, " bytes, got ", section.size()));
  }
  if (GetU32(section, 4) != 0) {
    return absl::InvalidArgumentError(
        "a hello proof's reserved bytes are not zero");
  }
  HelloProof proof;
  proof.receiver = GetU32(section, 0);
  proof.nonce = std::string(section.substr(8, kHelloNonceBytes));
  proof.mac = std::string(section.substr(8 + kHelloNonceBytes, kHelloMacBytes));
  return proof;
}

std::string HelloMac(const std::string& secret, FrameType type,
                     uint32_t src_node, uint32_t receiver,
                     std::string_view nonce, std::string_view address) {
  std::string data(kDomain);
  data.push_back('\0');
  PutLittleEndian<uint16_t>(static_cast<uint16_t>(type), &data);
  PutLittleEndian<uint32_t>(src_node, &data);
  PutLittleEndian<uint32_t>(receiver, &data);
  // Lengths first, so that no two field lists give the same bytes.
  PutLittleEndian<uint64_t>(nonce.size(), &data);
  data.append(nonce);
  PutLittleEndian<uint64_t>(address.size(), &data);
  data.append(address);
  return security::HmacSha256(secret, data);
}

HelloProof MakeHelloProof(const std::string& secret, FrameType type,
                          uint32_t src_node, uint32_t receiver,
                          std::string_view nonce, std::string_view address) {
  HelloProof proof;
  proof.receiver = receiver;
  proof.nonce = std::string(nonce);
  proof.mac = HelloMac(secret, type, src_node, receiver, nonce, address);
  return proof;
}

bool HelloProofValid(const std::string& secret, FrameType type,
                     uint32_t src_node, std::string_view address,
                     const HelloProof& proof) {
  if (secret.empty()) return false;
  return security::ConstantTimeEqual(
      proof.mac,
      HelloMac(secret, type, src_node, proof.receiver, proof.nonce, address));
}

}  // namespace karat
