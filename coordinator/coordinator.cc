#include "coordinator/coordinator.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
#include "common/log.h"
#include "common/tokenizer.h"
#include "coordinator/cluster_config.h"
#include "coordinator/placement.h"
#include "karat.grpc.pb.h"

namespace karat::coordinator {
namespace {

namespace v1 = ::karat::v1;
namespace cl = ::karat::cluster;

constexpr char kLog[] = "coordinator";

struct Node {
  uint32_t id = 0;
  std::string name;
  NodeRole role = NodeRole::kKarat;
  std::string grpc_address;
  std::string fabric_address;
  std::string provider;
  std::string fingerprint;
  std::vector<cl::DeviceInfo> devices;
  std::map<std::string, double> stats;
  absl::Time last_seen;
  int active_turns = 0;
  std::shared_ptr<grpc::Channel> channel;
};

struct Session {
  std::string id;
  uint64_t key = 0;  // data-plane session number
  uint64_t seed = 0;
  std::vector<int32_t> history;  // BOS, prompts, generated tokens
  int kv_len = 0;                // positions whose KV is on the home device
  int turns = 0;
  bool has_home = false;
  HomeDevice home;
  bool busy = false;
  // The running turn's call while busy (valid until busy is cleared).
  grpc::ServerContext* turn_ctx = nullptr;
};

const char* RoleName(NodeRole r) { return r == NodeRole::kGpu ? "gpu" : "karat"; }

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

// Shared state of both services. Every field is guarded by mu_; RPCs to
// nodes are made without holding it (a session's `busy` flag keeps its
// history stable meanwhile).
class State {
 public:
  explicit State(const Options& options)
      : links_(options.links), options_(options) {}

  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }
  const Options& options() const { return options_; }

  bool AliveLocked(const Node& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Now() - n.last_seen <= absl::Milliseconds(options_.node_timeout_ms);
  }

  ClusterState SnapshotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ClusterState state;
    for (const auto& [id, n] : nodes_) {
      NodeState ns;
      ns.id = id;
      ns.name = n.name;
      ns.role = n.role;
      ns.alive = AliveLocked(n);
      ns.active_turns = n.active_turns;
      for (const auto& d : n.devices)
        ns.devices.push_back({d.device(), d.capacity_bytes(), d.used_bytes()});
      state.nodes.push_back(std::move(ns));
    }
    return state;
  }

  mutable absl::Mutex mu_;
  std::map<uint32_t, Node> nodes_ ABSL_GUARDED_BY(mu_);
  uint32_t next_node_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::string gpu_fingerprint_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> session_keys_ ABSL_GUARDED_BY(mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
  // GPU calls of running turns, cancelled at shutdown.
  std::set<grpc::ClientContext*> running_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  int active_generations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tokens_generated_ ABSL_GUARDED_BY(mu_) = 0;
  // Link-emulation rules (Admin API), pushed to every node.
  std::vector<cl::LinkConfig> links_ ABSL_GUARDED_BY(mu_);
  // Incremented on every change of the table or of the membership; a push
  // carries the version it was built from.
  uint64_t links_version_ ABSL_GUARDED_BY(mu_) = 0;

 private:
  const Options options_;
};

// ---------------------------------------------------------------------------
// Link emulation: pushes the rule table to nodes (GpuNode/KaratNode
// SetLinks), with each node's name by id so that rules can use names.

struct LinkPushTarget {
  std::string name;
  NodeRole role;
  std::shared_ptr<grpc::Channel> channel;
};

// Builds the request and the alive targets. Requires s->mu_.
cl::SetLinksRequest LinkPushLocked(State* s, std::vector<LinkPushTarget>* targets)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
  cl::SetLinksRequest req;
  for (const auto& l : s->links_) *req.add_links() = l;
  req.set_seed(s->options().link_seed);
  for (const auto& [id, n] : s->nodes_) {
    (*req.mutable_node_names())[id] = n.name;
    if (s->AliveLocked(n)) targets->push_back({n.name, n.role, n.channel});
  }
  return req;
}

