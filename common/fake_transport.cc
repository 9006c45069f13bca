// In-process Transport for unit tests. Each endpoint has a delivery queue and
// one thread that runs the receive handler, like the libfabric progress
// thread does, so handlers see the same threading as in production.
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/transport.h"

namespace karat {
namespace {

constexpr const char* kLogModule = "fake_fabric";
// Same default as FabricOptions::max_message_size.
constexpr size_t kFakeMaxMessageSize = 8 << 20;

// A queued message and the address of the endpoint that sent it.
struct Envelope {
  std::string from;
  std::shared_ptr<const std::string> message;
};

// Receiver-side handler: the sender's address and the bytes.
using MailboxHandler =
    std::function<void(const std::string& from, std::string_view message)>;

// The receiving side of one endpoint: a queue drained by its own thread.
class Mailbox : public std::enable_shared_from_this<Mailbox> {
 public:
  explicit Mailbox(std::string name) : name_(std::move(name)) {}
  ~Mailbox() { Close(); }

  // The delivery thread holds a reference, so a mailbox closed from its own
  // handler lives until the handler returns.
  void Start() {
    thread_ =
        std::thread([self = shared_from_this()] { self->DeliveryLoop(); });
  }

  const std::string& name() const { return name_; }

  // False once the mailbox is closed. The bytes are read when the handler
  // runs, as a provider reads a zero-copy send's buffer in place.
  bool Deliver(std::string from, std::shared_ptr<const std::string> message) {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    queue_.push_back(Envelope{std::move(from), std::move(message)});
    return true;
  }

  void SetHandler(MailboxHandler handler) {
    absl::MutexLock lock(&handler_mu_);
    handler_ = std::move(handler);
  }

  void Close() {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return;
      closed_ = true;
    }
    if (thread_.joinable()) {
      if (thread_.get_id() == std::this_thread::get_id()) {
        thread_.detach();  // closed from its own handler; the loop ends next
      } else {
        thread_.join();
      }
    }
  }

 private:
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || !queue_.empty();
  }

  void DeliveryLoop() {
    for (;;) {
      Envelope envelope;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Mailbox::HasWork));
        // Messages queued before Close() are dropped, as a closed libfabric
        // endpoint drops its posted receives.
        if (closed_) return;
        envelope = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::MutexLock lock(&handler_mu_);
      if (handler_) {
        handler_(envelope.from, *envelope.message);
      } else {
        KLOG(Warning, kLogModule)
            << name_ << ": dropped a " << envelope.message->size()
            << "-byte message: no receive handler";
      }
    }
  }

  const std::string name_;
  absl::Mutex mu_;
  std::deque<Envelope> queue_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // Held while the handler runs; SetHandler() from inside a handler would
  // deadlock, which the Transport contract does not allow anyway.
  absl::Mutex handler_mu_;
  MailboxHandler handler_ ABSL_GUARDED_BY(handler_mu_);
  std::thread thread_;
};

// Every endpoint's mailbox by address.
struct FakeRegistry {
  absl::Mutex mu;
  int next_id ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<std::string, std::shared_ptr<Mailbox>> mailboxes
      ABSL_GUARDED_BY(mu);

  std::shared_ptr<Mailbox> Find(const std::string& address) {
    absl::MutexLock lock(&mu);
    auto it = mailboxes.find(address);
    return it == mailboxes.end() ? nullptr : it->second;
  }
};

// One endpoint's peers. Shared with its mailbox's handler, which maps a
// sender's address to its PeerId and may outlive the endpoint briefly.
struct PeerTable {
  struct Peer {
    std::string name;
    std::string address;
    // Set by FailPeer(): sends fail with it until AddPeer() adds the address
    // again.
    absl::Status failed;
  };
  mutable absl::Mutex mu;
  std::vector<Peer> peers ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, PeerId> by_address ABSL_GUARDED_BY(mu);

  PeerId Find(const std::string& address) const {
    absl::MutexLock lock(&mu);
    auto it = by_address.find(address);
    return it == by_address.end() ? kUnknownPeer : it->second;
  }
};

class FakeTransport final : public Transport {
 public:
  FakeTransport(std::shared_ptr<FakeRegistry> fabric, std::string address,
                std::shared_ptr<Mailbox> mailbox)
      : fabric_(std::move(fabric)),
        address_(std::move(address)),
        mailbox_(std::move(mailbox)) {}
  ~FakeTransport() override { Shutdown(); }

  std::string LocalAddress() const override { return address_; }

