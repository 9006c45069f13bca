# Data plane: libfabric transport, in-process fake, frame format.
target_sources(karat_common PRIVATE
  common/fabric_transport.cc
  common/fabric_transport_progress.cc
  common/fabric_transport_rma.cc
  common/fabric_transport_send.cc
  common/fake_transport.cc
  common/frame.cc
  common/hello_proof.cc
  common/transport.cc)
# The data-plane hello's proof is an HMAC (security/hmac.h).
target_link_libraries(karat_common PUBLIC karat_security)
