// karat-weights: writes DIR/config.json and DIR/model.safetensors with
// deterministic weights for a preset or a config file (MODEL.md "Files").
#include <charconv>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "common/model_config.h"
#include "common/weights.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-weights (--preset NAME | --config FILE) --seed N --out DIR "
    "[--dtype bf16|f32]\n"
    "       karat-weights --list\n"
    "\n"
    "Writes DIR/config.json and DIR/model.safetensors. Weights depend only on\n"
    "the config and the seed.\n"
    "  --preset NAME   a built-in preset (see --list)\n"
    "  --config FILE   a config.json to generate weights for instead\n"
    "  --seed N        unsigned 64-bit seed\n"
    "  --out DIR       output directory (created if missing)\n"
    "  --dtype D       storage type: bf16 (default) or f32\n"
    "  --list          print the preset names and exit\n";

struct Options {
  std::string preset;
  std::string config_file;
  bool has_seed = false;
  uint64_t seed = 0;
  std::string out;
  karat::DType dtype = karat::DType::kBF16;
};

int UsageError(const std::string& msg) {
  std::fprintf(stderr, "karat-weights: %s (see --help)\n", msg.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg == "--list") {
      for (const std::string& name : karat::PresetNames()) {
        std::printf("%s\n", name.c_str());
      }
      return 0;
    }
    // Every other flag takes a value, as "--flag VALUE" or "--flag=VALUE".
    std::string flag(arg), value;
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (flag == "--preset" || flag == "--config" || flag == "--seed" ||
               flag == "--out" || flag == "--dtype") {
      if (i + 1 >= argc) return UsageError(flag + " needs a value");
      value = argv[++i];
    }
    if (flag == "--preset") {
      opt.preset = value;
    } else if (flag == "--config") {
      opt.config_file = value;
    } else if (flag == "--seed") {
      const char* end = value.data() + value.size();
      auto [p, ec] = std::from_chars(value.data(), end, opt.seed);
      if (value.empty() || ec != std::errc() || p != end) {
        return UsageError("--seed must be an unsigned 64-bit integer, got '" +
                          value + "'");
      }
      opt.has_seed = true;
    } else if (flag == "--out") {
      opt.out = value;
    } else if (flag == "--dtype") {
      if (value == "bf16") {
        opt.dtype = karat::DType::kBF16;
      } else if (value == "f32") {
        opt.dtype = karat::DType::kF32;
      } else {
        return UsageError("--dtype must be bf16 or f32, got '" + value + "'");
      }
    } else {
      return UsageError("unknown argument '" + std::string(arg) + "'");
    }
  }
  if (opt.preset.empty() == opt.config_file.empty()) {
    return UsageError("give exactly one of --preset and --config");
  }
  if (!opt.has_seed) return UsageError("--seed is required");
  if (opt.out.empty()) return UsageError("--out is required");

  karat::ModelConfig config;
  if (!opt.preset.empty()) {
    absl::StatusOr<karat::ModelConfig> c = karat::PresetConfig(opt.preset);
    if (!c.ok()) return UsageError(std::string(c.status().message()));
    config = *c;
  } else {
    std::ifstream in(opt.config_file, std::ios::binary);
    if (!in) return UsageError("cannot open --config " + opt.config_file);
    std::ostringstream text;
    text << in.rdbuf();
    absl::StatusOr<karat::ModelConfig> c =
        karat::ParseModelConfig(text.str(), opt.config_file);
    if (!c.ok()) {
      std::fprintf(stderr, "karat-weights: %s\n",
                   std::string(c.status().message()).c_str());
      return 2;
    }
    config = *c;
  }

  const absl::Status s = karat::WriteModel(
      opt.out, config, karat::GenerateWeights(config, opt.seed), opt.dtype);
  if (!s.ok()) {
    std::fprintf(stderr, "karat-weights: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
