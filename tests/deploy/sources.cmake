# deploy/karat's shell functions, sourced without running a cluster.
add_test(NAME deploy_launch_log_test
  COMMAND bash ${PROJECT_SOURCE_DIR}/tests/deploy/launch_log_test.sh)
set_tests_properties(deploy_launch_log_test PROPERTIES LABELS unit TIMEOUT 60)
