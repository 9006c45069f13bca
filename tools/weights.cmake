# karat-weights: writes a model directory from a preset (or config) and a seed.
add_executable(karat-weights tools/karat_weights_main.cc)
target_link_libraries(karat-weights PRIVATE karat_common)
set_target_properties(karat-weights PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR})
set_target_properties(karat-weights PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
