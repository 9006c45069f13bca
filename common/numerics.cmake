# Numeric formats, model config, safetensors, weights (MODEL.md "Files").
target_sources(karat_common PRIVATE
  common/json.cc
  common/numeric.cc
  common/model_config.cc
  common/safetensors.cc
  common/weights.cc)

# Presets are data: each presets/NAME.json is embedded as a raw string
# literal in a generated source and parsed by PresetConfig() like any file.
set(KARAT_PRESETS
  dsa-tiny dsa-small glm-tiny glm-small minimax-tiny minimax-small
  llama-tiny llama-small
  llama-tiny-quest llama-tiny-magicpig llama-tiny-clusterkv
  llama-small-quest llama-small-magicpig llama-small-clusterkv)
string(CONCAT _karat_presets_cc
  "// Generated from presets/*.json by common/numerics.cmake; do not edit.\n"
  "#include <cstddef>\n\n"
  "namespace karat::internal {\n"
  "struct PresetText {\n  const char* name;\n  const char* json;\n};\n"
  "extern const PresetText kPresetTexts[];\n"
  "extern const size_t kNumPresetTexts;\n"
  "const PresetText kPresetTexts[] = {\n")
foreach(_p IN LISTS KARAT_PRESETS)
  set(_f ${PROJECT_SOURCE_DIR}/presets/${_p}.json)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_f})
  file(READ ${_f} _json)
  string(FIND "${_json}" ")karat_preset\"" _bad)
  if(NOT _bad EQUAL -1)
    message(FATAL_ERROR "${_f} contains the raw-string delimiter")
  endif()
  string(APPEND _karat_presets_cc
    "    {\"${_p}\", R\"karat_preset(${_json})karat_preset\"},\n")
endforeach()
string(APPEND _karat_presets_cc
  "};\n"
  "const size_t kNumPresetTexts = sizeof(kPresetTexts) / sizeof(kPresetTexts[0]);\n"
  "}  // namespace karat::internal\n")
set(_karat_presets_out ${PROJECT_BINARY_DIR}/generated/karat_presets.cc)
# Written through a temporary so that an unchanged preset set keeps the
# output's timestamp and triggers no rebuild.
file(WRITE ${_karat_presets_out}.tmp "${_karat_presets_cc}")
configure_file(${_karat_presets_out}.tmp ${_karat_presets_out} COPYONLY)
target_sources(karat_common PRIVATE ${_karat_presets_out})
