#include "common/membership.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
#include "common/log.h"

namespace karat {

struct NodeRegistrar::Impl {
  explicit Impl(RegistrarOptions o) : options(std::move(o)) {}

  void Run();
  // Sleeps for `d` or until Stop(); false when stopping.
  bool WaitFor(absl::Duration d);
  // Runs one RPC with a deadline, cancellable by Stop().
  template <typename Call>
  grpc::Status Rpc(Call call);

  const RegistrarOptions options;
  const char* module() const { return options.log_module.c_str(); }

  mutable absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::optional<uint32_t> node_id ABSL_GUARDED_BY(mu);
  grpc::ClientContext* in_flight ABSL_GUARDED_BY(mu) = nullptr;
  std::thread thread;
};

bool NodeRegistrar::Impl::WaitFor(absl::Duration d) {
  absl::MutexLock lock(&mu);
  auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return stopping; };
  mu.AwaitWithTimeout(absl::Condition(&stop), d);
  return !stopping;
}

template <typename Call>
grpc::Status NodeRegistrar::Impl::Rpc(Call call) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.rpc_timeout));
  {
    absl::MutexLock lock(&mu);
    if (stopping) return grpc::Status(grpc::StatusCode::CANCELLED, "stopping");
    in_flight = &ctx;
  }
  grpc::Status status = call(&ctx);
  absl::MutexLock lock(&mu);
  in_flight = nullptr;
  return status;
}

void NodeRegistrar::Impl::Run() {
  // The channel's own reconnect backoff (up to 120 s by default) would
  // otherwise delay re-registration after a coordinator restart far beyond
  // ours.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              int(absl::ToInt64Milliseconds(options.initial_backoff)));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              int(absl::ToInt64Milliseconds(options.initial_backoff)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              int(absl::ToInt64Milliseconds(options.max_backoff)));
  auto channel = grpc::CreateCustomChannel(
      options.coordinator,
      options.credentials != nullptr ? options.credentials
                                     : grpc::InsecureChannelCredentials(),
      args);
  auto stub = cluster::Coordinator::NewStub(channel);
  absl::Duration backoff = options.initial_backoff;
  absl::Duration interval = options.interval;
  bool registered = false;
  uint32_t id = 0;
  std::string name;  // as registered
  int failures = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu);
      if (stopping) return;
    }
    if (!registered) {
      const cluster::RegisterNodeRequest request = options.make_request();
      cluster::RegisterNodeResponse response;
      grpc::Status status = Rpc([&](grpc::ClientContext* ctx) {
        return stub->RegisterNode(ctx, request, &response);
      });
      if (status.ok()) {
        registered = true;
        failures = 0;
        backoff = options.initial_backoff;
        id = response.node_id();
        name = request.name();
        if (response.heartbeat_interval_ms() > 0) {
          interval = absl::Milliseconds(response.heartbeat_interval_ms());
        }
        {
          absl::MutexLock lock(&mu);
          node_id = id;
        }
        KLOG(Info, module())
            << "registered with coordinator at " << options.coordinator
            << " as node " << id << " (" << request.name() << ", role "
            << request.role() << ")";
        if (options.on_registered) options.on_registered(response);
        continue;
      }
      {
        absl::MutexLock lock(&mu);
        if (stopping) return;
      }
      if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
          status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        KLOG(Warning, module())
            << "cannot reach coordinator at " << options.coordinator << ": "
            << status.error_message() << "; retrying in "
            << absl::ToInt64Milliseconds(backoff) << " ms";
      } else {
        KLOG(Error, module())
            << "coordinator at " << options.coordinator
            << " refused registration (code " << int(status.error_code())
            << "): " << status.error_message() << "; retrying in "
            << absl::ToInt64Milliseconds(backoff) << " ms";
      }
      if (!WaitFor(backoff)) return;
      backoff = std::min(backoff * 2, options.max_backoff);
      continue;
    }

    if (!WaitFor(interval)) return;
    cluster::HeartbeatRequest request;
    if (options.fill_heartbeat) options.fill_heartbeat(&request);
    request.set_node_id(id);
    request.set_name(name);
    cluster::HeartbeatResponse response;
    grpc::Status status = Rpc([&](grpc::ClientContext* ctx) {
      return stub->Heartbeat(ctx, request, &response);
    });
    if (status.ok() && response.known()) {
      failures = 0;
      continue;
    }
    {
      absl::MutexLock lock(&mu);
      if (stopping) return;
    }
    bool again = false;
    if (status.ok()) {
      KLOG(Warning, module())
          << "coordinator at " << options.coordinator << " does not know node "
          << id << "; registering again";
      again = true;
    } else {
      ++failures;
      KLOG(Warning, module()) << "heartbeat to coordinator at "
                              << options.coordinator << " failed (" << failures
                              << " in a row): " << status.error_message();
      again = options.max_heartbeat_failures > 0 &&
              failures >= options.max_heartbeat_failures;
    }
    if (again) {
      registered = false;
      failures = 0;
      backoff = options.initial_backoff;
      absl::MutexLock lock(&mu);
      node_id.reset();
    }
  }
}

NodeRegistrar::NodeRegistrar() = default;

absl::StatusOr<std::unique_ptr<NodeRegistrar>> NodeRegistrar::Start(
    RegistrarOptions options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError("no coordinator address");
  }
  if (!options.make_request) {
    return absl::InvalidArgumentError("no registration request builder");
  }
  if (options.interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat interval must be > 0");
  }
  std::unique_ptr<NodeRegistrar> registrar(new NodeRegistrar());
  registrar->impl_ = std::make_unique<Impl>(std::move(options));
  Impl* impl = registrar->impl_.get();
  impl->thread = std::thread([impl] { impl->Run(); });
  return registrar;
}

NodeRegistrar::~NodeRegistrar() { Stop(); }

std::optional<uint32_t> NodeRegistrar::node_id() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->node_id;
}

bool NodeRegistrar::WaitRegistered(absl::Duration timeout) const {
  Impl* impl = impl_.get();
  absl::MutexLock lock(&impl->mu);
  auto done = [impl]() ABSL_SHARED_LOCKS_REQUIRED(impl->mu) {
    return impl->node_id.has_value() || impl->stopping;
  };
  impl->mu.AwaitWithTimeout(absl::Condition(&done), timeout);
  return impl->node_id.has_value();
}

void NodeRegistrar::Stop() {
  if (!impl_) return;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
    if (impl_->in_flight != nullptr) impl_->in_flight->TryCancel();
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

absl::Status WritePortFile(const std::string& path,
                           const std::string& address) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const std::string line = address + "\n";
  const bool written =
      std::fwrite(line.data(), 1, line.size(), f) == line.size();
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ",
                                               path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace karat
