add_unit_test(coordinator_placement_test
  SOURCES tests/coordinator/placement_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_config_test
  SOURCES tests/coordinator/cluster_config_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_service_test
  SOURCES tests/coordinator/coordinator_test.cc
  LIBS karat_coordinator)
add_unit_test(karatctl_workload_test
  SOURCES tests/coordinator/karatctl_workload_test.cc
  LIBS karatctl_lib)
add_unit_test(karatctl_retry_test
  SOURCES tests/coordinator/karatctl_retry_test.cc
  LIBS karatctl_lib)
add_unit_test(coordinator_scheduling_test
  SOURCES tests/coordinator/scheduling_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_wal_test
  SOURCES tests/coordinator/wal_test.cc
    tests/coordinator/wal_compaction_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_turn_plan_test
  SOURCES tests/coordinator/turn_plan_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_admission_policy_test
  SOURCES tests/coordinator/admission_policy_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_retry_test
  SOURCES tests/coordinator/coordinator_retry_test.cc
  LIBS karat_coordinator gRPC::grpc++)
add_unit_test(coordinator_quota_test
  SOURCES tests/coordinator/quota_test.cc
    tests/coordinator/idle_evict_test.cc
  LIBS karat_coordinator)
add_unit_test(coordinator_sessions_test
  SOURCES tests/coordinator/ownership_test.cc
    tests/coordinator/quota_service_test.cc
    tests/coordinator/idle_evict_service_test.cc
  LIBS karat_coordinator)
target_compile_definitions(coordinator_sessions_test PRIVATE
  KARAT_CERTS_SCRIPT="${PROJECT_SOURCE_DIR}/deploy/karat-certs")
# The data-plane secret (made, kept 0600, handed out) and the node table the
# KARAT nodes admit GPU nodes by (docs/security.md "Data plane").
add_unit_test(coordinator_data_plane_secret_test
  SOURCES tests/coordinator/data_plane_secret_test.cc
  LIBS karat_coordinator)
# Where the daemons' data planes bind: the cluster file's policy, the
# daemons' default and karatctl plan's --fabric-node.
add_unit_test(coordinator_data_plane_bind_test
  SOURCES tests/coordinator/data_plane_bind_test.cc
  LIBS karatctl_lib)
# The request checks of the client API and of RegisterNode.
add_unit_test(coordinator_requests_test
  SOURCES tests/coordinator/client_requests_test.cc
    tests/coordinator/register_request_test.cc
  LIBS karat_coordinator)
# The same checks through the coordinator's handlers.
add_unit_test(coordinator_request_checks_service_test
  SOURCES tests/coordinator/request_checks_service_test.cc
  LIBS karat_coordinator)
