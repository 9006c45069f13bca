add_unit_test(gpu_node_decode_loop_test
  SOURCES tests/gpu_node/decode_loop_test.cc
    tests/gpu_node/local_attention_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit)

# Both daemons in one process over gRPC and libfabric tcp on loopback.
add_unit_test(node_daemons_test
  SOURCES tests/gpu_node/node_daemons_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit loopback)

# Expert-parallel MoE across GPU ranks over an in-process FakeFabric.
add_unit_test(expert_parallel_test
  SOURCES tests/gpu_node/expert_parallel_test.cc
  LIBS karat_gpu_node
  LABELS unit)
# Its failure paths: late rank tables, dead peers, bad frames.
add_unit_test(expert_parallel_peers_test
  SOURCES tests/gpu_node/expert_parallel_peers_test.cc
  LIBS karat_gpu_node
  LABELS unit)
# The same over link emulators: loss, links down, resends, duplicates.
add_unit_test(expert_parallel_links_test
  SOURCES tests/gpu_node/expert_parallel_links_test.cc
  LIBS karat_gpu_node
  LABELS unit)

# The MoE retransmission timers and the serving rank's duplicate cache, as
# pure logic.
add_unit_test(moe_retransmit_test
  SOURCES tests/gpu_node/moe_retransmit_test.cc
  LIBS karat_gpu_node
  LABELS unit)
add_unit_test(combine_cache_test
  SOURCES tests/gpu_node/combine_cache_test.cc
  LIBS karat_gpu_node
  LABELS unit)

# Remote attention over link emulators: loss, links down, a silent node.
add_unit_test(remote_attention_loss_test
  SOURCES tests/gpu_node/remote_attention_loss_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit)

# A request whose attention segment failed fails alone in the decode loop.
add_unit_test(decode_loop_isolation_test
  SOURCES tests/gpu_node/decode_loop_isolation_test.cc
  LIBS karat_gpu_node
  LABELS unit)

# Remote attention with a data-plane secret (docs/security.md "Data plane"):
# the proven handshake, refused hellos and acks, answers from strangers.
add_unit_test(remote_attention_auth_test
  SOURCES tests/gpu_node/remote_attention_auth_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit)
# Expert-parallel MoE with a data-plane secret: frames only from the rank
# table's transport peers.
add_unit_test(expert_parallel_auth_test
  SOURCES tests/gpu_node/expert_parallel_auth_test.cc
  LIBS karat_gpu_node
  LABELS unit)
# The authenticated data plane over real libfabric endpoints (shm, tcp on
# loopback): an endpoint no coordinator registered gets no attention output.
add_unit_test(data_plane_fabric_auth_test
  SOURCES tests/gpu_node/data_plane_fabric_auth_test.cc
  LIBS karat_gpu_node karat_karat_node
  LABELS unit loopback)
# RunTurn's request check.
add_unit_test(gpu_node_turn_request_test
  SOURCES tests/gpu_node/turn_request_test.cc
  LIBS karat_gpu_node
  LABELS unit)