// Sends `req` to every target; returns "name: reason" for each failure.
std::vector<std::string> PushLinks(const cl::SetLinksRequest& req,
                                   const std::vector<LinkPushTarget>& targets,
                                   int timeout_ms) {
  std::vector<std::string> failed;
  for (const LinkPushTarget& t : targets) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() +
                                        absl::Milliseconds(timeout_ms)));
    cl::SetLinksResponse resp;
    grpc::Status st;
    if (t.role == NodeRole::kGpu) {
      st = cl::GpuNode::NewStub(t.channel)->SetLinks(&ctx, req, &resp);
    } else {
      st = cl::KaratNode::NewStub(t.channel)->SetLinks(&ctx, req, &resp);
    }
    if (!st.ok()) {
      KLOG(Warning, kLog) << "cannot push link settings to " << t.name << ": "
                          << st.error_message();
      failed.push_back(absl::StrCat(t.name, ": ", st.error_message()));
    }
  }
  return failed;
}

// Pushes the table in the background after registrations (a node that just
// registered, and the KARAT nodes that must learn its name).
class LinkPusher {
 public:
  explicit LinkPusher(State* s) : s_(s), thread_([this] { Loop(); }) {}
  ~LinkPusher() { Stop(); }

  void Request() {
    absl::MutexLock lock(&mu_);
    pending_ = true;
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      stop_ = true;
    }
    thread_.join();
  }

 private:
  void Loop() {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return pending_ || stop_;
        };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        pending_ = false;
      }
      // Give a node that just registered a moment to serve its RPCs.
      absl::SleepFor(absl::Milliseconds(100));
      std::vector<LinkPushTarget> targets;
      cl::SetLinksRequest req;
      {
        absl::MutexLock lock(&s_->mu_);
        if (s_->links_.empty()) continue;
        req = LinkPushLocked(s_, &targets);
      }
      PushLinks(req, targets, s_->options().node_call_timeout_ms);
    }
  }

  State* const s_;
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// karat.cluster.Admin: link emulation at run time.
class AdminService final : public cl::Admin::Service {
 public:
  explicit AdminService(State* state) : s_(state) {}

  grpc::Status SetLink(grpc::ServerContext*, const cl::SetLinkRequest* req,
                       cl::SetLinkResponse* resp) override {
    const absl::Status valid = ValidateLinkConfig(req->link(), "link");
    if (!valid.ok()) return ToGrpc(valid);
    const cl::LinkConfig& link = req->link();
    std::vector<LinkPushTarget> targets;
    cl::SetLinksRequest push;
    {
      absl::MutexLock lock(&s_->mu_);
      auto& links = s_->links_;
      auto it = std::find_if(links.begin(), links.end(), [&](const auto& l) {
        return l.source() == link.source() &&
               l.destination() == link.destination();
      });
      if (req->remove()) {
        if (it == links.end()) {
          return grpc::Status(
              grpc::StatusCode::NOT_FOUND,
              absl::StrCat("no link rule ", link.source(), " -> ",
                           link.destination()));
        }
        links.erase(it);
      } else if (it != links.end()) {
        *it = link;
      } else {
        links.push_back(link);
      }
      ++s_->links_version_;
      push = LinkPushLocked(s_, &targets);
      for (const auto& l : links) *resp->add_links() = l;
    }
    KLOG(Info, kLog) << (req->remove() ? "link rule removed: " : "link rule set: ")
                     << link.ShortDebugString();
    for (std::string& f :
         PushLinks(push, targets, s_->options().node_call_timeout_ms)) {
      resp->add_not_applied(std::move(f));
    }
    return grpc::Status::OK;
  }

  grpc::Status GetLinks(grpc::ServerContext*, const cl::GetLinksRequest*,
                        cl::GetLinksResponse* resp) override {
    absl::MutexLock lock(&s_->mu_);
    for (const auto& l : s_->links_) *resp->add_links() = l;
    resp->set_seed(s_->options().link_seed);
    return grpc::Status::OK;
  }

 private:
  State* s_;
};

// ---------------------------------------------------------------------------
// Membership (karat.cluster.Coordinator).

class MembershipService final : public cl::Coordinator::Service {
 public:
  explicit MembershipService(State* state) : s_(state) {}

