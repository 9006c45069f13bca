// gqa_dense, method `dense` (MODEL.md): every token attends to every
// position up to itself. Keeps no metadata.
#include "common/sparse_attention.h"

namespace karat {
namespace {

class GqaDenseAttention final : public SparseAttention {
 public:
  explicit GqaDenseAttention(const AttnShapes& s) : SparseAttention(s) {}
  const char* name() const override { return "gqa_dense/dense"; }
  bool SparseLayer(int) const override { return false; }
  void Select(const LayerView&, int pos, const float*, const MethodLayerState*,
              std::vector<HeadSelection>* heads, KernelCost*,
              CorePool*) const override {
    SelectDense(pos, heads);
  }
};

}  // namespace

std::unique_ptr<SparseAttention> NewGqaDenseAttention(const AttnShapes& s) {
  return std::make_unique<GqaDenseAttention>(s);
}

}  // namespace karat
