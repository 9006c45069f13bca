#include "common/link_rules.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace karat {

namespace {

// "links[2].loss: must be ..." or "link a -> b: loss must be ...".
absl::Status BadField(const LinkRule& r, absl::string_view field,
                      absl::string_view name, absl::string_view problem) {
  if (!field.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".", name, ": ", problem));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "link ", r.source, " -> ", r.destination, ": ", name, " ", problem));
}

}  // namespace

absl::Status ValidateLinkRule(const LinkRule& r, absl::string_view field) {
  if (r.source.empty())
    return BadField(r, field, "source", "must be a node name or *");
  if (r.destination.empty())
    return BadField(r, field, "destination", "must be a node name or *");
  const LinkSettings& s = r.settings;
  if (s.latency_us < 0) return BadField(r, field, "latency_us", "must be >= 0");
  if (s.jitter_us < 0) return BadField(r, field, "jitter_us", "must be >= 0");
  if (!(s.bandwidth_mbps >= 0) || std::isinf(s.bandwidth_mbps))
    return BadField(r, field, "bandwidth_mbps", "must be >= 0 and finite");
  if (!(s.loss >= 0 && s.loss <= 1)) {
    return BadField(r, field, "loss",
                    absl::StrCat("must be within [0, 1], got ", s.loss));
  }
  return absl::OkStatus();
}

LinkSettings ResolveLink(const std::vector<LinkRule>& rules,
                         const std::string& source,
                         const std::string& destination) {
  int best_rank = -1;
  LinkSettings best;
  for (const LinkRule& r : rules) {
    const bool src_exact = r.source == source;
    const bool dst_exact = r.destination == destination;
    if (!src_exact && r.source != "*") continue;
    if (!dst_exact && r.destination != "*") continue;
    const int rank = (src_exact ? 2 : 0) + (dst_exact ? 1 : 0);
    if (rank >= best_rank) {
      best_rank = rank;
      best = r.settings;
    }
  }
  return best;
}

LinkRule LinkRuleFromProto(const cluster::LinkConfig& c) {
  LinkRule r;
  r.source = c.source();
  r.destination = c.destination();
  r.settings.latency_us = c.latency_us();
  r.settings.jitter_us = c.jitter_us();
  r.settings.bandwidth_mbps = c.bandwidth_mbps();
  r.settings.loss = c.loss();
  r.settings.down = c.down();
  return r;
}

cluster::LinkConfig LinkRuleToProto(const LinkRule& r) {
  cluster::LinkConfig c;
  c.set_source(r.source);
  c.set_destination(r.destination);
  c.set_latency_us(r.settings.latency_us);
  c.set_jitter_us(r.settings.jitter_us);
  c.set_bandwidth_mbps(r.settings.bandwidth_mbps);
  c.set_loss(r.settings.loss);
  c.set_down(r.settings.down);
  return c;
}

absl::StatusOr<std::vector<LinkRule>> LinkRulesFromProto(
    const google::protobuf::RepeatedPtrField<cluster::LinkConfig>& configs) {
  std::vector<LinkRule> rules;
  for (const cluster::LinkConfig& c : configs) {
    rules.push_back(LinkRuleFromProto(c));
    RETURN_IF_ERROR(ValidateLinkRule(rules.back()));
  }
  return rules;
}

std::string DescribeLink(const LinkSettings& s) {
  if (!s.Active()) return "-";
  std::vector<std::string> parts;
  if (s.latency_us > 0)
    parts.push_back(absl::StrCat("latency ", s.latency_us, "us"));
  if (s.jitter_us > 0)
    parts.push_back(absl::StrCat("jitter ", s.jitter_us, "us"));
  if (s.bandwidth_mbps > 0) {
    parts.push_back(absl::StrFormat("bandwidth %gMb/s", s.bandwidth_mbps));
  }
  if (s.loss > 0) parts.push_back(absl::StrFormat("loss %g", s.loss));
  if (s.down) parts.push_back("down");
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += ' ';
    out += p;
  }
  return out;
}

}  // namespace karat
