add_unit_test(frame_test
  SOURCES tests/common/frame_test.cc
  LIBS karat_common)
# The data-plane hello's proof (HMAC layout and coverage).
add_unit_test(hello_proof_test
  SOURCES tests/common/hello_proof_test.cc
  LIBS karat_common)
target_compile_definitions(hello_proof_test PRIVATE
  KARAT_FRAME_CORPUS="${PROJECT_SOURCE_DIR}/tests/fuzz/frame_corpus")
add_unit_test(fake_transport_test
  SOURCES tests/common/fake_transport_test.cc
  LIBS karat_common)
# Two endpoints in one process over shm, and over tcp;ofi_rxm on 127.0.0.1.
add_unit_test(fabric_transport_test
  SOURCES tests/common/fabric_transport_test.cc
  LIBS karat_common)
# Link emulation decorator over the FakeFabric, per-link counters.
add_unit_test(link_emulation_test
  SOURCES tests/common/link_emulation_test.cc
  LIBS karat_common)

# libFuzzer target for the frame decoder (tests/fuzz/frame_fuzzer.cc). The
# main build uses g++, so clang++ is invoked directly; the target exists only
# where clang++ with libFuzzer is installed (Debian: clang,
# libclang-rt-14-dev). Not built by default: `deploy/karat test` builds and
# runs it for a bounded time (binary: fuzz/frame_fuzzer).
find_program(KARAT_FUZZ_CXX NAMES clang++-14 clang++)
set(KARAT_FUZZ_OK FALSE)
if(KARAT_FUZZ_CXX)
  set(_probe_dir ${PROJECT_BINARY_DIR}/fuzz-probe)
  file(MAKE_DIRECTORY ${_probe_dir})
  file(WRITE ${_probe_dir}/probe.cc
    "#include <cstddef>\n#include <cstdint>\n"
    "extern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
  execute_process(
    COMMAND ${KARAT_FUZZ_CXX} -fsanitize=fuzzer,address probe.cc -o probe
    WORKING_DIRECTORY ${_probe_dir}
    RESULT_VARIABLE _probe_rc OUTPUT_QUIET ERROR_QUIET)
  if(_probe_rc EQUAL 0)
    set(KARAT_FUZZ_OK TRUE)
  endif()
endif()
if(KARAT_FUZZ_OK)
  execute_process(
    COMMAND pkg-config --libs absl_status absl_statusor absl_strings
    OUTPUT_VARIABLE _fuzz_absl_libs OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _fuzz_pc_rc)
  separate_arguments(_fuzz_absl_libs UNIX_COMMAND "${_fuzz_absl_libs}")
  set(_fuzz_sources
    ${PROJECT_SOURCE_DIR}/tests/fuzz/frame_fuzzer.cc
    ${PROJECT_SOURCE_DIR}/common/frame.cc
    ${PROJECT_SOURCE_DIR}/common/log.cc)
  add_custom_command(
    OUTPUT ${PROJECT_BINARY_DIR}/fuzz/frame_fuzzer
    COMMAND ${CMAKE_COMMAND} -E make_directory ${PROJECT_BINARY_DIR}/fuzz
    COMMAND ${KARAT_FUZZ_CXX} -std=c++20 -O1 -g -fsanitize=fuzzer,address
            -I${PROJECT_SOURCE_DIR} ${_fuzz_sources} ${_fuzz_absl_libs}
            -o ${PROJECT_BINARY_DIR}/fuzz/frame_fuzzer
    DEPENDS ${_fuzz_sources} ${PROJECT_SOURCE_DIR}/common/frame.h
    COMMENT "Building the frame fuzzer with ${KARAT_FUZZ_CXX}"
    VERBATIM)
  add_custom_target(karat-frame-fuzzer
    DEPENDS ${PROJECT_BINARY_DIR}/fuzz/frame_fuzzer)
else()
  message(STATUS "clang++ with libFuzzer not found: the frame fuzzer "
                 "(karat-frame-fuzzer) is skipped")
endif()
