# The security library: token files, HMAC, and TLS between a gRPC server and
# its callers with certificates made by deploy/karat-certs.
add_unit_test(security_test
  SOURCES tests/security/security_test.cc
  LIBS karat_security karat_proto gRPC::grpc++_reflection)
target_compile_definitions(security_test PRIVATE
  KARAT_CERTS_SCRIPT="${PROJECT_SOURCE_DIR}/deploy/karat-certs")
