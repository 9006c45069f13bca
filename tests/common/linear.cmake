add_unit_test(karat_linear_test
  SOURCES tests/common/linear_test.cc
  LIBS karat_common)
