// How logs name a session's data-plane key (docs/security.md "Sessions"):
// the top 32 bits as 8 hex digits, enough to follow one session through the
// daemons' logs, not the key itself (security::ShortId does the same for
// session ids). Pure, header-only, so that every daemon can use it.
#pragma once

#include <cstdint>
#include <string>

namespace karat {

inline std::string ShortKey(uint64_t key) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(8, '0');
  for (int i = 0; i < 8; ++i) out[i] = kHex[(key >> (60 - 4 * i)) & 0xf];
  return out;
}

}  // namespace karat
