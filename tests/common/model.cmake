add_unit_test(attention_test SOURCES tests/common/attention_test.cc
              LIBS karat_common)
add_unit_test(model_runner_test SOURCES tests/common/model_runner_test.cc
              LIBS karat_common)
add_unit_test(sparse_attention_test
              SOURCES tests/common/sparse_attention_test.cc
              LIBS karat_common)
