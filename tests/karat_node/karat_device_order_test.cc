// A KARAT device applies a session's frames once and in order
// (karat_node/frame_order.h), whatever a lossy link makes of them: repeats
// of the last attention frame are answered again with the same bits and
// store nothing, stale copies are skipped and change nothing, an attention
// frame whose index keys were lost is refused ABORTED until both come
// again, frames of a fenced-off turn are refused, and Reserve(kv_tokens)
// leaves the session as if a failed turn had never written past the cut
// (or drops its KV when a method's turn-end metadata covers the cut, and
// the rebuild from position 0 gives the clean outputs).
//
// The frames are those a GPU node sends: the traffic of real ModelRunner
// steps, recorded with the outputs LocalAttentionBackend computed for it
// (the "clean run" every device output is compared with, bit for bit).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/frame.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/sparse_attention.h"
#include "common/status_macros.h"
#include "common/weights.h"
#include "karat_node/karat_device.h"

namespace karat {
namespace {

constexpr int kTokensPerPage = 16;

struct Model {
  ModelFiles files;
  std::unique_ptr<ModelRunner> runner;
  MethodWeights weights;  // MagicPIG's hyperplanes
  std::shared_ptr<const SparseAttention> method;  // null for mla_dsa
};

// The preset with generated weights; `index_reuse_freq` > 0 overrides the
// preset's (mla_dsa: layers without an indexer of their own).
const Model& GetModel(const std::string& preset, int index_reuse_freq = 0) {
  static auto* cache = new std::map<std::string, std::unique_ptr<Model>>();
  const std::string key = absl::StrCat(preset, "/", index_reuse_freq);
  auto it = cache->find(key);
  if (it != cache->end()) return *it->second;
  auto m = std::make_unique<Model>();
  auto config = PresetConfig(preset);
  REQUIRE(config.ok());
  m->files.config = *config;
  if (index_reuse_freq > 0) m->files.config.index_reuse_freq = index_reuse_freq;
  m->files.tensors = GenerateWeights(m->files.config, 1);
  if (auto t = m->files.tensors.find("model.lsh_hyperplanes");
      t != m->files.tensors.end()) {
    m->weights.lsh_hyperplanes = t->second.data;
  }
  auto runner = ModelRunner::Create(m->files);
  REQUIRE(runner.ok());
  m->runner = std::move(*runner);
  if (m->files.config.attention.type != AttentionType::kMlaDsa) {
    auto method = NewSparseAttention(m->files.config, m->weights);
    REQUIRE(method.ok());
    m->method = std::move(*method);
  }
  return *cache->emplace(key, std::move(m)).first->second;
}

// One segment of one layer as a GPU node sends it, and the output the
// reference computed for it.
struct SegWork {
  int step = 0;  // index of the step in its script
  int layer = 0;
  uint64_t session = 0;
  int pos = 0;
  int n = 0;
  std::vector<std::string> index;  // kIndexQK sections; empty: none
  std::vector<std::string> attention;
  std::vector<float> want;

