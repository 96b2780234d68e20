# Finds NVSHMEM for bench/nvshmem_bench: nvshmem.h, the device library (libnvshmem_device.a, linked with
# relocatable device code) and the host library (libnvshmem_host.so, often only as .so.3 in pip wheels), or
# the single static libnvshmem.a of old releases.
#
# Looks in NVSHMEM_HOME (CMake variable or environment), /usr/local/nvshmem, /opt/nvshmem, the nvidia-nvshmem
# wheels inside Python environments (site-packages/nvidia/nvshmem; the GPU machine has one under
# /opt/torch/.venv), and Debian's layout (/usr/include/nvshmem_<cuda>, /usr/lib/<arch>/nvshmem/<cuda>).
#
# Sets NVSHMEM_FOUND, NVSHMEM_VERSION, NVSHMEM_INCLUDE_DIR, NVSHMEM_LIBRARY_DIR, NVSHMEM_LIBRARIES and the
# imported target NVSHMEM::nvshmem (headers, device and host library).

set(_nvshmem_prefixes "")
foreach(_p IN ITEMS "${NVSHMEM_HOME}" "$ENV{NVSHMEM_HOME}" "$ENV{NVSHMEM_PREFIX}" /usr/local/nvshmem /opt/nvshmem
               /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem)
  if(NOT _p STREQUAL "" AND IS_DIRECTORY "${_p}")
    list(APPEND _nvshmem_prefixes "${_p}")
  endif()
endforeach()
file(GLOB _nvshmem_wheels LIST_DIRECTORIES true
     "$ENV{VIRTUAL_ENV}/lib/python3*/site-packages/nvidia/nvshmem"
     "/opt/*/.venv/lib/python3*/site-packages/nvidia/nvshmem"
     "/opt/*/lib/python3*/site-packages/nvidia/nvshmem"
     "/usr/local/lib/python3*/dist-packages/nvidia/nvshmem"
     "/usr/local/lib/python3*/site-packages/nvidia/nvshmem"
     "/usr/lib/python3/dist-packages/nvidia/nvshmem")
list(APPEND _nvshmem_prefixes ${_nvshmem_wheels})

# Debian/Ubuntu (libnvshmem3-dev-cuda-<major>): versioned include and library folders, the CUDA major of
# this build first.
set(_nvshmem_deb_includes "")
set(_nvshmem_deb_libdirs "")
if(CUDAToolkit_VERSION_MAJOR)
  list(APPEND _nvshmem_deb_includes "/usr/include/nvshmem_${CUDAToolkit_VERSION_MAJOR}")
  list(APPEND _nvshmem_deb_libdirs "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/nvshmem/${CUDAToolkit_VERSION_MAJOR}")
endif()
file(GLOB _nvshmem_glob_includes LIST_DIRECTORIES true "/usr/include/nvshmem*")
file(GLOB _nvshmem_glob_libdirs LIST_DIRECTORIES true "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/nvshmem/*"
     "/usr/lib/x86_64-linux-gnu/nvshmem/*")
list(APPEND _nvshmem_deb_includes ${_nvshmem_glob_includes})
list(APPEND _nvshmem_deb_libdirs ${_nvshmem_glob_libdirs})

find_path(NVSHMEM_INCLUDE_DIR nvshmem.h
  HINTS ${_nvshmem_prefixes}
  PATHS ${_nvshmem_deb_includes}
  PATH_SUFFIXES include include/nvshmem
  DOC "folder holding nvshmem.h")

# Libraries next to the headers that were found, before anywhere else, so headers and libraries match.
set(_nvshmem_libdirs "")
if(NVSHMEM_INCLUDE_DIR)
  get_filename_component(_nvshmem_root "${NVSHMEM_INCLUDE_DIR}/.." ABSOLUTE)
  list(APPEND _nvshmem_libdirs "${_nvshmem_root}/lib" "${_nvshmem_root}/lib64")
  if(NVSHMEM_INCLUDE_DIR MATCHES "^/usr/include/nvshmem_([0-9]+)$")
    list(APPEND _nvshmem_libdirs "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/nvshmem/${CMAKE_MATCH_1}"
                                 "/usr/lib/x86_64-linux-gnu/nvshmem/${CMAKE_MATCH_1}")
  endif()
endif()
foreach(_p IN LISTS _nvshmem_prefixes)
  list(APPEND _nvshmem_libdirs "${_p}/lib" "${_p}/lib64")
endforeach()
list(APPEND _nvshmem_libdirs ${_nvshmem_deb_libdirs})

find_library(NVSHMEM_DEVICE_LIBRARY NAMES libnvshmem_device.a nvshmem_device
  HINTS ${_nvshmem_libdirs} NO_DEFAULT_PATH DOC "NVSHMEM device library (static, relocatable device code)")
find_library(NVSHMEM_HOST_LIBRARY NAMES nvshmem_host
  HINTS ${_nvshmem_libdirs} NO_DEFAULT_PATH DOC "NVSHMEM host library")
