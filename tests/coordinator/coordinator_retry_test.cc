// The coordinator's answers to faults a client meets: turns that end early
// leave the session as the client saw it, retries with an idempotency key
// continue or replay the same turn, a restarted node is a new incarnation,
// the admission queue neither hangs on what never fits nor starves behind
// a head that does not fit yet, and unparsable requests are explained.
#include <grpcpp/generic/generic_stub.h>

#include "tests/coordinator/coordinator_fixture.h"

namespace karat::coordinator {
namespace {

// A client call with its trailing metadata.
struct Call {
  grpc::Status status;
  std::vector<v1::GeneratedToken> tokens;
  std::optional<v1::TurnDone> done;
  std::string turn_tokens;  // trailer karat-turn-tokens ("" when absent)
};

v1::GenerateRequest Request(const std::string& sid, const std::string& prompt,
                            int max_new, const std::string& key = "",
                            int tokens_received = 0) {
  v1::GenerateRequest req;
  req.set_session_id(sid);
  req.set_prompt(prompt);
  req.set_max_new_tokens(max_new);
  req.set_idempotency_key(key);
  req.set_tokens_received(tokens_received);
  return req;
}

// Runs `req`; cancels after `cancel_after` tokens (>= 0), or with a deadline
// of `deadline_ms` (> 0).
Call Run(Cluster& c, const v1::GenerateRequest& req, int cancel_after = -1,
         int deadline_ms = 0) {
  Call r;
  grpc::ClientContext ctx;
  if (deadline_ms > 0)
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(deadline_ms));
  auto reader = c.client->Generate(&ctx, req);
  v1::GenerateResponse resp;
  if (cancel_after == 0) ctx.TryCancel();
  while (reader->Read(&resp)) {
    if (resp.has_token()) r.tokens.push_back(resp.token());
    if (resp.has_done()) r.done = resp.done();
    if (static_cast<int>(r.tokens.size()) == cancel_after) ctx.TryCancel();
  }
  r.status = reader->Finish();
  auto t = ctx.GetServerTrailingMetadata().find("karat-turn-tokens");
  if (t != ctx.GetServerTrailingMetadata().end())
    r.turn_tokens = std::string(t->second.data(), t->second.size());
  return r;
}

std::vector<int32_t> Ids(const std::vector<v1::GeneratedToken>& tokens) {
  std::vector<int32_t> ids;
  for (const auto& t : tokens) ids.push_back(t.token_id());
  return ids;
}

TEST_CASE("retry: a turn that fails before its first token changes nothing") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B', 'C'});
  const std::string sid = c.NewSession();
  REQUIRE(Run(c, Request(sid, "hi", 2)).status.ok());
  const v1::Session before = c.Get(sid);
  SECTION("the GPU node fails") {
    c.gpu->fail_after = 0;
    Call r = Run(c, Request(sid, "more", 3));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK(r.turn_tokens == "0");
  }
  SECTION("the client cancels") {
    c.gpu->hold_after = 0;
    Call r = Run(c, Request(sid, "more", 3), /*cancel_after=*/0);
    CHECK(r.status.error_code() == grpc::StatusCode::CANCELLED);
  }
  SECTION("the client's deadline passes") {
    c.gpu->hold_after = 0;
    Call r = Run(c, Request(sid, "more", 3), -1, /*deadline_ms=*/100);
    CHECK(r.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  c.WaitIdle(sid);
  const v1::Session after = c.Get(sid);
  CHECK(after.num_tokens() == before.num_tokens());
  CHECK(after.turns() == before.turns());
  CHECK(std::vector<int32_t>(after.tokens().begin(), after.tokens().end()) ==
        std::vector<int32_t>(before.tokens().begin(), before.tokens().end()));
  // The next turn starts where the last finished one ended.
  c.gpu->fail_after = -1;
  c.gpu->hold_after = -1;
  REQUIRE(Run(c, Request(sid, "next", 1)).status.ok());
  CHECK(c.gpu->runs().back().pos_start() == before.num_tokens() - 1);
}

TEST_CASE("retry: a turn that fails after k tokens keeps exactly k") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B', 'C'});
  c.gpu->fail_after = 2;
  const std::string sid = c.NewSession();
  Call r = Run(c, Request(sid, "hi", 5));
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.tokens.size() == 2);
  CHECK(r.turn_tokens == "2");
  CHECK(r.status.error_message().find("kept the 2 tokens") !=
        std::string::npos);
  CHECK(c.Get(sid).num_tokens() == 3 + 2);  // BOS, "hi", two tokens
}

