# CMake toolchain file: the C++ (libnbx_core, _ffi and, with NBX_TESTING=ON, _ffi_testing)
# cross-compiled for arm64 Linux (aarch64) with Debian's cross toolchain, e.g. .ci/arm64:
#
#   apt-get install g++-aarch64-linux-gnu libpython3.11-dev:arm64   # after dpkg --add-architecture arm64
#   cmake -S . -B build/arm64/build -G Ninja \
#         -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#         -DPython_EXECUTABLE=.venv/bin/python
#
# Python_EXECUTABLE is the BUILD machine's Python 3.11 (x86-64): CMake runs it
# to find nanobind's CMake package and jaxlib's XLA FFI headers (source, the
# same for every architecture); nothing from it is compiled or linked in.  The
# target's Python headers are Debian's arm64 ones (Python.h is shared,
# pyconfig.h comes from /usr/include/aarch64-linux-gnu/python3.11), and the
# module's file name carries the arm64 suffix, not the build Python's.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

set(NBX_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "Prefix of the cross toolchain's programs")
set(CMAKE_C_COMPILER ${NBX_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${NBX_CROSS_PREFIX}g++)

# Libraries and headers from the target's paths only; programs from the host.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# The target Python's development artifacts, given rather than asked of the
# build machine's interpreter (FindPython would report x86-64's).
set(NBX_TARGET_PYTHON_INCLUDE_DIR /usr/include/python3.11 CACHE PATH "The arm64 Python's headers")
set(Python_INCLUDE_DIR ${NBX_TARGET_PYTHON_INCLUDE_DIR} CACHE PATH "")
# The module's suffix (.cpython-311-aarch64-linux-gnu.so): nanobind takes it
# from SKBUILD_SOABI first (the variable scikit-build-core sets), before
# FindPython's Python_SOABI, which is the build interpreter's (x86_64).
set(SKBUILD_SOABI cpython-311-aarch64-linux-gnu)
