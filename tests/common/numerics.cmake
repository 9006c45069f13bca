# Numeric formats, model config, safetensors, weights.
add_unit_test(numeric_test SOURCES tests/common/numeric_test.cc
              LIBS karat_common LABELS unit)
add_unit_test(model_config_test SOURCES tests/common/model_config_test.cc
              LIBS karat_common LABELS unit)
add_unit_test(safetensors_test SOURCES tests/common/safetensors_test.cc
              LIBS karat_common LABELS unit)
add_unit_test(weights_test SOURCES tests/common/weights_test.cc
              LIBS karat_common LABELS unit)
add_unit_test(log_limiter_test SOURCES tests/common/log_limiter_test.cc
              LIBS karat_common LABELS unit)
