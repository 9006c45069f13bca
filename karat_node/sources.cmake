# karat_node: the KARAT-node daemon (devices, data plane, control service).
add_library(karat_karat_node STATIC
  karat_node/frame_order.cc
  karat_node/karat_device.cc
  karat_node/data_plane.cc
  karat_node/peer_admission.cc
  karat_node/karat_node.cc
  karat_node/reserve_request.cc)
target_include_directories(karat_karat_node PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(karat_karat_node PUBLIC karat_common karat_proto
  absl::any_invocable gRPC::grpc++_reflection)

add_executable(karat-node karat_node/main.cc)
target_link_libraries(karat-node PRIVATE karat_karat_node)
set_target_properties(karat-node PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
