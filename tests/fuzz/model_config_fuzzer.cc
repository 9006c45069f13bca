// libFuzzer target for a model's config.json (common/model_config.h
// ParseModelConfig). A config it accepts is valid, writes back
// (ModelConfigToJson) to text that parses to the same config, and is one
// the programs can size: its tensor list and a GPU rank's weight bytes
// (common/weights.h), which every GPU node and the coordinator's cluster
// checks compute, come out without overflow.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/model_config.h"
#include "common/weights.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<karat::ModelConfig> config =
      karat::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(config.status().message().rfind("fuzz/config.json: ", 0) == 0);
    return 0;
  }
  FUZZ_CHECK(karat::ValidateModelConfig(*config, "fuzz/config.json").ok());
  const std::string written = karat::ModelConfigToJson(*config);
  absl::StatusOr<karat::ModelConfig> again =
      karat::ParseModelConfig(written, "written/config.json");
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(karat::ModelConfigToJson(*again) == written);
  FUZZ_CHECK(karat::RankWeightBytes(*config, 0, 1) > 0);
  return 0;
}
