# Benchmarks: built by default, run by hand (not registered with ctest).
add_executable(karat-bench-linear tests/bench/bench_linear.cc)
target_link_libraries(karat-bench-linear PRIVATE karat_common Eigen3::Eigen
  OpenMP::OpenMP_CXX)
