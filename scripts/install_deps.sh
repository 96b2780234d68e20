#!/usr/bin/env bash
# Installs what building and testing mori needs on Debian/Ubuntu, skipping what is already there.
#   install_deps.sh            compiler, CMake, GoogleTest, Open MPI, rdma-core, iproute2, and for the Python
#                              package: Python headers, pybind11, pip, and torch/pytest/numpy for its tests
#                              (libtorch-dev: torch's C++ headers, for the test that builds a torch extension),
#                              and clang 14 with its libFuzzer and sanitizer runtimes for the fuzz targets
#   install_deps.sh --hip      and hipcc with the HIP runtime headers (for the HIP compile check)
set -euo pipefail
packages=(cmake ninja-build g++ make libgtest-dev libopenmpi-dev openmpi-bin libibverbs-dev rdma-core iproute2 rsync
          python3-dev pybind11-dev python3-pip python3-torch libtorch-dev python3-pytest python3-numpy
          clang-14 libclang-rt-14-dev llvm-14)
if [ "${1:-}" = "--hip" ]; then
  packages+=(hipcc libamdhip64-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all present"
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
