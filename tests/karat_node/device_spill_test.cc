// Spill across the devices of one node (DESIGN.md §3 "Placement"): a
// session's pages leave its home device only when the home is full, go to
// the most free other device, are read in place (same outputs as an
// unspilled session, bit for bit), are counted (spilled, hosted and
// cross-device bytes) and go back to their own arenas when freed.
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/frame.h"
#include "common/kv_store.h"
#include "common/numeric.h"
#include "karat_node/karat_device.h"

namespace karat {
namespace {

constexpr int kTpp = 16;
constexpr uint64_t kSession = 7;

// ---------------------------------------------------------------------------
// The placement rule on its own.

TEST_CASE("spill plan: home first, then most free, ties to lower index",
          "[karat_device][spill]") {
  // The home has room: nothing spills.
  CHECK(*PlanPageSpill({10, 50, 50}, 10) == std::vector<int>{10, 0, 0});
  // The home takes what it can; the rest goes to the most free other arena.
  CHECK(*PlanPageSpill({3, 5, 20}, 10) == std::vector<int>{3, 0, 7});
  // Each spill arena is filled before the next; ties to the lower index.
  CHECK(*PlanPageSpill({0, 4, 6, 6}, 14) == std::vector<int>{0, 2, 6, 6});
  CHECK(*PlanPageSpill({0, 4, 6, 6}, 5) == std::vector<int>{0, 0, 5, 0});
  CHECK(*PlanPageSpill({2}, 0) == std::vector<int>{0});
  // All or nothing.
  CHECK(absl::IsResourceExhausted(PlanPageSpill({3, 5, 20}, 29).status()));
  CHECK(absl::IsResourceExhausted(PlanPageSpill({}, 1).status()));
  CHECK(absl::IsInvalidArgument(PlanPageSpill({3}, -1).status()));
}

TEST_CASE(
    "session cache: pages spill only when the home arena is full and "
    "go back to their own arenas",
    "[kv_store][spill]") {
  const ModelConfig c = *PresetConfig("dsa-small");
  const KvLayout layout = MakeKvLayout(c, kTpp);
  const int layers = layout.num_layers;
  // Per layer: 2 KV pages and an index page (64 keys) for 2 kTpp tokens;
  // 3 kTpp take one more KV page.
  REQUIRE(layout.PagesFor(2 * kTpp) == 3);
  REQUIRE(layout.PagesFor(3 * kTpp) == 4);
  const int home_pages = 3 * layers;
  auto home =
      *PageArena::Create(layout.page_bytes * home_pages, layout.page_bytes);
  auto other = *PageArena::Create(layout.page_bytes * 100, layout.page_bytes);
  {
    SessionCache cache(&layout, {home.get(), other.get()});
    REQUIRE(cache.Reserve(2 * kTpp).ok());
    CHECK(home->free_pages() == 0);
    CHECK(other->free_pages() == 100);
    CHECK(cache.PagesPerArena() == std::vector<int>{home_pages, 0});
    REQUIRE(cache.Reserve(3 * kTpp).ok());
    CHECK(cache.PagesPerArena() == std::vector<int>{home_pages, layers});
    CHECK(other->free_pages() == 100 - layers);
    // Too much for both: nothing taken.
    CHECK(absl::IsResourceExhausted(cache.Reserve(200 * kTpp)));
    CHECK(cache.PagesPerArena() == std::vector<int>{home_pages, layers});
    CHECK(cache.reserved_tokens() == 3 * kTpp);
    // Metadata pages come from the same arenas.
    REQUIRE(cache.ChargeMetadata(layout.page_bytes + 1).ok());
    CHECK(cache.metadata_pages() == 2);
    CHECK(other->free_pages() == 100 - layers - 2);
    REQUIRE(cache.ChargeMetadata(0).ok());
    CHECK(cache.metadata_pages() == 0);
    // Every layer's third KV page is the spilled one; its index page is
    // home.
    for (int l = 0; l < layers; ++l) {
      cache.SetLength(l, 2 * kTpp + 5);
      CHECK(cache.SpilledPositions(l) == 5);
      const uint8_t* spilled = cache.View(l).PageData(2);
      CHECK(spilled >= other->Page(0));
      CHECK(spilled <
            other->Page(other->total_pages() - 1) + layout.page_bytes);
      const uint8_t* first = cache.View(l).PageData(0);
      CHECK(first >= home->Page(0));
      CHECK(first < home->Page(home->total_pages() - 1) + layout.page_bytes);
      const uint8_t* keys = cache.View(l).IndexPageData(0);
      CHECK(keys >= home->Page(0));
      CHECK(keys < home->Page(home->total_pages() - 1) + layout.page_bytes);
    }
    cache.Shrink(kTpp);
    CHECK(cache.PagesPerArena() == std::vector<int>{2 * layers, 0});
    CHECK(cache.SpilledPositions(0) == 0);
  }
  CHECK(home->free_pages() == home->total_pages());
  CHECK(other->free_pages() == other->total_pages());
}

TEST_CASE(
    "session cache: a position whose index page spilled counts as spilled, "
    "though its KV page is home",
    "[kv_store][spill]") {
  const ModelConfig c = *PresetConfig("dsa-small");
  const KvLayout layout = MakeKvLayout(c, kTpp);
  const int layers = layout.num_layers;
  REQUIRE(layers == 3);
  REQUIRE(layout.index_tokens_per_page == 4 * kTpp);
  // 2 kTpp tokens take 2 KV pages and an index page a layer, taken layer
  // by layer: with room for 8 at home, the last layer's index page spills.
  auto home = *PageArena::Create(layout.page_bytes * 8, layout.page_bytes);
  auto other = *PageArena::Create(layout.page_bytes * 10, layout.page_bytes);
  SessionCache cache(&layout, {home.get(), other.get()});
  REQUIRE(cache.Reserve(2 * kTpp).ok());
  CHECK(cache.PagesPerArena() == std::vector<int>{8, 1});
  for (int l = 0; l < layers; ++l) cache.SetLength(l, kTpp + 3);
  CHECK(cache.SpilledPositions(0) == 0);
  CHECK(cache.SpilledPositions(1) == 0);
  CHECK(cache.SpilledPositions(2) == kTpp + 3);
  const uint8_t* keys = cache.View(2).IndexPageData(0);
  CHECK(keys >= other->Page(0));
  CHECK(keys < other->Page(other->total_pages() - 1) + layout.page_bytes);
  // Index keys written there read back through the view.
  std::vector<uint8_t> codes(size_t(layout.index_dim), 0x38);  // 1.0
  REQUIRE(cache.WriteIndexKey(2, kTpp + 2, codes.data(), 0.5f).ok());
  std::vector<uint8_t> got(codes.size());
  cache.View(2).IndexKeyCodes(kTpp + 2, got.data());
  CHECK(got == codes);
  CHECK(cache.View(2).IndexScale(kTpp + 2) == 0.5f);
  // Shrinking keeps the one index page: still spilled.
  cache.Shrink(kTpp);
  CHECK(cache.PagesPerArena() == std::vector<int>{5, 1});
  CHECK(cache.SpilledPositions(2) == kTpp);
}

// ---------------------------------------------------------------------------
// mla_dsa frames with random inputs.

struct MlaFrames {
  std::string index;  // empty on a layer without an indexer
  std::string attn;
};

MlaFrames RandomMlaFrames(const ModelConfig& c, const AttnShapes& s, int layer,
                          int pos, int n, std::mt19937* rng) {
  std::normal_distribution<float> nd;
  MlaFrames f;
  FrameHeader h;
  h.layer = uint32_t(layer);
  h.session = kSession;
  h.pos_start = uint32_t(pos);
  h.n_tokens = uint32_t(n);
  if (c.HasIndexer(layer)) {
    const int hi = s.index_heads, di = s.index_dim;
    std::vector<uint8_t> q_codes(size_t(n) * hi * di), k_codes(size_t(n) * di);
    std::vector<float> q_scales(size_t(n) * hi), weights(size_t(n) * hi),
        k_scales(n), x(di);
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < hi; ++j) {
        for (float& v : x) v = nd(*rng);
        q_scales[size_t(t) * hi + j] =
            QuantizeFp8(x.data(), di, &q_codes[(size_t(t) * hi + j) * di]);
        weights[size_t(t) * hi + j] = nd(*rng) * 0.5f;
      }
      for (float& v : x) v = nd(*rng);
      k_scales[t] = QuantizeFp8(x.data(), di, &k_codes[size_t(t) * di]);
    }
    auto bytes = [](const auto& v) {
      return std::string_view(reinterpret_cast<const char*>(v.data()),
                              v.size() * sizeof(v[0]));
    };
    h.type = static_cast<uint16_t>(FrameType::kIndexQK);
    EncodeFrame(h,
                {bytes(q_codes), bytes(q_scales), bytes(weights),
                 bytes(k_codes), bytes(k_scales)},
                &f.index);
  }
  std::vector<float> q(size_t(n) * s.heads * s.q_dim),
      kvf(size_t(n) * s.kv_dim);
  for (float& v : q) v = nd(*rng);
  for (float& v : kvf) v = nd(*rng);
  std::vector<uint16_t> kv(kvf.size());
  FloatToBf16(kvf.data(), kvf.size(), kv.data());
  h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
  EncodeFrame(
      h,
      {std::string_view(reinterpret_cast<const char*>(q.data()), q.size() * 4),
       std::string_view(reinterpret_cast<const char*>(kv.data()),
                        kv.size() * 2)},
      &f.attn);
  return f;
}

