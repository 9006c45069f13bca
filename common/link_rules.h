// Link-emulation rules (DESIGN.md §7 "Injection"): what a link from one node
// to another is set to, how the rule for a link is chosen among several,
// their checks, their protobuf form (cluster.proto LinkConfig) and their
// one-line description. Shared by the emulator on the nodes
// (common/link_emulation.h), the coordinator's config checks and karatctl,
// so that all three resolve, check and show rules alike.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cluster.pb.h"

namespace karat {

struct LinkSettings {
  int64_t latency_us = 0;
  int64_t jitter_us = 0;
  // 0: no cap.
  double bandwidth_mbps = 0;
  // Probability in [0, 1].
  double loss = 0;
  bool down = false;

  // True when any setting differs from a plain link.
  bool Active() const {
    return latency_us > 0 || jitter_us > 0 || bandwidth_mbps > 0 || loss > 0 ||
           down;
  }
  bool operator==(const LinkSettings&) const = default;
};

// Settings for the links from `source` to `destination`; either may be "*"
// (every node).
struct LinkRule {
  std::string source;
  std::string destination;
  LinkSettings settings;
};

// INVALID_ARGUMENT when a value is out of range (negative latency, jitter or
// bandwidth, loss outside [0, 1], empty names). The message names the rule
// ("link a -> b: loss must be within [0, 1], got 2") or, given `field`, the
// field ("links[2].loss: must be within [0, 1], got 2").
absl::Status ValidateLinkRule(const LinkRule& rule,
                              absl::string_view field = {});

// The settings of the link `source` -> `destination`: the last rule whose
// names match, preferring exact names over "*" (exact source and
// destination, then exact source, then exact destination, then "*" -> "*");
// plain settings when none matches.
LinkSettings ResolveLink(const std::vector<LinkRule>& rules,
                         const std::string& source,
                         const std::string& destination);

LinkRule LinkRuleFromProto(const cluster::LinkConfig& config);
cluster::LinkConfig LinkRuleToProto(const LinkRule& rule);
// Every rule of `configs`; INVALID_ARGUMENT naming the first invalid one.
absl::StatusOr<std::vector<LinkRule>> LinkRulesFromProto(
    const google::protobuf::RepeatedPtrField<cluster::LinkConfig>& configs);

// "latency 100us jitter 10us bandwidth 1000Mb/s loss 0.01 down", or "-" for a
// plain link.
std::string DescribeLink(const LinkSettings& settings);

}  // namespace karat
