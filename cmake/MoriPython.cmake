# The Python package (python/): resolves MORI_BUILD_PYTHON into MORI_HAS_PYTHON. AUTO builds it when the Python 3
# headers and pybind11 are found, except in sanitizer builds (a plain python cannot load sanitized libraries
# without the sanitizer runtime preloaded).
string(TOUPPER "${MORI_BUILD_PYTHON}" _mori_py)
set(MORI_HAS_PYTHON 0)
set(_mori_py_why "")
if(_mori_py STREQUAL "OFF")
  set(_mori_py_why "MORI_BUILD_PYTHON=OFF")
elseif(_mori_py STREQUAL "AUTO" AND NOT MORI_SANITIZE STREQUAL "")
  set(_mori_py_why "sanitizer build (MORI_SANITIZE=${MORI_SANITIZE})")
else()
  find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
  if(NOT Python3_FOUND)
    set(_mori_py_why "no Python 3 interpreter with its headers (apt-get install python3-dev)")
  else()
    # pybind11 from Debian (pybind11-dev) or from the interpreter's own site-packages (pip's pybind11).
    execute_process(COMMAND "${Python3_EXECUTABLE}" -m pybind11 --cmakedir OUTPUT_VARIABLE _mori_pybind11_dir
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    set(PYBIND11_FINDPYTHON ON)  # the Python3 found above, not pybind11's own search
    find_package(pybind11 CONFIG QUIET HINTS "${_mori_pybind11_dir}")
    if(pybind11_FOUND)
      set(MORI_HAS_PYTHON 1)
    else()
      set(_mori_py_why "pybind11 not found (apt-get install pybind11-dev)")
    endif()
  endif()
endif()
if(MORI_HAS_PYTHON)
  message(STATUS "mori: Python package for ${Python3_EXECUTABLE} (${Python3_VERSION}), pybind11 ${pybind11_VERSION}")
elseif(_mori_py STREQUAL "ON")
  message(FATAL_ERROR "mori: MORI_BUILD_PYTHON=ON but ${_mori_py_why}")
else()
  message(STATUS "mori: Python package not built: ${_mori_py_why}")
endif()
