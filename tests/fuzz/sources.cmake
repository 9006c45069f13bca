# libFuzzer targets for the inputs that come from outside the process
# (docs/testing.md, docs/security.md "Fuzzing"): tests/fuzz/NAME_fuzzer.cc
# with its seed corpus tests/fuzz/NAME_corpus/ and, for text inputs, a
# dictionary tests/fuzz/NAME.dict. The main build uses g++, so clang++
# compiles them directly, each source once into build/fuzz/obj/ (with
# AddressSanitizer, UndefinedBehaviorSanitizer and libFuzzer's coverage),
# and links each target into build/fuzz/NAME_fuzzer against Debian's
# libraries. They exist only where clang++ with libFuzzer is installed
# (Debian: clang, libclang-rt-14-dev) and are not built by default:
# `ninja karat-fuzzers` builds them all (karat-NAME-fuzzer one), and
# `deploy/karat test` builds and runs each for a bounded time
# (run_fuzzers; the list is build/fuzz/fuzzers.txt).
find_program(KARAT_FUZZ_CXX NAMES clang++-14 clang++)
set(KARAT_FUZZ_OK FALSE)
set(_fuzz_sanitize -fsanitize=address,undefined -fno-sanitize-recover=all)
if(KARAT_FUZZ_CXX)
  set(_probe_dir ${PROJECT_BINARY_DIR}/fuzz-probe)
  file(MAKE_DIRECTORY ${_probe_dir})
  file(WRITE ${_probe_dir}/probe.cc
    "#include <cstddef>\n#include <cstdint>\n"
    "extern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
  execute_process(
    COMMAND ${KARAT_FUZZ_CXX} -fsanitize=fuzzer ${_fuzz_sanitize} probe.cc
            -o probe
    WORKING_DIRECTORY ${_probe_dir}
    RESULT_VARIABLE _probe_rc OUTPUT_QUIET ERROR_QUIET)
  if(_probe_rc EQUAL 0)
    set(KARAT_FUZZ_OK TRUE)
  endif()
endif()

if(NOT KARAT_FUZZ_OK)
  message(STATUS "clang++ with libFuzzer not found: the fuzz targets "
                 "(karat-fuzzers) are skipped")
  return()
endif()

set(KARAT_FUZZ_DIR ${PROJECT_BINARY_DIR}/fuzz)
file(MAKE_DIRECTORY ${KARAT_FUZZ_DIR}/obj)
execute_process(
  COMMAND pkg-config --libs absl_status absl_statusor absl_strings
          absl_str_format absl_synchronization absl_flat_hash_map protobuf
          grpc++ libcrypto
  OUTPUT_VARIABLE _fuzz_libs OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _fuzz_pc_rc)
if(NOT _fuzz_pc_rc EQUAL 0)
  message(FATAL_ERROR "pkg-config cannot name the fuzz targets' libraries")
endif()
separate_arguments(_fuzz_libs UNIX_COMMAND "${_fuzz_libs}")
# The code under test compiles as in the main build: the same ISA and no
# contraction (numeric.cc's kernels need the ISA flags).
separate_arguments(_fuzz_user_flags UNIX_COMMAND "${CMAKE_CXX_FLAGS}")
set(_fuzz_common_cflags -std=c++20 -O1 -fno-fast-math -ffp-contract=off
    -fsanitize=fuzzer-no-link ${_fuzz_user_flags}
    -I${PROJECT_SOURCE_DIR} -I${KARAT_PROTO_OUT})
if(KARAT_NATIVE)
  list(APPEND _fuzz_common_cflags -march=native)
endif()
set(_fuzz_cflags ${_fuzz_common_cflags} -g -fno-omit-frame-pointer
    ${_fuzz_sanitize})
# protoc's generated code is compiled with coverage (it guides the mutations
# towards messages that parse) but without the sanitizers and debug
# information, which make it take 17 s instead of 5 to compile.
set(_fuzz_generated_cflags ${_fuzz_common_cflags})
# Every object waits for the generated protobuf headers.
set(_fuzz_generated ${KARAT_PROTO_OUT}/cluster.pb.h
    ${KARAT_PROTO_OUT}/karat.pb.h)

# karat_fuzz_object(SRC OUT): compiles SRC (an absolute path) once and sets
# OUT to its object file.
function(karat_fuzz_object src out)
  string(MAKE_C_IDENTIFIER "${src}" id)
  set(obj ${KARAT_FUZZ_DIR}/obj/${id}.o)
  get_property(seen GLOBAL PROPERTY KARAT_FUZZ_OBJ_${id} SET)
  if(NOT seen)
    set_property(GLOBAL PROPERTY KARAT_FUZZ_OBJ_${id} TRUE)
    set(flags ${_fuzz_cflags})
    string(FIND "${src}" "${KARAT_PROTO_OUT}/" generated)
    if(generated EQUAL 0)
      set(flags ${_fuzz_generated_cflags})
    endif()
    add_custom_command(
      OUTPUT ${obj}
      COMMAND ${KARAT_FUZZ_CXX} ${flags} -w -MD -MF ${obj}.d
              -c ${src} -o ${obj}
      DEPENDS ${src} ${_fuzz_generated}
      DEPFILE ${obj}.d
      COMMENT "Compiling ${src} for the fuzz targets"
      VERBATIM)
  endif()
  set(${out} ${obj} PARENT_SCOPE)
endfunction()

# add_karat_fuzzer(NAME SOURCES a.cc ...): build/fuzz/NAME from
# tests/fuzz/NAME.cc and the sources under test (paths relative to the
# repository, or absolute); target karat-NAME with `_` as `-`.
set(KARAT_FUZZERS "")
function(add_karat_fuzzer name)
  cmake_parse_arguments(F "" "" "SOURCES" ${ARGN})
  set(objs "")
  foreach(src ${PROJECT_SOURCE_DIR}/tests/fuzz/${name}.cc ${F_SOURCES})
    if(NOT IS_ABSOLUTE ${src})
      set(src ${PROJECT_SOURCE_DIR}/${src})
    endif()
    karat_fuzz_object(${src} obj)
    list(APPEND objs ${obj})
  endforeach()
  add_custom_command(
    OUTPUT ${KARAT_FUZZ_DIR}/${name}
    COMMAND ${KARAT_FUZZ_CXX} -fsanitize=fuzzer ${_fuzz_sanitize} ${objs}
            ${_fuzz_libs} -o ${KARAT_FUZZ_DIR}/${name}
    DEPENDS ${objs}
    COMMENT "Linking the fuzz target ${name}"
    VERBATIM)
  string(REPLACE "_" "-" target "karat-${name}")
  add_custom_target(${target} DEPENDS ${KARAT_FUZZ_DIR}/${name})
  set(KARAT_FUZZERS ${KARAT_FUZZERS} ${name} PARENT_SCOPE)
endfunction()

set(_pb_cluster ${KARAT_PROTO_OUT}/cluster.pb.cc)
set(_pb_karat ${KARAT_PROTO_OUT}/karat.pb.cc)

# Data-plane frames (common/frame.h DecodeFrame).
add_karat_fuzzer(frame_fuzzer SOURCES common/frame.cc common/log.cc)

# The coordinator's client API: Generate, CreateSession, GetSession and
# CloseSession requests (coordinator/client_requests.h, turn_plan.h).
add_karat_fuzzer(client_request_fuzzer
  SOURCES coordinator/client_requests.cc coordinator/turn_plan.cc
          ${_pb_karat} ${_pb_cluster})
# Coordinator.RegisterNode (coordinator/register_request.h), and the
# placement of what it admits (coordinator/placement.h).
add_karat_fuzzer(register_node_fuzzer
  SOURCES coordinator/register_request.cc coordinator/placement.cc
          ${_pb_cluster})
# GpuNode.RunTurn (gpu_node/turn_request.h).
add_karat_fuzzer(run_turn_fuzzer
  SOURCES gpu_node/turn_request.cc ${_pb_cluster})
# KaratNode.Reserve (karat_node/reserve_request.h).
add_karat_fuzzer(reserve_fuzzer
  SOURCES karat_node/reserve_request.cc ${_pb_cluster})

# The cluster configuration (coordinator/cluster_config.h), checked also
# against a preset model.
set(_model_sources common/json.cc common/model_config.cc common/numeric.cc
    common/safetensors.cc common/weights.cc
    ${PROJECT_BINARY_DIR}/generated/karat_presets.cc)
add_karat_fuzzer(cluster_config_fuzzer
  SOURCES coordinator/cluster_config.cc common/link_rules.cc ${_model_sources}
          ${_pb_cluster})
# safetensors files (common/safetensors.h ParseSafetensors).
add_karat_fuzzer(safetensors_fuzzer
  SOURCES common/safetensors.cc common/json.cc common/numeric.cc)
# JSON documents (common/json.h ParseJson).
add_karat_fuzzer(json_fuzzer SOURCES common/json.cc)
# A model's config.json (common/model_config.h ParseModelConfig).
add_karat_fuzzer(model_config_fuzzer SOURCES ${_model_sources})
# Token files (security/tokens.h TokenTable::Parse).
add_karat_fuzzer(token_file_fuzzer
  SOURCES security/tokens.cc security/tls.cc ${_pb_cluster})

set(_fuzz_bins "")
foreach(name ${KARAT_FUZZERS})
  list(APPEND _fuzz_bins ${KARAT_FUZZ_DIR}/${name})
endforeach()
add_custom_target(karat-fuzzers DEPENDS ${_fuzz_bins})
list(JOIN KARAT_FUZZERS "\n" _fuzz_list)
file(WRITE ${KARAT_FUZZ_DIR}/fuzzers.txt "${_fuzz_list}\n")
