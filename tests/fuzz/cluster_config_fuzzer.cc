// libFuzzer target for the cluster configuration (protobuf text format):
// the input is parsed and checked as the coordinator and `deploy/karat`
// read a cluster file (coordinator/cluster_config.h ParseClusterConfig),
// then checked against a MoE and a dense preset model
// (ValidateClusterConfigForModel). A config it accepts validates again
// after printing and parsing it back; refusals are INVALID_ARGUMENT naming
// the file.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/model_config.h"
#include "coordinator/cluster_config.h"
#include "google/protobuf/text_format.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/protobuf_quiet.h"

namespace {

const karat::ModelConfig& Preset(const char* name) {
  static const karat::ModelConfig moe = *karat::PresetConfig("dsa-tiny");
  static const karat::ModelConfig dense = *karat::PresetConfig("llama-tiny");
  return std::string(name) == "dsa-tiny" ? moe : dense;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<karat::cluster::ClusterConfig> config =
      karat::coordinator::ParseClusterConfig(text, "fuzz.textproto");
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(config.status().message().rfind("fuzz.textproto:", 0) == 0);
    return 0;
  }
  FUZZ_CHECK(karat::coordinator::ValidateClusterConfig(*config).ok());
  std::string printed;
  FUZZ_CHECK(google::protobuf::TextFormat::PrintToString(*config, &printed));
  absl::StatusOr<karat::cluster::ClusterConfig> again =
      karat::coordinator::ParseClusterConfig(printed, "printed.textproto");
  FUZZ_CHECK(again.ok());
  std::string reprinted;
  FUZZ_CHECK(google::protobuf::TextFormat::PrintToString(*again, &reprinted));
  FUZZ_CHECK(printed == reprinted);
  for (const char* model : {"dsa-tiny", "llama-tiny"}) {
    const absl::Status st = karat::coordinator::ValidateClusterConfigForModel(
        *config, Preset(model));
    FUZZ_CHECK(st.ok() || st.code() == absl::StatusCode::kInvalidArgument);
  }
  return 0;
}
