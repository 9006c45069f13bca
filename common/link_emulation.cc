#include "common/link_emulation.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/stable_hash.h"
#include "common/status_macros.h"

namespace karat {
namespace {

constexpr const char* kLogModule = "link";

// One queued message of a delayed link.
struct Pending {
  std::shared_ptr<const std::string> data;
  absl::Time deliver_at;
  absl::Time sent_at;        // when Send() was called
  Transport::SendDone done;  // SendSharedAsync()'s callback, or empty
};

// Calls the callbacks of discarded messages with `status` (no lock held).
void FailPending(std::deque<Pending>& discarded, const absl::Status& status) {
  for (Pending& p : discarded) {
    if (p.done) p.done(status);
  }
}

}  // namespace

struct LinkEmulator::Impl {
  // One link: this node -> one peer.
  struct Link {
    PeerId id = kUnknownPeer;
    std::string added_name;  // as given to AddPeer()
    // The node name rules match and counters use.
    std::string name ABSL_GUARDED_BY(mu);
    absl::Mutex mu;
    LinkSettings settings ABSL_GUARDED_BY(mu);
    std::deque<Pending> queue ABSL_GUARDED_BY(mu);
    size_t queued_bytes ABSL_GUARDED_BY(mu) = 0;
    absl::Time busy_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
    absl::Time last_delivery ABSL_GUARDED_BY(mu) = absl::InfinitePast();
    std::mt19937_64 rng ABSL_GUARDED_BY(mu);
    bool stop ABSL_GUARDED_BY(mu) = false;
    // Set by FailPeer() until AddPeer() adds the peer again.
    absl::Status failed ABSL_GUARDED_BY(mu);
    bool thread_started ABSL_GUARDED_BY(mu) = false;
    absl::CondVar cv;
    std::thread thread;
  };

  Impl(std::unique_ptr<Transport> t, LinkEmulatorOptions o)
      : inner(std::move(t)), options(std::move(o)) {
    if (options.stats == nullptr) options.stats = std::make_shared<LinkStats>();
  }

  Link* Find(PeerId peer) {
    absl::MutexLock lock(&links_mu);
    auto it = links.find(peer);
    return it == links.end() ? nullptr : it->second.get();
  }