  // Told after every registration (pushes the link table).
  void set_link_pusher(LinkPusher* pusher) { pusher_ = pusher; }

  grpc::Status RegisterNode(grpc::ServerContext*,
                            const cl::RegisterNodeRequest* req,
                            cl::RegisterNodeResponse* resp) override {
    NodeRole role;
    if (req->role() == "gpu") {
      role = NodeRole::kGpu;
    } else if (req->role() == "karat") {
      role = NodeRole::kKarat;
    } else {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("role must be \"gpu\" or \"karat\", got \"",
                                       req->role(), "\""));
    }
    if (req->name().empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "node name must not be empty");
    if (req->grpc_address().empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("node ", req->name(),
                                       ": grpc_address must not be empty"));
    auto channel = grpc::CreateChannel(req->grpc_address(),
                                       grpc::InsecureChannelCredentials());
    absl::MutexLock lock(&s_->mu_);
    if (role == NodeRole::kGpu && !req->model_fingerprint().empty()) {
      if (s_->gpu_fingerprint_.empty()) {
        s_->gpu_fingerprint_ = req->model_fingerprint();
      } else if (s_->gpu_fingerprint_ != req->model_fingerprint()) {
        return grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("node ", req->name(), " serves model ",
                         req->model_fingerprint(), " but the cluster serves ",
                         s_->gpu_fingerprint_));
      }
    }
    for (auto it = s_->nodes_.begin(); it != s_->nodes_.end(); ++it) {
      if (it->second.name == req->name()) {
        KLOG(Info, kLog) << "node " << req->name() << " re-registered; id "
                         << it->first << " retired";
        s_->nodes_.erase(it);
        break;
      }
    }
    Node n;
    n.id = s_->next_node_id_++;
    n.name = req->name();
    n.role = role;
    n.grpc_address = req->grpc_address();
    n.fabric_address = req->fabric_address();
    n.provider = req->provider();
    n.fingerprint = req->model_fingerprint();
    n.devices.assign(req->devices().begin(), req->devices().end());
    n.last_seen = s_->Now();
    n.channel = std::move(channel);
    KLOG(Info, kLog) << "node " << n.name << " registered: id=" << n.id
                     << " role=" << RoleName(role) << " grpc=" << n.grpc_address
                     << " provider=" << n.provider
                     << " devices=" << n.devices.size();
    resp->set_node_id(n.id);
    resp->set_heartbeat_interval_ms(s_->options().heartbeat_interval_ms);
    s_->nodes_.emplace(n.id, std::move(n));
    if (pusher_ != nullptr && !s_->links_.empty()) pusher_->Request();
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const cl::HeartbeatRequest* req,
                         cl::HeartbeatResponse* resp) override {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->nodes_.find(req->node_id());
    if (it == s_->nodes_.end()) {
      resp->set_known(false);
      return grpc::Status::OK;
    }
    Node& n = it->second;
    if (req->devices_size() > 0)
      n.devices.assign(req->devices().begin(), req->devices().end());
    for (const auto& [k, v] : req->stats()) n.stats[k] = v;
    n.last_seen = s_->Now();
    resp->set_known(true);
    return grpc::Status::OK;
  }

 private:
  State* s_;
  LinkPusher* pusher_ = nullptr;
};

// ---------------------------------------------------------------------------
// Client API (karat.v1.Karat).

// Everything a turn needs once it is admitted, copied out of the state.
struct AdmittedTurn {
  uint64_t key = 0;
  uint64_t seed = 0;
  uint32_t gpu_id = 0;
  std::string gpu_name;
  std::shared_ptr<grpc::Channel> gpu_channel;
  cl::KaratPlacement placement;
  int pos_start = 0;
  std::vector<int32_t> feed;
};

class KaratService final : public v1::Karat::Service {
 public:
  explicit KaratService(State* state) : s_(state) {}

