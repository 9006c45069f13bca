# Benchmarks: built by default, run by hand (not registered with ctest).
add_executable(karat-bench-linear tests/bench/bench_linear.cc)
target_link_libraries(karat-bench-linear PRIVATE karat_common Eigen3::Eigen
  OpenMP::OpenMP_CXX)
# The data-plane transport against fi_pingpong (libfabric-bin), shm and tcp.
add_executable(karat-bench-fabric tests/bench/bench_fabric.cc)
target_link_libraries(karat-bench-fabric PRIVATE karat_common)
add_executable(karat-bench-kernels tests/bench/bench_kernels.cc)
target_link_libraries(karat-bench-kernels PRIVATE karat_common)