TEST_CASE("retry: the same key continues a broken turn with its tokens") {
  Cluster c;
  c.AddNodes({1000}, {'a', 'b', 'c', 'd', 'e', 'f', 'g'});
  c.gpu->by_position = true;
  // The turn an uninterrupted call produces, on another session.
  const std::string ref = c.NewSession();
  Call whole = Run(c, Request(ref, "hi", 6));
  REQUIRE(whole.status.ok());
  REQUIRE(whole.tokens.size() == 6);

  const std::string sid = c.NewSession();
  c.gpu->fail_after = 2;
  c.gpu->fail_once = true;
  Call first = Run(c, Request(sid, "hi", 6, "turn-1"));
  CHECK(first.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  REQUIRE(first.tokens.size() == 2);
  CHECK(first.status.error_message().find("idempotency_key") !=
        std::string::npos);
  const size_t runs_before = c.gpu->runs().size();
  Call retry = Run(c, Request(sid, "hi", 6, "turn-1", /*tokens_received=*/2));
  REQUIRE(retry.status.ok());
  REQUIRE(retry.done.has_value());
  CHECK(retry.done->generated_tokens() == 6);
  // Only the rest was streamed, and together they are the whole turn.
  std::vector<v1::GeneratedToken> got = first.tokens;
  got.insert(got.end(), retry.tokens.begin(), retry.tokens.end());
  CHECK(Ids(got) == Ids(whole.tokens));
  REQUIRE(retry.tokens.size() == 4);
  CHECK(retry.tokens[0].position() == whole.tokens[2].position());
  // It fed the last kept token again as a decode, not the prompt.
  const auto runs = c.gpu->runs();
  REQUIRE(runs.size() == runs_before + 1);
  CHECK(runs.back().resumed_decode());
  CHECK(runs.back().max_new_tokens() == 4);
  CHECK(runs.back().feed_tokens_size() == 1);
  const v1::Session s = c.Get(sid);
  CHECK(s.turns() == 1);
  CHECK(s.num_tokens() == 3 + 6);
  // Every pass ran under a new turn epoch, and reserved its KV with it.
  CHECK(runs.back().turn_epoch() > runs[runs.size() - 2].turn_epoch());
  CHECK(c.karat->reserves().back().turn_epoch() == runs.back().turn_epoch());
}

TEST_CASE("retry: the same key replays a finished turn") {
  Cluster c;
  c.AddNodes({1000}, {'x', 'y', 'z'});
  const std::string sid = c.NewSession();
  Call first = Run(c, Request(sid, "hi", 3, "k"));
  REQUIRE(first.status.ok());
  const size_t runs = c.gpu->runs().size();
  Call again = Run(c, Request(sid, "hi", 3, "k", /*tokens_received=*/1));
  REQUIRE(again.status.ok());
  REQUIRE(again.done.has_value());
  CHECK(again.done->finish_reason() == "length");
  CHECK(again.done->generated_tokens() == 3);
  REQUIRE(again.tokens.size() == 2);
  CHECK(again.tokens[0].token_id() == first.tokens[1].token_id());
  CHECK(again.tokens[0].position() == first.tokens[1].position());
  CHECK(c.gpu->runs().size() == runs);  // nothing ran again
  CHECK(c.Get(sid).turns() == 1);
  // The same key with another request is refused.
  Call other = Run(c, Request(sid, "hello", 3, "k"));
  CHECK(other.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  // A key past the replayed turn's end, and one that is not printable.
  CHECK(Run(c, Request(sid, "hi", 3, "k", 4)).status.error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(Run(c, Request(sid, "hi", 3, "bad\nkey")).status.error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  // A new key is a new turn.
  REQUIRE(Run(c, Request(sid, "hi", 3, "k2")).status.ok());
  CHECK(c.Get(sid).turns() == 2);
}

TEST_CASE("retry: the same key takes over a call still running the turn") {
  Cluster c;
  c.AddNodes({1000}, {'a', 'b', 'c', 'd', 'e'});
  c.gpu->by_position = true;
  c.gpu->hold_after = 2;
  const std::string sid = c.NewSession();
  Call first;
  std::thread t([&] { first = Run(c, Request(sid, "hi", 5, "k")); });
  for (int i = 0; i < 1000 && c.Get(sid).num_tokens() < 5; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(c.Get(sid).num_tokens() == 5);
  c.gpu->hold_after = -1;
  Call retry = Run(c, Request(sid, "hi", 5, "k", /*tokens_received=*/2));
  t.join();
  CHECK(first.status.error_code() == grpc::StatusCode::ABORTED);
  CHECK(first.turn_tokens == "2");
  REQUIRE(retry.status.ok());
  CHECK(retry.tokens.size() == 3);
  CHECK(retry.done->generated_tokens() == 5);
  CHECK(c.Get(sid).num_tokens() == 3 + 5);
}

TEST_CASE("incarnations: a node registering under an alive name replaces it") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  const std::string sid = c.NewSession();
  REQUIRE(Run(c, Request(sid, "hi", 1)).status.ok());
  CHECK(c.Get(sid).home_node() == "karat0");
  const uint32_t old_id = c.karat_id;
  // karat0 restarts faster than its heartbeats run out.
  FakeKaratNode fresh({1000});
  FakeServer server(&fresh);
  const uint32_t new_id = c.Register("karat0", "karat", server.address, 1);
  CHECK(new_id != old_id);
  c.WaitStat("karat_nodes_lost", 1);
  // The GPU nodes were told, by name, that the old one is lost.
  for (int i = 0; i < 500 && c.gpu->karat_lost().empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(c.gpu->karat_lost() == std::vector<std::string>{"karat0"});
  // The session's KV is rebuilt on the new incarnation from position 0.
  REQUIRE(Run(c, Request(sid, "again", 1)).status.ok());
  CHECK(c.gpu->runs().back().pos_start() == 0);
  CHECK(fresh.reserves().size() == 1);
  // The old incarnation's heartbeats are not taken any more.
  cl::HeartbeatRequest hb;
  hb.set_node_id(old_id);
  hb.set_name("karat0");
  cl::HeartbeatResponse hr;
  grpc::ClientContext ctx;
  REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
  CHECK_FALSE(hr.known());
}

TEST_CASE("incarnations: a node taken for lost stays lost") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  c.clock.Advance(absl::Seconds(6));  // past node_timeout_ms
  cl::HeartbeatRequest hb;
  hb.set_node_id(c.karat_id);
  hb.set_name("karat0");
  cl::HeartbeatResponse hr;
  grpc::ClientContext ctx;
  REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
  CHECK_FALSE(hr.known());  // it must register again
}

TEST_CASE("admission: what no device holds even empty is refused at once") {
  Cluster c;
  c.AddNodes({20}, {'A'});
  const std::string sid = c.NewSession();
  const absl::Time start = absl::Now();
  Call r = Run(c, Request(sid, std::string(40, 'p'), 4));
  CHECK(r.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(r.status.error_message().find("even empty") != std::string::npos);
  // Not after the queue timeout (60 s): at the first attempt.
  CHECK(absl::Now() - start < absl::Seconds(10));
  CHECK(c.Get(sid).num_tokens() == 0);
}

TEST_CASE("admission: smaller turns pass a head that does not fit yet") {
  Cluster c(64, [](Options& o) { o.scheduling.set_queue_bypass_ms(3000); });
  c.AddNodes({100}, {'A'});
  c.karat->busy_tokens = 60;  // other sessions' KV
  const std::string big = c.NewSession(), small = c.NewSession(),
                    late = c.NewSession();
  Call rbig;
  std::thread tbig([&] { rbig = Run(c, Request(big, std::string(45, 'b'), 4)); });
  c.WaitStat("queue_length", 1);
  // 1 + 2 + 4 = 7 positions fit beside the others: admitted past the head.
  Call rsmall = Run(c, Request(small, "hi", 4));
  CHECK(rsmall.status.ok());
  // Once the head has waited the bypass bound, nobody passes it (the
  // nodes' timeout, 5 s, is not reached).
  c.clock.Advance(absl::Seconds(4));
  Call rlate;
  std::thread tlate([&] { rlate = Run(c, Request(late, "hi", 4)); });
  c.WaitStat("queue_length", 2);
  // Room appears (a session closes): the head first, then the late turn.
  c.karat->busy_tokens = 0;
  v1::CloseSessionRequest close;
  close.set_session_id(small);
  v1::CloseSessionResponse closed;
  grpc::ClientContext ctx;
  REQUIRE(c.client->CloseSession(&ctx, close, &closed).ok());
  tbig.join();
  tlate.join();
  CHECK(rbig.status.ok());
  CHECK(rlate.status.ok());
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 3);
  CHECK(runs[1].feed_tokens_size() == 46);  // BOS + the big prompt
  CHECK(runs[2].feed_tokens_size() == 3);
}

TEST_CASE("requests that cannot be parsed get an actionable status") {
  Cluster c;
  grpc::GenericStub generic(grpc::CreateChannel(
      c.coordinator->address(), grpc::InsecureChannelCredentials()));
  // GetSessionRequest{session_id: "\xff\xfe-x"}: not UTF-8.
  const std::string bytes = std::string("\x0a\x04\xff\xfe-x", 6);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = generic.PrepareUnaryCall(&ctx, "/karat.v1.Karat/GetSession",
                                       request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  REQUIRE(cq.Next(&tag, &ok));
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(status.error_message().find("UTF-8") != std::string::npos);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace karat::coordinator
