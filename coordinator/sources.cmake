# karat_coordinator: client API, sessions, placement, membership.
add_library(karat_coordinator STATIC
  coordinator/admin_service.cc
  coordinator/admission.cc
  coordinator/client_auth.cc
  coordinator/client_requests.cc
  coordinator/cluster_config.cc
  coordinator/control_push.cc
  coordinator/coordinator.cc
  coordinator/data_plane_bind.cc
  coordinator/data_plane_secret.cc
  coordinator/generate.cc
  coordinator/idle_evict.cc
  coordinator/karat_service.cc
  coordinator/kv_release.cc
  coordinator/membership_service.cc
  coordinator/register_request.cc
  coordinator/turn_plan.cc
  coordinator/turn_resume.cc
  coordinator/admission_policy.cc
  coordinator/placement.cc
  coordinator/quota.cc
  coordinator/scheduling.cc
  coordinator/wal.cc
  # The only compiled parts of common/ the coordinator needs (tokenizer.h and
  # status_macros.h are header-only): logging, and the model config and
  # tensor list for the config checks (RankWeightBytes), and the link rules
  # (common/link_rules.h, shared with the nodes and karatctl), and the admin
  # API's process-fault check (common/process_fault.h). Compiled in so that
  # the coordinator does not pull the model kernels and libfabric.
  common/log.cc
  common/log_limiter.cc
  common/request_errors.cc
  common/link_rules.cc
  common/process_fault.cc
  common/json.cc
  common/numeric.cc
  common/model_config.cc
  common/safetensors.cc
  common/weights.cc
  ${PROJECT_BINARY_DIR}/generated/karat_presets.cc)
target_include_directories(karat_coordinator PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(karat_coordinator PUBLIC
  karat_proto karat_security gRPC::grpc++ gRPC::grpc++_reflection
  protobuf::libprotobuf absl::status absl::statusor absl::strings
  absl::str_format absl::synchronization absl::random_random absl::time
  OpenMP::OpenMP_CXX Threads::Threads)

add_executable(karat-coordinator coordinator/main.cc)
target_link_libraries(karat-coordinator PRIVATE karat_coordinator)
set_target_properties(karat-coordinator PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
