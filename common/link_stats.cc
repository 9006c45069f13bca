#include "common/link_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace karat {
namespace {

// Label values escape backslash, double quote and newline.
std::string EscapeLabel(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  return absl::StrFormat("%.17g", v);
}

}  // namespace

void LinkStats::RecordSent(const std::string& peer, size_t bytes,
                           absl::Duration latency) {
  const double us = absl::ToDoubleMicroseconds(latency);
  const size_t bucket =
      std::lower_bound(kLinkLatencyBucketsUs.begin(),
                       kLinkLatencyBucketsUs.end(), us) -
      kLinkLatencyBucketsUs.begin();
  absl::MutexLock lock(&mu_);
  LinkCounters& c = links_[peer];
  ++c.messages;
  c.bytes += bytes;
  ++c.latency_buckets[bucket];
  c.latency_sum_us += us;
  ++c.latency_count;
}

void LinkStats::RecordDropped(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  ++links_[peer].dropped;
}

void LinkStats::RecordFailed(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  ++links_[peer].failed;
}

void LinkStats::RecordReceived(size_t bytes) {
  absl::MutexLock lock(&mu_);
  ++received_messages_;
  received_bytes_ += bytes;
}

std::map<std::string, LinkCounters> LinkStats::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return links_;
}

uint64_t LinkStats::received_messages() const {
  absl::MutexLock lock(&mu_);
  return received_messages_;
}

uint64_t LinkStats::received_bytes() const {
  absl::MutexLock lock(&mu_);
  return received_bytes_;
}

double LinkLatencyQuantileUs(const LinkCounters& c, double q) {
  if (c.latency_count == 0) return 0;
  const double target = q * static_cast<double>(c.latency_count);
  uint64_t seen = 0;
  for (size_t i = 0; i < c.latency_buckets.size(); ++i) {
    seen += c.latency_buckets[i];
    if (static_cast<double>(seen) >= target && seen > 0) {
      return i < kLinkLatencyBucketsUs.size()
                 ? kLinkLatencyBucketsUs[i]
                 : std::numeric_limits<double>::infinity();
    }
  }
  return std::numeric_limits<double>::infinity();
}

void LinkStats::ExportTo(
    google::protobuf::Map<std::string, double>* stats) const {
  const auto links = Snapshot();
  for (const auto& [peer, c] : links) {
    const std::string prefix = absl::StrCat("link.", peer, ".");
    (*stats)[prefix + "messages"] = static_cast<double>(c.messages);
    (*stats)[prefix + "bytes"] = static_cast<double>(c.bytes);
    (*stats)[prefix + "dropped"] = static_cast<double>(c.dropped);
    (*stats)[prefix + "failed"] = static_cast<double>(c.failed);
    (*stats)[prefix + "latency_us_mean"] =
        c.latency_count > 0 ? c.latency_sum_us / c.latency_count : 0.0;
    const double p50 = LinkLatencyQuantileUs(c, 0.5);
    const double p99 = LinkLatencyQuantileUs(c, 0.99);
    // A map value of +inf does not survive every JSON printer; report the
    // largest finite bound instead.
    (*stats)[prefix + "latency_us_p50"] =
        std::isinf(p50) ? kLinkLatencyBucketsUs.back() : p50;
    (*stats)[prefix + "latency_us_p99"] =
        std::isinf(p99) ? kLinkLatencyBucketsUs.back() : p99;
  }
  (*stats)["link.received_messages"] =
      static_cast<double>(received_messages());
  (*stats)["link.received_bytes"] = static_cast<double>(received_bytes());
}