  grpc::Status CreateSession(grpc::ServerContext*,
                             const v1::CreateSessionRequest* req,
                             v1::Session* resp) override {
    absl::MutexLock lock(&s_->mu_);
    if (s_->shutting_down_)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "coordinator is shutting down");
    Session session;
    do {
      session.id = absl::StrFormat("s-%016x", absl::Uniform<uint64_t>(s_->rng_));
    } while (s_->sessions_.count(session.id));
    do {
      session.key = absl::Uniform<uint64_t>(s_->rng_);
    } while (session.key == 0 || s_->session_keys_.count(session.key));
    session.seed = req->seed();
    s_->session_keys_.insert(session.key);
    FillSession(session, false, resp);
    KLOG(Info, kLog) << "session=" << session.id << " created seed="
                     << session.seed;
    s_->sessions_.emplace(session.id, std::move(session));
    return grpc::Status::OK;
  }

  grpc::Status GetSession(grpc::ServerContext*,
                          const v1::GetSessionRequest* req,
                          v1::Session* resp) override {
    WaitForCancelledTurn(req->session_id(), absl::Milliseconds(50));
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(req->session_id());
    if (it == s_->sessions_.end()) return NoSession(req->session_id());
    FillSession(it->second, req->include_tokens(), resp);
    return grpc::Status::OK;
  }

  grpc::Status CloseSession(grpc::ServerContext*,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse*) override {
    std::shared_ptr<grpc::Channel> home_channel;
    std::string home_name;
    uint64_t key = 0;
    WaitForCancelledTurn(req->session_id(), absl::Milliseconds(200));
    {
      absl::MutexLock lock(&s_->mu_);
      auto it = s_->sessions_.find(req->session_id());
      if (it == s_->sessions_.end()) return NoSession(req->session_id());
      if (it->second.busy)
        return grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("a generate is running on session ", req->session_id(),
                         "; cancel it before closing the session"));
      key = it->second.key;
      if (it->second.has_home) {
        auto n = s_->nodes_.find(it->second.home.node_id);
        if (n != s_->nodes_.end()) {
          home_channel = n->second.channel;
          home_name = n->second.name;
        }
      }
      s_->session_keys_.erase(key);
      s_->sessions_.erase(it);
    }
    KLOG(Info, kLog) << "session=" << req->session_id() << " closed";
    if (home_channel) {
      auto stub = cl::KaratNode::NewStub(home_channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(
                           s_->options().node_call_timeout_ms));
      cl::FreeSessionRequest freq;
      freq.set_session(key);
      cl::FreeSessionResponse fresp;
      grpc::Status st = stub->FreeSession(&ctx, freq, &fresp);
      if (!st.ok()) {
        // The session is closed either way; the node frees the pages when
        // it restarts or when it learns the session is gone.
        KLOG(Warning, kLog) << "session=" << req->session_id()
                            << " FreeSession on " << home_name
                            << " failed: " << st.error_message();
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status GetClusterStatus(grpc::ServerContext*,
                                const v1::GetClusterStatusRequest*,
                                v1::ClusterStatus* resp) override {
    absl::MutexLock lock(&s_->mu_);
    absl::Time now = s_->Now();
    for (const auto& [id, n] : s_->nodes_) {
      v1::NodeStatus* ns = resp->add_nodes();
      ns->set_name(n.name);
      ns->set_role(RoleName(n.role));
      ns->set_grpc_address(n.grpc_address);
      ns->set_provider(n.provider);
      ns->set_alive(s_->AliveLocked(n));
      ns->set_last_heartbeat_ms_ago(absl::ToInt64Milliseconds(now - n.last_seen));
      for (const auto& d : n.devices) {
        v1::DeviceStatus* ds = ns->add_devices();
        ds->set_device(d.device());
        ds->set_capacity_bytes(d.capacity_bytes());
        ds->set_used_bytes(d.used_bytes());
        ds->set_sessions(d.sessions());
        ds->set_cores(d.cores());
      }
      for (const auto& [k, v] : n.stats) (*ns->mutable_stats())[k] = v;
    }
    resp->set_sessions(static_cast<int32_t>(s_->sessions_.size()));
    resp->set_active_generations(s_->active_generations_);
    resp->set_tokens_generated(s_->tokens_generated_);
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext* ctx,
                        const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;

 private:
  static grpc::Status NoSession(const std::string& id) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("no session \"", id, "\" (unknown or closed)"));
  }

  void FillSession(const Session& s, bool tokens, v1::Session* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
    out->set_session_id(s.id);
    out->set_seed(s.seed);
    out->set_num_tokens(static_cast<int64_t>(s.history.size()));
    out->set_turns(s.turns);
    out->set_state(s.busy ? "generating" : "idle");
    if (s.has_home) {
      auto n = s_->nodes_.find(s.home.node_id);
      out->set_home_node(n != s_->nodes_.end() ? n->second.name : "");
      out->set_home_device(s.home.device);
    }
    if (tokens) {
      out->mutable_tokens()->Assign(s.history.begin(), s.history.end());
    }
  }

  // A client that cancels a Generate sees CANCELLED before the coordinator
  // has noticed and wound the turn down. So that the client's next call
  // sees the session idle with its final history, calls on a busy session
  // first wait up to `grace` for the running turn's cancellation to become
  // visible, and then (bounded) for the turn to end.
  void WaitForCancelledTurn(const std::string& session_id,
                            absl::Duration grace) const;

  absl::Status Validate(const v1::GenerateRequest& req) const;
  // Finds a home with room for `tokens` positions (reserving it) and
  // records it in the session. The session is left unchanged on failure.
  absl::Status PlaceTurn(const std::string& session_id, int tokens);

  State* s_;
};

