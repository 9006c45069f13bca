// Who may call what (docs/security.md), end to end through the real daemons
// with TLS: each attack an outside process tried on a cluster without
// authentication now fails to do harm.
//   * A caller without credentials gets UNAUTHENTICATED (or no TLS
//     handshake) from every service; plaintext gets no answer.
//   * A process cannot register as a node: not with a client token, not
//     with another daemon's certificate, not with another cluster's CA;
//     nor heartbeat for a node it is not.
//   * The nodes take calls from the coordinator's certificate only: a
//     GpuNode.RunTurn or KaratNode.Reserve / FreeSession / InjectFault from
//     anyone else is refused and the cluster's turns go on unharmed.
//   * The admin API listens on a port of its own and takes admin tokens
//     only; the client port does not serve it.
//   * Every daemon completes a TLS handshake (openssl s_client) and listens
//     on the ports it advertises and no other.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "cluster.grpc.pb.h"
#include "karat.grpc.pb.h"
#include "security/tls.h"
#include "tests/integration/cluster_harness.h"

namespace karat::testing {
namespace {

namespace cl = karat::cluster;

std::string Trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return Trimmed(ss.str());
}

// A channel to `address`: TLS verifying the cluster's CA (unless
// `plaintext`), presenting certificate `cert` from `cert_dir` when not
// empty, sending `token` when not empty.
std::shared_ptr<grpc::Channel> Channel(const Cluster& c,
                                       const std::string& address,
                                       const std::string& cert = "",
                                       const std::string& token = "",
                                       const std::string& cert_dir = "",
                                       bool plaintext = false) {
  security::TlsOptions tls;
  tls.plaintext = plaintext;
  tls.ca_file = c.tls_dir() + "/ca.crt";
  if (!cert.empty()) {
    const std::string dir = cert_dir.empty() ? c.tls_dir() : cert_dir;
    tls.cert_file = dir + "/" + cert + ".crt";
    tls.key_file = dir + "/" + cert + ".key";
  }
  auto creds = security::ClientCredentials(tls, token);
  REQUIRE(creds.ok());
  return grpc::CreateChannel(address, *creds);
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(10));
}

grpc::StatusCode Status(const std::shared_ptr<grpc::Channel>& ch) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::ClusterStatus st;
  return v1::Karat::NewStub(ch)
      ->GetClusterStatus(&ctx, v1::GetClusterStatusRequest(), &st)
      .error_code();
}

grpc::Status Register(const std::shared_ptr<grpc::Channel>& ch,
                      const std::string& name) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  cl::RegisterNodeRequest req;
  req.set_name(name);
  req.set_role("gpu");
  req.set_grpc_address("127.0.0.1:1");
  req.set_model_fingerprint("anything");
  cl::RegisterNodeResponse resp;
  return cl::Coordinator::NewStub(ch)->RegisterNode(&ctx, req, &resp);
}

grpc::Status GetLinks(const std::shared_ptr<grpc::Channel>& ch) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  cl::GetLinksResponse resp;
  return cl::Admin::NewStub(ch)->GetLinks(&ctx, cl::GetLinksRequest(), &resp);
}

// The reference turn the cluster must still produce after the attacks.
std::vector<int32_t> OneTurn(const Cluster& c) {
  auto stub = c.NewStub();
  const std::string sid = NewSession(stub.get(), 5);
  Turn t = Generate(stub.get(), sid, "unharmed: ", 12, 0);
  REQUIRE(t.status.ok());
  return t.tokens;
}

// The TCP ports process `pid` listens on: its sockets (/proc/PID/fd) that
// /proc/net/tcp{,6} lists in the LISTEN state.
std::set<std::string> ListeningPorts(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(fd_dir, ec)) {
    const std::string target = std::filesystem::read_symlink(e.path(), ec);
    if (target.rfind("socket:[", 0) == 0)
      inodes.insert(target.substr(8, target.size() - 9));
  }
  std::set<std::string> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout,
          inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >>
          timeout >> inode;
      if (state != "0A" || !inodes.count(inode)) continue;
      ports.insert(std::to_string(
          std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16)));
    }
  }
  return ports;
}

std::string PortOf(const std::string& address) {
  return address.substr(address.rfind(':') + 1);
}

