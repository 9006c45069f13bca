// HMAC-SHA256 for the data plane's authenticated hello (docs/security.md).
// Pure functions, thread-safe.
#pragma once

#include <string>

namespace karat::security {

// HMAC-SHA256 of `data` under `key` (32 raw bytes).
std::string HmacSha256(const std::string& key, const std::string& data);

// a == b, in a time that depends on the sizes only.
bool ConstantTimeEqual(const std::string& a, const std::string& b);

// `n` random bytes from the operating system's generator (aborts if it
// fails: nothing secret can be made without it).
std::string RandomBytes(size_t n);

}  // namespace karat::security
