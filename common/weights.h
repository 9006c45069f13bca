// Model weights: the tensor names and shapes a config implies (MODEL.md
// "Files"), loading a model directory (config.json + model.safetensors) into
// fp32, and the deterministic generator behind `karat-weights`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace karat {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor the config requires, in a fixed order (embeddings, then per
// layer, then final norm, lm_head; `model.lsh_hyperplanes` for magicpig).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// Bytes of the weights GPU rank `rank` of `ranks` holds, as fp32 (the
// emulated GPU's weights; the host copy keeps bf16-exact matrices in half
// that, see LinearWeight): every tensor of ExpectedTensors() except the routed
// experts' ("model.layers.L.mlp.experts.E."), plus the experts of the rank's
// contiguous block [rank·E/ranks, (rank+1)·E/ranks). Expects ranks >= 1,
// 0 <= rank < ranks and n_routed_experts divisible by ranks (callers check).
int64_t RankWeightBytes(const ModelConfig& config, int rank, int ranks);

// The routed expert a tensor of ExpectedTensors() belongs to
// ("model.layers.L.mlp.experts.E."), or -1 for every other tensor.
int RoutedExpertOfTensor(const std::string& name);

// Bytes of routed expert `expert`'s tensors over every MoE layer, as fp32
// (what a GPU rank that takes the expert over holds in addition).
int64_t ExpertWeightBytes(const ModelConfig& config, int expert);

// A dense fp32 tensor, row-major.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t rows() const { return shape.empty() ? 0 : shape[0]; }
  int64_t cols() const { return shape.size() < 2 ? 1 : shape[1]; }
};

struct ModelFiles {
  ModelConfig config;
  std::map<std::string, Tensor> tensors;  // fp32 copies
  const Tensor& at(const std::string& name) const { return tensors.at(name); }
};

// Loads DIR/config.json and DIR/model.safetensors. Refuses, naming the file
// and the field/tensor: a malformed config, a truncated or corrupt
// safetensors file, a missing tensor, a tensor whose shape disagrees with the
// config. Extra tensors are ignored.
absl::StatusOr<ModelFiles> LoadModel(const std::string& model_dir);

// As LoadModel, but of the tensors only those of the routed experts in
// `experts` (a GPU rank taking over a lost rank's experts). INVALID_ARGUMENT
// for an expert id outside [0, n_routed_experts).
absl::StatusOr<ModelFiles> LoadExpertWeights(const std::string& model_dir,
                                             const std::vector<int>& experts);

// Deterministic weights for `config` from `seed` (each tensor from its own
// stream keyed by seed and name, so adding a tensor changes no other). Linear
// weights ~ N(0, 1/in); norm weights 1 + N(0, 0.02^2); LayerNorm bias
// N(0, 0.02^2); embeddings N(0, 1).
std::map<std::string, Tensor> GenerateWeights(const ModelConfig& config,
                                              uint64_t seed);

// Writes DIR/config.json and DIR/model.safetensors (creating DIR).
absl::Status WriteModel(const std::string& model_dir, const ModelConfig& config,
                        const std::map<std::string, Tensor>& tensors,
                        DType dtype);

}  // namespace karat
