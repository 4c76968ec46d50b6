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
# zeroalloc::logging: spdlog as a shared library, or compiled in (header-only spdlog over
# header-only fmt) where ZEROALLOC_STATIC_DEPS asks for a library that needs only glibc.
add_library(zeroalloc_logging INTERFACE)
add_library(zeroalloc::logging ALIAS zeroalloc_logging)
if(ZEROALLOC_STATIC_DEPS)
  find_package(fmt CONFIG QUIET)
  zeroalloc_require(fmt_FOUND "fmt" "libfmt-dev")
  get_target_property(spdlog_includes spdlog::spdlog_header_only INTERFACE_INCLUDE_DIRECTORIES)
  target_include_directories(zeroalloc_logging SYSTEM INTERFACE ${spdlog_includes})
  target_compile_definitions(zeroalloc_logging INTERFACE SPDLOG_FMT_EXTERNAL)
  target_link_libraries(zeroalloc_logging INTERFACE fmt::fmt-header-only Threads::Threads)
else()
  target_link_libraries(zeroalloc_logging INTERFACE spdlog::spdlog)
endif()

# With ZEROALLOC_STATIC_DEPS, a system library is linked from its static archive.
function(zeroalloc_find_system_library variable name)
  if(ZEROALLOC_STATIC_DEPS)
    find_library(${variable} NAMES lib${name}.a)
  else()
    find_library(${variable} NAMES ${name} ${ARGN})
  endif()
endfunction()

find_package(nlohmann_json 3 CONFIG QUIET)
zeroalloc_require(nlohmann_json_FOUND "nlohmann/json (JSON for Modern C++)" "nlohmann-json3-dev")

# libnuma and NCCL are loaded at run time (Note [libnuma at run time] in core/host_memory.cpp):
# the build needs their headers only.
find_path(NUMA_INCLUDE_DIR numa.h)
zeroalloc_require(NUMA_INCLUDE_DIR "libnuma's header (numa.h)" "libnuma-dev")
add_library(zeroalloc::numa INTERFACE IMPORTED)
set_target_properties(zeroalloc::numa PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${NUMA_INCLUDE_DIR})

find_path(LIBURING_INCLUDE_DIR liburing.h)
zeroalloc_find_system_library(LIBURING_LIBRARY uring liburing.so.2)
zeroalloc_require(LIBURING_LIBRARY "liburing" "liburing-dev")
zeroalloc_require(LIBURING_INCLUDE_DIR "liburing's headers" "liburing-dev")
add_library(zeroalloc::uring UNKNOWN IMPORTED)
set_target_properties(zeroalloc::uring PROPERTIES IMPORTED_LOCATION ${LIBURING_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${LIBURING_INCLUDE_DIR})

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
zeroalloc_require(NCCL_INCLUDE_DIR "NCCL's header (nccl.h)" "libnccl-dev (or the NCCL of the CUDA Toolkit)")
add_library(zeroalloc::nccl INTERFACE IMPORTED)
set_target_properties(zeroalloc::nccl PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})

if(ZEROALLOC_BUILD_TESTS)
  find_package(GTest)
  zeroalloc_require(GTest_FOUND "GoogleTest" "libgtest-dev")
endif()
if(ZEROALLOC_BUILD_BENCH)
  find_package(benchmark CONFIG QUIET)
  zeroalloc_require(benchmark_FOUND "Google Benchmark" "libbenchmark-dev")
endif()
