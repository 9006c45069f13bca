add_executable(karat-reference tools/karat_reference_main.cc)
target_link_libraries(karat-reference PRIVATE karat_common)
set_target_properties(karat-reference PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
