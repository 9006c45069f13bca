#include "common/reference_engine.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace karat {

struct ReferenceEngine::Impl {
  ReferenceOptions options;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<LocalAttentionBackend> backend;
};

ReferenceEngine::ReferenceEngine() : impl_(new Impl) {}
ReferenceEngine::~ReferenceEngine() = default;
const ModelRunner& ReferenceEngine::runner() const { return *impl_->runner; }

absl::StatusOr<std::unique_ptr<ReferenceEngine>> ReferenceEngine::Create(
    const ModelFiles& files, const ReferenceOptions& options) {
  std::unique_ptr<ReferenceEngine> e(new ReferenceEngine());
  e->impl_->options = options;
  ASSIGN_OR_RETURN(e->impl_->runner, ModelRunner::Create(files));
  e->impl_->backend = std::make_unique<LocalAttentionBackend>(
      files.config, options.tokens_per_page, options.capacity_bytes);
  if (auto it = files.tensors.find("model.lsh_hyperplanes");
      it != files.tensors.end()) {
    e->impl_->backend->SetMethodWeights(MethodWeights{it->second.data});
  }
  RETURN_IF_ERROR(e->impl_->backend->Init());
  return e;
}

absl::StatusOr<std::vector<int32_t>> ReferenceEngine::RunTurn(
    ReferenceSession* s, const std::vector<int32_t>& prompt,
    int max_new_tokens, float temperature) {
  const ModelConfig& c = impl_->runner->config();
  if (max_new_tokens <= 0) {
    return absl::InvalidArgumentError("max_new_tokens must be > 0");
  }
  if (s->tokens.empty()) s->tokens.push_back(c.bos_token_id);
  s->tokens.insert(s->tokens.end(), prompt.begin(), prompt.end());
  std::vector<int32_t> feed(s->tokens.begin() + s->kv_len, s->tokens.end());
  if (feed.empty()) {
    return absl::InvalidArgumentError("nothing to feed: empty prompt");
  }
  RETURN_IF_ERROR(impl_->backend->Reserve(
      s->key, int(s->tokens.size()) + max_new_tokens));
  std::vector<int32_t> generated;
  const int chunk = impl_->options.prefill_chunk > 0
                        ? impl_->options.prefill_chunk
                        : static_cast<int>(feed.size());
  size_t done = 0;
  bool decoding = false;
  while (true) {
    Segment seg;
    seg.session = s->key;
    seg.pos_start = s->kv_len;
    const size_t n = std::min(feed.size() - done, size_t(chunk));
    seg.tokens.assign(feed.begin() + done, feed.begin() + done + n);
    // The prompt's last chunk ends the turn's prefill; a decode step's
    // single sampled token does not.
    seg.ends_prefill = !decoding && done + n == feed.size();
    ASSIGN_OR_RETURN(auto logits, impl_->runner->Step({seg}, impl_->backend.get()));
    s->kv_len += static_cast<int>(n);
    done += n;
    if (done < feed.size()) continue;
    const int32_t tok =
        SampleToken(logits[0], temperature, s->seed, s->kv_len);
    s->tokens.push_back(tok);
    generated.push_back(tok);
    if (tok == c.eos_token_id || int(generated.size()) >= max_new_tokens) break;
    feed.assign(1, tok);
    done = 0;
    decoding = true;
  }
  return generated;
}

}  // namespace karat
