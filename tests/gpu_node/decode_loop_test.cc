// The GPU node's decode loop against hand-run steps: one turn through
// DecodeLoop (local attention, or the remote backend over a FakeFabric to a
// KARAT data-plane handler) must produce exactly the tokens of
// ModelRunner::Step + LocalAttentionBackend + SampleToken done by hand.
#include "gpu_node/decode_loop.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/kernel_cost.h"
#include "common/linear.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "common/weights.h"
#include "gpu_node/remote_attention.h"
#include "karat_node/data_plane.h"

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

struct Token {
  int32_t id;
  int64_t position;
  bool operator==(const Token& o) const {
    return id == o.id && position == o.position;
  }
};
std::ostream& operator<<(std::ostream& os, const Token& t) {
  return os << t.id << "@" << t.position;
}

// The turn run by hand: one prefill step, then one step per decode token.
std::vector<Token> HandRun(uint64_t session, const std::vector<int32_t>& feed,
                           int max_new, float temperature, uint64_t seed) {
  const ModelRunner& runner = Runner();
  LocalAttentionBackend local(runner.config(), 16, size_t(64) << 20);
  REQUIRE(local.Init().ok());
  REQUIRE(local.Reserve(session, 256).ok());
  auto logits = runner.Step({{session, 0, feed}}, &local);
  REQUIRE(logits.ok());
  int64_t next = int64_t(feed.size());
  std::vector<Token> out;
  int32_t tok = SampleToken((*logits)[0], temperature, seed, next);
  for (;;) {
    out.push_back({tok, next});
    if (tok == runner.config().eos_token_id || int(out.size()) == max_new) {
      break;
    }
    logits = runner.Step({{session, int(next), {tok}}}, &local);
    REQUIRE(logits.ok());
    ++next;
    tok = SampleToken((*logits)[0], temperature, seed, next);
  }
  return out;
}

