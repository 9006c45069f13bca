#include "karat_node/karat_device.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/log_ids.h"
#include "common/status_macros.h"

namespace karat {

// ---------------------------------------------------------------------------
// SerialWorker

SerialWorker::SerialWorker(std::string name)
    : name_(std::move(name)), thread_([this] { Run(); }) {}

SerialWorker::~SerialWorker() { Stop(); }

void SerialWorker::Post(absl::AnyInvocable<void()> work) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  queue_.push_back(std::move(work));
}

size_t SerialWorker::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void SerialWorker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool SerialWorker::TryRunInline(absl::FunctionRef<void()> work) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || busy_ || !queue_.empty()) return false;
    busy_ = true;
  }
  work();
  absl::MutexLock lock(&mu_);
  busy_ = false;
  return true;
}

void SerialWorker::Run() {
  for (;;) {
    absl::AnyInvocable<void()> work;
    {
      absl::MutexLock lock(&mu_);
      // An item running inline holds back the queue, and Stop().
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return !busy_ && (stopping_ || !queue_.empty());
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    work();
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

// ---------------------------------------------------------------------------
// Timing model

absl::Duration RooflineTime(const KernelCost& cost, double bandwidth_gbps,
                            double tflops) {
  return absl::Seconds(RooflineSeconds(cost, bandwidth_gbps, tflops));
}

absl::Duration PacingDelay(const KernelCost& cost, double bandwidth_gbps,
                           double tflops, absl::Duration elapsed) {
  const absl::Duration d = RooflineTime(cost, bandwidth_gbps, tflops) - elapsed;
  return d > absl::ZeroDuration() ? d : absl::ZeroDuration();
}

// ---------------------------------------------------------------------------
// NodeMemory

absl::Status NodeMemory::Add(int device, std::shared_ptr<PageArena> arena) {
  if (arena == nullptr) return absl::InvalidArgumentError("no arena");
  absl::MutexLock lock(&mu_);
  if (arenas_.contains(device)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " already has an arena on this node"));
  }
  if (!arenas_.empty() &&
      arenas_.begin()->second->page_bytes() != arena->page_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " has pages of ", arena->page_bytes(),
                     " bytes; the node's other devices have ",
                     arenas_.begin()->second->page_bytes()));
  }
  arenas_.emplace(device, std::move(arena));
  return absl::OkStatus();
}

std::vector<int> NodeMemory::DevicesFor(int home) const {
  absl::MutexLock lock(&mu_);
  std::vector<int> out;
  if (arenas_.contains(home)) out.push_back(home);
  for (const auto& [device, arena] : arenas_) {
    if (device != home) out.push_back(device);
  }
  return out;
}

std::vector<PageArena*> NodeMemory::ArenasFor(int home) const {
  absl::MutexLock lock(&mu_);
  std::vector<PageArena*> out;
  auto it = arenas_.find(home);
  if (it != arenas_.end()) out.push_back(it->second.get());
  for (const auto& [device, arena] : arenas_) {
    if (device != home) out.push_back(arena.get());
  }
  return out;
}

void ExportDeviceMetrics(int index, const DeviceMetrics& m,
                         std::map<std::string, double>* stats) {
  const std::string p = absl::StrCat("device.", index, ".");
  auto& st = *stats;
  st[p + "busy_seconds"] = m.busy_seconds;
  st[p + "frames"] = double(m.frames);
  st[p + "frame_errors"] = double(m.frame_errors);
  st[p + "frames_stale"] = double(m.frames_stale);
  st[p + "frames_repeated"] = double(m.frames_repeated);
  st[p + "frames_superseded"] = double(m.frames_superseded);
  st[p + "frames_without_index"] = double(m.frames_without_index);
  st[p + "kernel_bytes"] = double(m.kernel_bytes);
  st[p + "cross_device_bytes"] = double(m.cross_device_bytes);
  st[p + "used_bytes"] = double(m.used_bytes);
  st[p + "capacity_bytes"] = double(m.capacity_bytes);
  st[p + "spilled_bytes"] = double(m.spilled_bytes);
  st[p + "hosted_bytes"] = double(m.hosted_bytes);
  st[p + "metadata_bytes"] = double(m.metadata_bytes);
  st[p + "sessions"] = double(m.sessions);
}

// ---------------------------------------------------------------------------
// KaratDevice

