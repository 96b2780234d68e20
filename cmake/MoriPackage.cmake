# cmake --build <dir> --target package: a Debian package of what `cmake --install` puts in place (runtime
# libraries, mori-info, headers, CMake package config, example programs), installed under /usr. Its run
# paths are $ORIGIN-relative, so the same files also work extracted anywhere (dpkg -x).
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME mori)
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION} (${MORI_BACKEND} backend)")
set(CPACK_PACKAGE_DESCRIPTION "GPU kernels move data between GPUs themselves: a SHMEM-style symmetric heap, \
RDMA device primitives (IBGDA) and port/memory channels. Built for the ${MORI_BACKEND} backend.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)  # debug information stays in the build tree
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # mori_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "mori developers <mori@localhost>")
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
# Run-time dependencies from what the libraries and programs link (dpkg-shlibdeps reads their NEEDED entries:
# libc6, libstdc++6, libgcc-s1, libopenmpi3 when MPI is built in). rdma-core is opened at run time
# (libibverbs.so.1, libmlx5.so.1 from ibverbs-providers) and only recommended: without it DirectVerbs and
# IBVerbs report no devices and the emulated NIC still works.
find_program(MORI_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(MORI_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
  if(MORI_BACKEND STREQUAL "CUDA")
    # The CUDA runtime comes from NVIDIA's toolkit, not from a Debian package dpkg-shlibdeps could name.
    set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${CUDAToolkit_LIBRARY_DIR}")
  endif()
else()
  message(STATUS "mori: dpkg-shlibdeps not found (dpkg-dev): the package's Depends line is written by hand")
  set(CPACK_DEBIAN_PACKAGE_DEPENDS "libc6, libstdc++6, libgcc-s1")
  if(MORI_HAS_MPI)
    string(APPEND CPACK_DEBIAN_PACKAGE_DEPENDS ", libopenmpi3")
  endif()
endif()
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libibverbs1, ibverbs-providers")
if(MORI_HAS_MPI)
  set(CPACK_DEBIAN_PACKAGE_SUGGESTS "openmpi-bin")
endif()
include(CPack)
