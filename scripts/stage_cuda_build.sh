#!/usr/bin/env bash
# Copies the CUDA build (built here: MORI_GPU_BACKEND=CUDA) without object files into .carry/build-cuda,
# small enough to travel to the GPU machine, where scripts/gpu_suite.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
rm -rf .carry/build-cuda
mkdir -p .carry/build-cuda
# tar rather than rsync, which a fresh machine may not have.
tar -C "$build" --exclude='*.o' --exclude='*.o.d' --exclude='.ninja_*' --exclude='./install_test' -cf - . |
  tar -C .carry/build-cuda -xf -
# Debug info is most of the bytes; the device machine needs none of it (the carry limit is 64 MiB).
find .carry/build-cuda -type f \( -perm -u+x -o -name '*.so*' \) -exec sh -c \
  'for f; do head -c 4 "$f" | grep -q ELF && strip --strip-debug "$f"; done' sh {} +
cp "$(cmake --system-information 2>/dev/null | sed -n 's/^CMAKE_ROOT "\(.*\)"/\1/p')/Modules/GoogleTestAddTests.cmake" .carry/
du -sh .carry/build-cuda