namespace {

// A segment longer than this is refused before any size arithmetic.
constexpr uint32_t kMaxSegmentTokens = 1 << 20;

absl::Status CheckSection(const FrameView& f, int i, uint64_t expected,
                          const char* what) {
  if (f.sections[i].size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(FrameTypeName(f.header.type), " section ", i, " (", what,
                     ") holds ", f.sections[i].size(), " bytes; ",
                     f.header.n_tokens, " tokens need ", expected));
  }
  return absl::OkStatus();
}

// Whether a kAttnQKV frame carries the flags section with
// kAttnFlagEndsPrefill set (the GQA forms).
bool EndsPrefill(const FrameView& f) {
  if (f.header.n_sections != 3 || f.sections[2].size() != sizeof(uint32_t))
    return false;
  uint32_t flags = 0;
  std::memcpy(&flags, f.sections[2].data(), sizeof(flags));
  return (flags & kAttnFlagEndsPrefill) != 0;
}

}  // namespace

KaratDevice::KaratDevice(int index, const ModelConfig& config,
                         int tokens_per_page, const DeviceOptions& options)
    : index_(index),
      config_(config),
      layout_(MakeKvLayout(config, tokens_per_page)),
      shapes_(MakeAttnShapes(config)),
      options_(options),
      pool_(std::make_unique<CorePool>(options.cores)),
      worker_(absl::StrCat("device-", index)) {}

KaratDevice::~KaratDevice() { worker_.Stop(); }

absl::StatusOr<std::unique_ptr<KaratDevice>> KaratDevice::Create(
    int index, const ModelConfig& config, int tokens_per_page,
    const DeviceOptions& options) {
  return Create(index, config, tokens_per_page, options, nullptr);
}

absl::StatusOr<std::unique_ptr<KaratDevice>> KaratDevice::Create(
    int index, const ModelConfig& config, int tokens_per_page,
    const DeviceOptions& options,
    std::shared_ptr<const SparseAttention> attention) {
  if (tokens_per_page <= 0) {
    return absl::InvalidArgumentError("tokens per page must be > 0");
  }
  if (options.cores <= 0) {
    return absl::InvalidArgumentError("device cores must be > 0");
  }
  std::unique_ptr<KaratDevice> device(
      new KaratDevice(index, config, tokens_per_page, options));
  if (options.capacity_bytes < device->layout_.page_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("device capacity ", options.capacity_bytes,
                     " bytes is less than one page (",
                     device->layout_.page_bytes, " bytes)"));
  }
  ASSIGN_OR_RETURN(
      device->arena_,
      PageArena::Create(options.capacity_bytes, device->layout_.page_bytes));
  if (options.memory != nullptr) {
    RETURN_IF_ERROR(options.memory->Add(index, device->arena_));
  }
  if (config.attention.type != AttentionType::kMlaDsa) {
    device->method_ = std::move(attention);
    if (device->method_ == nullptr) {
      ASSIGN_OR_RETURN(device->method_,
                       NewSparseAttention(config, MethodWeights{}));
    }
  }
  return device;
}

KaratDevice::Session KaratDevice::NewSession() {
  Session s;
  std::vector<PageArena*> arenas = {arena_.get()};
  if (options_.memory != nullptr) arenas = options_.memory->ArenasFor(index_);
  s.cache = std::make_unique<SessionCache>(&layout_, std::move(arenas));
  if (method_ != nullptr) {
    s.method_state =
        NewAttentionSessionState(*method_, config_.num_hidden_layers);
  }
  return s;
}

bool KaratDevice::FitsEmptyNode(int tokens) const {
  const int64_t need =
      int64_t(layout_.KvPagesFor(tokens) + layout_.IndexPagesFor(tokens)) *
      layout_.num_layers;
  int64_t pages = arena_->total_pages();
  if (options_.memory != nullptr) {
    pages = 0;
    for (PageArena* a : options_.memory->ArenasFor(index_))
      pages += a->total_pages();
  }
  return need <= pages;
}

