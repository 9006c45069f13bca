// The coordinator's side of the authenticated data plane (docs/security.md
// "Data plane"): the cluster's data-plane secret (made once, kept 0600 in
// the state dir, none in plaintext mode), handed to every node in
// RegisterNodeResponse; and the table of registered node ids, names and
// roles pushed to every node on each registration, with or without link
// rules.
#include "coordinator/data_plane_secret.h"

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "coordinator/client_auth.h"
#include "coordinator/membership_service.h"
#include "coordinator/state.h"
#include "tests/coordinator/coordinator_fixture.h"

namespace karat::coordinator {
namespace {

class TempDir {
 public:
  TempDir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "karat_secret_XXXXXX")
            .string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

TEST_CASE("the data-plane secret is kept 0600 in the state dir",
          "[coordinator][security]") {
  TempDir dir;
  const std::string state = dir.path + "/state";  // made when missing
  const std::string file = state + "/" + kDataPlaneSecretFile;
  absl::StatusOr<std::string> first = LoadOrCreateDataPlaneSecret(state);
  REQUIRE(first.ok());
  CHECK(first->size() == kDataPlaneSecretBytes);
  struct stat st;
  REQUIRE(stat(file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  // A coordinator restarted on the same directory hands out the same one.
  absl::StatusOr<std::string> again = LoadOrCreateDataPlaneSecret(state);
  REQUIRE(again.ok());
  CHECK(*again == *first);
  // Without a state dir: a fresh one each time, kept nowhere.
  absl::StatusOr<std::string> a = LoadOrCreateDataPlaneSecret("");
  absl::StatusOr<std::string> b = LoadOrCreateDataPlaneSecret("");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->size() == kDataPlaneSecretBytes);
  CHECK(*a != *b);

  SECTION("readable by others: refused, saying how to fix it") {
    REQUIRE(chmod(file.c_str(), 0644) == 0);
    absl::StatusOr<std::string> s = LoadOrCreateDataPlaneSecret(state);
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(s.status().message()),
               Catch::Contains("chmod 600 " + file));
  }
  SECTION("of the wrong size: refused, naming the file") {
    {
      std::ofstream out(file, std::ios::trunc | std::ios::binary);
      out << "short";
    }
    absl::StatusOr<std::string> s = LoadOrCreateDataPlaneSecret(state);
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(s.status().message()), Catch::Contains(file));
    CHECK_THAT(std::string(s.status().message()), Catch::Contains("5 bytes"));
  }
  SECTION("not a regular file: refused") {
    REQUIRE(unlink(file.c_str()) == 0);
    REQUIRE(mkdir(file.c_str(), 0700) == 0);
    absl::StatusOr<std::string> s = LoadOrCreateDataPlaneSecret(state);
    CHECK(s.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(s.status().message()),
               Catch::Contains("not a regular file"));
  }
}

TEST_CASE("plaintext mode has no data-plane secret",
          "[coordinator][security]") {
  TempDir dir;
  cluster::SecurityConfig security;
  security.set_plaintext(true);
  absl::StatusOr<std::string> none = DataPlaneSecretFor(security, dir.path);
  REQUIRE(none.ok());
  CHECK(none->empty());
  CHECK_FALSE(std::filesystem::exists(dir.path + "/" + kDataPlaneSecretFile));
  security.set_plaintext(false);
  absl::StatusOr<std::string> some = DataPlaneSecretFor(security, dir.path);
  REQUIRE(some.ok());
  CHECK(some->size() == kDataPlaneSecretBytes);
  CHECK(std::filesystem::exists(dir.path + "/" + kDataPlaneSecretFile));
}

TEST_CASE("RegisterNode hands every node the cluster's secret",
          "[coordinator][security]") {
  Options options;
  State state(options);
  auto auth = ClientAuth::Create(options.security);  // plaintext callers
  REQUIRE(auth.ok());
  state.auth_ = std::move(*auth);
  state.data_plane_secret_ = std::string(32, 'z');
  state.node_credentials_ = grpc::InsecureChannelCredentials();
  MembershipService membership(&state);
  for (const char* role : {"karat", "gpu"}) {
    cl::RegisterNodeRequest req;
    req.set_name(std::string(role) + "0");
    req.set_role(role);
    req.set_grpc_address("127.0.0.1:1");
    req.set_fabric_address("fabric");
    req.set_model_fingerprint("test-model");
    cl::RegisterNodeResponse resp;
    grpc::ServerContext ctx;
    REQUIRE(membership.RegisterNode(&ctx, &req, &resp).ok());
    CHECK(resp.data_plane_secret() == state.data_plane_secret_);
  }
}

// A KARAT node that records the tables pushed to it; with `hold`, each
// push waits for Release() (a node that hangs).
class RecordingKaratNode final : public cl::KaratNode::Service {
 public:
  explicit RecordingKaratNode(bool hold = false) : hold_(hold) {}
  grpc::Status SetLinks(grpc::ServerContext*, const cl::SetLinksRequest* req,
                        cl::SetLinksResponse*) override {
    if (hold_) released_.WaitForNotificationWithTimeout(absl::Seconds(60));
    absl::MutexLock lock(&mu_);
    pushed_.push_back(*req);
    return grpc::Status::OK;
  }
  void Release() {
    if (!released_.HasBeenNotified()) released_.Notify();
  }
  // Waits (bounded) for a push whose table holds `ids`; returns it.
  std::optional<cl::SetLinksRequest> WaitFor(const std::vector<uint32_t>& ids) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (absl::Now() < give_up) {
      {
        absl::MutexLock lock(&mu_);
        for (const cl::SetLinksRequest& r : pushed_) {
          bool all = true;
          for (uint32_t id : ids) all = all && r.node_roles().count(id) > 0;
          if (all) return r;
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return std::nullopt;
  }

 private:
  const bool hold_;
  absl::Notification released_;
  absl::Mutex mu_;
  std::vector<cl::SetLinksRequest> pushed_ ABSL_GUARDED_BY(mu_);
};

TEST_CASE("every registration pushes the node table with roles, rules or not",
          "[coordinator][security]") {
  Cluster c(64);  // no link rules configured
  RecordingKaratNode karat;
  FakeServer karat_server(&karat);
  FakeGpuNode gpu({1});
  FakeServer gpu_server(&gpu);
  const uint32_t karat_id =
      c.Register("karat0", "karat", karat_server.address, 1);
  const uint32_t gpu_id = c.Register("gpu0", "gpu", gpu_server.address, 0);
  std::optional<cl::SetLinksRequest> pushed = karat.WaitFor({karat_id, gpu_id});
  REQUIRE(pushed.has_value());
  CHECK(pushed->links().empty());
  CHECK(pushed->node_roles().at(gpu_id) == "gpu");
  CHECK(pushed->node_roles().at(karat_id) == "karat");
  CHECK(pushed->node_names().at(gpu_id) == "gpu0");
}

TEST_CASE("a node that hangs holds back no other node's table",
          "[coordinator][security]") {
  // Calls to nodes wait long: a push made one node after the other would
  // wait on the hung node first.
  Cluster c(64, [](Options& o) { o.node_call_timeout_ms = 60000; });
  RecordingKaratNode hung(/*hold=*/true), karat;
  FakeServer hung_server(&hung), karat_server(&karat);
  FakeGpuNode gpu({1});
  FakeServer gpu_server(&gpu);
  c.Register("karat0", "karat", hung_server.address, 1);  // the lowest id
  const uint32_t karat_id =
      c.Register("karat1", "karat", karat_server.address, 1);
  const uint32_t gpu_id = c.Register("gpu0", "gpu", gpu_server.address, 0);
  CHECK(karat.WaitFor({karat_id, gpu_id}).has_value());
  hung.Release();
}

}  // namespace
}  // namespace karat::coordinator
