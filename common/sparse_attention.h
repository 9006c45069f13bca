// The KARAT-device kernel interface for the GQA attention forms of MODEL.md
// ("Attention forms": gqa_block, and gqa_dense with dense, quest, magicpig,
// clusterkv). A method is one class implementing the stages it needs
// (DESIGN.md §3, requirement R4):
//
//   NewLayerState  metadata kept per session and layer next to the cache
//                  (per-page min/max, block sums, LSH codes, clusters)
//   OnAppend       update the metadata after new entries were written
//   OnPrefillEnd   update after the last token of a turn's prefill attended
//   Select         Score + Select: the positions (and logit offsets) each
//                  query head attends to
//   Attend         Gather + Attend over the selection (one shared kernel)
//
// each reporting its KernelCost. A registry maps (type, method) to the
// implementation; each method lives in its own common/attn_*.cc file.
//
// RunAttentionLayer() drives one layer of one segment through these stages;
// the KARAT-node devices and LocalAttentionBackend (the reference engine)
// call it, so both run the same code and agree bit for bit. The mla_dsa form
// keeps its own entry points (RunIndexer / RunAttention in attention.h).
//
// Every selection is a function of the session's tokens only: metadata a
// token's score reads covers only whole pages/blocks before the token's own
// (or is rebuilt only at turn boundaries), so how a prefill is cut into
// segments does not change any output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/attention.h"
#include "common/kv_store.h"
#include "common/model_config.h"

namespace karat {

class CorePool;

// Where the parts of one GQA cache entry sit (bf16 values, MakeKvLayout):
// [k: Hkv x d | v: Hkv x d | index key: Hkv x Di (gqa_block only)], as
// values of the entry a write takes (K, V, IndexKey) and as the layout's
// parts, each stored as rows of its own in a page (KPart, VPart,
// IndexKeyPart; read with LayerView::Part).
struct GqaEntry {
  static int KPart(const AttnShapes&, int g) { return g; }
  static int VPart(const AttnShapes& s, int g) { return s.kv_heads + g; }
  static int IndexKeyPart(const AttnShapes& s, int g) {
    return 2 * s.kv_heads + g;
  }
  static size_t K(const AttnShapes& s, int g) { return size_t(g) * s.head_dim; }
  static size_t V(const AttnShapes& s, int g) {
    return size_t(s.kv_heads + g) * s.head_dim;
  }
  static size_t IndexKey(const AttnShapes& s, int g) {
    return size_t(2 * s.kv_heads) * s.head_dim + size_t(g) * s.block_index_dim;
  }
};

// The positions one query head attends to for one token, increasing and
// all <= the token's position; `bias`, when not empty, holds one logit
// offset per position (MagicPIG's importance weights).
struct HeadSelection {
  std::vector<int32_t> positions;
  std::vector<float> bias;
};

// A method's metadata for one session and layer. Lives as long as the
// session's cache; not thread-safe (the cache's owner serialises access).
class MethodLayerState {
 public:
  virtual ~MethodLayerState() = default;
  // Bytes of metadata held (reported with the session's occupancy).
  virtual size_t bytes() const = 0;
};

// The metadata of every layer of one session.
struct AttentionSessionState {
  std::vector<std::unique_ptr<MethodLayerState>> layers;  // null: none
  size_t bytes() const;
};

// One attention method. Immutable after creation and thread-safe: all
// per-session data lives in MethodLayerState objects the caller owns.
class SparseAttention {
 public:
  virtual ~SparseAttention() = default;
  virtual const char* name() const = 0;
  const AttnShapes& shapes() const { return shapes_; }

  // Whether `layer` selects at all; otherwise every token attends densely
  // and the layer keeps no metadata. The gqa_dense family keeps layers 0 and
  // 1 dense (MODEL.md).
  virtual bool SparseLayer(int layer) const { return layer >= 2; }
  // Fresh metadata for a sparse layer, or null when the method keeps none.
  virtual std::unique_ptr<MethodLayerState> NewLayerState() const {
    return nullptr;
  }
  // Called after positions [pos_start, pos_start + n) were (re)written and
  // the layer's length set to pos_start + n, before any of them attends.
  virtual void OnAppend(const LayerView& view, int pos_start, int n,
                        MethodLayerState* state, KernelCost* cost) const {}
  // Called after the last token of a turn's prefill attended. `pool` (may be
  // null) lends the device's cores; the metadata must not depend on it.
  virtual void OnPrefillEnd(const LayerView& view, MethodLayerState* state,
                            KernelCost* cost, CorePool* pool) const {}
  // Whether `state` stays valid when the layer's positions >= `length` are
  // dropped and written again later (TruncateSessionKv): true for metadata
  // that OnAppend rebuilds for whatever is written (per page or block, per
  // position); false when metadata fixed at a turn's end covers dropped
  // positions (ClusterKV's clusters, MagicPIG's centring mean).
  virtual bool SurvivesTruncation(const MethodLayerState* state,
                                  int length) const {
    return true;
  }
  // Score + Select for the token at `pos` (its entry already stored) with
  // query `q` (H x q_dim floats). Fills heads[h] for every query head.
  // `pool` (may be null; RunAttentionLayer lends it for a lone token) lends
  // the device's cores; the selections must not depend on it. gqa_block
  // splits its block-sum scan over them by block range, MagicPIG its bucket
  // scan by token range, Quest by KV head, ClusterKV by query head.
  virtual void Select(const LayerView& view, int pos, const float* q,
                      const MethodLayerState* state,
                      std::vector<HeadSelection>* heads, KernelCost* cost,
                      CorePool* pool) const = 0;

