# Generated C++ for every .proto: the karat_proto library.
set(KARAT_PROTOS
  ${PROJECT_SOURCE_DIR}/proto/karat.proto
  ${PROJECT_SOURCE_DIR}/proto/cluster.proto)
set(KARAT_PROTO_OUT ${PROJECT_BINARY_DIR}/proto)
file(MAKE_DIRECTORY ${KARAT_PROTO_OUT})
set(KARAT_PROTO_SRCS)
foreach(p ${KARAT_PROTOS})
  get_filename_component(n ${p} NAME_WE)
  set(out_pb ${KARAT_PROTO_OUT}/${n}.pb.cc ${KARAT_PROTO_OUT}/${n}.pb.h)
  set(out_grpc ${KARAT_PROTO_OUT}/${n}.grpc.pb.cc ${KARAT_PROTO_OUT}/${n}.grpc.pb.h)
  add_custom_command(
    OUTPUT ${out_pb} ${out_grpc}
    COMMAND protobuf::protoc
      --proto_path=${PROJECT_SOURCE_DIR}/proto
      --cpp_out=${KARAT_PROTO_OUT}
      --grpc_out=${KARAT_PROTO_OUT}
      --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin>
      ${p}
    DEPENDS ${p}
    COMMENT "protoc ${n}.proto")
  list(APPEND KARAT_PROTO_SRCS ${KARAT_PROTO_OUT}/${n}.pb.cc
       ${KARAT_PROTO_OUT}/${n}.grpc.pb.cc)
endforeach()
add_library(karat_proto STATIC ${KARAT_PROTO_SRCS})
target_include_directories(karat_proto PUBLIC ${KARAT_PROTO_OUT})
target_link_libraries(karat_proto PUBLIC gRPC::grpc++ gRPC::grpc++_reflection
                      protobuf::libprotobuf)
target_compile_options(karat_proto PRIVATE -w)
