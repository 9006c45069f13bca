#include "tests/integration/faults_util.h"

#include <algorithm>
#include <fstream>
#include <thread>

#include "cluster.grpc.pb.h"
#include "common/tokenizer.h"

namespace karat::testing {

CallResult GenerateCall(karat::v1::Karat::Stub* stub,
                        const std::string& session, const std::string& prompt,
                        int max_new_tokens, float temperature,
                        const CallOptions& options) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options.deadline);
  karat::v1::GenerateRequest req;
  req.set_session_id(session);
  req.set_prompt(prompt);
  req.set_max_new_tokens(max_new_tokens);
  req.set_temperature(temperature);
  req.set_idempotency_key(options.key);
  req.set_tokens_received(options.tokens_received);
  auto reader = stub->Generate(&ctx, req);
  CallResult r;
  if (options.cancel_after == 0) ctx.TryCancel();
  karat::v1::GenerateResponse ev;
  while (reader->Read(&ev)) {
    if (ev.has_token()) {
      r.tokens.push_back(ev.token().token_id());
      r.positions.push_back(ev.token().position());
      if (options.on_token) options.on_token(r);
      if (int(r.tokens.size()) == options.cancel_after) ctx.TryCancel();
    }
    if (ev.has_done()) {
      r.finish_reason = ev.done().finish_reason();
      r.done_generated = ev.done().generated_tokens();
    }
  }
  r.status = reader->Finish();
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find("karat-turn-tokens");
  if (it != trailers.end()) {
    r.trailer_tokens =
        std::stoi(std::string(it->second.data(), it->second.size()));
  }
  return r;
}

RetriedTurn RunTurnWithRetries(
    const Cluster& cluster, const std::string& session,
    const std::string& prompt, int max_new_tokens, float temperature,
    const std::string& key, std::chrono::seconds timeout,
    const std::function<void(const CallResult&)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point end = Clock::now() + timeout;
  RetriedTurn turn;
  std::chrono::milliseconds backoff(100);
  while (Clock::now() < end) {
    // A fresh channel per attempt: a restarted coordinator is reached at
    // once, not after the old channel's reconnect back-off.
    auto stub = cluster.NewStub();
    CallOptions o;
    o.key = key;
    o.tokens_received = int(turn.tokens.size());
    o.deadline = std::min<std::chrono::milliseconds>(
        std::chrono::duration_cast<std::chrono::milliseconds>(end -
                                                              Clock::now()),
        std::chrono::seconds(60));
    const size_t before = turn.tokens.size();
    if (on_token) {
      o.on_token = [&](const CallResult& call) {
        CallResult all;
        all.tokens = turn.tokens;
        all.tokens.insert(all.tokens.end(), call.tokens.begin(),
                          call.tokens.end());
        on_token(all);
      };
    }
    ++turn.attempts;
    CallResult r = GenerateCall(stub.get(), session, prompt, max_new_tokens,
                                temperature, o);
    turn.tokens.insert(turn.tokens.end(), r.tokens.begin(), r.tokens.end());
    turn.positions.insert(turn.positions.end(), r.positions.begin(),
                          r.positions.end());
    if (r.status.ok() && !r.finish_reason.empty()) {
      turn.finish_reason = r.finish_reason;
      turn.completed = true;
      return turn;
    }
    turn.failures.push_back(r.status);
    const grpc::StatusCode code = r.status.error_code();
    if (code == grpc::StatusCode::INVALID_ARGUMENT ||
        code == grpc::StatusCode::NOT_FOUND)
      return turn;
    // After an attempt that made progress the back-off starts again.
    if (turn.tokens.size() > before) backoff = std::chrono::milliseconds(100);
    std::this_thread::sleep_for(backoff);
    backoff = std::min<std::chrono::milliseconds>(backoff * 2,
                                                  std::chrono::seconds(1));
  }
  return turn;
}

bool ConsecutivePositions(const std::vector<int64_t>& positions) {
  for (size_t i = 1; i < positions.size(); ++i)
    if (positions[i] != positions[i - 1] + 1) return false;
  return true;
}

grpc::Status GetSessionInfo(karat::v1::Karat::Stub* stub,
                            const std::string& session,
                            karat::v1::Session* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  karat::v1::GetSessionRequest req;
  req.set_session_id(session);
  req.set_include_tokens(true);
  karat::v1::Session s;
  grpc::Status st = stub->GetSession(&ctx, req, &s);
  if (st.ok()) *out = std::move(s);
  return st;
}

