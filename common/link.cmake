# Data-plane links: emulation decorator (latency, bandwidth, loss, down) and
# per-link counters with a Prometheus exporter.
target_sources(karat_common PRIVATE
  common/link_emulation.cc
  common/link_rules.cc
  common/link_stats.cc)
