# Third-party dependencies: threads, MPI (optional), the GPU runtime of the backend.

set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)

string(TOUPPER "${MORI_ENABLE_MPI}" _mori_mpi)
set(MORI_HAS_MPI 0)
if(NOT _mori_mpi STREQUAL "OFF")
  find_package(MPI COMPONENTS C QUIET)
  if(MPI_C_FOUND)
    set(MORI_HAS_MPI 1)
    # Only include paths and libraries travel: MPI's compile options (-pthread) are not nvcc options.
    add_library(mori_mpi INTERFACE)
    target_include_directories(mori_mpi SYSTEM INTERFACE ${MPI_C_INCLUDE_DIRS})
    # mori speaks MPI's C interface; the deprecated C++ bindings only bring warnings.
    target_compile_definitions(mori_mpi INTERFACE OMPI_SKIP_MPICXX MPICH_SKIP_MPICXX)
    target_link_libraries(mori_mpi INTERFACE ${MPI_C_LIBRARIES})
    find_program(MORI_MPIRUN NAMES mpirun mpiexec HINTS ${MPI_C_COMPILER}/.. PATH_SUFFIXES bin)
    message(STATUS "mori: MPI found (${MPI_C_LIBRARIES}), launcher ${MORI_MPIRUN}")
  elseif(_mori_mpi STREQUAL "ON")
    message(FATAL_ERROR "mori: MORI_ENABLE_MPI=ON but no MPI was found (apt-get install libopenmpi-dev)")
  else()
    message(STATUS "mori: MPI not found, MpiBootstrap is not built")
  endif()
endif()

add_library(mori_gpu_runtime INTERFACE)
if(MORI_BACKEND STREQUAL "CUDA")
  # The driver API is reached through cudaGetDriverEntryPoint, so nothing links libcuda.
  target_link_libraries(mori_gpu_runtime INTERFACE CUDA::cudart)
elseif(MORI_BACKEND STREQUAL "HIP")
  target_compile_definitions(mori_gpu_runtime INTERFACE __HIP_PLATFORM_AMD__)
endif()