std::string LinkStats::Prometheus(const std::string& node) const {
  const auto links = Snapshot();
  const std::string n = EscapeLabel(node);
  std::string out;
  auto counter = [&](const char* name, const char* help, auto value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name,
                    " counter\n");
    for (const auto& [peer, c] : links) {
      absl::StrAppend(&out, name, "{node=\"", n, "\",peer=\"",
                      EscapeLabel(peer), "\"} ", value(c), "\n");
    }
  };
  counter("karat_link_messages_total", "Messages sent to the peer.",
          [](const LinkCounters& c) { return c.messages; });
  counter("karat_link_bytes_total", "Bytes sent to the peer.",
          [](const LinkCounters& c) { return c.bytes; });
  counter("karat_link_dropped_total",
          "Messages to the peer dropped by link emulation.",
          [](const LinkCounters& c) { return c.dropped; });
  counter("karat_link_failed_total", "Sends to the peer that failed.",
          [](const LinkCounters& c) { return c.failed; });
  const char* h = "karat_link_send_latency_seconds";
  absl::StrAppend(&out, "# HELP ", h,
                  " Time from Send() until the message was sent.\n# TYPE ", h,
                  " histogram\n");
  for (const auto& [peer, c] : links) {
    const std::string labels =
        absl::StrCat("node=\"", n, "\",peer=\"", EscapeLabel(peer), "\"");
    uint64_t cumulative = 0;
    for (size_t i = 0; i < c.latency_buckets.size(); ++i) {
      cumulative += c.latency_buckets[i];
      const std::string le =
          i < kLinkLatencyBucketsUs.size()
              ? Number(kLinkLatencyBucketsUs[i] * 1e-6)
              : std::string("+Inf");
      absl::StrAppend(&out, h, "_bucket{", labels, ",le=\"", le, "\"} ",
                      cumulative, "\n");
    }
    absl::StrAppend(&out, h, "_sum{", labels, "} ",
                    Number(c.latency_sum_us * 1e-6), "\n");
    absl::StrAppend(&out, h, "_count{", labels, "} ", c.latency_count, "\n");
  }
  absl::StrAppend(&out,
                  "# HELP karat_link_received_messages_total Messages "
                  "received.\n# TYPE karat_link_received_messages_total "
                  "counter\nkarat_link_received_messages_total{node=\"",
                  n, "\"} ", received_messages(), "\n");
  absl::StrAppend(&out,
                  "# HELP karat_link_received_bytes_total Bytes received.\n"
                  "# TYPE karat_link_received_bytes_total counter\n"
                  "karat_link_received_bytes_total{node=\"",
                  n, "\"} ", received_bytes(), "\n");
  return out;
}

std::string PrometheusFromStatsMap(const std::string& node,
                                   const std::map<std::string, double>& stats) {
  static const char* const kCounters[] = {"messages", "bytes", "dropped",
                                          "failed"};
  const std::string n = EscapeLabel(node);
  std::string out;
  std::string gauges;
  for (const auto& [key, value] : stats) {
    bool link_series = false;
    if (key.rfind("link.", 0) == 0) {
      const size_t dot = key.rfind('.');
      const std::string peer = key.substr(5, dot > 5 ? dot - 5 : 0);
      const std::string counter = key.substr(dot + 1);
      if (key == "link.received_messages" || key == "link.received_bytes") {
        absl::StrAppend(&out, "karat_link_", counter, "_total{node=\"", n,
                        "\"} ", Number(value), "\n");
        link_series = true;
      } else if (!peer.empty()) {
        link_series = true;
        const bool is_counter =
            std::find(std::begin(kCounters), std::end(kCounters), counter) !=
            std::end(kCounters);
        absl::StrAppend(&out, "karat_link_", counter,
                        is_counter ? "_total" : "", "{node=\"", n,
                        "\",peer=\"", EscapeLabel(peer), "\"} ", Number(value),
                        "\n");
      }
    }
    if (!link_series) {
      absl::StrAppend(&gauges, "karat_node_stat{node=\"", n, "\",name=\"",
                      EscapeLabel(key), "\"} ", Number(value), "\n");
    }
  }
  return out + gauges;
}

}  // namespace karat
