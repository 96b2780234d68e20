# cmake --install and the package config, so that an outside project can find_package(mori).
include(CMakePackageConfigHelpers)

set(MORI_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/mori")
set(MORI_EXPORTED_TARGETS mori_core mori_gpu_runtime)
if(TARGET mori_rdma)
  list(APPEND MORI_EXPORTED_TARGETS mori_rdma)
endif()
if(TARGET mori_channels)
  list(APPEND MORI_EXPORTED_TARGETS mori_channels)
endif()
if(TARGET mori_shmem)
  list(APPEND MORI_EXPORTED_TARGETS mori_shmem)
endif()
if(TARGET mori_ep)
  list(APPEND MORI_EXPORTED_TARGETS mori_ep)
endif()
if(MORI_HAS_MPI)
  list(APPEND MORI_EXPORTED_TARGETS mori_mpi)
endif()
set_target_properties(mori_gpu_runtime PROPERTIES EXPORT_NAME gpu_runtime)
if(MORI_HAS_MPI)
  set_target_properties(mori_mpi PROPERTIES EXPORT_NAME mpi)
endif()

# Each shared library finds the others beside it ($ORIGIN), whatever the prefix.
foreach(target IN LISTS MORI_EXPORTED_TARGETS)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "SHARED_LIBRARY")
    mori_set_install_rpath(${CMAKE_INSTALL_LIBDIR} ${target})
  endif()
endforeach()

install(TARGETS ${MORI_EXPORTED_TARGETS}
  EXPORT moriTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/mori DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.hpp")
install(FILES "${MORI_GENERATED_INCLUDE_DIR}/mori/core/config.hpp" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mori/core)
install(EXPORT moriTargets NAMESPACE mori:: DESTINATION ${MORI_INSTALL_CMAKEDIR})

configure_package_config_file(cmake/moriConfig.cmake.in "${CMAKE_CURRENT_BINARY_DIR}/moriConfig.cmake"
  INSTALL_DESTINATION ${MORI_INSTALL_CMAKEDIR})
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/moriConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/moriConfig.cmake" "${CMAKE_CURRENT_BINARY_DIR}/moriConfigVersion.cmake"
  DESTINATION ${MORI_INSTALL_CMAKEDIR})
