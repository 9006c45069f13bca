add_unit_test(gpu_node_decode_loop_test
  SOURCES tests/gpu_node/decode_loop_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit)

# Both daemons in one process over gRPC and libfabric tcp on loopback.
add_unit_test(node_daemons_test
  SOURCES tests/gpu_node/node_daemons_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit loopback)