  absl::StatusOr<PeerId> AddPeer(const std::string& name,
                                 const std::string& address) override {
    if (address.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer '", name, "': empty address"));
    }
    absl::MutexLock lock(&table_->mu);
    if (auto it = table_->by_address.find(address);
        it != table_->by_address.end()) {
      table_->peers[it->second].failed = absl::OkStatus();
      return it->second;
    }
    const PeerId id = static_cast<PeerId>(table_->peers.size());
    table_->peers.push_back(PeerTable::Peer{name, address, absl::OkStatus()});
    table_->by_address.emplace(address, id);
    return id;
  }

  std::string PeerName(PeerId peer) const override {
    if (peer == kUnknownPeer) return "unknown peer";
    absl::MutexLock lock(&table_->mu);
    if (peer < 0 || static_cast<size_t>(peer) >= table_->peers.size()) {
      return absl::StrCat("peer #", peer);
    }
    return table_->peers[peer].name;
  }

  absl::Status Send(PeerId peer, const void* data, size_t len) override {
    if (len > kFakeMaxMessageSize) return TooLarge(len);
    return Post(peer, std::make_shared<const std::string>(
                          static_cast<const char*>(data), len));
  }

  // Queues the caller's string itself; the reference is dropped once the
  // receive handler has run (or the message is discarded).
  absl::Status SendShared(PeerId peer,
                          std::shared_ptr<const std::string> message) override {
    if (message == nullptr) {
      return absl::InvalidArgumentError("SendShared: null message");
    }
    if (message->size() > kFakeMaxMessageSize) return TooLarge(message->size());
    return Post(peer, std::move(message));
  }

  void SetPeerReceiveHandler(PeerReceiveHandler handler) override {
    if (!handler) {
      mailbox_->SetHandler(nullptr);
      return;
    }
    mailbox_->SetHandler(
        [table = table_, handler = std::move(handler)](
            const std::string& from, std::string_view message) {
          handler(table->Find(from), message);
        });
  }

  // Messages are queued at once, so there is never a send in progress to
  // end: only later sends fail.
  absl::Status FailPeer(PeerId peer, const absl::Status& reason) override {
    absl::MutexLock lock(&table_->mu);
    if (peer < 0 || static_cast<size_t>(peer) >= table_->peers.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown peer id ", peer));
    }
    table_->peers[peer].failed = absl::UnavailableError(
        absl::StrCat("send to peer '", table_->peers[peer].name,
                     "': peer failed: ", reason.message()));
    return absl::OkStatus();
  }

  size_t MaxMessageSize() const override { return kFakeMaxMessageSize; }

  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    {
      absl::MutexLock lock(&fabric_->mu);
      fabric_->mailboxes.erase(address_);
    }
    mailbox_->Close();
  }

 private:
  static absl::Status TooLarge(size_t len) {
    return absl::InvalidArgumentError(
        absl::StrCat("message of ", len, " bytes exceeds the maximum of ",
                     kFakeMaxMessageSize));
  }

  absl::Status Post(PeerId peer, std::shared_ptr<const std::string> message) {
    {
      absl::MutexLock lock(&mu_);
      if (shut_down_) {
        return absl::UnavailableError(absl::StrCat(
            address_, " is shut down; cannot send to peer ", peer));
      }
    }
    PeerTable::Peer target;
    {
      absl::MutexLock lock(&table_->mu);
      if (peer < 0 || static_cast<size_t>(peer) >= table_->peers.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("unknown peer id ", peer));
      }
      target = table_->peers[peer];
    }
    if (!target.failed.ok()) return target.failed;
    std::shared_ptr<Mailbox> mailbox = fabric_->Find(target.address);
    if (mailbox == nullptr || !mailbox->Deliver(address_, std::move(message))) {
      return absl::UnavailableError(absl::StrCat(
          "peer '", target.name, "' (", target.address, ") is not reachable"));
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<FakeRegistry> fabric_;
  const std::string address_;
  const std::shared_ptr<Mailbox> mailbox_;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  const std::shared_ptr<PeerTable> table_ = std::make_shared<PeerTable>();
};

}  // namespace

struct FakeFabric::Impl : FakeRegistry {};

FakeFabric::FakeFabric() : impl_(std::make_shared<Impl>()) {}
FakeFabric::~FakeFabric() = default;

std::unique_ptr<Transport> FakeFabric::NewEndpoint(const std::string& name) {
  std::string address;
  {
    absl::MutexLock lock(&impl_->mu);
    address = absl::StrCat("fake:", impl_->next_id++);
  }
  auto mailbox =
      std::make_shared<Mailbox>(absl::StrCat(name, " (", address, ")"));
  mailbox->Start();
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->mailboxes.emplace(address, mailbox);
  }
  return std::make_unique<FakeTransport>(impl_, std::move(address),
                                         std::move(mailbox));
}

}  // namespace karat