absl::StatusOr<KaratDevice::ReserveResult> KaratDevice::Reserve(
    uint64_t session, int tokens, uint64_t turn_epoch, int kv_tokens) {
  if (tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reserve of ", tokens, " tokens; must be > 0"));
  }
  ReserveResult result;
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  const bool created = it == sessions_.end();
  if (created) it = sessions_.emplace(session, NewSession()).first;
  Session& s = it->second;
  const int before = s.cache->reserved_tokens();
  absl::Status status = EnsureRoom(session, &s, tokens);
  // Metadata a frame could not charge (or a new session's) is charged now,
  // and the reservation fails with it.
  if (status.ok()) status = ChargeMetadata(session, &s);
  if (!status.ok()) {
    s.cache->Shrink(before);
    if (created) {
      UpdatePageCounts(&s, /*dropping=*/true);
      sessions_.erase(it);
    } else {
      UpdatePageCounts(&s);
    }
    if (absl::IsResourceExhausted(status) && !FitsEmptyNode(tokens)) {
      return absl::OutOfRangeError(absl::StrCat(
          "session ", session, " needs room for ", tokens,
          " positions, more than the node's devices hold even empty (",
          status.message(), ")"));
    }
    return status;
  }
  if (created) num_sessions_.fetch_add(1);
  // The turn about to run: older turns' frames are refused from now on.
  if (turn_epoch > s.fence) s.fence = turn_epoch;
  if (kv_tokens >= 0 &&
      !TruncateSessionKv(method_.get(), s.method_state.get(), s.cache.get(),
                         config_.num_hidden_layers, kv_tokens)) {
    // Metadata fixed at a turn's end covers the cut: start the session's
    // KV afresh (its pages stay reserved), to be rebuilt from the token log.
    for (int l = 0; l < config_.num_hidden_layers; ++l) s.cache->Truncate(l, 0);
    metadata_bytes_.fetch_sub(s.metadata_bytes);
    s.metadata_bytes = 0;
    s.method_state =
        NewAttentionSessionState(*method_, config_.num_hidden_layers);
    (void)ChargeMetadata(session, &s);
    s.last.reset();
    s.last_out.clear();
    s.selection_key.reset();
    result.kv_dropped = true;
    KLOG(Info, "karat_node")
        << "session=" << ShortKey(session) << " device=" << index_
        << ": the attention metadata covers positions past " << kv_tokens
        << "; its KV is dropped and rebuilt from the token log";
  }
  result.session_bytes = int64_t(s.cache->bytes());
  return result;
}

absl::Status KaratDevice::EnsureRoom(uint64_t session, Session* s, int tokens) {
  if (tokens <= s->cache->reserved_tokens()) return absl::OkStatus();
  absl::Status status = s->cache->Reserve(tokens);
  UpdatePageCounts(s);
  if (status.ok()) return status;
  if (absl::IsResourceExhausted(status)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device ", index_, " cannot hold ", tokens, " positions of session ",
        session, " (", arena_->free_pages(), " of ", arena_->total_pages(),
        " pages free here",
        options_.memory != nullptr
            ? "; the node's other devices cannot make up the rest"
            : "",
        "): ", status.message()));
  }
  return status;
}

absl::Status KaratDevice::ChargeMetadata(uint64_t session, Session* s) {
  if (s->method_state == nullptr) return absl::OkStatus();
  const size_t bytes = s->method_state->bytes();
  absl::Status status = s->cache->ChargeMetadata(bytes);
  UpdatePageCounts(s);
  if (status.ok()) return status;
  return absl::ResourceExhaustedError(absl::StrCat(
      "device ", index_, ": the attention metadata of session ", session, " (",
      bytes, " bytes) does not fit: ", status.message()));
}

void KaratDevice::UpdatePageCounts(Session* s, bool dropping) {
  int64_t home = 0, spilled = 0;
  if (!dropping) {
    const std::vector<int>& per_arena = s->cache->PagesPerArena();
    for (size_t a = 0; a < per_arena.size(); ++a) {
      (a == 0 ? home : spilled) += per_arena[a];
    }
  }
  home_pages_.fetch_add(home - s->home_pages);
  spilled_pages_.fetch_add(spilled - s->spilled_pages);
  s->home_pages = home;
  s->spilled_pages = spilled;
}

bool KaratDevice::HasSession(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  return sessions_.contains(session);
}

absl::Status KaratDevice::Free(uint64_t session) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " is not on device ", index_));
  }
  metadata_bytes_.fetch_sub(it->second.metadata_bytes);
  UpdatePageCounts(&it->second, /*dropping=*/true);
  sessions_.erase(it);  // the cache returns every page to its own arena
  num_sessions_.fetch_sub(1);
  return absl::OkStatus();
}

