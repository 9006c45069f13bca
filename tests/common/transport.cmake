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
