# Data plane: libfabric transport, in-process fake, frame format.
target_sources(karat_common PRIVATE
  common/fabric_transport.cc
  common/fake_transport.cc
  common/frame.cc
  common/transport.cc)