void KaratService::WaitForCancelledTurn(const std::string& session_id,
                                        absl::Duration grace) const {
  // Real time, not the options' clock: this bounds a wait on threads.
  const absl::Time start = absl::Now();
  while (true) {
    {
      absl::MutexLock lock(&s_->mu_);
      auto it = s_->sessions_.find(session_id);
      if (it == s_->sessions_.end() || !it->second.busy) return;
      bool cancelled =
          it->second.turn_ctx != nullptr && it->second.turn_ctx->IsCancelled();
      absl::Duration waited = absl::Now() - start;
      if (!cancelled && waited >= grace) return;
      if (waited >= grace + absl::Seconds(5)) return;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

absl::Status KaratService::Validate(const v1::GenerateRequest& req) const {
  int limit = s_->options().max_new_tokens_limit;
  if (req.max_new_tokens() < 1 || req.max_new_tokens() > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be in [1, ", limit, "], got ",
                     req.max_new_tokens()));
  }
  if (req.prompt().empty() && req.prompt_tokens().empty())
    return absl::InvalidArgumentError(
        "the prompt is empty (set prompt or prompt_tokens)");
  if (!req.prompt().empty() && !req.prompt_tokens().empty())
    return absl::InvalidArgumentError("set prompt or prompt_tokens, not both");
  for (int i = 0; i < req.prompt_tokens_size(); ++i) {
    int32_t t = req.prompt_tokens(i);
    if (t < 0 || t >= kVocabSize)
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_tokens[", i, "] = ", t, " is outside [0, ",
                       kVocabSize - 1, "]"));
  }
  if (!std::isfinite(req.temperature()) || req.temperature() < 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be finite and >= 0, got ", req.temperature()));
  return absl::OkStatus();
}

absl::Status KaratService::PlaceTurn(const std::string& session_id,
                                     int tokens) {
  struct Try {
    HomeDevice home;
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Try> tries;
  uint64_t key = 0;
  bool replacing = false;
  {
    absl::MutexLock lock(&s_->mu_);
    Session& session = s_->sessions_.at(session_id);
    key = session.key;
    if (session.has_home) {
      auto n = s_->nodes_.find(session.home.node_id);
      if (n != s_->nodes_.end() && s_->AliveLocked(n->second)) {
        tries.push_back({session.home, n->second.name, n->second.channel});
      } else {
        // The home node is gone: place again and rebuild the KV from the
        // token log by prefill (DESIGN.md §7).
        replacing = true;
        KLOG(Warning, kLog) << "session=" << session_id << " home node "
                            << session.home.node_id
                            << " is not alive; placing the session again";
      }
    }
    if (tries.empty()) {
      for (const HomeDevice& h : ChooseHomeDevices(s_->SnapshotLocked())) {
        const Node& n = s_->nodes_.at(h.node_id);
        tries.push_back({h, n.name, n.channel});
      }
    }
  }
  absl::Status other_error;
  for (const Try& t : tries) {
    auto stub = cl::KaratNode::NewStub(t.channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(s_->options().node_call_timeout_ms));
    cl::ReserveRequest rreq;
    rreq.set_session(key);
    rreq.set_device(t.home.device);
    rreq.set_tokens(tokens);
    cl::ReserveResponse rresp;
    grpc::Status st = stub->Reserve(&ctx, rreq, &rresp);
    if (st.ok()) {
      absl::MutexLock lock(&s_->mu_);
      Session& session = s_->sessions_.at(session_id);
      if (!session.has_home || replacing) {
        KLOG(Info, kLog) << "session=" << session_id << " home " << t.name
                         << "/" << t.home.device;
      }
      if (replacing) session.kv_len = 0;
      session.has_home = true;
      session.home = t.home;
      auto n = s_->nodes_.find(t.home.node_id);
      if (n != s_->nodes_.end()) {
        for (auto& d : n->second.devices)
          if (d.device() == t.home.device) d.set_used_bytes(rresp.used_bytes());
      }
      return absl::OkStatus();
    }
    if (st.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      KLOG(Warning, kLog) << "session=" << session_id << " Reserve on "
                          << t.name << "/" << t.home.device
                          << " failed: " << st.error_message();
      other_error = absl::UnavailableError(
          absl::StrCat("KARAT node ", t.name, ": ", st.error_message()));
    }
  }
  if (!other_error.ok()) return other_error;
  if (tries.empty())
    return absl::UnavailableError("no alive KARAT node has a device");
  return absl::ResourceExhaustedError(
      absl::StrCat("turn needs ", tokens, " tokens of KV; no device has room"));
}

grpc::Status KaratService::Generate(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const absl::Time arrived = s_->Now();
  const std::string& sid = req->session_id();
  WaitForCancelledTurn(sid, absl::Milliseconds(200));
  std::vector<int32_t> prompt = req->prompt_tokens().empty()
                                    ? EncodeText(req->prompt())
                                    : std::vector<int32_t>(
                                          req->prompt_tokens().begin(),
                                          req->prompt_tokens().end());
  int reserve_tokens = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it == s_->sessions_.end()) return NoSession(sid);
    absl::Status valid = Validate(*req);
    if (!valid.ok()) return ToGrpc(valid);
    Session& session = it->second;
    if (session.busy)
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("a generate is already running on session ", sid));
    if (s_->shutting_down_)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "coordinator is shutting down");
    bool gpu = false, karat = false;
    for (const auto& [id, n] : s_->nodes_) {
      if (!s_->AliveLocked(n)) continue;
      (n.role == NodeRole::kGpu ? gpu : karat) = true;
    }
    if (!gpu || !karat)
      return grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("no alive ", !gpu ? "GPU" : "KARAT",
                       " node is registered; start one and retry"));
    session.busy = true;
    session.turn_ctx = ctx;
    reserve_tokens = static_cast<int>(session.history.size()) +
                     (session.history.empty() ? 1 : 0) +
                     static_cast<int>(prompt.size()) + req->max_new_tokens();
  }
  // Clears the busy flag however the handler ends.
  struct BusyGuard {
    State* s;
    std::string id;
    ~BusyGuard() {
      absl::MutexLock lock(&s->mu_);
      auto it = s->sessions_.find(id);
      if (it != s->sessions_.end()) {
        it->second.busy = false;
        it->second.turn_ctx = nullptr;
      }
    }
  } busy_guard{s_, sid};

  absl::Status placed = PlaceTurn(sid, reserve_tokens);
  if (!placed.ok()) {
    KLOG(Info, kLog) << "session=" << sid << " turn refused: " << placed;
    return ToGrpc(placed);
  }

  AdmittedTurn turn;
  {
    absl::MutexLock lock(&s_->mu_);
    Session& session = s_->sessions_.at(sid);
    std::optional<uint32_t> gpu_id = ChooseGpuNode(s_->SnapshotLocked());
    auto home = s_->nodes_.find(session.home.node_id);
    if (!gpu_id || home == s_->nodes_.end())
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "no alive GPU node is registered; start one and retry");
    Node& gpu = s_->nodes_.at(*gpu_id);
    gpu.active_turns++;
    s_->active_generations_++;
    turn.key = session.key;
    turn.seed = session.seed;
    turn.gpu_id = gpu.id;
    turn.gpu_name = gpu.name;
    turn.gpu_channel = gpu.channel;
    turn.placement.set_node_id(home->second.id);
    turn.placement.set_node_name(home->second.name);
    turn.placement.set_fabric_address(home->second.fabric_address);
    turn.placement.set_device(session.home.device);
    if (session.history.empty()) session.history.push_back(kBosToken);
    session.history.insert(session.history.end(), prompt.begin(), prompt.end());
    turn.pos_start = session.kv_len;
    turn.feed.assign(session.history.begin() + session.kv_len,
                     session.history.end());
    session.turns++;
  }
  struct ActiveGuard {
    State* s;
    uint32_t gpu_id;
    ~ActiveGuard() {
      absl::MutexLock lock(&s->mu_);
      s->active_generations_--;
      auto n = s->nodes_.find(gpu_id);
      if (n != s->nodes_.end()) n->second.active_turns--;
    }
  } active_guard{s_, turn.gpu_id};

  KLOG(Info, kLog) << "session=" << sid << " turn on " << turn.gpu_name
                   << " home=" << turn.placement.node_name() << "/"
                   << turn.placement.device() << " pos_start=" << turn.pos_start
                   << " feed=" << turn.feed.size()
                   << " max_new_tokens=" << req->max_new_tokens();

  cl::RunTurnRequest run;
  run.set_session(turn.key);
  run.set_seed(turn.seed);
  run.set_temperature(req->temperature());
  run.set_pos_start(turn.pos_start);
  run.mutable_feed_tokens()->Assign(turn.feed.begin(), turn.feed.end());
  run.set_max_new_tokens(req->max_new_tokens());
  *run.mutable_placement() = turn.placement;

  grpc::ClientContext gpu_ctx;
  {
    absl::MutexLock lock(&s_->mu_);
    if (s_->shutting_down_) gpu_ctx.TryCancel();
    s_->running_.insert(&gpu_ctx);
  }
  // Watches for the client going away and cancels the GPU call.
  absl::Mutex watch_mu;
  bool turn_over = false;
  std::atomic<bool> client_cancelled{false};
  std::thread watcher([&] {
    absl::MutexLock lock(&watch_mu);
    while (!turn_over) {
      watch_mu.AwaitWithTimeout(absl::Condition(&turn_over),
                                absl::Milliseconds(20));
      if (!turn_over && ctx->IsCancelled()) {
        client_cancelled = true;
        gpu_ctx.TryCancel();
        return;
      }
    }
  });

  auto stub = cl::GpuNode::NewStub(turn.gpu_channel);
  std::unique_ptr<grpc::ClientReader<cl::RunTurnEvent>> reader =
      stub->RunTurn(&gpu_ctx, run);
  cl::RunTurnEvent ev;
  int generated = 0;
  bool eos = false;
  int64_t ttft_us = 0;
  absl::Time previous = arrived;
  while (reader->Read(&ev)) {
    {
      absl::MutexLock lock(&s_->mu_);
      Session& session = s_->sessions_.at(sid);
      session.history.push_back(ev.token_id());
      session.kv_len = ev.kv_len();
      s_->tokens_generated_++;
    }
    generated++;
    absl::Time now = s_->Now();
    int64_t latency = absl::ToInt64Microseconds(now - previous);
    if (generated == 1) ttft_us = latency;
    previous = now;
    if (ev.token_id() == kEosToken) eos = true;
    v1::GenerateResponse out;
    v1::GeneratedToken* tok = out.mutable_token();
    tok->set_token_id(ev.token_id());
    tok->set_text(TokenText(ev.token_id()));
    tok->set_position(ev.position());
    tok->set_latency_us(latency);
    if (!writer->Write(out)) {
      client_cancelled = true;
      gpu_ctx.TryCancel();
      while (reader->Read(&ev)) {
      }
      break;
    }
  }
  grpc::Status gpu_status = reader->Finish();
  {
    absl::MutexLock lock(&watch_mu);
    turn_over = true;
  }
  watcher.join();
  bool shutdown_cancel = false;
  {
    absl::MutexLock lock(&s_->mu_);
    s_->running_.erase(&gpu_ctx);
    shutdown_cancel = s_->shutting_down_;
  }
  const int64_t total_us = absl::ToInt64Microseconds(s_->Now() - arrived);
  std::string reason;
  if (client_cancelled || ctx->IsCancelled()) {
    KLOG(Info, kLog) << "session=" << sid << " turn cancelled by the client after "
                     << generated << " tokens";
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
  }
  if (!gpu_status.ok() && shutdown_cancel) {
    reason = "cancelled";
  } else if (!gpu_status.ok()) {
    KLOG(Warning, kLog) << "session=" << sid << " GPU node " << turn.gpu_name
                        << " failed after " << generated
                        << " tokens: " << gpu_status.error_message();
    grpc::StatusCode code = gpu_status.error_code();
    switch (code) {
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
      case grpc::StatusCode::FAILED_PRECONDITION:
        break;
      default:
        code = grpc::StatusCode::UNAVAILABLE;
    }
    return grpc::Status(code,
                        absl::StrCat("GPU node ", turn.gpu_name,
                                     " failed during the turn after ", generated,
                                     " tokens: ", gpu_status.error_message()));
  } else {
    reason = eos ? "eos" : "length";
  }
  v1::GenerateResponse done;
  v1::TurnDone* d = done.mutable_done();
  d->set_finish_reason(reason);
  d->set_prompt_tokens(static_cast<int32_t>(prompt.size()));
  d->set_generated_tokens(generated);
  d->set_ttft_us(ttft_us);
  d->set_total_us(total_us);
  writer->Write(done);
  KLOG(Info, kLog) << "session=" << sid << " turn done: " << reason << " "
                   << generated << " tokens, ttft_us=" << ttft_us
                   << " total_us=" << total_us;
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------

