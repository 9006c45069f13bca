add_unit_test(karat_node_data_plane_test
  SOURCES tests/karat_node/data_plane_test.cc
  LIBS karat_karat_node
  LABELS unit)

add_unit_test(membership_test
  SOURCES tests/karat_node/membership_test.cc
  LIBS karat_common
  LABELS unit)
add_unit_test(karat_device_test SOURCES tests/karat_node/karat_device_test.cc
              LIBS karat_karat_node)
add_unit_test(karat_device_gqa_test
              SOURCES tests/karat_node/karat_device_gqa_test.cc
              LIBS karat_karat_node)
add_unit_test(karat_device_spill_test
              SOURCES tests/karat_node/device_spill_test.cc
              LIBS karat_karat_node)
add_unit_test(karat_node_stats_test
              SOURCES tests/karat_node/karat_node_stats_test.cc
              LIBS karat_karat_node
              LABELS unit loopback)
add_unit_test(frame_order_test SOURCES tests/karat_node/frame_order_test.cc
              LIBS karat_karat_node)
# Frame order on a device: repeats, stale copies, lost index keys, fenced
# turns, Reserve's cut of a failed turn's KV.
add_unit_test(karat_device_order_test
              SOURCES tests/karat_node/karat_device_order_test.cc
              LIBS karat_karat_node)
# Which senders the data plane takes (pure policy and admission state), and
# the authenticated handshake and frames on the in-process fake transport.
add_unit_test(peer_admission_test
              SOURCES tests/karat_node/peer_admission_test.cc
              LIBS karat_karat_node)
add_unit_test(karat_node_data_plane_auth_test
              SOURCES tests/karat_node/data_plane_auth_test.cc
              LIBS karat_karat_node)
# Reserve's request check.
add_unit_test(karat_node_reserve_request_test
              SOURCES tests/karat_node/reserve_request_test.cc
              LIBS karat_karat_node)
