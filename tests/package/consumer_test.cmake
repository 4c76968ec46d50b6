# cmake -DBUILD_DIR=<zeroalloc build> -DSOURCE_DIR=<tests/package/consumer> -DWORK_DIR=<scratch>
#   [-DPROGRAM=<its executable, default consumer>] [-DEXPECT=<a line it must print>]
#   -P consumer_test.cmake
# Installs the built zeroalloc into a scratch prefix, then configures, builds and runs a
# program that finds it with find_package(zeroalloc), as a C or C++ project would.
if(NOT PROGRAM)
  set(PROGRAM consumer)
endif()
file(REMOVE_RECURSE ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "failed (${result}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
  set(out "${out}" PARENT_SCOPE)
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/${PROGRAM})
if(EXPECT)
  string(FIND "${out}" "${EXPECT}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "${PROGRAM} did not print \"${EXPECT}\":\n${out}")
  endif()
endif()