// LocalAttentionBackend as the decode loop's backend. Runs on the loop
// thread, so it records failures instead of asserting.
class LocalStepBackend : public StepBackend {
 public:
  LocalStepBackend() : local_(Runner().config(), 16, size_t(64) << 20) {
    init_ = local_.Init();
  }
  void SetPlacement(uint64_t session, const cluster::KaratPlacement&,
                    uint64_t) override {
    absl::Status s = local_.Reserve(session, 256);
    if (!s.ok()) init_ = s;
  }
  // With `hold_at_step` = k, the k-th step waits for `release` before it
  // runs (so that a test can act between steps however slow its thread).
  void BeginStep() override {
    if (++steps == hold_at_step.load()) {
      while (!release.load())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::atomic<int> hold_at_step{-1};
  std::atomic<bool> release{false};
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* traffic) override {
    if (fail_with.has_value()) return *fail_with;
    max_segments = std::max(max_segments, int(segs.size()));
    if (layer == 0)
      for (const Segment& seg : segs) ends_prefill.push_back(seg.ends_prefill);
    return local_.RunLayer(layer, segs, traffic);
  }
  absl::Status init_;
  int steps = 0;
  int max_segments = 0;
  std::vector<bool> ends_prefill;  // each segment's, in step order
  std::optional<absl::Status> fail_with;

 private:
  LocalAttentionBackend local_;
};

TurnRequest MakeTurn(uint64_t session, std::vector<int32_t> feed, int max_new,
                     float temperature = 0, uint64_t seed = 0) {
  TurnRequest t;
  t.session = session;
  t.seed = seed;
  t.temperature = temperature;
  t.feed_tokens = std::move(feed);
  t.max_new_tokens = max_new;
  t.placement.set_node_id(7);
  t.placement.set_node_name("karat-0");
  t.placement.set_device(0);
  t.placement.set_fabric_address("unused");
  return t;
}

// Pops every event; returns the tokens and the turn's status, and in
// `*fed` (optional) the prefill progress reports' fed counts.
std::vector<Token> Collect(TurnStream* stream, absl::Status* status,
                           std::vector<int32_t>* fed = nullptr) {
  std::vector<Token> out;
  for (int i = 0; i < 600; ++i) {  // at most a minute
    cluster::RunTurnEvent e;
    switch (stream->Pop(absl::Milliseconds(100), &e)) {
      case TurnStream::Next::kEvent:
        if (e.progress()) {
          // Before the turn's first token, counting up, no token fields.
          CHECK(out.empty());
          CHECK(e.prefill_fed() > 0);
          CHECK(e.prefill_fed() < e.prefill_total());
          CHECK(e.token_id() == 0);
          CHECK(e.step_us() == 0);
          if (fed != nullptr) {
            if (!fed->empty()) CHECK(e.prefill_fed() > fed->back());
            fed->push_back(e.prefill_fed());
          }
          break;
        }
        out.push_back({e.token_id(), e.position()});
        CHECK(e.kv_len() == e.position());
        // The step that produced it: timed, with this request among its
        // requests; alone, its context before the step is the step's.
        CHECK(e.step_us() > 0);
        CHECK(e.step_requests() >= 1);
        CHECK(e.step_context_tokens() >= 0);
        CHECK(e.step_prefill_tokens() >= 0);
        if (e.step_requests() == 1)
          CHECK(e.step_context_tokens() < e.position());
        break;
      case TurnStream::Next::kTimeout:
        break;
      case TurnStream::Next::kFinished:
        *status = stream->status();
        return out;
    }
  }
  *status = absl::DeadlineExceededError("turn did not finish");
  return out;
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p = {256};
  for (int i = 1; i < n; ++i) p.push_back((i * 13 + salt) % 256);
  return p;
}

TEST_CASE("decode loop equals hand-run steps", "[gpu_node]") {
  const std::vector<int32_t> feed = Prompt(37, 1);
  const std::vector<Token> expected = HandRun(11, feed, 6, 0, 0);
  for (int max_step_tokens : {256, 8}) {
    INFO("max_step_tokens " << max_step_tokens);
    LocalStepBackend backend;
    REQUIRE(backend.init_.ok());
    DecodeLoopOptions options;
    options.max_step_tokens = max_step_tokens;
    DecodeLoop loop(&Runner(), &backend, options);
    loop.Start();
    auto stream = loop.Submit(MakeTurn(11, feed, 6));
    REQUIRE(stream.ok());
    absl::Status status;
    std::vector<int32_t> fed;
    const std::vector<Token> got = Collect(stream->get(), &status, &fed);
    CHECK(status.ok());
    CHECK(got == expected);
    // A feed that fits one step reports no progress; 37 tokens 8 a step
    // report each of the first four steps.
    if (max_step_tokens == 256) CHECK(fed.empty());
    if (max_step_tokens == 8) CHECK(fed == std::vector<int32_t>{8, 16, 24, 32});
    const DecodeStats stats = loop.stats();
    CHECK(stats.tokens_prefilled == feed.size());
    CHECK(stats.tokens_generated == expected.size());
    CHECK(stats.tokens_decoded == expected.size() - 1);
    CHECK(stats.steps == uint64_t(backend.steps));
    if (max_step_tokens == 8) CHECK(stats.steps > 5);
  }
}

TEST_CASE("requests batched together each match their own run", "[gpu_node]") {
  const std::vector<int32_t> f1 = Prompt(20, 2), f2 = Prompt(5, 3);
  const std::vector<Token> e1 = HandRun(1, f1, 5, 0, 0);
  const std::vector<Token> e2 = HandRun(2, f2, 7, 0.9f, 1234);
  LocalStepBackend backend;
  DecodeLoop loop(&Runner(), &backend, DecodeLoopOptions{});
  // Both queued before the loop starts: they share every step.
  auto s1 = loop.Submit(MakeTurn(1, f1, 5));
  auto s2 = loop.Submit(MakeTurn(2, f2, 7, 0.9f, 1234));
  REQUIRE(s1.ok());
  REQUIRE(s2.ok());
  loop.Start();
  absl::Status st1, st2;
  CHECK(Collect(s1->get(), &st1) == e1);
  CHECK(Collect(s2->get(), &st2) == e2);
  CHECK(st1.ok());
  CHECK(st2.ok());
  CHECK(backend.max_segments == 2);
}

TEST_CASE("cancel and failure end a turn", "[gpu_node]") {
  LocalStepBackend backend;
  DecodeLoop loop(&Runner(), &backend, DecodeLoopOptions{});
  loop.Start();
  SECTION("cancel") {
    // The second step waits until the cancel is in: a turn that ran past
    // its reserved positions first would fail otherwise.
    backend.hold_at_step = 2;
    auto s = loop.Submit(MakeTurn(3, Prompt(4, 4), 100000));
    REQUIRE(s.ok());
    cluster::RunTurnEvent e;
    while ((*s)->Pop(absl::Milliseconds(100), &e) != TurnStream::Next::kEvent) {
    }
    (*s)->Cancel();
    backend.release = true;
    absl::Status status;
    Collect(s->get(), &status);
    CHECK(status.code() == absl::StatusCode::kCancelled);
  }
  SECTION("a failed step fails the turn") {
    backend.fail_with = absl::UnavailableError("KARAT node karat-0 is gone");
    auto s = loop.Submit(MakeTurn(4, Prompt(4, 5), 3));
    REQUIRE(s.ok());
    absl::Status status;
    CHECK(Collect(s->get(), &status).empty());
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK(loop.stats().failed_steps == 1);
  }
  SECTION("stop ends queued and running turns") {
    auto s = loop.Submit(MakeTurn(5, Prompt(4, 6), 100000));
    REQUIRE(s.ok());
    loop.Stop();
    absl::Status status;
    Collect(s->get(), &status);
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK(loop.Submit(MakeTurn(6, Prompt(4, 6), 1)).status().code() ==
          absl::StatusCode::kUnavailable);
  }
}

// The whole data path in one process: DecodeLoop -> RemoteAttentionBackend
// -> FakeFabric -> DataPlaneHandler (KARAT devices) and back.
struct RemoteFixture {
  explicit RemoteFixture(absl::Duration timeout = absl::Seconds(10),
                         int max_step_tokens = 16) {
    karat_ep = fabric.NewEndpoint("karat");
    gpu_ep = fabric.NewEndpoint("gpu");
    DataPlaneOptions options;
    options.tokens_per_page = 16;
    options.devices = {DeviceOptions{size_t(8) << 20, 1},
                       DeviceOptions{size_t(8) << 20, 1}};
    auto h =
        DataPlaneHandler::Create(Runner().config(), options, karat_ep.get());
    REQUIRE(h.ok());
    handler = std::move(h).value();
    handler->set_node_id(7);
    RemoteAttentionOptions remote;
    remote.timeout = timeout;
    backend = std::make_unique<RemoteAttentionBackend>(Runner().shapes(),
                                                       gpu_ep.get(), remote);
    backend->set_node_id(3);
    DecodeLoopOptions loop_options;
    loop_options.max_step_tokens = max_step_tokens;
    loop = std::make_unique<DecodeLoop>(&Runner(), backend.get(), loop_options);
    loop->Start();
  }
  ~RemoteFixture() {
    backend->Abort();
    loop->Stop();
    handler->Stop();
    gpu_ep->Shutdown();
    karat_ep->Shutdown();
  }
  TurnRequest Turn(uint64_t session, std::vector<int32_t> feed, int max_new,
                   int device, float temperature = 0, uint64_t seed = 0) {
    TurnRequest t =
        MakeTurn(session, std::move(feed), max_new, temperature, seed);
    t.placement.set_fabric_address(karat_ep->LocalAddress());
    t.placement.set_device(device);
    return t;
  }

