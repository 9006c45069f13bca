include(tools/weights.cmake OPTIONAL)    # karat-weights
include(tools/reference.cmake OPTIONAL)  # karat-reference
include(tools/karatctl.cmake OPTIONAL)   # karatctl
