// safetensors files (MODEL.md "Files"): 8-byte little-endian header length,
// JSON header (`__metadata__` allowed, trailing-space padding allowed), raw
// little-endian tensors. F32 and BF16 are supported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace karat {

enum class DType { kF32, kBF16 };
const char* DTypeName(DType d);  // "F32", "BF16"
size_t DTypeSize(DType d);

// A view of one tensor inside a memory-mapped file. `data` stays valid while
// the SafetensorsFile that produced it is alive.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t NumElements() const;
  // Converts to fp32 (bf16 widened exactly).
  std::vector<float> ToFloat() const;
};

// The tensors and metadata of a safetensors file held in memory (`bytes`,
// the whole file), checked as SafetensorsFile::Open checks a file; the
// views point into `bytes`. `path` prefixes every error (DATA_LOSS for a
// corrupt file). Pure; what the fuzz target
// tests/fuzz/safetensors_fuzzer.cc exercises.
struct SafetensorsContents {
  std::map<std::string, TensorView> tensors;  // in name order
  std::map<std::string, std::string> metadata;
};
absl::StatusOr<SafetensorsContents> ParseSafetensors(std::string_view bytes,
                                                     const std::string& path);

// A memory-mapped, validated safetensors file. Open() checks the header
// (length within the file, JSON well-formed, every tensor's dtype known,
// offsets in order, inside the data area, non-overlapping, and matching
// shape x dtype size) and names the file and tensor in any error.
// Immutable after Open; thread-safe for reads.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in name order.
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: fp32 values, stored as `dtype` (bf16 rounds to
// nearest even).
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* values = nullptr;  // NumElements(shape) floats
};

// Writes a safetensors file (tensors sorted by name, header padded with
// spaces to a multiple of 8 bytes). Written to PATH.tmp then renamed.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorToWrite>& tensors,
                              DType dtype,
                              const std::map<std::string, std::string>&
                                  metadata = {});

}  // namespace karat