  FakeFabric fabric;
  std::unique_ptr<Transport> karat_ep, gpu_ep;
  std::unique_ptr<DataPlaneHandler> handler;
  std::unique_ptr<RemoteAttentionBackend> backend;
  std::unique_ptr<DecodeLoop> loop;
};

TEST_CASE("remote attention over the data plane equals hand-run steps",
          "[gpu_node]") {
  const std::vector<int32_t> f1 = Prompt(45, 7), f2 = Prompt(6, 8);
  const std::vector<Token> e1 = HandRun(21, f1, 5, 0, 0);
  const std::vector<Token> e2 = HandRun(22, f2, 5, 0.7f, 99);
  RemoteFixture fx;
  REQUIRE(fx.handler->Reserve(21, 0, 64).ok());
  REQUIRE(fx.handler->Reserve(22, 1, 64).ok());
  auto s1 = fx.loop->Submit(fx.Turn(21, f1, 5, 0));
  auto s2 = fx.loop->Submit(fx.Turn(22, f2, 5, 1, 0.7f, 99));
  absl::Status st1, st2;
  CHECK(Collect(s1->get(), &st1) == e1);
  CHECK(Collect(s2->get(), &st2) == e2);
  CHECK(st1.ok());
  CHECK(st2.ok());
  CHECK(fx.backend->bytes_sent() > 0);
  CHECK(fx.backend->bytes_received() > 0);
  const auto c = fx.handler->Counters();
  CHECK(c.at("errors") == 0);
  CHECK(c.at("kv_bytes_ingested") > 0);
}

// A prefill in one step: its kAttnQKV and kAttnOut frames are past
// kSharedSendMinBytes, so both sides send them with SendShared().
TEST_CASE("remote attention with large frames equals hand-run steps",
          "[gpu_node]") {
  const std::vector<int32_t> feed = Prompt(120, 5);
  const AttnShapes& s = Runner().shapes();
  REQUIRE(feed.size() * size_t(s.heads) * size_t(s.q_dim) * sizeof(float) >=
          kSharedSendMinBytes);
  REQUIRE(feed.size() * size_t(s.heads) * size_t(s.out_dim) * sizeof(float) >=
          kSharedSendMinBytes);
  const std::vector<Token> expected = HandRun(41, feed, 4, 0, 0);
  RemoteFixture fx(absl::Seconds(10), /*max_step_tokens=*/128);
  REQUIRE(fx.handler->Reserve(41, 0, 128).ok());
  auto stream = fx.loop->Submit(fx.Turn(41, feed, 4, 0));
  absl::Status status;
  CHECK(Collect(stream->get(), &status) == expected);
  CHECK(status.ok());
  CHECK(fx.handler->Counters().at("errors") == 0);
}

TEST_CASE("remote attention errors reach the turn", "[gpu_node]") {
  SECTION("session unknown to the KARAT node") {
    RemoteFixture fx;
    auto s = fx.loop->Submit(fx.Turn(31, Prompt(4, 9), 3, 0));
    absl::Status status;
    CHECK(Collect(s->get(), &status).empty());
    CHECK(status.code() == absl::StatusCode::kNotFound);
    CHECK(std::string(status.message()).find("31") != std::string::npos);
  }
  SECTION("KARAT node that never answers") {
    RemoteFixture fx(absl::Milliseconds(200));
    auto silent = fx.fabric.NewEndpoint("silent");
    silent->SetReceiveHandler([](std::string_view) {});
    TurnRequest t = fx.Turn(32, Prompt(4, 9), 3, 0);
    t.placement.set_fabric_address(silent->LocalAddress());
    auto s = fx.loop->Submit(t);
    absl::Status status;
    CHECK(Collect(s->get(), &status).empty());
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK(std::string(status.message()).find("karat-0") != std::string::npos);
    silent->Shutdown();
  }
}

// A backend whose layers "wait on a transfer": it calls the micro-batch's
// wait hooks around the attention, as the data-plane backends do, so the
// worker token hands the rank to the other micro-batch there.
class TransferStepBackend : public LocalStepBackend {
 public:
  class View : public AttentionBackend {
   public:
    View(TransferStepBackend* owner, WaitHooks* hooks)
        : owner_(owner), hooks_(hooks) {}
    absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                          LayerTraffic* traffic) override {
      if (hooks_ != nullptr) {
        hooks_->BeforeSend();
        hooks_->BeforeWait();
      }
      absl::Status s;
      {
        absl::MutexLock lock(&owner_->mu_);
        s = owner_->LocalStepBackend::RunLayer(layer, segs, traffic);
      }
      if (hooks_ != nullptr) hooks_->AfterWait();
      return s;
    }