// Runs `frame` on `device`; returns the attention output (empty for an
// indexer frame).
std::vector<float> Run(KaratDevice* device, const std::string& frame) {
  auto view = DecodeFrame(frame);
  REQUIRE(view.ok());
  std::vector<float> out;
  uint64_t ingested = 0;
  const absl::Status st = device->Process(*view, &out, &ingested);
  INFO(st.ToString());
  REQUIRE(st.ok());
  return out;
}

std::unique_ptr<KaratDevice> NewDevice(const ModelConfig& c, int index,
                                       size_t capacity,
                                       std::shared_ptr<NodeMemory> memory) {
  DeviceOptions o;
  o.capacity_bytes = capacity;
  o.cores = 2;
  o.memory = std::move(memory);
  auto d = KaratDevice::Create(index, c, kTpp, o);
  REQUIRE(d.ok());
  return std::move(d).value();
}

TEST_CASE(
    "mla_dsa: a spilled session attends bit for bit like an unspilled "
    "one, and the bytes it reads across devices are counted",
    "[karat_device][spill]") {
  const ModelConfig c = *PresetConfig("dsa-small");
  const AttnShapes s = MakeAttnShapes(c);
  const KvLayout layout = MakeKvLayout(c, kTpp);
  const size_t page = layout.page_bytes;
  const int layers = c.num_hidden_layers;

  // Node: device 0 holds 64 tokens (4 KV pages and an index page per
  // layer), device 1 plenty.
  const int home = layout.PagesFor(64);
  REQUIRE(home == 5);
  // Pages per layer that 160 tokens take beyond the home's.
  const int spill = layout.PagesFor(160) - home;
  auto memory = std::make_shared<NodeMemory>();
  auto dev0 = NewDevice(c, 0, page * layers * home, memory);
  auto dev1 = NewDevice(c, 1, page * 200, memory);
  // The same session alone on a roomy device of another node.
  auto ref = NewDevice(c, 0, page * 200, nullptr);

  // What fits the home stays there.
  REQUIRE(dev0->Reserve(kSession, 64).ok());
  REQUIRE(ref->Reserve(kSession, 64).ok());
  CHECK(dev0->used_bytes() == page * layers * home);
  CHECK(dev1->used_bytes() == 0);
  CHECK(dev0->Metrics().spilled_bytes == 0);

  // The home is full: the rest of 160 tokens' pages spill to device 1.
  REQUIRE(dev0->Reserve(kSession, 160).ok());
  REQUIRE(ref->Reserve(kSession, 160).ok());
  CHECK(dev0->used_bytes() == dev0->capacity_bytes());
  CHECK(dev1->used_bytes() == page * layers * spill);
  CHECK(dev0->Metrics().spilled_bytes == page * layers * spill);
  CHECK(dev1->Metrics().hosted_bytes == page * layers * spill);
  CHECK(dev1->Metrics().spilled_bytes == 0);
  CHECK(dev0->sessions() == 1);
  CHECK(dev1->sessions() == 0);
  CHECK_FALSE(dev1->HasSession(kSession));

  // A prefill of 150 tokens in two segments, then decode steps; the
  // context passes index_topk, so Select and Gather read spilled pages.
  std::mt19937 rng(11);
  const int segs[][2] = {{0, 100}, {100, 50}, {150, 1}, {151, 1}, {152, 1}};
  for (const auto& sg : segs) {
    for (int layer = 0; layer < layers; ++layer) {
      const MlaFrames f = RandomMlaFrames(c, s, layer, sg[0], sg[1], &rng);
      if (!f.index.empty()) {
        Run(dev0.get(), f.index);
        Run(ref.get(), f.index);
      }
      const std::vector<float> got = Run(dev0.get(), f.attn);
      const std::vector<float> want = Run(ref.get(), f.attn);
      REQUIRE(got.size() == size_t(sg[1]) * s.heads * s.out_dim);
      REQUIRE(got.size() == want.size());
      CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
    }
  }
  const DeviceMetrics m0 = dev0->Metrics(), mr = ref->Metrics();
  CHECK(m0.frames == mr.frames);
  CHECK(m0.frames > 0);
  CHECK(m0.frame_errors == 0);
  CHECK(m0.kernel_bytes == mr.kernel_bytes);
  CHECK(m0.cross_device_bytes > 0);
  CHECK(m0.cross_device_bytes < m0.kernel_bytes);
  CHECK(mr.cross_device_bytes == 0);
  CHECK(m0.busy_seconds > 0);
  // Device 1 ran no kernel: its arena only lends pages.
  CHECK(dev1->Metrics().frames == 0);
  CHECK(dev1->Metrics().cross_device_bytes == 0);

  // A frame that grows the session past the reservation spills too.
  const MlaFrames grow = RandomMlaFrames(c, s, 0, 153, 20, &rng);
  Run(dev0.get(), grow.index);
  Run(dev0.get(), grow.attn);
  CHECK(dev1->used_bytes() > page * layers * spill);

  // Free returns every page to its own arena.
  REQUIRE(dev0->Free(kSession).ok());
  CHECK(dev0->used_bytes() == 0);
  CHECK(dev1->used_bytes() == 0);
  CHECK(dev0->Metrics().spilled_bytes == 0);
  CHECK(dev1->Metrics().hosted_bytes == 0);
  CHECK(absl::IsNotFound(dev1->Free(kSession)));
}