class CoordinatorImpl final : public Coordinator {
 public:
  explicit CoordinatorImpl(const Options& options)
      : state_(options),
        karat_(&state_),
        membership_(&state_),
        admin_(&state_),
        link_pusher_(&state_) {
    membership_.set_link_pusher(&link_pusher_);
  }
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(5)); }

  absl::Status Init() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(state_.options().listen,
                             grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&karat_);
    builder.RegisterService(&membership_);
    builder.RegisterService(&admin_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", state_.options().listen));
    }
    const std::string& listen = state_.options().listen;
    std::string host = listen.substr(0, listen.rfind(':'));
    address_ = absl::StrCat(host, ":", port);
    KLOG(Info, kLog) << "listening on " << address_;
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  void Shutdown(absl::Duration deadline) override {
    {
      absl::MutexLock lock(&shutdown_mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    {
      absl::MutexLock lock(&state_.mu_);
      state_.shutting_down_ = true;
      for (grpc::ClientContext* c : state_.running_) c->TryCancel();
    }
    if (server_) {
      server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
      server_->Wait();
    }
    link_pusher_.Stop();
    KLOG(Info, kLog) << "shut down";
  }

  void Wait() override {
    if (server_) server_->Wait();
  }

 private:
  State state_;
  KaratService karat_;
  MembershipService membership_;
  AdminService admin_;
  LinkPusher link_pusher_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(
    const Options& options) {
  if (options.max_new_tokens_limit < 1)
    return absl::InvalidArgumentError("max_new_tokens_limit must be >= 1");
  if (options.node_timeout_ms < 1)
    return absl::InvalidArgumentError("node_timeout_ms must be >= 1");
  auto impl = std::make_unique<CoordinatorImpl>(options);
  absl::Status st = impl->Init();
  if (!st.ok()) return st;
  return std::unique_ptr<Coordinator>(std::move(impl));
}

}  // namespace karat::coordinator