  std::string Frame(FrameType type, uint64_t turn) const {
    FrameHeader h;
    h.type = static_cast<uint16_t>(type);
    h.layer = uint32_t(layer);
    h.session = session;
    h.turn = turn;
    h.pos_start = uint32_t(pos);
    h.n_tokens = uint32_t(n);
    h.step = uint64_t(step);
    const auto& src = type == FrameType::kIndexQK ? index : attention;
    std::vector<std::string_view> sections(src.begin(), src.end());
    std::string out;
    EncodeFrame(h, sections, &out);
    return out;
  }
  std::string Index(uint64_t turn) const {
    return Frame(FrameType::kIndexQK, turn);
  }
  std::string Attention(uint64_t turn) const {
    return Frame(FrameType::kAttnQKV, turn);
  }
};

// Records every layer's traffic of a ModelRunner over LocalAttentionBackend.
class Recorder : public AttentionBackend {
 public:
  explicit Recorder(const Model& m)
      : shapes_(MakeAttnShapes(m.files.config)),
        local_(m.files.config, kTokensPerPage, size_t(64) << 20) {
    local_.SetMethodWeights(m.weights);
    REQUIRE(local_.Init().ok());
  }
  absl::Status Reserve(uint64_t session, int tokens) {
    return local_.Reserve(session, tokens);
  }
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* t) override {
    RETURN_IF_ERROR(local_.RunLayer(layer, segs, t));
    const AttnShapes& s = shapes_;
    for (size_t i = 0; i < segs.size(); ++i) {
      SegWork w;
      w.step = step;
      w.layer = layer;
      w.session = segs[i].session;
      w.pos = segs[i].pos_start;
      w.n = int(segs[i].tokens.size());
      const size_t n = size_t(w.n);
      auto bytes = [](const void* p, size_t len) {
        return std::string(static_cast<const char*>(p), len);
      };
      if (t->has_indexer) {
        const IndexInputs in = t->IndexFor(int(i), s);
        const size_t hi = s.index_heads, di = s.index_dim;
        w.index = {bytes(in.q_codes, n * hi * di), bytes(in.q_scales, n * hi * 4),
                   bytes(in.weights, n * hi * 4), bytes(in.k_codes, n * di),
                   bytes(in.k_scales, n * 4)};
      }
      const AttnInputs in = t->AttnFor(int(i), s);
      w.attention = {bytes(in.q, n * s.heads * s.q_dim * 4),
                     bytes(in.kv, n * s.kv_dim * 2)};
      // The GQA forms' flags section, sent only when set (as the GPU node).
      if (segs[i].ends_prefill && s.kv_heads > 0) {
        const uint32_t flags = kAttnFlagEndsPrefill;
        w.attention.push_back(bytes(&flags, 4));
      }
      const float* out = t->OutFor(int(i), s);
      w.want.assign(out, out + n * s.heads * s.out_dim);
      work.push_back(std::move(w));
    }
    return absl::OkStatus();
  }
  int step = 0;
  std::vector<SegWork> work;

 private:
  const AttnShapes shapes_;
  LocalAttentionBackend local_;
};

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 29 + salt * 53 + 7) % 256);
  return t;
}

// Steps of one or more sessions: each step's segments.
using Script = std::vector<std::vector<Segment>>;

// The frames of `script`, in the order a GPU node sends them (step by
// step, layer by layer, segment by segment), with the clean outputs.
std::vector<SegWork> Record(const Model& m, const Script& script) {
  Recorder rec(m);
  for (const auto& step : script) {
    for (const Segment& seg : step) REQUIRE(rec.Reserve(seg.session, 256).ok());
  }
  for (size_t i = 0; i < script.size(); ++i) {
    rec.step = int(i);
    REQUIRE(m.runner->Step(script[i], &rec).ok());
  }
  return std::move(rec.work);
}

std::unique_ptr<KaratDevice> NewDevice(const Model& m,
                                       DeviceOptions options = {},
                                       int index = 0) {
  if (options.capacity_bytes == DeviceOptions{}.capacity_bytes)
    options.capacity_bytes = size_t(64) << 20;
  auto d = KaratDevice::Create(index, m.files.config, kTokensPerPage, options,
                               m.method);
  REQUIRE(d.ok());
  return std::move(*d);
}

struct Result {
  absl::Status status;
  std::vector<float> out;
  uint64_t ingested = 0;
  bool skipped = false;
};