absl::Status KaratDevice::Process(const FrameView& frame,
                                  std::vector<float>* out, uint64_t* ingested,
                                  bool* skipped) {
  const FrameHeader& h = frame.header;
  *ingested = 0;
  bool skip = false;
  if (skipped == nullptr) skipped = &skip;
  *skipped = false;
  const auto type = static_cast<FrameType>(h.type);
  absl::Status status;
  if (type != FrameType::kIndexQK && type != FrameType::kAttnQKV) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "frame type ", FrameTypeName(h.type), " carries no attention work"));
  } else if (h.layer >= uint32_t(layout_.num_layers)) {
    status = absl::InvalidArgumentError(
        absl::StrCat("layer ", h.layer, " out of range (the model has ",
                     layout_.num_layers, ")"));
  } else if (type == FrameType::kIndexQK &&
             (!config_.HasIndexer(int(h.layer)) || shapes_.index_dim == 0)) {
    status = absl::InvalidArgumentError(
        absl::StrCat("layer ", h.layer, " runs no indexer"));
  } else if (h.n_tokens == 0 || h.n_tokens > kMaxSegmentTokens) {
    status = absl::InvalidArgumentError(
        absl::StrCat("segment of ", h.n_tokens, " tokens"));
  } else if (uint64_t(h.pos_start) + h.n_tokens >
             uint64_t(std::numeric_limits<int32_t>::max())) {
    status = absl::InvalidArgumentError(
        absl::StrCat("segment position ", h.pos_start, " out of range"));
  }
  if (!status.ok()) {
    frame_errors_.fetch_add(1);
    return status;
  }

  // The timing model's clock starts before the wait for the device; busy
  // time once the device is taken.
  const absl::Time start = absl::Now();
  KernelCost cost;
  absl::Time kernel_start;
  {
    absl::MutexLock lock(&mu_);
    kernel_start = absl::Now();
    status = ProcessLocked(frame, out, ingested, &cost, skipped);
  }
  if (*skipped) return status;
  // Frames run one at a time on the device worker, so sleeping here keeps
  // the device busy until the roofline time without blocking Reserve().
  if (status.ok()) {
    const absl::Duration delay = PacingDelay(
        cost, options_.bandwidth_gbps, options_.tflops, absl::Now() - start);
    if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
  }
  busy_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - kernel_start));
  kernel_bytes_.fetch_add(uint64_t(cost.bytes));
  (status.ok() ? frames_ : frame_errors_).fetch_add(1);
  return status;
}

absl::Status KaratDevice::ProcessLocked(const FrameView& frame,
                                        std::vector<float>* out,
                                        uint64_t* ingested, KernelCost* cost,
                                        bool* skipped) {
  const FrameHeader& h = frame.header;
  const auto type = static_cast<FrameType>(h.type);
  auto it = sessions_.find(h.session);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown session ", h.session, " on device ", index_));
  }
  Session& session = it->second;
  const FrameKey key = KeyOf(h);
  switch (JudgeFrame(key, session.fence, session.last)) {
    case FrameVerdict::kSuperseded:
      frames_superseded_.fetch_add(1);
      return absl::FailedPreconditionError(absl::StrCat(
          "turn ", h.turn, " of session ", h.session,
          " was superseded by turn ", session.fence,
          " (cancelled or failed while its step ran)"));
    case FrameVerdict::kStale:
      frames_stale_.fetch_add(1);
      *skipped = true;
      return absl::OkStatus();
    case FrameVerdict::kRepeat:
      if (type == FrameType::kIndexQK) {
        frames_stale_.fetch_add(1);
        *skipped = true;
        return absl::OkStatus();
      }
      // The answer to this attention frame was lost (or is late): nothing
      // was applied since, so the kept output, or the same computation
      // again, is the same bits; it stores nothing new.
      frames_repeated_.fetch_add(1);
      if (!session.last_out.empty()) {
        *out = session.last_out;
        return absl::OkStatus();
      }
      RETURN_IF_ERROR(ApplyLocked(frame, &session, out, ingested, cost));
      *ingested = 0;
      return absl::OkStatus();
    case FrameVerdict::kApply:
      break;
  }
  RETURN_IF_ERROR(ApplyLocked(frame, &session, out, ingested, cost));
  session.last = key;
  session.last_out.clear();
  if (type == FrameType::kIndexQK) {
    session.selection_key = key;
  } else if (h.n_tokens <= kKeptOutputTokens || EndsPrefill(frame)) {
    session.last_out = *out;
  }
  return absl::OkStatus();
}

