# deploy/karat's shell functions, sourced without running a cluster.
add_test(NAME deploy_launch_log_test
  COMMAND bash ${PROJECT_SOURCE_DIR}/tests/deploy/launch_log_test.sh)
# Label `deploy`: a shell script, nothing for the sanitized builds to build.
set_tests_properties(deploy_launch_log_test PROPERTIES LABELS deploy TIMEOUT 60)