  // Every position <= pos, for every head (layers that do not select).
  void SelectDense(int pos, std::vector<HeadSelection>* heads) const;
  // Gather + Attend, shared by every method: per query head h (KV head
  // g = h / (H / Hkv)) s_j = (q[h] . k_j) * d^-0.5 + bias_j over the
  // selected positions in increasing order, one softmax, o[h] = sum p_j v_j.
  // `out` receives H x d floats.
  void Attend(const LayerView& view, const float* q,
              const std::vector<HeadSelection>& heads, float* out,
              KernelCost* cost) const {
    AttendHeads(view, q, heads, 0, shapes_.heads, out, cost);
  }
  // Attend for query heads [h_begin, h_end) only (both multiples of
  // H / Hkv: whole KV groups); out's other heads are left as they are.
  // Heads are computed independently, so splitting them over cores gives
  // the same bits.
  void AttendHeads(const LayerView& view, const float* q,
                   const std::vector<HeadSelection>& heads, int h_begin,
                   int h_end, float* out, KernelCost* cost) const;

 protected:
  explicit SparseAttention(const AttnShapes& shapes) : shapes_(shapes) {}
  const AttnShapes shapes_;
};

// What a method may need besides the config: MagicPIG's
// `model.lsh_hyperplanes` [K·L, head_dim] (the only weights a KARAT node
// holds; the node loads them from its --model directory).
struct MethodWeights {
  std::vector<float> lsh_hyperplanes;
};

// Looks up (config.attention.type, config.attention.method) in the registry.
// UNIMPLEMENTED for mla_dsa (served by RunIndexer/RunAttention) and
// INVALID_ARGUMENT when a method's weights are missing or misshapen.
absl::StatusOr<std::unique_ptr<SparseAttention>> NewSparseAttention(
    const ModelConfig& config, const MethodWeights& weights);

// The weights NewSparseAttention needs for `config`, read from
// DIR/model.safetensors (nothing for methods that need none).
absl::StatusOr<MethodWeights> LoadMethodWeights(const std::string& model_dir,
                                                const ModelConfig& config);

// Fresh metadata for every layer of one session.
std::unique_ptr<AttentionSessionState> NewAttentionSessionState(
    const SparseAttention& method, int num_layers);

// One layer of one segment for the GQA forms: writes the KV entries of
// positions [pos_start, pos_start + n) (a resent position overwrites),
// updates the method's metadata, then for each token Select and Attend into
// `out` (n x H x out_dim). `ends_prefill`: the segment's last token is the
// last of its turn's prefill (ClusterKV clusters and MagicPIG fixes its
// centring mean then). `cost` (optional) accumulates what the kernels read
// and computed. With `pool` the segment's tokens are dealt over its cores
// (each token's Select and Attend only read the cache and the metadata);
// every token's result is the same whichever core computes it.
absl::Status RunAttentionLayer(const SparseAttention& method, int layer,
                               int pos_start, int n, const AttnInputs& in,
                               bool ends_prefill, SessionCache* cache,
                               AttentionSessionState* state, float* out,
                               KernelCost* cost = nullptr,
                               CorePool* pool = nullptr);

// Drops every layer's positions >= `length` of a session's cache: what a
// turn that failed or was cancelled stored beyond what the coordinator
// counts (KaratNode.Reserve kv_tokens), so that the next turn writes them
// as if it had never run. `method` and `state` are null for mla_dsa. False,
// leaving the cache as it was, when some layer's metadata does not survive
// the cut (SparseAttention::SurvivesTruncation): the caller then drops the
// session's KV and it is rebuilt from the token log.
bool TruncateSessionKv(const SparseAttention* method,
                       const AttentionSessionState* state, SessionCache* cache,
                       int num_layers, int length);

// --- Per-method factories (registry entries; one file each) ---
std::unique_ptr<SparseAttention> NewGqaDenseAttention(const AttnShapes& s);
std::unique_ptr<SparseAttention> NewGqaBlockAttention(const AttnShapes& s,
                                                      const AttentionConfig& a);
std::unique_ptr<SparseAttention> NewQuestAttention(const AttnShapes& s,
                                                   const AttentionConfig& a);
std::unique_ptr<SparseAttention> NewMagicPigAttention(
    const AttnShapes& s, const AttentionConfig& a,
    std::vector<float> hyperplanes);
std::unique_ptr<SparseAttention> NewClusterKvAttention(
    const AttnShapes& s, const AttentionConfig& a);

// --- Pieces exposed for tests (MODEL.md formulas) ---

// MagicPIG: probability that a key at angle theta from the query is
// retrieved (collides in at least two of L tables of K bits):
// p = (1 - theta/pi)^K, w = 1 - (1-p)^(L-1) (L p + 1 - p).
double MagicPigRetrievalProbability(double theta, int bits, int tables);
// Quest's upper bound of q . k over a page: sum_i max(q_i M_i, q_i m_i),
// evaluated as acc = fma(q_i, q_i >= 0 ? M_i : m_i, acc) in channel order
// from +0, which Select's kernel reproduces bit for bit (attn_quest.cc).
float QuestBound(const float* q, const float* min, const float* max, int d);

}  // namespace karat