   private:
    TransferStepBackend* const owner_;
    WaitHooks* const hooks_;
  };
  AttentionBackend* ForMicroBatch(int mb, WaitHooks* hooks) override {
    views_[mb] = std::make_unique<View>(this, hooks);
    return views_[mb].get();
  }

 private:
  absl::Mutex mu_;
  std::unique_ptr<View> views_[2];
};

TEST_CASE("two micro-batches: every request keeps its own tokens",
          "[gpu_node]") {
  for (Schedule schedule : {Schedule::kOfms, Schedule::kScms}) {
    INFO("schedule " << ScheduleName(schedule));
    TransferStepBackend backend;
    REQUIRE(backend.init_.ok());
    DecodeLoopOptions options;
    options.micro_batches = 2;
    options.schedule = schedule;
    options.max_step_tokens = 16;
    DecodeLoop loop(&Runner(), &backend, options);
    std::vector<std::vector<Token>> expected;
    std::vector<std::shared_ptr<TurnStream>> streams;
    for (int i = 0; i < 4; ++i) {
      const std::vector<int32_t> feed = Prompt(9 + 7 * i, 20 + i);
      const float temperature = i % 2 ? 0.8f : 0.0f;
      expected.push_back(HandRun(40 + i, feed, 6, temperature, 77 + i));
      TurnRequest turn = MakeTurn(40 + i, feed, 6, temperature, 77 + i);
      turn.micro_batch = i % 2;
      auto s = loop.Submit(turn);
      REQUIRE(s.ok());
      streams.push_back(*s);
    }
    loop.Start();
    // Once the turns run, one session moves to the other micro-batch (and
    // an unknown session is ignored).
    cluster::RunTurnEvent first;
    while (streams[0]->Pop(absl::Milliseconds(100), &first) !=
           TurnStream::Next::kEvent) {
    }
    loop.SetMicroBatches({{43, 0}, {999, 1}});
    absl::Status status0;
    std::vector<Token> got0 = {{first.token_id(), first.position()}};
    for (const Token& t : Collect(streams[0].get(), &status0)) {
      got0.push_back(t);
    }
    CHECK(got0 == expected[0]);
    CHECK(status0.ok());
    for (int i = 1; i < 4; ++i) {
      absl::Status status;
      CHECK(Collect(streams[i].get(), &status) == expected[i]);
      CHECK(status.ok());
    }
    const DecodeStats stats = loop.stats();
    CHECK(stats.two_micro_batch_steps > 0);
    CHECK(stats.micro_batch_tokens[0] > 0);
    CHECK(stats.micro_batch_tokens[1] > 0);
    CHECK(stats.switches > 0);
    CHECK(stats.busy_seconds > 0);
  }
}

