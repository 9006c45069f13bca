# karatctl: command-line client (generate, chat, status, bench, plan).
add_library(karatctl_lib STATIC
  tools/karatctl/bench.cc
  tools/karatctl/client.cc
  tools/karatctl/connection.cc
  tools/karatctl/plan.cc
  tools/karatctl/retry.cc
  tools/karatctl/workload.cc
  # Prometheus text of the nodes' counters (`karatctl metrics`).
  common/link_stats.cc)
target_include_directories(karatctl_lib PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(karatctl_lib PUBLIC
  karat_coordinator karat_security karat_proto gRPC::grpc++ absl::status
  absl::statusor
  absl::strings absl::str_format absl::synchronization Threads::Threads)

add_executable(karatctl tools/karatctl/main.cc)
target_link_libraries(karatctl PRIVATE karatctl_lib)
set_target_properties(karatctl PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
