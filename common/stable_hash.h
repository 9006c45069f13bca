// Fixed, platform-independent integer mixing and string hashing, for values
// that must be the same in every build and run (weights, sampling, link
// emulation seeds); std::hash is not.
#pragma once

#include <cstdint>
#include <string_view>

namespace karat {

// splitmix64's output function of `x` plus the golden-ratio increment.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// 64-bit FNV-1a.
inline uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

}  // namespace karat