if(NOT NVSHMEM_HOST_LIBRARY)
  # pip wheels ship libnvshmem_host.so.3 without the unversioned link.
  foreach(_d IN LISTS _nvshmem_libdirs)
    file(GLOB _nvshmem_host_versioned "${_d}/libnvshmem_host.so.*")
    if(_nvshmem_host_versioned)
      list(SORT _nvshmem_host_versioned)
      list(GET _nvshmem_host_versioned 0 _nvshmem_host_first)
      set(NVSHMEM_HOST_LIBRARY "${_nvshmem_host_first}" CACHE FILEPATH "NVSHMEM host library" FORCE)
      break()
    endif()
  endforeach()
endif()
find_library(NVSHMEM_STATIC_LIBRARY NAMES libnvshmem.a
  HINTS ${_nvshmem_libdirs} NO_DEFAULT_PATH DOC "NVSHMEM as one static library (old releases)")

set(_nvshmem_required NVSHMEM_INCLUDE_DIR NVSHMEM_DEVICE_LIBRARY NVSHMEM_HOST_LIBRARY)
set(NVSHMEM_LIBRARIES "")
if(NVSHMEM_DEVICE_LIBRARY AND NVSHMEM_HOST_LIBRARY)
  set(NVSHMEM_LIBRARIES "${NVSHMEM_DEVICE_LIBRARY}" "${NVSHMEM_HOST_LIBRARY}")
  get_filename_component(NVSHMEM_LIBRARY_DIR "${NVSHMEM_HOST_LIBRARY}" DIRECTORY)
elseif(NVSHMEM_STATIC_LIBRARY)
  set(_nvshmem_required NVSHMEM_INCLUDE_DIR NVSHMEM_STATIC_LIBRARY)
  set(NVSHMEM_LIBRARIES "${NVSHMEM_STATIC_LIBRARY}")
  get_filename_component(NVSHMEM_LIBRARY_DIR "${NVSHMEM_STATIC_LIBRARY}" DIRECTORY)
endif()

set(NVSHMEM_VERSION "")
if(NVSHMEM_INCLUDE_DIR)
  file(GLOB_RECURSE _nvshmem_version_headers "${NVSHMEM_INCLUDE_DIR}/nvshmem_version.h")
  foreach(_h IN LISTS _nvshmem_version_headers)
    file(STRINGS "${_h}" _nvshmem_version_lines REGEX "#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
    foreach(_part MAJOR MINOR PATCH)
      string(REGEX MATCH "NVSHMEM_VENDOR_${_part}_VERSION[ \t]+([0-9]+)" _m "${_nvshmem_version_lines}")
      set(_nvshmem_${_part} "${CMAKE_MATCH_1}")
    endforeach()
    if(NOT _nvshmem_MAJOR STREQUAL "")
      set(NVSHMEM_VERSION "${_nvshmem_MAJOR}.${_nvshmem_MINOR}.${_nvshmem_PATCH}")
      break()
    endif()
  endforeach()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM REQUIRED_VARS ${_nvshmem_required} VERSION_VAR NVSHMEM_VERSION)

if(NVSHMEM_FOUND AND NOT TARGET NVSHMEM::nvshmem)
  add_library(NVSHMEM::nvshmem INTERFACE IMPORTED)
  target_include_directories(NVSHMEM::nvshmem SYSTEM INTERFACE "${NVSHMEM_INCLUDE_DIR}")
  if(NVSHMEM_DEVICE_LIBRARY AND NVSHMEM_HOST_LIBRARY)
    # STATIC and SHARED (not UNKNOWN) so that CMake's device-link step takes the device library and the
    # host library is linked by its full path even when only the versioned file exists.
    add_library(NVSHMEM::device STATIC IMPORTED)
    set_target_properties(NVSHMEM::device PROPERTIES IMPORTED_LOCATION "${NVSHMEM_DEVICE_LIBRARY}")
    add_library(NVSHMEM::host SHARED IMPORTED)
    get_filename_component(_nvshmem_host_name "${NVSHMEM_HOST_LIBRARY}" NAME)
    set_target_properties(NVSHMEM::host PROPERTIES IMPORTED_LOCATION "${NVSHMEM_HOST_LIBRARY}"
                                                   IMPORTED_SONAME "${_nvshmem_host_name}")
    target_link_libraries(NVSHMEM::nvshmem INTERFACE NVSHMEM::device NVSHMEM::host)
  else()
    add_library(NVSHMEM::static STATIC IMPORTED)
    set_target_properties(NVSHMEM::static PROPERTIES IMPORTED_LOCATION "${NVSHMEM_STATIC_LIBRARY}")
    target_link_libraries(NVSHMEM::nvshmem INTERFACE NVSHMEM::static)
  endif()
endif()

mark_as_advanced(NVSHMEM_INCLUDE_DIR NVSHMEM_DEVICE_LIBRARY NVSHMEM_HOST_LIBRARY NVSHMEM_STATIC_LIBRARY)
