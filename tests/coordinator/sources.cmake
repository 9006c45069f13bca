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
# The request checks of the client API and of RegisterNode.
add_unit_test(coordinator_requests_test
  SOURCES tests/coordinator/client_requests_test.cc
    tests/coordinator/register_request_test.cc
  LIBS karat_coordinator)
# The same checks through the coordinator's handlers.
add_unit_test(coordinator_request_checks_service_test
  SOURCES tests/coordinator/request_checks_service_test.cc
  LIBS karat_coordinator)
