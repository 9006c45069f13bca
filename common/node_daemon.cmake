# Pieces both node daemons share: command-line flags, signal handling, data
# plane and gRPC server set-up.
target_sources(karat_common PRIVATE common/node_daemon.cc common/request_errors.cc)
target_sources(karat_common PRIVATE common/process_fault.cc)  # admin kill/pause
target_link_libraries(karat_common PUBLIC karat_security)  # TLS of the node daemons