TEST_CASE(
    "spill goes to the most free device; RESOURCE_EXHAUSTED changes "
    "nothing when the node cannot hold the pages",
    "[karat_device][spill]") {
  const ModelConfig c = *PresetConfig("dsa-small");
  const KvLayout layout = MakeKvLayout(c, kTpp);
  const size_t page = layout.page_bytes;
  const int layers = c.num_hidden_layers;
  // Pages per layer (KV pages of kTpp tokens, index pages of 64).
  REQUIRE(layout.PagesFor(2 * kTpp) == 3);
  REQUIRE(layout.PagesFor(3 * kTpp) == 4);
  REQUIRE(layout.PagesFor(4 * kTpp) == 5);
  REQUIRE(layout.PagesFor(7 * kTpp) == 9);
  REQUIRE(layout.PagesFor(13 * kTpp) == 17);
  auto memory = std::make_shared<NodeMemory>();
  auto dev0 = NewDevice(c, 0, page * layers * 3, memory);
  auto dev1 = NewDevice(c, 1, page * layers * 3, memory);
  auto dev2 = NewDevice(c, 2, page * layers * 6, memory);

  // A session homed on device 2 fits there: no spill.
  REQUIRE(dev2->Reserve(2, 2 * kTpp).ok());
  CHECK(dev2->used_bytes() == page * layers * 3);
  CHECK(dev0->used_bytes() == 0);
  CHECK(dev1->used_bytes() == 0);

  // Device 0 holds 3 pages per layer; the fourth goes to device 1 and 2's
  // most free one (both have 3 per layer free: the lower id wins).
  REQUIRE(dev0->Reserve(1, 3 * kTpp).ok());
  CHECK(dev0->used_bytes() == dev0->capacity_bytes());
  CHECK(dev1->used_bytes() == page * layers);
  CHECK(dev2->used_bytes() == page * layers * 3);
  // Now device 2 has the most room (3 per layer against 2).
  REQUIRE(dev0->Reserve(1, 4 * kTpp).ok());
  CHECK(dev1->used_bytes() == page * layers);
  CHECK(dev2->used_bytes() == page * layers * 4);

  // The node has 4 pages per layer left: 8 more per layer do not fit now,
  // and 13 would not fit even an empty node (12 pages per layer in all).
  const size_t used[3] = {dev0->used_bytes(), dev1->used_bytes(),
                          dev2->used_bytes()};
  absl::Status st = dev0->Reserve(1, 8 * kTpp).status();
  CHECK(absl::IsResourceExhausted(st));
  CHECK(std::string(st.message()).find("device 0") != std::string::npos);
  st = dev0->Reserve(1, 13 * kTpp).status();
  CHECK(absl::IsOutOfRange(st));
  CHECK(std::string(st.message()).find("even empty") != std::string::npos);
  // A new session that cannot fit is not created.
  CHECK(absl::IsResourceExhausted(dev1->Reserve(3, 6 * kTpp).status()));
  CHECK(absl::IsOutOfRange(dev1->Reserve(3, 20 * kTpp).status()));
  CHECK_FALSE(dev1->HasSession(3));
  CHECK(dev0->used_bytes() == used[0]);
  CHECK(dev1->used_bytes() == used[1]);
  CHECK(dev2->used_bytes() == used[2]);
  CHECK(dev0->Metrics().spilled_bytes == page * layers * 2);

  // What is left is still usable, exactly.
  REQUIRE(dev0->Reserve(1, 7 * kTpp).ok());
  CHECK(dev0->used_bytes() + dev1->used_bytes() + dev2->used_bytes() ==
        page * layers * 12);

  REQUIRE(dev0->Free(1).ok());
  REQUIRE(dev2->Free(2).ok());
  CHECK(dev0->used_bytes() == 0);
  CHECK(dev1->used_bytes() == 0);
  CHECK(dev2->used_bytes() == 0);
}

