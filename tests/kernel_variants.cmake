# The kernels' sources compile both with and without the tile unit
# (AMX-BF16), whichever the build machine has: each compiles for Sapphire
# Rapids as is and with the tile unit switched off (compile only, warnings
# as errors), so that a change which breaks the path this machine does not
# build fails here instead of on the next machine of the other kind.
set(KARAT_KERNEL_VARIANT_SOURCES
  common/attention.cc
  common/attention_indexer.cc
  common/attention_indexer_rows.cc
  common/attention_indexer_tiles.cc
  common/attention_indexer_vector.cc
  common/attention_mla.cc
  common/attention_mla_tiles.cc
  common/attention_topk.cc
  tests/bench/bench_kernels.cc)
set(KARAT_VARIANT_amx -march=sapphirerapids)
set(KARAT_VARIANT_noamx -march=sapphirerapids -mno-amx-tile -mno-amx-bf16
  -mno-amx-int8)
foreach(variant amx noamx)
  foreach(src ${KARAT_KERNEL_VARIANT_SOURCES})
    get_filename_component(stem ${src} NAME_WE)
    set(name kernel_variant_${variant}_${stem})
    add_test(NAME ${name}
      COMMAND ${CMAKE_CXX_COMPILER} -std=gnu++20 -O1 ${KARAT_VARIANT_${variant}}
        -Wall -Wextra -Wno-unused-parameter -Werror -fno-fast-math
        -ffp-contract=off -fopenmp -I${PROJECT_SOURCE_DIR}
        -c ${PROJECT_SOURCE_DIR}/${src} -o /dev/null)
    set_tests_properties(${name} PROPERTIES LABELS build TIMEOUT 300)
  endforeach()
endforeach()

# The kernels' object code holds no instruction form that a supported CPU
# runs in microcode far below its usual rate (tests/kernel_forms.sh: a
# vector compress straight to memory, which AMD Zen 4 microcodes).
add_test(NAME kernel_forms
  COMMAND bash ${PROJECT_SOURCE_DIR}/tests/kernel_forms.sh ${CMAKE_OBJDUMP}
    $<TARGET_FILE:karat_common>)
set_tests_properties(kernel_forms PROPERTIES LABELS build TIMEOUT 120)
