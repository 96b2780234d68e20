# Languages, architectures, warnings and sanitizers for the resolved backend.

set(MORI_BACKEND_CUDA 0)
set(MORI_BACKEND_HIP 0)
set(MORI_BACKEND_HOST 0)
set(MORI_BACKEND_${MORI_BACKEND} 1)

if(MORI_BACKEND STREQUAL "CUDA")
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "${MORI_CUDA_ARCHS}")
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "mori: CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
elseif(MORI_BACKEND STREQUAL "HIP")
  if(MORI_HIP_ARCHS STREQUAL "")
    set(MORI_HIP_ARCHS "gfx90a;gfx940")
    include(CheckCXXSourceCompiles)
    set(CMAKE_REQUIRED_FLAGS "--offload-arch=gfx942")
    check_cxx_source_compiles("__global__ void k() {} int main() { return 0; }" MORI_HIPCC_KNOWS_GFX942)
    unset(CMAKE_REQUIRED_FLAGS)
    if(MORI_HIPCC_KNOWS_GFX942)
      list(APPEND MORI_HIP_ARCHS gfx942)
    endif()
  endif()
  message(STATUS "mori: HIP with hipcc ${CMAKE_CXX_COMPILER}, architectures ${MORI_HIP_ARCHS}")
endif()

# One interface target carries the project-wide flags for every mori target, test and example.
add_library(mori_build_flags INTERFACE)
set(_mori_cxx_warnings -Wall -Wextra)
target_compile_options(mori_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${_mori_cxx_warnings}>)
if(MORI_BACKEND STREQUAL "CUDA")
  target_compile_options(mori_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra --expt-relaxed-constexpr -lineinfo>)
endif()
if(MORI_BACKEND STREQUAL "HIP")
  foreach(_arch IN LISTS MORI_HIP_ARCHS)
    target_compile_options(mori_build_flags INTERFACE --offload-arch=${_arch})
    target_link_options(mori_build_flags INTERFACE --offload-arch=${_arch})
  endforeach()
endif()
if(MORI_WERROR)
  target_compile_options(mori_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  if(MORI_BACKEND STREQUAL "CUDA")
    target_compile_options(mori_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
  endif()
endif()

# MORI_DEBUG_INFO=lines: the build type's -g becomes -g1 (line tables and function names, no variables or
# types): backtraces, sanitizer reports and gdb's `bt` keep file:line. MORI_DEBUG_INFO=none drops it, for a build
# nothing runs from (a compile check). Either way the code is the same (debug information never changes what GCC
# or clang generate). What CI's builds use. Measured on 2026-12-02 (2 cores, one file compiled twice each way,
# alternating; whole builds compared across runs were no guide: this machine's speed moved by up to 2x between
# them): gcc at -O2 spent 24-36% more with -g than with -g1 (shmem_single_test.cpp 15.2-16.6 against 12.2 user-s,
# soft_nic.cpp 4.9-5.8 against 3.7-4.4), at -O1 with ASan 25-37% more; hipcc at -O0 20-22 user-s with -g, 16-17
# with -g1, 12-16 with none; nvcc's host part at -O0 the same either way (its device compile dominates). nvcc
# takes the host compiler's level through -Xcompiler; its device line information (-lineinfo) stays.
set(MORI_DEBUG_INFO "" CACHE STRING "Debug information: empty (what the build type gives), 'lines' (-g1) or 'none'")
if(MORI_DEBUG_INFO STREQUAL "lines" OR MORI_DEBUG_INFO STREQUAL "none")
  set(_mori_g "")
  set(_mori_cuda_g "")
  if(MORI_DEBUG_INFO STREQUAL "lines")
    set(_mori_g "-g1")
    set(_mori_cuda_g "-Xcompiler=-g1")
  endif()
  foreach(_config DEBUG RELWITHDEBINFO)
    foreach(_lang C CXX)
      string(REGEX REPLACE "(^| )-g( |$)" "\\1${_mori_g}\\2" CMAKE_${_lang}_FLAGS_${_config}
             "${CMAKE_${_lang}_FLAGS_${_config}}")
    endforeach()
    if(MORI_BACKEND STREQUAL "CUDA")
      string(REGEX REPLACE "(^| )-g( |$)" "\\1${_mori_cuda_g}\\2" CMAKE_CUDA_FLAGS_${_config}
             "${CMAKE_CUDA_FLAGS_${_config}}")
    endif()
  endforeach()
elseif(NOT MORI_DEBUG_INFO STREQUAL "")
  message(FATAL_ERROR "mori: MORI_DEBUG_INFO must be empty, 'lines' or 'none', not '${MORI_DEBUG_INFO}'")
endif()

if(NOT MORI_SANITIZE STREQUAL "")
  if(NOT MORI_SANITIZE MATCHES "^(address,undefined|address|undefined|thread)$")
    message(FATAL_ERROR "mori: MORI_SANITIZE must be 'address,undefined', 'address', 'undefined' or 'thread'")
  endif()
  set(_mori_san -fsanitize=${MORI_SANITIZE} -fno-omit-frame-pointer)
  if(MORI_SANITIZE MATCHES "undefined")
    list(APPEND _mori_san -fno-sanitize-recover=undefined)
  endif()
  target_compile_options(mori_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${_mori_san}>)
  if(MORI_BACKEND STREQUAL "CUDA")
    string(REPLACE ";" "," _mori_san_x "${_mori_san}")
    target_compile_options(mori_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${_mori_san_x}>)
  endif()
  target_link_options(mori_build_flags INTERFACE ${_mori_san})
endif()

# Fuzz builds instrument every mori library for libFuzzer's coverage feedback; only the fuzz targets themselves
# link libFuzzer's main (fuzz/CMakeLists.txt).
if(MORI_BUILD_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "mori: MORI_BUILD_FUZZ needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID} "
                        "${CMAKE_CXX_COMPILER}; configure a build directory of its own with "
                        "CC=clang-14 CXX=clang++-14 (scripts/fuzz.sh does)")
  endif()
  if(NOT MORI_BACKEND STREQUAL "HOST")
    message(FATAL_ERROR "mori: MORI_BUILD_FUZZ needs MORI_GPU_BACKEND=HOST, not ${MORI_BACKEND}")
  endif()
  if(MORI_SANITIZE STREQUAL "")
    message(WARNING "mori: MORI_BUILD_FUZZ without MORI_SANITIZE: the fuzz targets find crashes only, not memory "
                    "errors (scripts/fuzz.sh uses MORI_SANITIZE=address,undefined)")
  endif()
  target_compile_options(mori_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>)
endif()

# Sources that hold device code (kernels, or device functions instantiated there) are compiled by the GPU
# compiler on CUDA; on HIP every source already goes through hipcc, and on HOST through the C++ compiler.
function(mori_device_sources)
  if(MORI_BACKEND STREQUAL "CUDA")
    set_source_files_properties(${ARGN} DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} PROPERTIES LANGUAGE CUDA)
  endif()
endfunction()

# An executable of the project: flags, the device-source treatment of its sources and the libraries.
function(mori_add_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEVICE_SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES} ${ARG_DEVICE_SOURCES})
  if(ARG_DEVICE_SOURCES)
    mori_device_sources(${ARG_DEVICE_SOURCES})
  endif()
  target_link_libraries(${name} PRIVATE mori_build_flags ${ARG_LIBS})
