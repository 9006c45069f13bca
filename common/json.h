// A small JSON reader and writer helpers for the two JSON documents the
// runtime reads itself: a model's config.json and a safetensors header.
// Numbers keep their literal text so that integers (tensor offsets) are read
// exactly, not through a double. Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace karat {

struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  // Declared here and defaulted in json.cc, where the type is complete:
  // clang with libstdc++ refuses the implicit ones, which would need
  // std::pair<std::string, JsonValue> while JsonValue is being defined.
  JsonValue();
  ~JsonValue();
  JsonValue(const JsonValue&);
  JsonValue(JsonValue&&) noexcept;
  JsonValue& operator=(const JsonValue&);
  JsonValue& operator=(JsonValue&&) noexcept;

  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0.0;
  // kString: the decoded string (UTF-8). kNumber: the literal as written.
  std::string text;
  std::vector<JsonValue> array;
  // Members in document order; keys are unique (the parser refuses repeats).
  std::vector<std::pair<std::string, JsonValue>> object;

  bool is_object() const { return kind == Kind::kObject; }
  // The member named `key` of an object, or nullptr.
  const JsonValue* Find(std::string_view key) const;
  // True, with *out set, when this is a number with an integral value that
  // fits in int64 (`12`, `-3`, `1e3`, `4.0`); false otherwise.
  bool AsInt64(int64_t* out) const;
};

// Parses one JSON document (RFC 8259; surrounding whitespace allowed).
// Errors are InvalidArgument with "offset N: reason". Nesting deeper than 64
// levels is refused so that hostile input cannot exhaust the stack.
absl::StatusOr<JsonValue> ParseJson(std::string_view text);

// `s` as a JSON string literal, quotes included. With `ascii`, bytes from
// 0x7f up are escaped as \u00XX too, so text of unknown encoding (error
// messages) still gives valid ASCII JSON.
std::string JsonQuote(std::string_view s, bool ascii = false);

// Shortest text that reads back as the same double ("1e-06", "10000").
std::string JsonNumber(double v);

}  // namespace karat
