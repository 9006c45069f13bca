// libFuzzer target for safetensors files: the input is a whole file, parsed
// and checked as SafetensorsFile::Open checks a model's weights
// (common/safetensors.h ParseSafetensors). Every tensor it accepts lies in
// the file's data area, holds exactly its shape's bytes and converts to
// fp32; refusals are DATA_LOSS naming the file.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

// Tensors up to this size are converted (ToFloat) too.
constexpr unsigned __int128 kConvertBytes = 1 << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<karat::SafetensorsContents> file =
      karat::ParseSafetensors(bytes, "fuzz.safetensors");
  if (!file.ok()) {
    FUZZ_CHECK(file.status().code() == absl::StatusCode::kDataLoss);
    FUZZ_CHECK(file.status().message().rfind("fuzz.safetensors: ", 0) == 0);
    return 0;
  }
  FUZZ_CHECK(size >= 8);
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | data[i];
  const uint8_t* area = data + 8 + header;
  const uint8_t* end = data + size;
  for (const auto& [name, t] : file->tensors) {
    FUZZ_CHECK(name == t.name && name != "__metadata__");
    FUZZ_CHECK(t.data >= area && t.data <= end);
    FUZZ_CHECK(t.nbytes <= size_t(end - t.data));
    // The shape's bytes, without overflow.
    unsigned __int128 elements = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0);
      elements *= static_cast<unsigned __int128>(d);
      if (elements > (unsigned __int128)1 << 64)
        elements = (unsigned __int128)1 << 64;
    }
    FUZZ_CHECK(elements * karat::DTypeSize(t.dtype) == t.nbytes);
    FUZZ_CHECK(static_cast<unsigned __int128>(t.NumElements()) == elements);
    if (t.nbytes <= kConvertBytes) {
      FUZZ_CHECK(t.ToFloat().size() == size_t(elements));
    }
  }
  return 0;
}
