# Two ways to install, chosen by who builds:
#  - cmake --install: the library, its header and a CMake package, so that a C or C++
#    project finds it with find_package(zeroalloc) and links zeroalloc::zeroalloc;
#  - pip (scikit-build-core sets SKBUILD): component "python", the library inside the
#    Python package and the start-up hook at the top of site-packages.
include(CMakePackageConfigHelpers)

if(SKBUILD)
  # The package loads the library by its file name, next to its modules (zeroalloc/_library.py).
  install(TARGETS zeroalloc LIBRARY DESTINATION zeroalloc COMPONENT python)
  install(FILES ${PROJECT_SOURCE_DIR}/bindings/python/zeroalloc-startup.pth DESTINATION .
          COMPONENT python)
  return()
endif()

install(TARGETS zeroalloc EXPORT zeroallocTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/include/zeroalloc/zeroalloc.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/zeroalloc COMPONENT development)
set(config_dir ${CMAKE_INSTALL_LIBDIR}/cmake/zeroalloc)
install(EXPORT zeroallocTargets NAMESPACE zeroalloc:: DESTINATION ${config_dir}
        COMPONENT development)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/zeroallocConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/zeroallocConfig.cmake INSTALL_DESTINATION ${config_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/zeroallocConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/zeroallocConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/zeroallocConfigVersion.cmake
        DESTINATION ${config_dir} COMPONENT development)