TEST_CASE("a turn fed with earlier turns' boundaries cuts its prefill there",
          "[gpu_node]") {
  // The rebuild of a two-turn history in one feed gives the same tokens as
  // running it turn by turn (ends_prefill reaches the backend at each cut).
  const std::vector<int32_t> feed = Prompt(30, 5);
  const std::vector<Token> expected = HandRun(60, feed, 4, 0, 0);
  LocalStepBackend backend;
  DecodeLoopOptions options;
  options.max_step_tokens = 64;
  DecodeLoop loop(&Runner(), &backend, options);
  loop.Start();
  TurnRequest turn = MakeTurn(60, feed, 4);
  turn.prefill_ends = {12, 30};
  auto s = loop.Submit(turn);
  REQUIRE(s.ok());
  absl::Status status;
  CHECK(Collect(s->get(), &status) == expected);
  CHECK(status.ok());
  // 12 + 18 tokens of prefill in two steps, then 3 decode steps.
  CHECK(loop.stats().steps == 5);
}

TEST_CASE("a resumed decode's feed does not end a prefill", "[gpu_node]") {
  // The same tokens as the turn that was cut after its first token; only
  // the per-turn marker differs.
  const std::vector<int32_t> prompt = Prompt(20, 3);
  const std::vector<Token> whole = HandRun(61, prompt, 4, 0, 0);
  LocalStepBackend backend;
  DecodeLoopOptions options;
  options.max_step_tokens = 64;
  DecodeLoop loop(&Runner(), &backend, options);
  loop.Start();
  absl::Status status;
  auto first = loop.Submit(MakeTurn(61, prompt, 1));
  REQUIRE(first.ok());
  CHECK(Collect(first->get(), &status) == std::vector<Token>{whole[0]});
  CHECK(status.ok());
  TurnRequest rest = MakeTurn(61, {whole[0].id}, 3);
  rest.pos_start = int(prompt.size());
  rest.feed_ends_prefill = false;
  auto resumed = loop.Submit(rest);
  REQUIRE(resumed.ok());
  CHECK(Collect(resumed->get(), &status) ==
        std::vector<Token>(whole.begin() + 1, whole.end()));
  CHECK(status.ok());
  CHECK(backend.ends_prefill == std::vector<bool>{true, false, false, false});
  cluster::RunTurnRequest proto;
  proto.set_resumed_decode(true);
  CHECK_FALSE(TurnRequestFromProto(proto).feed_ends_prefill);
  CHECK(TurnRequestFromProto(cluster::RunTurnRequest()).feed_ends_prefill);
}

