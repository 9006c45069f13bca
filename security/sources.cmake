# karat_security: TLS credentials, bearer tokens, data-plane proofs
# (docs/security.md). Shared by every daemon and karatctl.
find_package(OpenSSL REQUIRED)
add_library(karat_security STATIC
  security/call_guards.cc
  security/hmac.cc
  security/tls.cc
  security/tokens.cc)
target_include_directories(karat_security PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(karat_security PUBLIC
  karat_proto gRPC::grpc++ OpenSSL::Crypto absl::status absl::statusor
  absl::strings absl::flat_hash_map)
