// The GPU-node half of the forward pass (DESIGN.md §2): everything that reads
// weights. Attention's KARAT half sits behind AttentionBackend, so the same
// runner drives the single-process reference engine (LocalAttentionBackend)
// and the GPU-node daemon (a backend that talks libfabric to KARAT nodes).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/attention.h"
#include "common/kv_store.h"
#include "common/sparse_attention.h"
#include "common/weights.h"

namespace karat {

// New tokens of one request in a step: positions [pos_start, pos_start + n).
// `ends_prefill`: the last token is the last of its turn's prefill (the
// next token of the session is a sampled one); methods that update their
// metadata once per turn (ClusterKV, MagicPIG) do it then, so the outputs do
// not depend on how a prefill is cut into segments.
struct Segment {
  uint64_t session = 0;
  int pos_start = 0;
  std::vector<int32_t> tokens;
  bool ends_prefill = false;
};

// One layer's attention traffic for a step, token-major over all segments
// in order (segment i's tokens start at row `offsets[i]`). For the GQA forms
// (AttnShapes.kv_heads > 0) `q` holds [q | q_i] per head (q_dim floats), `kv`
// the entry k | v | k_i in bf16 and `out` H x head_dim per token; there is no
// indexer traffic.
struct LayerTraffic {
  bool has_indexer = false;
  std::vector<int> offsets;
  std::vector<uint8_t> index_q_codes;  // N x Hi x Di
  std::vector<float> index_q_scales;   // N x Hi
  std::vector<float> index_weights;    // N x Hi
  std::vector<uint8_t> index_k_codes;  // N x Di
  std::vector<float> index_k_scales;   // N
  std::vector<float> q;                // N x H x q_dim
  std::vector<uint16_t> kv;            // N x kv_dim
  std::vector<float> out;              // N x H x out_dim (backend fills)
  // Per segment (sized by ModelRunner::Step): OK, or why the segment's
  // attention failed on its own (its session freed, its KARAT node lost,
  // its turn superseded, no answer in time). A backend that can tell one
  // segment's failure from the layer's reports it here, zeroes the
  // segment's rows of `out` and goes on with the others; it skips segments
  // that failed in an earlier layer of the step.
  std::vector<absl::Status> failed;

  IndexInputs IndexFor(int seg, const AttnShapes& s) const;
  AttnInputs AttnFor(int seg, const AttnShapes& s) const;
  float* OutFor(int seg, const AttnShapes& s);
};

// Runs the KARAT half of one layer for every segment of a step. Called once
// per layer in layer order; must fill traffic->out.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                                LayerTraffic* traffic) = 0;
};

// Called by a data-plane backend around each blocking wait for a transfer,
// on the thread that waits: a GPU rank running two micro-batches switches to
// the other micro-batch there (DESIGN.md §4, OFMS). Either may block.
//
// BeforeSend() is called before a backend sends what the computation so far
// produced (before the first send of a batch of sends): a rank that emulates
// a slower GPU waits there until that computation would have completed.
class WaitHooks {
 public:
  virtual ~WaitHooks() = default;
  virtual void BeforeWait() = 0;
  virtual void AfterWait() = 0;
  virtual void BeforeSend() {}
};

// The routed experts of one MoE layer for a step (DESIGN.md §2 step 5).
// `rows_of[e]` lists, in increasing order, the rows of `xn` (N x hidden,
// post-attention-normed) routed to expert e; the backend fills `out[e]`
// with FFN_e of those rows (rows_of[e].size() x hidden), unweighted. The
// runner combines them in increasing expert id. The default (nullptr in
// Step) computes every expert locally; gpu_node/expert_parallel.h sends the
// rows of other ranks' experts over the data plane.
struct ExpertWork {
  int layer = 0;
  int rows = 0;
  const float* xn = nullptr;
  std::vector<std::vector<int>> rows_of;
};

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;
  virtual absl::Status RunExperts(const ExpertWork& work,
                                  std::vector<std::vector<float>>* out) = 0;
};

// Where a runner sits among the GPU ranks (DESIGN.md §4): data-parallel
// attention, expert-parallel MoE. Rank r owns the routed experts
// [r * E / ranks, (r + 1) * E / ranks) (E = n_routed_experts, which must be
// a multiple of `ranks`) until ModelRunner::SetExpertOwners moves some;
// dense weights, the router and the shared expert are on every rank.
struct RunnerOptions {
  int rank = 0;
  int ranks = 1;
};

// The routed experts of one MoE layer as a step sees them
// (ModelRunner::SnapshotExperts): owner[e] of every expert and the weights
// this rank held, taken together. It keeps those weights alive, so that a
// step that routed by owners() computes the experts it planned to compute
// here even when SetExpertOwners gives some back meanwhile (a lost rank
// rejoined). Copyable; thread-safe to read.
class ExpertSnapshot {
 public:
  const std::vector<int>& owners() const { return owners_; }
  // Whether the snapshot holds expert `expert`'s weights.
  bool holds(int expert) const {
    return expert >= 0 && size_t(expert) < weights_.size() &&
           weights_[size_t(expert)] != nullptr;
  }

 private:
  friend class ModelRunner;
  int layer_ = -1;
  std::vector<int> owners_;
  std::vector<std::shared_ptr<const void>> weights_;  // by expert id
};

