include(tests/common/numerics.cmake OPTIONAL)
include(tests/common/linear.cmake OPTIONAL)
include(tests/common/transport.cmake OPTIONAL)
include(tests/common/model.cmake OPTIONAL)
include(tests/bench/sources.cmake OPTIONAL)
include(tests/kernel_variants.cmake)
include(tests/integration/sources.cmake OPTIONAL)
include(tests/coordinator/sources.cmake OPTIONAL)
include(tests/karat_node/sources.cmake OPTIONAL)
include(tests/gpu_node/sources.cmake OPTIONAL)
include(tests/security/sources.cmake)
include(tests/deploy/sources.cmake)
include(tests/fuzz/sources.cmake)

# ThreadSanitizer builds: what tests/sanitizers/tsan_annotations.cc tells
# ThreadSanitizer, checked on small programs (tsan_probe) with and without a
# race.
if(KARAT_SANITIZE STREQUAL "thread")
  add_executable(tsan_probe tests/sanitizers/tsan_probe.cc)
  target_link_libraries(tsan_probe PRIVATE absl::synchronization absl::time
                        OpenMP::OpenMP_CXX Threads::Threads)
  add_unit_test(tsan_annotations_test
    SOURCES tests/sanitizers/tsan_annotations_test.cc)
  target_compile_definitions(tsan_annotations_test PRIVATE
    KARAT_TSAN_PROBE="$<TARGET_FILE:tsan_probe>")
  add_dependencies(tsan_annotations_test tsan_probe)
endif()
