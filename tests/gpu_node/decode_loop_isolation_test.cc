// A request whose attention segment fails on its own (LayerTraffic::failed:
// its session freed, its KARAT node lost, no answer in time) fails alone:
// its turn ends with the error, and the other turns of the same steps go on
// with exactly the tokens they get without it. A backend that fails a
// whole layer still fails the whole step. With one micro-batch and with
// two.
#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/weights.h"
#include "gpu_node/decode_loop.h"

namespace karat {
namespace {

const ModelRunner& Runner() {
  static const ModelRunner* runner = [] {
    ModelFiles files;
    files.config = *PresetConfig("dsa-small");
    files.tensors = GenerateWeights(files.config, 1);
    auto r = ModelRunner::Create(files);
    REQUIRE(r.ok());
    return r->release();
  }();
  return *runner;
}

// LocalAttentionBackend as a decode loop's backend that fails on purpose:
// at step `fail_step` (counted from 1 by BeginStep), layer `fail_layer`,
// either session `fail_session`'s segment alone (reported in
// LayerTraffic::failed, its rows zeroed, as the remote backend does) or,
// with `whole_layer`, the layer. Both micro-batches' layers run under one
// mutex, around the wait hooks, as a data-plane backend's would.
class FailingBackend : public StepBackend {
 public:
  FailingBackend() : local_(Runner().config(), 16, size_t(64) << 20) {
    REQUIRE(local_.Init().ok());
  }
  void SetPlacement(uint64_t session, const cluster::KaratPlacement&,
                    uint64_t) override {
    absl::MutexLock lock(&mu_);
    if (!local_.Reserve(session, 256).ok()) ++errors_;
  }
  void ClearPlacement(uint64_t session) override {
    absl::MutexLock lock(&mu_);
    cleared_.push_back(session);
  }
  void BeginStep() override {
    absl::MutexLock lock(&mu_);
    ++steps_;
  }
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* traffic) override {
    absl::MutexLock lock(&mu_);
    const bool here = steps_ == fail_step && layer == fail_layer;
    if (here && whole_layer) return fail_with;
    const bool isolate = traffic->failed.size() == segs.size();
    for (size_t i = 0; here && i < segs.size(); ++i) {
      if (segs[i].session != fail_session) continue;
      if (!isolate) return fail_with;  // the caller cannot tell them apart
      traffic->failed[i] = fail_with;
      ++injected_;
    }
    // The local backend skips the failed segment (this layer and later).
    absl::Status st = local_.RunLayer(layer, segs, traffic);
    const AttnShapes& s = Runner().shapes();
    for (size_t i = 0; isolate && i < segs.size(); ++i) {
      if (traffic->failed[i].ok()) continue;
      float* out = traffic->OutFor(int(i), s);
      std::fill(out, out + segs[i].tokens.size() * s.heads * s.out_dim, 0.0f);
    }
    return st;
  }
  AttentionBackend* ForMicroBatch(int mb, WaitHooks* hooks) override {
    views_[mb] = std::make_unique<View>(this, hooks);
    return views_[mb].get();
  }

  uint64_t fail_session = 0;
  int fail_step = -1;
  int fail_layer = -1;
  bool whole_layer = false;
  absl::Status fail_with =
      absl::UnavailableError("KARAT node karat-1 is lost: test");

  int injected() {
    absl::MutexLock lock(&mu_);
    return injected_;
  }
  std::vector<uint64_t> cleared() {
    absl::MutexLock lock(&mu_);
    return cleared_;
  }
  int errors() {
    absl::MutexLock lock(&mu_);
    return errors_;
  }

 private:
  class View : public AttentionBackend {
   public:
    View(FailingBackend* owner, WaitHooks* hooks)
        : owner_(owner), hooks_(hooks) {}
    absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                          LayerTraffic* traffic) override {
      if (hooks_ != nullptr) {
        hooks_->BeforeSend();
        hooks_->BeforeWait();
      }
      absl::Status s = owner_->RunLayer(layer, segs, traffic);
      if (hooks_ != nullptr) hooks_->AfterWait();
      return s;
    }

   private:
    FailingBackend* const owner_;
    WaitHooks* const hooks_;
  };

  absl::Mutex mu_;
  LocalAttentionBackend local_ ABSL_GUARDED_BY(mu_);
  int steps_ ABSL_GUARDED_BY(mu_) = 0;
  int injected_ ABSL_GUARDED_BY(mu_) = 0;
  int errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> cleared_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<View> views_[2];
};

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p = {256};
  for (int i = 1; i < n; ++i) p.push_back((i * 17 + salt * 5) % 256);
  return p;
}

struct Spec {
  uint64_t session;
  int prompt;
  float temperature;
  int micro_batch;
};
// Three turns; session 2 is the one that fails.
const Spec kTurns[] = {{1, 20, 0.0f, 0}, {2, 9, 0.8f, 1}, {3, 14, 0.0f, 1}};

TurnRequest MakeTurn(const Spec& spec) {
  TurnRequest t;
  t.session = spec.session;
  t.seed = 100 + spec.session;
  t.temperature = spec.temperature;
  t.feed_tokens = Prompt(spec.prompt, int(spec.session));
  t.max_new_tokens = 6;
  t.micro_batch = spec.micro_batch;
  t.placement.set_node_id(7);
  t.placement.set_device(0);
  t.placement.set_fabric_address("unused");
  return t;
}