TEST_CASE("a device without a node memory does not spill",
          "[karat_device][spill]") {
  const ModelConfig c = *PresetConfig("dsa-small");
  const KvLayout layout = MakeKvLayout(c, kTpp);
  const int layers = c.num_hidden_layers;
  auto dev = NewDevice(
      c, 0, layout.page_bytes * layers * layout.PagesFor(2 * kTpp), nullptr);
  REQUIRE(dev->Reserve(1, 2 * kTpp).ok());
  CHECK(absl::IsOutOfRange(dev->Reserve(1, 3 * kTpp).status()));
  CHECK(dev->used_bytes() == dev->capacity_bytes());
}

TEST_CASE("a node memory refuses a second arena for one device",
          "[karat_device][spill]") {
  auto a = *PageArena::Create(4096, 1024);
  auto b = *PageArena::Create(4096, 2048);
  NodeMemory memory;
  REQUIRE(memory.Add(0, std::shared_ptr<PageArena>(std::move(a))).ok());
  auto c = *PageArena::Create(4096, 1024);
  CHECK(absl::IsInvalidArgument(
      memory.Add(0, std::shared_ptr<PageArena>(std::move(c)))));
  CHECK(absl::IsInvalidArgument(
      memory.Add(1, std::shared_ptr<PageArena>(std::move(b)))));
  CHECK(memory.DevicesFor(0) == std::vector<int>{0});
}

TEST_CASE("device metrics are exported as device.<i>.<name>",
          "[karat_device]") {
  DeviceMetrics m;
  m.busy_seconds = 1.5;
  m.frames = 3;
  m.cross_device_bytes = 42;
  m.used_bytes = 7;
  std::map<std::string, double> stats;
  ExportDeviceMetrics(2, m, &stats);
  CHECK(stats.at("device.2.busy_seconds") == 1.5);
  CHECK(stats.at("device.2.frames") == 3);
  CHECK(stats.at("device.2.cross_device_bytes") == 42);
  CHECK(stats.at("device.2.used_bytes") == 7);
  CHECK(stats.count("device.2.kernel_bytes") == 1);
  CHECK(stats.count("device.2.spilled_bytes") == 1);
  CHECK(stats.count("device.2.sessions") == 1);
}

}  // namespace
}  // namespace karat
