# Every dependency the design names, found on the system, never vendored. A missing one
# stops the configure step with the package that provides it: no feature is dropped silently.

function(zeroalloc_require found what package)
  if(NOT ${found})
    message(FATAL_ERROR "zeroalloc needs ${what}, which was not found. On Debian or Ubuntu: "
                        "apt-get install ${package} (scripts/install-deps.sh installs everything). "
                        "For a private prefix, pass -DCMAKE_PREFIX_PATH=<prefix>.")
  endif()
endfunction()

find_package(CUDAToolkit 13)
zeroalloc_require(CUDAToolkit_FOUND "the CUDA Toolkit 13 (headers, cudart)" "the CUDA Toolkit 13 from NVIDIA")

find_package(Threads REQUIRED)

find_package(spdlog CONFIG QUIET)
zeroalloc_require(spdlog_FOUND "spdlog" "libspdlog-dev")

find_package(nlohmann_json 3 CONFIG QUIET)
zeroalloc_require(nlohmann_json_FOUND "nlohmann/json (JSON for Modern C++)" "nlohmann-json3-dev")

find_path(NUMA_INCLUDE_DIR numa.h)
find_library(NUMA_LIBRARY numa)
zeroalloc_require(NUMA_LIBRARY "libnuma" "libnuma-dev")
add_library(zeroalloc::numa UNKNOWN IMPORTED)
set_target_properties(zeroalloc::numa PROPERTIES IMPORTED_LOCATION ${NUMA_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${NUMA_INCLUDE_DIR})

find_path(LIBURING_INCLUDE_DIR liburing.h)
find_library(LIBURING_LIBRARY NAMES uring liburing.so.2)
zeroalloc_require(LIBURING_LIBRARY "liburing" "liburing-dev")
zeroalloc_require(LIBURING_INCLUDE_DIR "liburing's headers" "liburing-dev")
add_library(zeroalloc::uring UNKNOWN IMPORTED)
set_target_properties(zeroalloc::uring PROPERTIES IMPORTED_LOCATION ${LIBURING_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${LIBURING_INCLUDE_DIR})

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
zeroalloc_require(NCCL_LIBRARY "NCCL" "libnccl-dev (or the NCCL of the CUDA Toolkit)")
add_library(zeroalloc::nccl UNKNOWN IMPORTED)
set_target_properties(zeroalloc::nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})

if(ZEROALLOC_BUILD_TESTS)
  find_package(GTest)
  zeroalloc_require(GTest_FOUND "GoogleTest" "libgtest-dev")
endif()
if(ZEROALLOC_BUILD_BENCH)
  find_package(benchmark CONFIG QUIET)
  zeroalloc_require(benchmark_FOUND "Google Benchmark" "libbenchmark-dev")
endif()