endfunction()

# Run paths of installed files, relative to where each one lands ($ORIGIN), so that the installed tree works
# from any prefix and after being moved: libraries find each other, programs find the libraries. Directories
# of outside libraries that a target links from a non-system place (CUDA's runtime, say) are kept as well.
# The build tree keeps CMake's absolute build run paths.
function(mori_set_install_rpath dest)
  if(IS_ABSOLUTE "${dest}")
    set(full "${dest}")
  else()
    set(full "${CMAKE_INSTALL_PREFIX}/${dest}")
  endif()
  file(RELATIVE_PATH to_libs "${full}" "${CMAKE_INSTALL_FULL_LIBDIR}")
  if(to_libs STREQUAL "")
    set(rpath "$ORIGIN")
  else()
    set(rpath "$ORIGIN/${to_libs}")
  endif()
  set_target_properties(${ARGN} PROPERTIES INSTALL_RPATH "${rpath}" INSTALL_RPATH_USE_LINK_PATH TRUE)
endfunction()

# Installs programs into `dest` (under the prefix) with a run path from there to mori's libraries.
function(mori_install_programs dest)
  mori_set_install_rpath("${dest}" ${ARGN})
  install(TARGETS ${ARGN} RUNTIME DESTINATION "${dest}")
endfunction()

# Gives every test of the calling directory a COST from its labels, so that `ctest -j` in a fresh build directory
# (no cost data from an earlier run, as in CI) starts the long tests first instead of leaving one of them to run
# alone at the end. Costs are rough seconds on the 2-core CI machine; a test takes its largest label's. CMake
# before 3.28 cannot set the properties of another directory's tests, so each directory that adds tests calls
# this at its end.
function(mori_set_test_costs)
  set(costs unit 1 example 5 mpi 30 chaos 40 python 60 package 100)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(test IN LISTS tests)
    get_test_property(${test} LABELS labels)
    set(cost 0)
    set(i 0)
    list(LENGTH costs n)
    while(i LESS n)
      list(GET costs ${i} label)
      math(EXPR j "${i} + 1")
      list(GET costs ${j} value)
      if(label IN_LIST labels AND value GREATER cost)
        set(cost ${value})
      endif()
      math(EXPR i "${i} + 2")
    endwhile()
    if(cost GREATER 0)
      set_tests_properties(${test} PROPERTIES COST ${cost})
    endif()
  endforeach()
endfunction()