TEST_CASE("nobody without credentials gets in",
          "[integration][security][sanitized]") {
  ClusterSpec spec;
  Cluster c(spec);
  // Certificates the cluster never gave a daemon: gpu1 of its own CA, and
  // gpu0 of another cluster's.
  std::string out;
  REQUIRE(RunCommand({KARAT_CERTS_SCRIPT, c.tls_dir(), "gpu1"}, &out) == 0);
  const std::string other = c.dir() + "/other-ca";
  REQUIRE(RunCommand({KARAT_CERTS_SCRIPT, other, "gpu0"}, &out) == 0);
  const std::string client_token = ReadText(c.tls_dir() + "/client.token");
  const std::string admin_token = ReadText(c.tls_dir() + "/admin.token");
  const std::vector<int32_t> before = OneTurn(c);
  const std::string coord = c.coordinator_address();

  SECTION("the client API needs a client token") {
    CHECK(Status(Channel(c, coord)) == grpc::StatusCode::UNAUTHENTICATED);
    CHECK(Status(Channel(c, coord, "", "0123456789abcdef0123456789")) ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(Status(Channel(c, coord, "", admin_token)) ==
          grpc::StatusCode::UNAUTHENTICATED);
    // A daemon's certificate passes the port, not the client API.
    CHECK(Status(Channel(c, coord, "gpu0")) ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(Status(Channel(c, coord, "", client_token)) == grpc::StatusCode::OK);
    // Plaintext: no TLS handshake, no answer.
    CHECK(Status(Channel(c, coord, "", "", "", true)) ==
          grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("only a node's own certificate registers it") {
    CHECK(Register(Channel(c, coord), "gpu0").error_code() ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(Register(Channel(c, coord, "", client_token), "gpu0").error_code() ==
          grpc::StatusCode::UNAUTHENTICATED);
    const grpc::Status as_other = Register(Channel(c, coord, "gpu1"), "gpu0");
    CHECK(as_other.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(as_other.error_message().find("gpu1") != std::string::npos);
    CHECK(Register(Channel(c, coord, "gpu0", "", other), "gpu0").error_code() ==
          grpc::StatusCode::UNAVAILABLE);  // another CA: no handshake
    // Nor may another daemon keep gpu0 alive with heartbeats.
    grpc::ClientContext ctx;
    Deadline(&ctx);
    cl::HeartbeatRequest hb;
    hb.set_node_id(1);
    hb.set_name("gpu0");
    cl::HeartbeatResponse resp;
    CHECK(cl::Coordinator::NewStub(Channel(c, coord, "gpu1"))
              ->Heartbeat(&ctx, hb, &resp)
              .error_code() == grpc::StatusCode::PERMISSION_DENIED);
  }
  SECTION("the nodes take calls from the coordinator only") {
    for (const std::string node : {"gpu0", "karat0"}) {
      std::string address;
      std::ifstream(c.dir() + "/" + node + ".addr") >> address;
      REQUIRE(!address.empty());
      // Another daemon's certificate: refused before any handler.
      auto as_karat = Channel(c, address, node == "gpu0" ? "karat0" : "gpu0");
      {
        grpc::ClientContext ctx;
        Deadline(&ctx);
        cl::StatsResponse resp;
        const grpc::Status st =
            node == "gpu0"
                ? cl::GpuNode::NewStub(as_karat)->GetStats(
                      &ctx, cl::StatsRequest(), &resp)
                : cl::KaratNode::NewStub(as_karat)->GetStats(
                      &ctx, cl::StatsRequest(), &resp);
        CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
      }
      // A client with a token but no certificate: refused before any
      // handler, with the reason.
      {
        grpc::ClientContext ctx;
        Deadline(&ctx);
        cl::ProcessFaultRequest req;
        req.set_action("kill");
        cl::ProcessFaultResponse resp;
        auto ch = Channel(c, address, "", client_token);
        const grpc::Status st =
            node == "gpu0"
                ? cl::GpuNode::NewStub(ch)->InjectFault(&ctx, req, &resp)
                : cl::KaratNode::NewStub(ch)->InjectFault(&ctx, req, &resp);
        CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
        CHECK(st.error_message().find("coordinator") != std::string::npos);
      }
    }
    // A RunTurn with a chosen feed straight to the GPU node, and a Reserve /
    // FreeSession straight to the KARAT node, from a daemon certificate.
    std::string gpu, karat;
    std::ifstream(c.dir() + "/gpu0.addr") >> gpu;
    std::ifstream(c.dir() + "/karat0.addr") >> karat;
    {
      grpc::ClientContext ctx;
      Deadline(&ctx);
      cl::RunTurnRequest req;
      req.set_session(1);
      req.add_feed_tokens(7);
      req.set_max_new_tokens(4);
      auto reader =
          cl::GpuNode::NewStub(Channel(c, gpu, "karat0"))->RunTurn(&ctx, req);
      cl::RunTurnEvent ev;
      while (reader->Read(&ev)) {
      }
      CHECK(reader->Finish().error_code() ==
            grpc::StatusCode::UNAUTHENTICATED);
    }
    for (bool reserve : {true, false}) {
      grpc::ClientContext ctx;
      Deadline(&ctx);
      auto stub = cl::KaratNode::NewStub(Channel(c, karat, "gpu0"));
      grpc::Status st;
      if (reserve) {
        cl::ReserveRequest req;
        req.set_session(1);
        req.set_tokens(1 << 20);
        cl::ReserveResponse resp;
        st = stub->Reserve(&ctx, req, &resp);
      } else {
        cl::FreeSessionRequest req;
        req.set_session(1);
        cl::FreeSessionResponse resp;
        st = stub->FreeSession(&ctx, req, &resp);
      }
      CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    }
  }
  SECTION("the admin API: its own port, admin tokens only") {
    const std::string admin = c.admin_address();
    CHECK(admin != coord);
    CHECK(GetLinks(Channel(c, coord, "", client_token)).error_code() ==
          grpc::StatusCode::UNIMPLEMENTED);
    CHECK(GetLinks(Channel(c, coord, "", admin_token)).error_code() ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(GetLinks(Channel(c, admin)).error_code() ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(GetLinks(Channel(c, admin, "", client_token)).error_code() ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(GetLinks(Channel(c, admin, "coordinator")).error_code() ==
          grpc::StatusCode::UNAUTHENTICATED);
    CHECK(GetLinks(Channel(c, admin, "", admin_token)).ok());
    grpc::ClientContext ctx;
    Deadline(&ctx);
    cl::ProcessFaultRequest req;
    req.set_node("karat0");
    req.set_action("kill");
    cl::ProcessFaultResponse resp;
    CHECK(cl::Admin::NewStub(Channel(c, admin, "", client_token))
              ->InjectProcessFault(&ctx, req, &resp)
              .error_code() == grpc::StatusCode::UNAUTHENTICATED);
  }
  SECTION("openssl s_client completes a TLS handshake with every daemon") {
    std::vector<std::pair<std::string, std::string>> servers = {
        {"coordinator", coord}, {"admin API", c.admin_address()}};
    for (const std::string node : {"gpu0", "karat0"}) {
      std::string address;
      std::ifstream(c.dir() + "/" + node + ".addr") >> address;
      servers.push_back({node, address});
    }
    for (const auto& [name, address] : servers) {
      // The nodes require a client certificate: the coordinator's.
      std::string hs;
      const int rc = RunCommand(
          {"/bin/sh", "-c",
           "openssl s_client -connect " + address + " -CAfile " +
               c.tls_dir() + "/ca.crt -cert " + c.tls_dir() +
               "/coordinator.crt -key " + c.tls_dir() +
               "/coordinator.key -alpn h2 -verify_return_error -brief "
               "</dev/null"},
          &hs);
      INFO(name << " at " << address << ":\n" << hs);
      CHECK(rc == 0);
      CHECK(hs.find("Verification: OK") != std::string::npos);
    }
  }
  SECTION("every daemon listens where it says and nowhere else") {
    CHECK(ListeningPorts(c.pids().at("coordinator")) ==
          std::set<std::string>{PortOf(coord), PortOf(c.admin_address())});
    for (const std::string node : {"gpu0", "karat0"}) {
      std::string address;
      std::ifstream(c.dir() + "/" + node + ".addr") >> address;
      CHECK(ListeningPorts(c.pids().at(node)) ==
            std::set<std::string>{PortOf(address)});
    }
  }
  // Whatever was tried, the cluster still serves the same tokens.
  CHECK(OneTurn(c) == before);
  for (const auto& [name, pid] : c.pids()) CHECK(kill(pid, 0) == 0);
}

}  // namespace
}  // namespace karat::testing
