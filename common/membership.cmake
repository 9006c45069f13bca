# Node registration and heartbeats with the coordinator.
target_sources(karat_common PRIVATE common/membership.cc)
