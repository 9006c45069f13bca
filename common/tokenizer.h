// Byte-level tokens (MODEL.md): ids 0-255 are bytes, 256 BOS, 257 EOS.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace karat {

constexpr int32_t kBosToken = 256;
constexpr int32_t kEosToken = 257;
constexpr int32_t kVocabSize = 258;

inline std::vector<int32_t> EncodeText(std::string_view text) {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

// The bytes of one token: the byte itself, or "" for BOS/EOS.
inline std::string TokenText(int32_t id) {
  if (id >= 0 && id < 256) return std::string(1, static_cast<char>(id));
  return std::string();
}

inline std::string DecodeTokens(const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) out += TokenText(id);
  return out;
}

}  // namespace karat