std::string CreateSessionOrEmpty(karat::v1::Karat::Stub* stub, uint64_t seed) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  karat::v1::CreateSessionRequest req;
  req.set_seed(seed);
  karat::v1::Session s;
  if (!stub->CreateSession(&ctx, req, &s).ok()) return "";
  return s.session_id();
}

grpc::Status CloseSessionCall(karat::v1::Karat::Stub* stub,
                              const std::string& session) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  karat::v1::CloseSessionRequest req;
  req.set_session_id(session);
  karat::v1::CloseSessionResponse resp;
  return stub->CloseSession(&ctx, req, &resp);
}

std::map<std::string, double> NodeStats(const Cluster& cluster,
                                        const std::string& name) {
  std::string addr;
  std::ifstream(cluster.dir() + "/" + name + ".addr") >> addr;
  std::map<std::string, double> out;
  if (addr.empty()) return out;
  auto channel = cluster.NodeChannel(name);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  karat::cluster::StatsRequest req;
  karat::cluster::StatsResponse resp;
  const grpc::Status st =
      name.rfind("gpu", 0) == 0
          ? karat::cluster::GpuNode::NewStub(channel)->GetStats(&ctx, req,
                                                                &resp)
          : karat::cluster::KaratNode::NewStub(channel)->GetStats(&ctx, req,
                                                                  &resp);
  if (!st.ok()) return out;
  for (const auto& [k, v] : resp.stats()) out[k] = v;
  return out;
}

double SumStats(const std::map<std::string, double>& stats,
                const std::string& prefix, const std::string& suffix) {
  double sum = 0;
  for (const auto& [k, v] : stats) {
    if (k.size() >= prefix.size() + suffix.size() &&
        k.compare(0, prefix.size(), prefix) == 0 &&
        k.compare(k.size() - suffix.size(), suffix.size(), suffix) == 0)
      sum += v;
  }
  return sum;
}

std::map<std::string, double> CoordinatorStats(const Cluster& cluster) {
  auto stub = cluster.NewStub();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  karat::v1::GetClusterStatusRequest req;
  karat::v1::ClusterStatus st;
  std::map<std::string, double> out;
  if (!stub->GetClusterStatus(&ctx, req, &st).ok()) return out;
  for (const auto& [k, v] : st.stats()) out[k] = v;
  out["tokens_generated"] = double(st.tokens_generated());
  return out;
}

Reference::Reference(const std::string& model_dir) {
  auto files = LoadModel(model_dir);
  if (!files.ok()) {
    error_ = files.status().ToString();
    return;
  }
  files_ = std::make_unique<ModelFiles>(std::move(*files));
  auto engine = ReferenceEngine::Create(*files_);
  if (!engine.ok()) {
    error_ = engine.status().ToString();
    return;
  }
  engine_ = std::move(*engine);
}

std::vector<int32_t> Reference::Turn(ReferenceSession* session,
                                     const std::string& prompt,
                                     int max_new_tokens, float temperature) {
  auto got = engine_->RunTurn(session, EncodeText(prompt), max_new_tokens,
                              temperature);
  if (!got.ok()) {
    error_ = got.status().ToString();
    return {};
  }
  return *got;
}

std::unique_ptr<karat::cluster::Admin::Stub> NewAdminStub(
    const Cluster& cluster) {
  return cluster.NewAdminStub();
}

karat::cluster::LinkConfig LinkRule(const std::string& source,
                                    const std::string& destination, double loss,
                                    bool down, int64_t latency_us) {
  karat::cluster::LinkConfig link;
  link.set_source(source);
  link.set_destination(destination);
  link.set_loss(loss);
  link.set_down(down);
  link.set_latency_us(latency_us);
  return link;
}

grpc::Status RemoveLink(karat::cluster::Admin::Stub* admin,
                        const std::string& source,
                        const std::string& destination) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  karat::cluster::SetLinkRequest req;
  req.mutable_link()->set_source(source);
  req.mutable_link()->set_destination(destination);
  req.set_remove(true);
  karat::cluster::SetLinkResponse resp;
  return admin->SetLink(&ctx, req, &resp);
}

}  // namespace karat::testing