TEST_CASE("worker token: SCMS keeps the static order, OFMS runs who is ready",
          "[gpu_node]") {
  for (Schedule schedule : {Schedule::kOfms, Schedule::kScms}) {
    INFO("schedule " << ScheduleName(schedule));
    WorkerToken token(schedule);
    token.BeginStep(2);
    absl::Mutex mu;
    std::vector<std::string> order;
    auto log = [&](const char* what) {
      absl::MutexLock lock(&mu);
      order.push_back(what);
    };
    // µB0 computes, waits on a transfer, and wants the worker back before
    // µB1 has even started.
    token.Begin(0);
    token.Release(0);
    std::thread first([&] {
      token.Acquire(0);
      log("mb0");
      token.End(0);
    });
    if (schedule == Schedule::kOfms) first.join();  // it needs nobody
    std::thread second([&] {
      token.Begin(1);
      log("mb1");
      token.End(1);
    });
    if (first.joinable()) first.join();
    second.join();
    const std::vector<std::string> want =
        schedule == Schedule::kOfms ? std::vector<std::string>{"mb0", "mb1"}
                                    : std::vector<std::string>{"mb1", "mb0"};
    CHECK(order == want);
    CHECK(ParseSchedule(ScheduleName(schedule)).value() == schedule);
  }
  CHECK(!ParseSchedule("fifo").ok());
}

