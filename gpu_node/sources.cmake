# gpu_node: the GPU-node daemon (decode loop, remote attention, control).
add_library(karat_gpu_node STATIC
  gpu_node/decode_loop.cc
  gpu_node/turn_request.cc
  gpu_node/combine_cache.cc
  gpu_node/expert_parallel.cc
  gpu_node/expert_parallel_dispatch.cc
  gpu_node/expert_parallel_serve.cc
  gpu_node/moe_retransmit.cc
  gpu_node/remote_attention.cc
  gpu_node/remote_attention_handshake.cc
  gpu_node/local_attention.cc
  gpu_node/worker_token.cc
  gpu_node/gpu_node.cc)
target_include_directories(karat_gpu_node PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(karat_gpu_node PUBLIC karat_common karat_proto
  gRPC::grpc++_reflection OpenMP::OpenMP_CXX)

add_executable(karat-gpu-node gpu_node/main.cc)
target_link_libraries(karat-gpu-node PRIVATE karat_gpu_node)
set_target_properties(karat-gpu-node PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