// Holds the packed weights. Immutable after Create but for the routed
// experts a rank holds (SetExpertOwners); Step() is thread-safe as long as
// each caller uses its own backends (attention and experts).
class ModelRunner {
 public:
  // Packs the weights; of the routed experts only the rank's own block.
  // INVALID_ARGUMENT for a missing tensor, ranks < 1, a rank outside
  // [0, ranks), or n_routed_experts not a multiple of ranks.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(
      const ModelFiles& files, const RunnerOptions& options = {});
  ~ModelRunner();
  const ModelConfig& config() const;
  const AttnShapes& shapes() const;
  int rank() const;
  int ranks() const;

  // The rank that owns routed expert `expert` (in [0, n_routed_experts)),
  // and whether it is this one. -1 / false for an id out of range.
  int ExpertOwner(int expert) const;
  bool OwnsExpert(int expert) const;
  // Whether this rank holds the expert's weights (it owns it, or it is of
  // its own block, which it always keeps).
  bool HoldsExpert(int expert) const;
  // owner[e] for every routed expert, as one consistent snapshot.
  std::vector<int> ExpertOwners() const;
  // The experts whose weights this rank holds, in increasing id.
  std::vector<int> HeldExperts() const;
  // ExpertOwners() and the weights in MoE layer `layer` of the experts this
  // rank holds, as one snapshot (no weights for a layer that is not an MoE
  // layer).
  ExpertSnapshot SnapshotExperts(int layer) const;

  // Expert ownership over the alive ranks (DESIGN.md §7, GPU node lost):
  // the experts `owners` gives this rank that it does not hold (the ones
  // SetExpertOwners needs in `files`). INVALID_ARGUMENT unless `owners` has
  // one rank in [0, ranks) per routed expert.
  absl::StatusOr<std::vector<int>> MissingExperts(
      const std::vector<int>& owners) const;
  // Installs `owners`: packs the experts it gives this rank that it does
  // not hold from `files` (their tensors: LoadExpertWeights) and releases
  // the experts beyond its own block that it no longer owns (a step still
  // computing one finishes with it). Steps may run meanwhile; a step that
  // routes to an expert another rank owns sends it there. Errors leave the
  // ownership as it was: INVALID_ARGUMENT as MissingExperts, or for a
  // tensor missing from `files`.
  absl::Status SetExpertOwners(const std::vector<int>& owners,
                               const ModelFiles& files);

  // FFN_expert of rows x[rows[0]], ..., x[rows[n-1]] (x: rows of hidden
  // floats, normed) into out[0, n) (n x hidden), exactly as Step computes
  // it locally: the bits of a row do not depend on the other rows.
  // Thread-safe; its scratch is per thread and reused. INVALID_ARGUMENT for
  // a layer that is not an MoE layer, an expert id out of range or n < 0;
  // FAILED_PRECONDITION when this rank does not hold the expert.
  absl::Status ApplyExpert(int layer, int expert, const float* x,
                           const int32_t* rows, int n, float* out) const;
  // The same with the weights `snapshot` (of `layer`) holds, whatever this
  // rank holds now: FAILED_PRECONDITION for an expert the snapshot does not
  // hold, INVALID_ARGUMENT also for a snapshot of another layer.
  absl::Status ApplyExpert(const ExpertSnapshot& snapshot, int layer,
                           int expert, const float* x, const int32_t* rows,
                           int n, float* out) const;

  // Runs one step over `segs` and returns the logits (vocab floats) of the
  // last token of each segment, in segment order. MoE layers hand their
  // routed experts to `experts` (ExpertBackend::RunExperts) and combine the
  // outputs in increasing expert id, then the shared expert; with nullptr
  // every routed expert is computed here, which needs this rank to own each
  // expert the step routes to (else FAILED_PRECONDITION).
  // Segments whose attention failed on their own (LayerTraffic::failed):
  // with `failed` null the step fails with the first such error; otherwise
  // the step goes on and `*failed` (one status per segment) says which
  // failed; their logits are then meaningless. Every row is computed on
  // its own (batch-invariant kernels), so the other segments' logits are
  // the same bits as in a step without the failed ones.
  absl::StatusOr<std::vector<std::vector<float>>> Step(
      const std::vector<Segment>& segs, AttentionBackend* backend,
      ExpertBackend* experts = nullptr,
      std::vector<absl::Status>* failed = nullptr) const;

 private:
  ModelRunner();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Attention on local session caches (the reference engine's backend and the
// building block of the KARAT node's devices).
class LocalAttentionBackend : public AttentionBackend {
 public:
  LocalAttentionBackend(const ModelConfig& config, int tokens_per_page,
                        size_t capacity_bytes);
  ~LocalAttentionBackend() override;
  // Weights the attention method needs (MagicPIG's hyperplanes); call
  // before Init().
  void SetMethodWeights(MethodWeights weights);
  // Creates the arena and, for the GQA forms, the attention method.
  absl::Status Init();
  // Ensures room for `tokens` positions of `session` (creating it).
  absl::Status Reserve(uint64_t session, int tokens);
  void Drop(uint64_t session);
  // Drops the session's positions >= `length` (TruncateSessionKv); false
  // when the method's metadata did not survive the cut and the session's
  // KV was emptied instead (to be rebuilt from position 0).
  bool Truncate(uint64_t session, int length);
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* traffic) override;
  const KvLayout& layout() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Sampling (MODEL.md): greedy (temperature <= 0) takes the highest logit,
// ties to the lower id; otherwise
// u = (splitmix64(seed ^ (0x9E3779B97F4A7C15 * (position + 1))) >> 11) * 2^-53
// and the first id whose cumulative softmax(logits / T) exceeds u.
int32_t SampleToken(const std::vector<float>& logits, float temperature,
                    uint64_t seed, int64_t position);

}  // namespace karat