TEST_CASE("worker token: the expert service takes turns on the worker",
          "[gpu_node]") {
  WorkerToken token(Schedule::kOfms);
  // Between steps the token is free: the service takes it at once, and its
  // time counts as busy.
  token.AcquireService();
  absl::SleepFor(absl::Milliseconds(5));
  token.ReleaseService();
  CHECK(token.busy_seconds() > 0);
  CHECK(token.stalled_seconds() == 0);

  // Within a step it waits for the micro-batch to let go, and goes ahead of
  // that micro-batch when it wants the token back.
  token.BeginStep(1);
  token.Begin(0);
  absl::Mutex mu;
  std::vector<std::string> order;
  auto log = [&](const char* what) {
    absl::MutexLock lock(&mu);
    order.push_back(what);
  };
  std::atomic<bool> serving{false};
  std::thread service([&] {
    token.AcquireService();
    serving = true;
    log("service");
    absl::SleepFor(absl::Milliseconds(20));
    token.ReleaseService();
  });
  absl::SleepFor(absl::Milliseconds(20));
  CHECK(!serving);   // the micro-batch holds the token
  token.Release(0);  // a transfer: the service runs now
  while (!serving) absl::SleepFor(absl::Milliseconds(1));
  token.Acquire(0);  // waits for the service
  log("mb0");
  service.join();
  token.End(0);
  CHECK(order == std::vector<std::string>{"service", "mb0"});

  // A step that begins while the service holds the token does not take it
  // from the service.
  token.AcquireService();
  token.BeginStep(1);
  std::atomic<bool> began{false};
  std::thread step([&] {
    token.Begin(0);
    began = true;
    token.End(0);
  });
  absl::SleepFor(absl::Milliseconds(20));
  CHECK(!began);
  token.ReleaseService();
  step.join();
  CHECK(began);
}

TEST_CASE("linear layers charge their cost to the thread's meter",
          "[gpu_node]") {
  const int out = 40, in = 70, rows = 3;
  std::vector<float> w(size_t(out) * in, 0.5f), x(size_t(rows) * in, 1.0f),
      y(size_t(rows) * out);
  const LinearWeight lin(w.data(), out, in);
  CHECK(CurrentKernelMeter() == nullptr);
  lin.Apply(x.data(), rows, y.data());  // no meter: nothing to count
  KernelCost cost;
  SetKernelMeter(&cost);
  lin.Apply(x.data(), rows, y.data());
  // Another thread's computation is not this thread's.
  std::thread([&] { lin.Apply(x.data(), rows, y.data()); }).join();
  SetKernelMeter(nullptr);
  lin.Apply(x.data(), rows, y.data());
  CHECK(cost.flops == 2.0 * rows * out * in);
  // The emulated GPU's fp32 weights, whichever form the host copy keeps
  // (0.5 is a bf16 value: kept as bf16), and the rows in and out.
  REQUIRE(lin.bf16());
  CHECK(cost.bytes == 4.0 * (double(out) * in + double(rows) * (in + out)));
  const LinearWeight lin32(w.data(), out, in, LinearWeight::Storage::kFp32);
  KernelCost cost32;
  SetKernelMeter(&cost32);
  lin32.Apply(x.data(), rows, y.data());
  SetKernelMeter(nullptr);
  CHECK(cost32.bytes == cost.bytes);
  CHECK(RooflineSeconds({2e9, 3e12}, 1, 1) == 3.0);
  CHECK(RooflineSeconds({2e9, 3e12}, 1, 0) == 2.0);
  CHECK(RooflineSeconds({2e9, 3e12}, 0, 0) == 0.0);
}