struct Outcome {
  std::vector<std::pair<int32_t, int64_t>> tokens;  // id, position
  absl::Status status = absl::DeadlineExceededError("turn did not finish");
};

Outcome Collect(TurnStream* stream) {
  Outcome o;
  for (int i = 0; i < 600; ++i) {  // at most a minute
    cluster::RunTurnEvent e;
    switch (stream->Pop(absl::Milliseconds(100), &e)) {
      case TurnStream::Next::kEvent:
        if (!e.progress()) o.tokens.push_back({e.token_id(), e.position()});
        break;
      case TurnStream::Next::kTimeout:
        break;
      case TurnStream::Next::kFinished:
        o.status = stream->status();
        return o;
    }
  }
  return o;
}

// Runs the turns of `sessions` in one DecodeLoop, all queued before it
// starts (so that they share their steps).
std::map<uint64_t, Outcome> Run(FailingBackend* backend, int micro_batches,
                                const std::vector<uint64_t>& sessions,
                                DecodeStats* stats = nullptr) {
  DecodeLoopOptions options;
  options.micro_batches = micro_batches;
  // Step 1: the prompts of sessions 1 and 2 and 3 tokens of session 3's;
  // step 2: the rest of it. Session 2 samples its k-th token in step k.
  options.max_step_tokens = 32;
  DecodeLoop loop(&Runner(), backend, options);
  std::map<uint64_t, std::shared_ptr<TurnStream>> streams;
  for (const Spec& spec : kTurns) {
    if (std::find(sessions.begin(), sessions.end(), spec.session) ==
        sessions.end())
      continue;
    auto s = loop.Submit(MakeTurn(spec));
    REQUIRE(s.ok());
    streams[spec.session] = *s;
  }
  loop.Start();
  std::map<uint64_t, Outcome> out;
  for (auto& [session, stream] : streams) out[session] = Collect(stream.get());
  if (stats != nullptr) *stats = loop.stats();
  return out;
}

TEST_CASE(
    "a request whose segment failed fails alone; the step's others keep "
    "their tokens",
    "[gpu_node]") {
  const int micro_batches = GENERATE(1, 2);
  // In a prefill step (step 1: every session's first chunk) or a decode
  // step of session 2 (its prompt is done after step 1, it samples from
  // step 1 on; step 4 is its fourth token).
  const auto [step, layer] =
      GENERATE(std::pair<int, int>{1, 2}, std::pair<int, int>{4, 1});
  INFO("micro-batches " << micro_batches << ", failure at step " << step
                        << " layer " << layer);

  FailingBackend clean_all, clean_others;
  const auto all = Run(&clean_all, micro_batches, {1, 2, 3});
  const auto others = Run(&clean_others, micro_batches, {1, 3});
  for (const auto& [session, o] : all) REQUIRE(o.status.ok());
  for (const auto& [session, o] : others) REQUIRE(o.status.ok());
  REQUIRE(all.at(2).tokens.size() == 6);

  FailingBackend backend;
  backend.fail_session = 2;
  backend.fail_step = step;
  backend.fail_layer = layer;
  DecodeStats stats;
  const auto got = Run(&backend, micro_batches, {1, 2, 3}, &stats);
  CHECK(backend.injected() == 1);
  CHECK(backend.errors() == 0);
  // Sessions 1 and 3 shared steps with the failure and never noticed.
  for (uint64_t session : {1, 3}) {
    INFO("session " << session);
    CHECK(got.at(session).status.ok());
    CHECK(got.at(session).tokens == others.at(session).tokens);
  }
  // Session 2 got the tokens of the steps before, then the error.
  const Outcome& failed = got.at(2);
  CHECK(failed.status == backend.fail_with);
  const size_t before = step == 1 ? 0 : size_t(step - 1);
  REQUIRE(failed.tokens.size() == before);
  CHECK(std::equal(failed.tokens.begin(), failed.tokens.end(),
                   all.at(2).tokens.begin()));
  CHECK(stats.failed_steps == 0);
  CHECK(stats.failed_requests == 1);
  // Its session left the batch (the backend was told once), as the others
  // did when they ended.
  const std::vector<uint64_t> cleared = backend.cleared();
  CHECK(std::count(cleared.begin(), cleared.end(), 2) == 1);
  CHECK(cleared.size() == 3);
}

TEST_CASE("a backend that fails the whole layer still fails the whole step",
          "[gpu_node]") {
  const int micro_batches = GENERATE(1, 2);
  INFO("micro-batches " << micro_batches);
  FailingBackend clean;
  const auto all = Run(&clean, micro_batches, {1, 2, 3});
  FailingBackend backend;
  backend.whole_layer = true;
  backend.fail_step = 4;  // every request decodes by then
  backend.fail_layer = 0;
  backend.fail_with = absl::InternalError("the layer broke");
  DecodeStats stats;
  const auto got = Run(&backend, micro_batches, {1, 2, 3}, &stats);
  for (const auto& [session, o] : got) {
    INFO("session " << session);
    CHECK(o.status == backend.fail_with);
    // The tokens of the steps before, then nothing.
    REQUIRE(o.tokens.size() <= all.at(session).tokens.size());
    CHECK(std::equal(o.tokens.begin(), o.tokens.end(),
                     all.at(session).tokens.begin()));
    CHECK(o.tokens.size() < all.at(session).tokens.size());
  }
  CHECK(stats.failed_steps == 1);
  CHECK(stats.failed_requests == 3);
}

}  // namespace
}  // namespace karat
