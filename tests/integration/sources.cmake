# In the sanitized builds (deploy/karat test's build-asan and build-tsan),
# where the daemons run six to eight times slower, ctest runs the cases
# tagged [sanitized] only: the concurrent sessions against the reference
# engine, the error statuses, a coordinator restart and idle eviction
# (cluster_test), every client fault (faults_test), 1% loss and a KARAT node
# restarted at once (faults_recovery_test), two namespaces over tcp
# (netns_test), the attacks (attacks_test), and six concurrent sessions on
# two ranks with two micro-batches each (expert-parallel) and two KARAT
# nodes under OFMS and SCMS, and a KARAT node lost mid-turn (scale_out_test).
# Every executable still runs all its cases when started by hand.
set(KARAT_INTEGRATION_ARGS "")
if(KARAT_SANITIZE)
  set(KARAT_INTEGRATION_ARGS "[sanitized]")
endif()
add_unit_test(cluster_test
  SOURCES tests/integration/cluster_test.cc tests/integration/cluster_harness.cc
  LIBS karat_common karat_proto
  LABELS integration
  ARGS ${KARAT_INTEGRATION_ARGS})
target_compile_definitions(cluster_test PRIVATE
  KARAT_BIN_DIR="${PROJECT_BINARY_DIR}/bin")
# The daemons and tools the test starts.
add_dependencies(cluster_test karat-coordinator karat-node karat-gpu-node
                 karat-weights karat-reference)
# Two network namespaces over tcp (skipped without the privilege), and link
# emulation through the admin API.
add_unit_test(netns_test
  SOURCES tests/integration/netns_test.cc tests/integration/cluster_harness.cc
  LIBS karat_common karat_proto
  LABELS integration
  ARGS ${KARAT_INTEGRATION_ARGS})
target_compile_definitions(netns_test PRIVATE
  KARAT_BIN_DIR="${PROJECT_BINARY_DIR}/bin")
add_dependencies(netns_test karat-coordinator karat-node karat-gpu-node
                 karat-weights karatctl)
# Several GPU ranks (expert-parallel MoE) and KARAT nodes, two micro-batches
# under OFMS and SCMS, count balancing, and the gpu_only baseline.
add_unit_test(scale_out_test
  SOURCES tests/integration/scale_out_test.cc
          tests/integration/cluster_harness.cc
  LIBS karat_common karat_proto
  LABELS integration
  ARGS ${KARAT_INTEGRATION_ARGS})
target_compile_definitions(scale_out_test PRIVATE
  KARAT_BIN_DIR="${PROJECT_BINARY_DIR}/bin")
add_dependencies(scale_out_test karat-coordinator karat-node karat-gpu-node
                 karat-weights)
# Process faults under load (deploy/experiments/chaos --quick, ~1 min): a
# kill of the coordinator, a GPU rank and a KARAT node and a stop, under
# `karatctl bench --retry`; fails when a turn is lost, a turn's tokens differ
# from a fault-free run or a token is replayed. Its clusters run in
# build/chaos-quick/points/ and are taken down also on failure; it runs
# alone (it loads every core).
if(EXISTS /usr/bin/python3)
  add_test(NAME chaos_quick
    COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/deploy/experiments/chaos
            --quick --build-dir ${PROJECT_BINARY_DIR}
            --out-dir ${PROJECT_BINARY_DIR}/chaos-quick
            --model-dir ${PROJECT_BINARY_DIR}/chaos-quick/model
            --bench-timeout 240)
  set_tests_properties(chaos_quick PROPERTIES
    LABELS chaos TIMEOUT 900 RUN_SERIAL TRUE)
endif()
# Faults a client causes: cancels, deadlines and closes beside other
# sessions' turns, turns retried with idempotency keys, admission refusals.
add_unit_test(faults_test
  SOURCES tests/integration/faults_test.cc tests/integration/faults_util.cc
          tests/integration/cluster_harness.cc
  LIBS karat_common karat_proto
  LABELS integration
  ARGS ${KARAT_INTEGRATION_ARGS})
target_compile_definitions(faults_test PRIVATE
  KARAT_BIN_DIR="${PROJECT_BINARY_DIR}/bin")
add_dependencies(faults_test karat-coordinator karat-node karat-gpu-node
                 karat-weights)
# Faults of the cluster under running turns: a coordinator restart with
# retrying clients, lossy and broken data-plane links, a KARAT node killed
# and restarted at once.
add_unit_test(faults_recovery_test
  SOURCES tests/integration/faults_recovery_test.cc
          tests/integration/faults_util.cc
          tests/integration/cluster_harness.cc
  LIBS karat_common karat_proto
  LABELS integration
  ARGS ${KARAT_INTEGRATION_ARGS})
target_compile_definitions(faults_recovery_test PRIVATE
  KARAT_BIN_DIR="${PROJECT_BINARY_DIR}/bin")
add_dependencies(faults_recovery_test karat-coordinator karat-node
                 karat-gpu-node karat-weights)
# The harness makes each cluster's CA, certificates and tokens with the
# launcher's script.
foreach(t cluster_test netns_test scale_out_test faults_test
          faults_recovery_test)
  target_compile_definitions(${t} PRIVATE
    KARAT_CERTS_SCRIPT="${PROJECT_SOURCE_DIR}/deploy/karat-certs")
endforeach()
# Who may call what, end to end with TLS: the attacks of docs/security.md.
add_unit_test(attacks_test
  SOURCES tests/integration/attacks_test.cc
          tests/integration/cluster_harness.cc
  LIBS karat_common karat_proto
  LABELS integration
  ARGS ${KARAT_INTEGRATION_ARGS})
target_compile_definitions(attacks_test PRIVATE
  KARAT_BIN_DIR="${PROJECT_BINARY_DIR}/bin"
  KARAT_CERTS_SCRIPT="${PROJECT_SOURCE_DIR}/deploy/karat-certs")
add_dependencies(attacks_test karat-coordinator karat-node karat-gpu-node
                 karat-weights)