TEST_CASE("worker token: the timing model paces each operation", "[gpu_node]") {
  // 1 GB/s: 1e7 bytes are 10 ms of the emulated GPU.
  WorkerToken token(Schedule::kOfms, GpuTiming{1.0, 0});
  token.BeginStep(1);
  token.Begin(0);
  REQUIRE(CurrentKernelMeter() != nullptr);
  ChargeKernelCost(2e7, 1e9);
  token.Pace(0);  // before a send: 20 ms since Begin, the token kept
  CHECK(token.model_seconds() == Approx(0.02));
  CHECK(token.model_wait_seconds() > 0);
  CHECK(token.busy_seconds() == 0);  // still held
  ChargeKernelCost(1e7, 0);
  token.Release(0);  // the whole operation: 30 ms since Begin
  CHECK(CurrentKernelMeter() == nullptr);
  CHECK(token.model_seconds() == Approx(0.03));
  // Lower bounds only: the worker was busy at least the modelled time.
  CHECK(token.busy_seconds() >= 0.03 - 1e-6);
  const double wait = token.model_wait_seconds();
  CHECK(wait > 0);
  CHECK(wait <= token.busy_seconds());
  ChargeKernelCost(1e9, 0);  // not holding: not counted
  // A new operation starts from zero; one that computed nothing is not
  // paced.
  token.Acquire(0);
  token.End(0);
  CHECK(token.model_seconds() == Approx(0.03));
  CHECK(token.model_wait_seconds() == wait);
  // The expert service's computation is paced the same way.
  std::thread service([&] {
    token.AcquireService();
    ChargeKernelCost(1e7, 0);
    token.ReleaseService();
    CHECK(CurrentKernelMeter() == nullptr);
  });
  service.join();
  CHECK(token.model_seconds() == Approx(0.04));
  CHECK(token.busy_seconds() >= 0.04 - 1e-6);
  CHECK(token.model_wait_seconds() > wait);

  // Off by default: no meter, no pacing.
  WorkerToken plain(Schedule::kOfms);
  plain.BeginStep(1);
  plain.Begin(0);
  CHECK(CurrentKernelMeter() == nullptr);
  plain.End(0);
  CHECK(plain.model_seconds() == 0);
  CHECK(plain.model_wait_seconds() == 0);
}

TEST_CASE("timing model: the tokens are the same, the operations paced",
          "[gpu_node]") {
  for (Schedule schedule : {Schedule::kOfms, Schedule::kScms}) {
    INFO("schedule " << ScheduleName(schedule));
    TransferStepBackend backend;
    REQUIRE(backend.init_.ok());
    DecodeLoopOptions options;
    options.micro_batches = 2;
    options.schedule = schedule;
    options.max_step_tokens = 16;
    // Slow enough that every operation waits out part of its time, also in
    // the sanitized builds on a loaded machine.
    options.timing.bandwidth_gbps = 0.2;
    options.timing.tflops = 0.0001;
    DecodeLoop loop(&Runner(), &backend, options);
    std::vector<std::vector<Token>> expected;
    std::vector<std::shared_ptr<TurnStream>> streams;
    for (int i = 0; i < 2; ++i) {
      const std::vector<int32_t> feed = Prompt(11 + 5 * i, 30 + i);
      const float temperature = i % 2 ? 0.8f : 0.0f;
      expected.push_back(HandRun(70 + i, feed, 4, temperature, 5 + i));
      TurnRequest turn = MakeTurn(70 + i, feed, 4, temperature, 5 + i);
      turn.micro_batch = i % 2;
      auto s = loop.Submit(turn);
      REQUIRE(s.ok());
      streams.push_back(*s);
    }
    loop.Start();
    for (int i = 0; i < 2; ++i) {
      absl::Status status;
      CHECK(Collect(streams[i].get(), &status) == expected[i]);
      CHECK(status.ok());
    }
    const DecodeStats stats = loop.stats();
    CHECK(stats.two_micro_batch_steps > 0);
    CHECK(stats.model_seconds > 0);
    CHECK(stats.model_wait_seconds > 0);
    CHECK(stats.busy_seconds >= stats.model_seconds - 1e-6);
    CHECK(stats.busy_seconds >= stats.model_wait_seconds);
  }
}

}  // namespace
}  // namespace karat