absl::Status KaratDevice::ApplyLocked(const FrameView& frame, Session* sp,
                                      std::vector<float>* out,
                                      uint64_t* ingested, KernelCost* cost) {
  const FrameHeader& h = frame.header;
  const auto type = static_cast<FrameType>(h.type);
  const int layer = int(h.layer);
  const int n = int(h.n_tokens);
  const int pos_start = int(h.pos_start);
  const uint64_t un = h.n_tokens;
  const AttnShapes& s = shapes_;
  Session& session = *sp;

  if (type == FrameType::kIndexQK) {
    if (!config_.HasIndexer(layer) || s.index_dim == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " runs no indexer"));
    }
    if (h.n_sections != 5) {
      return absl::InvalidArgumentError(absl::StrCat(
          "IndexQK carries ", h.n_sections, " sections; expected 5"));
    }
    const uint64_t hi = s.index_heads, di = s.index_dim;
    RETURN_IF_ERROR(CheckSection(frame, 0, un * hi * di, "q_codes"));
    RETURN_IF_ERROR(CheckSection(frame, 1, un * hi * 4, "q_scales"));
    RETURN_IF_ERROR(CheckSection(frame, 2, un * hi * 4, "weights"));
    RETURN_IF_ERROR(CheckSection(frame, 3, un * di, "k_codes"));
    RETURN_IF_ERROR(CheckSection(frame, 4, un * 4, "k_scales"));
    RETURN_IF_ERROR(EnsureRoom(h.session, &session, pos_start + n));
    IndexInputs in;
    in.q_codes = reinterpret_cast<const uint8_t*>(frame.sections[0].data());
    in.q_scales = reinterpret_cast<const float*>(frame.sections[1].data());
    in.weights = reinterpret_cast<const float*>(frame.sections[2].data());
    in.k_codes = reinterpret_cast<const uint8_t*>(frame.sections[3].data());
    in.k_scales = reinterpret_cast<const float*>(frame.sections[4].data());
    RETURN_IF_ERROR(RunIndexer(s, layer, pos_start, n, in, session.cache.get(),
                               &session.selection, pool_.get(), cost));
    *ingested = un * (di + 4);
  } else if (method_ != nullptr) {
    RETURN_IF_ERROR(ProcessGqa(frame, &session, out, cost));
    *ingested = un * uint64_t(s.kv_dim) * 2;
  } else {
    if (h.n_sections != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AttnQKV carries ", h.n_sections, " sections; expected 2"));
    }
    RETURN_IF_ERROR(CheckSection(
        frame, 0, un * uint64_t(s.heads) * uint64_t(s.q_dim) * 4, "q"));
    RETURN_IF_ERROR(CheckSection(frame, 1, un * uint64_t(s.kv_dim) * 2, "kv"));
    RETURN_IF_ERROR(EnsureRoom(h.session, &session, pos_start + n));
    // The selection must be this segment's, from its own index frame (a
    // lost or late one leaves another layer's or step's): the sender is
    // asked to send both again. A segment beyond the stored positions is
    // the kernel's error to report.
    const std::optional<FrameKey> need = NeededSelection(config_, KeyOf(h));
    if (need.has_value() && session.selection_key != need &&
        pos_start <= session.cache->length(layer)) {
      frames_without_index_.fetch_add(1);
      return absl::AbortedError(absl::StrCat(
          "no index keys of layer ", need->layer, " for positions ",
          pos_start, "..", pos_start + n - 1, " of turn ", h.turn,
          " arrived before this attention frame; resend both"));
    }
    AttnInputs in;
    in.q = reinterpret_cast<const float*>(frame.sections[0].data());
    in.kv = reinterpret_cast<const uint16_t*>(frame.sections[1].data());
    // Layers without their own indexer attend to the selection the last
    // indexer layer left for this segment (cross-layer index reuse, §II-B).
    const SelectionState* sel = config_.attention.type == AttentionType::kMlaDsa
                                    ? &session.selection
                                    : nullptr;
    out->assign(size_t(n) * s.heads * s.out_dim, 0.0f);
    RETURN_IF_ERROR(RunAttention(s, layer, pos_start, n, in,
                                 session.cache.get(), sel, out->data(),
                                 pool_.get(), cost));
    *ingested = un * uint64_t(s.kv_dim) * 2;
  }
  session.ingested_bytes += *ingested;
  // Bytes read from the pages spilled to other devices: the frame's share
  // in proportion to the layer's stored positions on them.
  const int length = session.cache->length(layer);
  const int spilled = session.cache->SpilledPositions(layer);
  if (spilled > 0 && length > 0) {
    cross_device_bytes_.fetch_add(
        uint64_t(cost->bytes * double(spilled) / double(length)));
  }
  KLOG(Debug, "karat_node")
      << "session=" << ShortKey(h.session) << " device=" << index_
      << " layer=" << layer << " " << FrameTypeName(h.type) << " positions "
      << pos_start << ".." << pos_start + n - 1
      << " ingested_bytes=" << session.ingested_bytes;
  return absl::OkStatus();
}

