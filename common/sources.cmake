# karat_common: everything two or more programs share (DESIGN.md §8).
add_library(karat_common STATIC)
target_include_directories(karat_common PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(karat_common PUBLIC
  karat_proto absl::status absl::statusor absl::strings absl::str_format
  absl::synchronization absl::flat_hash_map absl::time
  protobuf::libprotobuf PkgConfig::FABRIC OpenMP::OpenMP_CXX Threads::Threads)
include(common/base.cmake)                # logging
include(common/numerics.cmake OPTIONAL)   # numeric, config, safetensors, weights
include(common/linear.cmake OPTIONAL)     # batch-invariant linear kernel
include(common/transport.cmake OPTIONAL)  # libfabric transport, frames
include(common/link.cmake OPTIONAL)       # link emulation, per-link counters
include(common/model.cmake OPTIONAL)      # kv store, attention, runner, engine
include(common/membership.cmake OPTIONAL)
include(common/node_daemon.cmake)     # shared node daemon set-up
include(common/attention_methods.cmake)  # GQA attention methods
