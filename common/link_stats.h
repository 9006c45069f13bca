// Per-link data-plane counters: for every peer a node sends to, the messages
// and bytes sent, sends dropped or failed, and a histogram of send latency
// (from the Send() call until the wrapped transport's Send() returned, i.e.
// the message was handed over or completed, including any delay a
// LinkEmulator adds). Received traffic is counted per
// node (the transport does not know a message's sender).
//
// Exported two ways: as flat `link.<peer>.<counter>` entries for the stats
// maps of GetStats and heartbeats, and in the Prometheus text exposition
// format.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/map.h"

namespace karat {

// Upper bounds of the latency histogram buckets, in microseconds; a last,
// unbounded bucket follows.
inline constexpr std::array<double, 16> kLinkLatencyBucketsUs = {
    1,    2,    5,     10,    20,    50,     100,    200,
    500,  1000, 2000,  5000,  10000, 100000, 1000000, 10000000};

struct LinkCounters {
  uint64_t messages = 0;
  uint64_t bytes = 0;
  uint64_t dropped = 0;  // lost by link emulation
  uint64_t failed = 0;   // the send returned an error
  // Histogram of send latency; buckets[i] counts samples <=
  // kLinkLatencyBucketsUs[i] and above the previous bound, the last one the
  // rest (not cumulative).
  std::array<uint64_t, kLinkLatencyBucketsUs.size() + 1> latency_buckets{};
  double latency_sum_us = 0;
  uint64_t latency_count = 0;
};

// Thread safety: every method may be called from any thread.
class LinkStats {
 public:
  LinkStats() = default;
  LinkStats(const LinkStats&) = delete;
  LinkStats& operator=(const LinkStats&) = delete;

  // A message of `bytes` sent to `peer` in `latency`.
  void RecordSent(const std::string& peer, size_t bytes,
                  absl::Duration latency);
  void RecordDropped(const std::string& peer);
  void RecordFailed(const std::string& peer);
  void RecordReceived(size_t bytes);

  // Counters per peer name.
  std::map<std::string, LinkCounters> Snapshot() const;
  uint64_t received_messages() const;
  uint64_t received_bytes() const;

  // Adds `link.<peer>.messages`, `.bytes`, `.dropped`, `.failed`,
  // `.latency_us_mean`, `.latency_us_p50`, `.latency_us_p99` (bucket upper
  // bounds) and `link.received_messages` / `link.received_bytes`.
  void ExportTo(google::protobuf::Map<std::string, double>* stats) const;

  // Prometheus text format; every series is labelled node="<node>" and, per
  // link, peer="<peer>". Metric names: karat_link_messages_total,
  // karat_link_bytes_total, karat_link_dropped_total,
  // karat_link_failed_total, karat_link_send_latency_seconds (histogram),
  // karat_link_received_messages_total, karat_link_received_bytes_total.
  std::string Prometheus(const std::string& node) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, LinkCounters> links_ ABSL_GUARDED_BY(mu_);
  uint64_t received_messages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t received_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// The upper bound (µs) of the bucket holding quantile `q` (0..1) of the
// histogram; 0 without samples, +inf when it falls in the last bucket.
double LinkLatencyQuantileUs(const LinkCounters& counters, double q);

// Turns a stats map that holds `link.<peer>.<counter>` entries (as
// ExportTo() writes them, e.g. from GetStats or a heartbeat) into Prometheus
// text for `node`. Other entries become karat_node_stat{name="..."} gauges.
std::string PrometheusFromStatsMap(
    const std::string& node, const std::map<std::string, double>& stats);

}  // namespace karat