size_t KaratDevice::capacity_bytes() const {
  return size_t(arena_->total_pages()) * arena_->page_bytes();
}

size_t KaratDevice::used_bytes() const { return arena_->used_bytes(); }

DeviceMetrics KaratDevice::Metrics() const {
  DeviceMetrics m;
  m.busy_seconds = double(busy_ns_.load()) * 1e-9;
  m.frames = frames_.load();
  m.frame_errors = frame_errors_.load();
  m.frames_stale = frames_stale_.load();
  m.frames_repeated = frames_repeated_.load();
  m.frames_superseded = frames_superseded_.load();
  m.frames_without_index = frames_without_index_.load();
  m.kernel_bytes = kernel_bytes_.load();
  m.cross_device_bytes = cross_device_bytes_.load();
  m.used_bytes = used_bytes();
  m.capacity_bytes = capacity_bytes();
  const int64_t page = int64_t(layout_.page_bytes);
  m.spilled_bytes =
      uint64_t(std::max<int64_t>(spilled_pages_.load(), 0) * page);
  // Counters read one after the other: clamp a momentary mismatch.
  const int64_t hosted = int64_t(arena_->total_pages() - arena_->free_pages()) -
                         home_pages_.load();
  m.hosted_bytes = uint64_t(std::max<int64_t>(hosted, 0) * page);
  m.metadata_bytes = metadata_bytes_.load();
  m.sessions = sessions();
  return m;
}

absl::Status KaratDevice::ProcessGqa(const FrameView& frame, Session* session,
                                     std::vector<float>* out,
                                     KernelCost* cost) {
  const FrameHeader& h = frame.header;
  const AttnShapes& s = shapes_;
  const uint64_t un = h.n_tokens;
  const int n = int(h.n_tokens), pos_start = int(h.pos_start);
  if (h.n_sections != 2 && h.n_sections != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttnQKV carries ", h.n_sections, " sections; expected 2 or 3"));
  }
  RETURN_IF_ERROR(CheckSection(
      frame, 0, un * uint64_t(s.heads) * uint64_t(s.q_dim) * 4, "q"));
  RETURN_IF_ERROR(CheckSection(frame, 1, un * uint64_t(s.kv_dim) * 2, "kv"));
  uint32_t flags = 0;
  if (h.n_sections == 3) {
    RETURN_IF_ERROR(CheckSection(frame, 2, 4, "flags"));
    std::memcpy(&flags, frame.sections[2].data(), 4);
    if ((flags & ~kAttnFlagEndsPrefill) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("AttnQKV flags ", flags, " has unknown bits"));
    }
  }
  RETURN_IF_ERROR(EnsureRoom(h.session, session, pos_start + n));
  AttnInputs in;
  in.q = reinterpret_cast<const float*>(frame.sections[0].data());
  in.kv = reinterpret_cast<const uint16_t*>(frame.sections[1].data());
  out->assign(size_t(n) * s.heads * s.out_dim, 0.0f);
  absl::Status status = RunAttentionLayer(
      *method_, int(h.layer), pos_start, n, in,
      (flags & kAttnFlagEndsPrefill) != 0, session->cache.get(),
      session->method_state.get(), out->data(), cost, pool_.get());
  const size_t bytes = session->method_state->bytes();
  metadata_bytes_.fetch_add(bytes - session->metadata_bytes);
  session->metadata_bytes = bytes;
  absl::Status charged = ChargeMetadata(h.session, session);
  return status.ok() ? charged : status;
}

cluster::DeviceInfo KaratDevice::Info() const {
  cluster::DeviceInfo info;
  info.set_device(index_);
  info.set_capacity_bytes(int64_t(capacity_bytes()));
  info.set_used_bytes(int64_t(used_bytes()));
  info.set_sessions(sessions());
  info.set_cores(options_.cores);
  return info;
}

}  // namespace karat
