# Installs the build tree into a scratch prefix; builds the consumer project against it with find_package and
# runs each consumer (one per library a user links alone); then moves the prefix elsewhere and runs the
# installed mori-info and an installed example from there. Every program starts with a clean environment
# (env -i, PATH only), so a library or program that cannot find its libraries through its run path fails here.
#
# Arguments: MORI_BUILD_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, CXX_COMPILER, CUDA_COMPILER (may be empty),
# MORI_INFO (the installed mori-info relative to the prefix; empty when tools are not built), EXAMPLE (an installed example program relative to the prefix, run
# without arguments; empty when examples are not built).
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${MORI_BUILD_DIR}" --prefix "${prefix}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
set(args -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build" "-DCMAKE_PREFIX_PATH=${prefix}"
         "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
if(CUDA_COMPILER)
  list(APPEND args "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} ${args} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumers against the installed mori failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumers failed (${rc})")
endif()

# A clean environment: PATH, a small heap and a bound on every wait; sanitizer settings pass through (they
# change no library lookup).
set(clean_env env -i "PATH=/usr/bin:/bin" "MORI_SHMEM_HEAP_SIZE=16m" "MORI_TIMEOUT_S=60")
foreach(var ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS)
  if(DEFINED ENV{${var}})
    list(APPEND clean_env "${var}=$ENV{${var}}")
  endif()
endforeach()

# Runs `program` (with arguments) in the clean environment; fails unless it exits 0 and prints `expected`.
function(run_clean what expected)
  execute_process(COMMAND ${clean_env} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 120)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "${expected}")
    message(FATAL_ERROR "${what} failed (exit ${rc}, expected output '${expected}'):\n${out}${err}")
  endif()
  string(REGEX MATCH "[^\n]*${expected}[^\n]*" line "${out}")
  message(STATUS "${what}: ${line}")
endfunction()

foreach(lib shmem rdma channels)
  run_clean("consumer linking only mori::${lib}" "${lib} consumer of mori [0-9.]+ .*ok"
            "${WORK_DIR}/build/consumer_${lib}")
endforeach()

# The installed tree works from wherever it is moved to.
set(moved "${WORK_DIR}/moved/mori")
file(MAKE_DIRECTORY "${WORK_DIR}/moved")
file(RENAME "${prefix}" "${moved}")
if(MORI_INFO)
  run_clean("installed mori-info (prefix moved)" "^mori [0-9.]+, backend" "${moved}/${MORI_INFO}")
endif()
if(EXAMPLE)
  run_clean("installed example ${EXAMPLE} (prefix moved)" "verified" "${moved}/${EXAMPLE}")
endif()