Result Send(KaratDevice* device, const std::string& message) {
  auto frame = DecodeFrame(message);
  REQUIRE(frame.ok());
  Result r;
  r.ingested = 12345;  // Process must set it
  r.status = device->Process(*frame, &r.out, &r.ingested, &r.skipped);
  return r;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Sends `w`'s frames of turn `turn` once; its output must be the clean one.
void Apply(KaratDevice* device, const SegWork& w, uint64_t turn) {
  INFO("step " << w.step << " layer " << w.layer << " session " << w.session
               << " positions " << w.pos << "+" << w.n);
  if (!w.index.empty()) {
    const Result r = Send(device, w.Index(turn));
    REQUIRE(r.status.ok());
    REQUIRE_FALSE(r.skipped);
  }
  const Result r = Send(device, w.Attention(turn));
  INFO(r.status);
  REQUIRE(r.status.ok());
  REQUIRE_FALSE(r.skipped);
  CHECK(SameBits(r.out, w.want));
}

// Applies steps [from, to) of `work` as turn `turn`, each output checked.
void ApplySteps(KaratDevice* device, const std::vector<SegWork>& work,
                int from, int to, uint64_t turn) {
  for (const SegWork& w : work) {
    if (w.step >= from && w.step < to) Apply(device, w, turn);
  }
}

Segment Seg(uint64_t session, int pos, std::vector<int32_t> tokens,
            bool ends_prefill = false) {
  return Segment{session, pos, std::move(tokens), ends_prefill};
}

TEST_CASE(
    "device: a repeated attention frame is answered with the same bits and "
    "stores nothing; stale copies change nothing",
    "[karat_node][frame_order]") {
  struct Case {
    const char* preset;
    int reuse;
  };
  const Case c = GENERATE(values<Case>({{"dsa-small", 0},
                                        {"dsa-small", 2},
                                        {"llama-small-clusterkv", 0},
                                        {"llama-small-magicpig", 0},
                                        {"minimax-small", 0}}));
  INFO(c.preset << " index_reuse_freq " << c.reuse);
  const Model& m = GetModel(c.preset, c.reuse);
  const AttnShapes s = MakeAttnShapes(m.files.config);
  // Two sessions on one device. Turn 1: a 40-token prefill (beyond the
  // indexer's top-k and ClusterKV's budget) next to a 9-token one, two
  // decode steps; turn 2: a 12-token prefill of session 7 (ClusterKV now
  // selects over turn 1's clusters), a decode step of both.
  const Script script = {
      {Seg(7, 0, Tokens(40, 1), true), Seg(8, 0, Tokens(9, 2), true)},
      {Seg(7, 40, {11}), Seg(8, 9, {12})},
      {Seg(7, 41, {13}), Seg(8, 10, {14})},
      {Seg(7, 42, Tokens(12, 3), true), Seg(8, 11, {15})},
      {Seg(7, 54, {16}), Seg(8, 12, {17})},
  };
  const std::vector<SegWork> work = Record(m, script);
  auto device = NewDevice(m);
  for (uint64_t session : {7, 8}) REQUIRE(device->Reserve(session, 64, 1).ok());

  uint64_t applied = 0, repeated = 0, stale = 0, superseded = 0;
  std::map<uint64_t, const SegWork*> previous;  // per session, this turn's
  for (const SegWork& w : work) {
    INFO("step " << w.step << " layer " << w.layer << " session " << w.session
                 << " positions " << w.pos << "+" << w.n);
    const uint64_t turn = w.step < 3 ? 1 : 2;
    if (w.step == 3 && w.layer == 0 && previous.count(w.session) &&
        previous[w.session]->step < 3) {
      // Turn 2 begins: the fence moves, and turn 1's last frame is refused.
      REQUIRE(device->Reserve(w.session, 64, 2).ok());
      const Result r = Send(device.get(), previous[w.session]->Attention(1));
      CHECK(absl::IsFailedPrecondition(r.status));
      CHECK(r.ingested == 0);
      ++superseded;
      previous.erase(w.session);
    }
    if (!w.index.empty()) {
      Result r = Send(device.get(), w.Index(turn));
      REQUIRE(r.status.ok());
      CHECK_FALSE(r.skipped);
      CHECK(r.ingested == uint64_t(w.n) * (s.index_dim + 4));
      ++applied;
      // The same index frame again: nothing to do, nothing to answer.
      r = Send(device.get(), w.Index(turn));
      CHECK(r.status.ok());
      CHECK(r.skipped);
      CHECK(r.ingested == 0);
      ++stale;
    }
    Result first = Send(device.get(), w.Attention(turn));
    INFO(first.status);
    REQUIRE(first.status.ok());
    CHECK_FALSE(first.skipped);
    CHECK(first.ingested == uint64_t(w.n) * s.kv_dim * 2);
    CHECK(SameBits(first.out, w.want));
    ++applied;
    // Its answer was lost: the repeat gets the same bits and stores nothing
    // (decode-sized: the kept output; a prefill chunk: computed again).
    Result again = Send(device.get(), w.Attention(turn));
    REQUIRE(again.status.ok());
    CHECK_FALSE(again.skipped);
    CHECK(again.ingested == 0);
    CHECK(SameBits(again.out, w.want));
    ++repeated;
    // Late copies: the index frame after its attention frame, and the
    // session's frame before (an earlier layer or position).
    if (!w.index.empty()) {
      const Result r = Send(device.get(), w.Index(turn));
      CHECK(r.status.ok());
      CHECK(r.skipped);
      CHECK(r.ingested == 0);
      ++stale;
    }
    if (previous.count(w.session)) {
      const SegWork& p = *previous[w.session];
      std::vector<std::string> copies = {p.Attention(turn)};
      if (!p.index.empty()) copies.push_back(p.Index(turn));
      for (const std::string& copy : copies) {
        const Result r = Send(device.get(), copy);
        CHECK(r.status.ok());
        CHECK(r.skipped);
        CHECK(r.ingested == 0);
        ++stale;
      }
    }
    previous[w.session] = &w;
  }
  // The later outputs (checked above) are the clean run's: no copy changed
  // the sessions. Every frame was counted where it belongs.
  const DeviceMetrics dm = device->Metrics();
  CHECK(dm.frames == applied + repeated);
  CHECK(dm.frames_repeated == repeated);
  CHECK(dm.frames_stale == stale);
  CHECK(dm.frames_superseded == superseded);
  CHECK(dm.frame_errors == superseded);
  CHECK(dm.frames_without_index == 0);
  CHECK(superseded == 2);
}

TEST_CASE(
    "device: an attention frame whose index keys were lost is refused "
    "ABORTED; both sent again give the clean output",
    "[karat_node][frame_order]") {
  // Every layer runs the indexer, or every other one (layer 1 attends with
  // layer 0's selection).
  const int reuse = GENERATE(0, 2);
  INFO("index_reuse_freq " << reuse);
  const Model& m = GetModel("dsa-small", reuse);
  const Script script = {{Seg(7, 0, Tokens(40, 1), true)},
                         {Seg(7, 40, {11})},
                         {Seg(7, 41, {13})},
                         {Seg(7, 42, {15})}};
  const std::vector<SegWork> work = Record(m, script);
  auto device = NewDevice(m);
  REQUIRE(device->Reserve(7, 64, 1).ok());
  uint64_t refused = 0;
  for (const SegWork& w : work) {
    INFO("step " << w.step << " layer " << w.layer);
    // The prefill's and the second decode step's index frames are lost.
    if (!w.index.empty() && (w.step == 0 || w.step == 2)) {
      const Result r = Send(device.get(), w.Attention(1));
      CHECK(absl::IsAborted(r.status));
      CHECK_FALSE(r.skipped);
      CHECK(r.ingested == 0);
      ++refused;
    }
    Apply(device.get(), w, 1);  // both again (or the first time)
  }
  CHECK(refused == (reuse == 2 ? 4 : 6));
  const DeviceMetrics dm = device->Metrics();
  CHECK(dm.frames_without_index == refused);
  CHECK(dm.frame_errors == refused);
  CHECK(dm.frames_stale == 0);
  CHECK(dm.frames_repeated == 0);
}

TEST_CASE("device: frames of a turn older than Reserve's epoch are refused",
          "[karat_node][frame_order]") {
  const Model& m = GetModel("dsa-small");
  const Script script = {{Seg(7, 0, Tokens(20, 4), true)},
                         {Seg(7, 20, {11})},
                         {Seg(7, 21, {13})}};
  const std::vector<SegWork> work = Record(m, script);
  auto device = NewDevice(m);
  REQUIRE(device->Reserve(7, 64, 5).ok());
  const SegWork& first = work.front();
  REQUIRE_FALSE(first.index.empty());
  uint64_t refused = 0;
  for (const std::string& frame : {first.Index(4), first.Attention(4)}) {
    const Result r = Send(device.get(), frame);
    CHECK(absl::IsFailedPrecondition(r.status));
    CHECK(r.ingested == 0);
    ++refused;
  }
  // An older epoch does not lower the fence.
  REQUIRE(device->Reserve(7, 64, 3).ok());
  CHECK(absl::IsFailedPrecondition(Send(device.get(), first.Index(4)).status));
  ++refused;
  ApplySteps(device.get(), work, 0, 2, 5);
  // Turn 6 fences turn 5 off: the repeat of its last attention frame is
  // refused now, not answered.
  REQUIRE(device->Reserve(7, 64, 6).ok());
  const SegWork* last = nullptr;
  for (const SegWork& w : work) {
    if (w.step == 1) last = &w;
  }
  const Result r = Send(device.get(), last->Attention(5));
  CHECK(absl::IsFailedPrecondition(r.status));
  ++refused;
  // Nothing refused changed the session.
  ApplySteps(device.get(), work, 2, 3, 6);
  const DeviceMetrics dm = device->Metrics();
  CHECK(dm.frames_superseded == refused);
  CHECK(dm.frames_repeated == 0);
}

// A session whose turn 1 ran `a` and whose turn 2 ran `b` and failed is cut
// back to `k` positions (what `a` left) by Reserve(turn 3, kv_tokens = k);
// turn 3 then runs `c`. The outputs must be those of a session that ran `a`
// then `c` only: from `c` on where the KV was kept, from `a` on (the
// caller's rebuild from position 0) where it was dropped.
struct CutCase {
  const char* name;
  const char* preset;
  Script a, b, c;
  bool dropped;
};

Script Concat(const Script& x, const Script& y) {
  Script out = x;
  out.insert(out.end(), y.begin(), y.end());
  return out;
}

int Length(const Script& script) {
  int end = 0;
  for (const auto& step : script) {
    for (const Segment& s : step)
      end = std::max(end, s.pos_start + int(s.tokens.size()));
  }
  return end;
}

void RunCut(const CutCase& cc) {
  INFO(cc.name);
  const Model& m = GetModel(cc.preset);
  const std::vector<SegWork> clean = Record(m, Concat(cc.a, cc.c));
  const std::vector<SegWork> dirty = Record(m, Concat(cc.a, cc.b));
  const int na = int(cc.a.size()), nb = int(cc.b.size());
  const int k = Length(cc.a);
  auto history = [&](KaratDevice* d) {
    REQUIRE(d->Reserve(7, 128, 1).ok());
    ApplySteps(d, dirty, 0, na, 1);
    REQUIRE(d->Reserve(7, 128, 2).ok());
    ApplySteps(d, dirty, na, na + nb, 2);
  };
  auto device = NewDevice(m);
  history(device.get());
  auto cut = device->Reserve(7, 128, 3, k);
  REQUIRE(cut.ok());
  CHECK(cut->kv_dropped == cc.dropped);
  if (!cc.dropped) {
    ApplySteps(device.get(), clean, na, int(clean.back().step) + 1, 3);
    return;
  }
  // The KV is gone: turn 3 cannot continue at k ...
  const SegWork* first_c = nullptr;
  for (const SegWork& w : clean) {
    if (w.step == na && first_c == nullptr) first_c = &w;
  }
  CHECK(absl::IsFailedPrecondition(
      Send(device.get(), first_c->Attention(3)).status));
  // ... and the rebuild from position 0 gives the clean outputs.
  ApplySteps(device.get(), clean, 0, int(clean.back().step) + 1, 3);

  // Without the cut, the metadata of the failed turn would have changed
  // turn 3's outputs: the drop is what made them clean.
  auto kept = NewDevice(m);
  history(kept.get());
  REQUIRE(kept->Reserve(7, 128, 3).ok());
  bool differs = false;
  for (const SegWork& w : clean) {
    if (w.step < na) continue;
    const Result r = Send(kept.get(), w.Attention(3));
    REQUIRE(r.status.ok());
    differs = differs || !SameBits(r.out, w.want);
  }
  CHECK(differs);
}

TEST_CASE(
    "device: Reserve(kv_tokens) leaves the session as if the failed turn had "
    "not run",
    "[karat_node][frame_order]") {
  // Turn 1 (a): a 40-token prefill and two decode steps, 42 positions.
  const Script a = {{Seg(7, 0, Tokens(40, 1), true)},
                    {Seg(7, 40, {11})},
                    {Seg(7, 41, {13})}};
  // The failed turn 2 (b): a whole prefill and a decode step, or only a
  // prefill chunk (it failed before the prefill ended).
  const Script b_whole = {{Seg(7, 42, Tokens(20, 2), true)},
                          {Seg(7, 62, {17})}};
  const Script b_chunk = {{Seg(7, 42, Tokens(20, 2), false)}};
  // Turn 3 (c): other tokens from position 42.
  const Script c = {{Seg(7, 42, Tokens(12, 3), true)},
                    {Seg(7, 54, {19})},
                    {Seg(7, 55, {21})}};
  SECTION("dsa: cut") { RunCut({"dsa", "dsa-small", a, b_whole, c, false}); }
  SECTION("quest: cut inside a page") {
    // 21 positions: the cut splits a page of 8.
    const Script a21 = {{Seg(7, 0, Tokens(21, 5), true)}};
    const Script b = {{Seg(7, 21, Tokens(10, 6), true)}, {Seg(7, 31, {9})}};
    const Script c21 = {{Seg(7, 21, Tokens(14, 7), true)},
                        {Seg(7, 35, {23})},
                        {Seg(7, 36, {25})}};
    RunCut({"quest", "llama-small-quest", a21, b, c21, false});
  }
  SECTION("clusterkv: the failed turn clustered past the cut: dropped") {
    RunCut({"clusterkv dropped", "llama-small-clusterkv", a, b_whole, c, true});
  }
  SECTION("clusterkv: the failed turn clustered nothing: cut") {
    RunCut({"clusterkv kept", "llama-small-clusterkv", a, b_chunk, c, false});
  }
  SECTION("magicpig: the mean was fixed past the cut: dropped") {
    // Turn 1 had fed 12 tokens of its prefill when the session was cut
    // back there; the failed rest of it fixed the mean at 30.
    const Script a12 = {{Seg(7, 0, Tokens(12, 8), false)}};
    const Script b = {{Seg(7, 12, Tokens(18, 9), true)}, {Seg(7, 30, {27})}};
    const Script c12 = {{Seg(7, 12, Tokens(20, 10), true)},
                        {Seg(7, 32, {29})},
                        {Seg(7, 33, {31})}};
    RunCut({"magicpig dropped", "llama-small-magicpig", a12, b, c12, true});
  }
  SECTION("magicpig: the mean was fixed before the cut: cut") {
    RunCut({"magicpig kept", "llama-small-magicpig", a, b_whole, c, false});
  }
}

TEST_CASE(
    "device: Reserve says OUT_OF_RANGE for what the node could not hold "
    "even empty, RESOURCE_EXHAUSTED for what it cannot hold now",
    "[karat_node][frame_order]") {
  const Model& m = GetModel("dsa-small");
  const KvLayout layout = MakeKvLayout(m.files.config, kTokensPerPage);
  // Pages of t positions in the 3 layers: a KV page per 16 positions and an
  // index page per 64.
  auto pages = [&](int t) { return size_t(layout.PagesFor(t)) * 3; };
  REQUIRE(pages(64) == 15);
  REQUIRE(pages(128) == 30);
  REQUIRE(pages(129) == 36);
  auto memory = std::make_shared<NodeMemory>();
  DeviceOptions o;
  o.capacity_bytes = layout.page_bytes * pages(64);  // 128 on the node
  o.memory = memory;
  auto d0 = NewDevice(m, o, 0);
  auto d1 = NewDevice(m, o, 1);

  REQUIRE(d1->Reserve(1, 64, 1).ok());  // device 1 full
  CHECK(absl::IsResourceExhausted(d0->Reserve(2, 96, 1).status()));
  CHECK(absl::IsResourceExhausted(d0->Reserve(2, 128, 1).status()));
  CHECK(absl::IsOutOfRange(d0->Reserve(2, 129, 1).status()));
  CHECK_FALSE(d0->HasSession(2));
  CHECK(d0->used_bytes() == 0);

  REQUIRE(d1->Free(1).ok());
  REQUIRE(d0->Reserve(2, 96, 1).ok());  // 24 pages: 9 spill to device 1
  REQUIRE(d1->Reserve(3, 16, 1).ok());  // 6 pages: device 1 full again
  const size_t used0 = d0->used_bytes(), used1 = d1->used_bytes();
  CHECK(used0 == d0->capacity_bytes());
  CHECK(used1 == d1->capacity_bytes());

  // Turn 1 of session 2 runs; Reserves for a turn 9 that fail change
  // nothing: no fence, no cut, no pages.
  const Script script = {{Seg(2, 0, Tokens(40, 1), true)},
                         {Seg(2, 40, {11})},
                         {Seg(2, 41, {13})}};
  const std::vector<SegWork> work = Record(m, script);
  ApplySteps(d0.get(), work, 0, 1, 1);
  CHECK(absl::IsResourceExhausted(d0->Reserve(2, 128, 9, 0).status()));
  CHECK(absl::IsOutOfRange(d0->Reserve(2, 129, 9, 0).status()));
  CHECK(d0->used_bytes() == used0);
  CHECK(d1->used_bytes() == used1);
  ApplySteps(d0.get(), work, 1, 3, 1);
  CHECK(d0->Metrics().frames_superseded == 0);
  // With device 1's other session gone, the same Reserve succeeds.
  REQUIRE(d1->Free(3).ok());
  auto grown = d0->Reserve(2, 128, 9, 42);
  REQUIRE(grown.ok());
  CHECK_FALSE(grown->kv_dropped);
}

}  // namespace
}  // namespace karat
