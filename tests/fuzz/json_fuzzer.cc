// libFuzzer target for the JSON reader (common/json.h ParseJson), which
// reads a model's config.json and every safetensors header. A document it
// accepts, written back (strings through JsonQuote, numbers as written),
// reads back to the same document; AsInt64 takes any number.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/json.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

std::string Write(const karat::JsonValue& v) {
  using Kind = karat::JsonValue::Kind;
  switch (v.kind) {
    case Kind::kNull:
      return "null";
    case Kind::kBool:
      return v.boolean ? "true" : "false";
    case Kind::kNumber: {
      int64_t i;
      (void)v.AsInt64(&i);
      return v.text;
    }
    case Kind::kString:
      return karat::JsonQuote(v.text);
    case Kind::kArray: {
      std::string out = "[";
      for (size_t i = 0; i < v.array.size(); ++i) {
        if (i > 0) out += ",";
        out += Write(v.array[i]);
      }
      return out + "]";
    }
    case Kind::kObject: {
      std::string out = "{";
      for (size_t i = 0; i < v.object.size(); ++i) {
        if (i > 0) out += ",";
        out += karat::JsonQuote(v.object[i].first) + ":" +
               Write(v.object[i].second);
        FUZZ_CHECK(v.Find(v.object[i].first) == &v.object[i].second);
      }
      return out + "}";
    }
  }
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<karat::JsonValue> doc = karat::ParseJson(text);
  if (!doc.ok()) {
    FUZZ_CHECK(doc.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(doc.status().message().rfind("offset ", 0) == 0);
    return 0;
  }
  const std::string written = Write(*doc);
  absl::StatusOr<karat::JsonValue> again = karat::ParseJson(written);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(Write(*again) == written);
  return 0;
}