  // The name rules match and counters use for a peer added as `added_name`.
  std::string NodeName(const std::string& added_name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(links_mu) {
    auto it = peer_names.find(added_name);
    return it == peer_names.end() ? added_name : it->second;
  }

  void DeliveryLoop(Link* link);
  // Called with links_mu held (options.seed may change).
  uint64_t LinkSeed(const std::string& peer) const {
    return SplitMix64(options.seed ^
                      SplitMix64(Fnv1a64(options.local_name) ^ Fnv1a64(peer)));
  }
  // Stops the delivery threads: first marks every link stopped and drops
  // what is queued (StopLinks), then, once the inner transport is shut down
  // (which ends a send a thread may be blocked in, towards a dead peer),
  // joins them (JoinLinks).
  void StopLinks();
  void JoinLinks();

  const std::unique_ptr<Transport> inner;
  LinkEmulatorOptions options;

  mutable absl::Mutex links_mu;
  std::vector<LinkRule> rules ABSL_GUARDED_BY(links_mu);
  std::map<std::string, std::string> peer_names ABSL_GUARDED_BY(links_mu);
  absl::flat_hash_map<PeerId, std::unique_ptr<Link>> links
      ABSL_GUARDED_BY(links_mu);
  bool shut_down ABSL_GUARDED_BY(links_mu) = false;
};

void LinkEmulator::Impl::DeliveryLoop(Link* link) {
  LinkStats& stats = *options.stats;
  absl::MutexLock lock(&link->mu);
  for (;;) {
    if (link->stop) return;
    if (link->queue.empty()) {
      link->cv.Wait(&link->mu);
      continue;
    }
    if (link->settings.down) {
      // Disconnected: what was in flight is lost.
      KLOG(Warning, kLogModule) << "link " << options.local_name << " -> "
                                << link->name << " is down: discarding "
                                << link->queue.size() << " queued messages";
      for (size_t i = 0; i < link->queue.size(); ++i) {
        stats.RecordFailed(link->name);
      }
      std::deque<Pending> discarded;
      discarded.swap(link->queue);
      link->queued_bytes = 0;
      const absl::Status down = absl::UnavailableError(
          absl::StrCat("send to peer '", link->name, "': link ",
                       options.local_name, " -> ", link->name, " went down"));
      link->mu.Unlock();
      FailPending(discarded, down);
      link->mu.Lock();
      continue;
    }
    const absl::Time now = absl::Now();
    if (now < link->queue.front().deliver_at) {
      link->cv.WaitWithDeadline(&link->mu, link->queue.front().deliver_at);
      continue;
    }
    Pending p = std::move(link->queue.front());
    link->queue.pop_front();
    const size_t size = p.data->size();
    link->queued_bytes -= size;
    const std::string name = link->name;
    link->mu.Unlock();
    if (p.done) {
      // The delivery thread goes on with the next message; the outcome goes
      // to the sender's callback.
      std::shared_ptr<LinkStats> counters = options.stats;
      const absl::Time sent_at = p.sent_at;
      Transport::SendDone done = std::move(p.done);
      const absl::Status status = inner->SendSharedAsync(
          link->id, std::move(p.data),
          [counters, name, size, sent_at, done](absl::Status s) {
            if (s.ok()) {
              counters->RecordSent(name, size, absl::Now() - sent_at);
            } else {
              counters->RecordFailed(name);
            }
            done(std::move(s));
          });
      if (!status.ok()) {
        stats.RecordFailed(name);
        done(status);
      }
      link->mu.Lock();
      continue;
    }
    const absl::Status status = inner->SendShared(link->id, std::move(p.data));
    if (status.ok()) {
      stats.RecordSent(name, size, absl::Now() - p.sent_at);
    } else {
      stats.RecordFailed(name);
      KLOG(Warning, kLogModule) << "delayed send of " << size << " bytes to '"
                                << name << "' failed: " << status;
    }
    link->mu.Lock();
  }
}

void LinkEmulator::Impl::StopLinks() {
  std::vector<Link*> all;
  {
    absl::MutexLock lock(&links_mu);
    shut_down = true;
    for (auto& [id, link] : links) all.push_back(link.get());
  }
  for (Link* link : all) {
    std::deque<Pending> discarded;
    std::string name;
    {
      absl::MutexLock lock(&link->mu);
      link->stop = true;
      if (!link->queue.empty()) {
        KLOG(Info, kLogModule) << "shutdown discards " << link->queue.size()
                               << " messages queued to '" << link->name << "'";
      }
      discarded.swap(link->queue);
      link->queued_bytes = 0;
      link->cv.SignalAll();
      name = link->name;
    }
    FailPending(discarded,
                absl::UnavailableError(absl::StrCat(
                    "send to peer '", name, "': transport is shut down")));
  }
}

void LinkEmulator::Impl::JoinLinks() {
  std::vector<Link*> all;
  {
    absl::MutexLock lock(&links_mu);
    for (auto& [id, link] : links) all.push_back(link.get());
  }
  for (Link* link : all) {
    if (link->thread.joinable()) {
      if (link->thread.get_id() == std::this_thread::get_id()) {
        link->thread.detach();
      } else {
        link->thread.join();
      }
    }
  }
}

LinkEmulator::LinkEmulator(std::unique_ptr<Transport> inner,
                           LinkEmulatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(inner), std::move(options))) {}

LinkEmulator::~LinkEmulator() { Shutdown(); }

absl::Status LinkEmulator::SetLinks(std::vector<LinkRule> rules) {
  for (const LinkRule& r : rules) RETURN_IF_ERROR(ValidateLinkRule(r));
  absl::MutexLock lock(&impl_->links_mu);
  impl_->rules = std::move(rules);
  for (auto& [id, link] : impl_->links) {
    const LinkSettings s =
        ResolveLink(impl_->rules, impl_->options.local_name, link->name);
    absl::MutexLock link_lock(&link->mu);
    if (!(link->settings == s)) {
      KLOG(Info, kLogModule) << "link " << impl_->options.local_name << " -> "
                             << link->name << ": " << DescribeLink(s);
    }
    link->settings = s;
    link->cv.SignalAll();
  }
  return absl::OkStatus();
}

void LinkEmulator::SetSeed(uint64_t seed) {
  absl::MutexLock lock(&impl_->links_mu);
  if (impl_->options.seed == seed) return;
  impl_->options.seed = seed;
  for (auto& [id, link] : impl_->links) {
    absl::MutexLock link_lock(&link->mu);
    link->rng.seed(impl_->LinkSeed(link->name));
  }
}

void LinkEmulator::SetPeerNames(std::map<std::string, std::string> names) {
  absl::MutexLock lock(&impl_->links_mu);
  impl_->peer_names = std::move(names);
  for (auto& [id, link] : impl_->links) {
    const std::string name = impl_->NodeName(link->added_name);
    absl::MutexLock link_lock(&link->mu);
    link->name = name;
    link->settings = ResolveLink(impl_->rules, impl_->options.local_name, name);
  }
}

std::vector<LinkRule> LinkEmulator::links() const {
  absl::MutexLock lock(&impl_->links_mu);
  return impl_->rules;
}

LinkSettings LinkEmulator::SettingsFor(PeerId peer) const {
  Impl::Link* link = impl_->Find(peer);
  if (link == nullptr) return {};
  absl::MutexLock lock(&link->mu);
  return link->settings;
}

const std::shared_ptr<LinkStats>& LinkEmulator::stats() const {
  return impl_->options.stats;
}

std::string LinkEmulator::LocalAddress() const {
  return impl_->inner->LocalAddress();
}

absl::StatusOr<PeerId> LinkEmulator::AddPeer(const std::string& name,
                                             const std::string& address) {
  absl::StatusOr<PeerId> id = impl_->inner->AddPeer(name, address);
  if (!id.ok()) return id;
  absl::MutexLock lock(&impl_->links_mu);
  auto& slot = impl_->links[*id];
  if (slot == nullptr) {
    slot = std::make_unique<Impl::Link>();
    slot->id = *id;
    slot->added_name = name;
    absl::MutexLock link_lock(&slot->mu);
    slot->name = impl_->NodeName(name);
    slot->settings =
        ResolveLink(impl_->rules, impl_->options.local_name, slot->name);
    slot->stop = impl_->shut_down;
    slot->rng.seed(impl_->LinkSeed(slot->name));
  } else {
    absl::MutexLock link_lock(&slot->mu);
    slot->failed = absl::OkStatus();  // added again: usable
  }
  return id;
}

absl::Status LinkEmulator::Send(PeerId peer, const void* data, size_t len) {
  return SendMessage(peer, static_cast<const char*>(data), len, nullptr);
}

absl::Status LinkEmulator::SendShared(
    PeerId peer, std::shared_ptr<const std::string> message) {
  if (message == nullptr) {
    return absl::InvalidArgumentError("SendShared: null message");
  }
  const char* data = message->data();
  const size_t len = message->size();
  return SendMessage(peer, data, len, std::move(message));
}

absl::Status LinkEmulator::SendSharedAsync(
    PeerId peer, std::shared_ptr<const std::string> message, SendDone done) {
  if (absl::Status args = CheckAsyncArgs(message, done); !args.ok())
    return args;
  const char* data = message->data();
  const size_t len = message->size();
  return SendMessage(peer, data, len, std::move(message), &done);
}

absl::Status LinkEmulator::FailPeer(PeerId peer, const absl::Status& reason) {
  Impl::Link* link = impl_->Find(peer);
  if (link == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown peer id ", peer));
  }
  std::deque<Pending> discarded;
  absl::Status failure;
  {
    absl::MutexLock lock(&link->mu);
    failure = absl::UnavailableError(absl::StrCat(
        "send to peer '", link->name, "': peer failed: ", reason.message()));
    link->failed = failure;
    for (size_t i = 0; i < link->queue.size(); ++i) {
      impl_->options.stats->RecordFailed(link->name);
    }
    discarded.swap(link->queue);
    link->queued_bytes = 0;
    link->cv.SignalAll();
  }
  FailPending(discarded, failure);
  return impl_->inner->FailPeer(peer, reason);
}

absl::Status LinkEmulator::SendMessage(
    PeerId peer, const char* data, size_t len,
    std::shared_ptr<const std::string> shared, SendDone* async) {
  Impl::Link* link = impl_->Find(peer);
  LinkStats& stats = *impl_->options.stats;
  if (link == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown peer id ", peer));
  }
  const absl::Time start = absl::Now();
  std::string name;
  bool lost = false;
  {
    absl::MutexLock lock(&link->mu);
    name = link->name;
    const LinkSettings s = link->settings;
    if (s.down) {
      stats.RecordFailed(name);
      return absl::UnavailableError(absl::StrCat(
          "send to peer '", link->name, "': link ", impl_->options.local_name,
          " -> ", link->name, " is down"));
    }
    if (link->stop) {
      return absl::UnavailableError(absl::StrCat("send to peer '", link->name,
                                                 "': transport is shut down"));
    }
    if (!link->failed.ok()) return link->failed;
    if (s.Active() || !link->queue.empty()) {
      if (s.loss > 0 && std::uniform_real_distribution<double>(
                            0.0, 1.0)(link->rng) < s.loss) {
        stats.RecordDropped(name);
        lost = true;
      }
    }
    if (!lost && (s.Active() || !link->queue.empty())) {
      const size_t max_queued = impl_->options.max_queued_bytes;
      // Runs under link->mu (absl::Condition evaluates it with the lock).
      auto has_room = [link, len, max_queued]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return link->stop || !link->failed.ok() || link->queue.empty() ||
               link->queued_bytes + len <= max_queued;
      };
      link->mu.Await(absl::Condition(&has_room));
      if (link->stop) {
        return absl::UnavailableError(absl::StrCat(
            "send to peer '", link->name, "': transport is shut down"));
      }
      if (!link->failed.ok()) return link->failed;
      const absl::Time now = absl::Now();
      absl::Time ready = now;
      if (s.bandwidth_mbps > 0) {
        const absl::Duration serialisation = absl::Seconds(
            static_cast<double>(len) * 8.0 / (s.bandwidth_mbps * 1e6));
        ready = std::max(now, link->busy_until) + serialisation;
        link->busy_until = ready;
      }
      int64_t delay_us = s.latency_us;
      if (s.jitter_us > 0) {
        delay_us +=
            std::uniform_int_distribution<int64_t>(0, s.jitter_us)(link->rng);
      }
      const absl::Time deliver_at =
          std::max(ready + absl::Microseconds(delay_us), link->last_delivery);
      link->last_delivery = deliver_at;
      if (shared == nullptr) {
        shared = std::make_shared<const std::string>(data, len);
      }
      Pending pending{std::move(shared), deliver_at, start, nullptr};
      if (async != nullptr) pending.done = std::move(*async);
      link->queue.push_back(std::move(pending));
      link->queued_bytes += len;
      if (!link->thread_started) {
        link->thread_started = true;
        link->thread = std::thread([this, link] { impl_->DeliveryLoop(link); });
      }
      link->cv.Signal();
      return absl::OkStatus();
    }
  }
  if (lost) {
    // As Send() returns OK for a lost message, the callback gets OK.
    if (async != nullptr) {
      SendDone done = std::move(*async);
      done(absl::OkStatus());
    }
    return absl::OkStatus();
  }
  if (async != nullptr) {
    std::shared_ptr<LinkStats> counters = impl_->options.stats;
    SendDone done = std::move(*async);
    absl::Status status = impl_->inner->SendSharedAsync(
        peer, std::move(shared),
        [counters, name, len, start, done](absl::Status s) {
          if (s.ok()) {
            counters->RecordSent(name, len, absl::Now() - start);
          } else {
            counters->RecordFailed(name);
          }
          done(std::move(s));
        });
    if (!status.ok()) {
      stats.RecordFailed(name);
      *async = std::move(done);  // not sent: the caller keeps its callback
    }
    return status;
  }
  const absl::Status status =
      shared != nullptr ? impl_->inner->SendShared(peer, std::move(shared))
                        : impl_->inner->Send(peer, data, len);
  if (status.ok()) {
    stats.RecordSent(name, len, absl::Now() - start);
  } else {
    stats.RecordFailed(name);
  }
  return status;
}

void LinkEmulator::SetPeerReceiveHandler(PeerReceiveHandler handler) {
  std::shared_ptr<LinkStats> stats = impl_->options.stats;
  impl_->inner->SetPeerReceiveHandler(
      [stats, handler = std::move(handler)](PeerId from,
                                            std::string_view message) {
        stats->RecordReceived(message.size());
        if (handler) handler(from, message);
      });
}

std::string LinkEmulator::PeerName(PeerId peer) const {
  return impl_->inner->PeerName(peer);
}

size_t LinkEmulator::MaxMessageSize() const {
  return impl_->inner->MaxMessageSize();
}

std::map<std::string, double> LinkEmulator::Counters() const {
  return impl_->inner->Counters();
}

void LinkEmulator::Shutdown() {
  impl_->StopLinks();
  impl_->inner->Shutdown();
  impl_->JoinLinks();
}

}  // namespace karat
