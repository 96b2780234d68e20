#!/usr/bin/env bash
# Copies the CUDA build (built here: MORI_GPU_BACKEND=CUDA) without object files into .carry/build-cuda,
# small enough to travel to the GPU machine, where scripts/gpu_suite.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
rm -rf .carry/build-cuda
mkdir -p .carry
rsync -a --exclude '*.o' --exclude '*.o.d' --exclude '.ninja_*' --exclude 'install_test' "$build/" .carry/build-cuda/
cp "$(cmake --system-information 2>/dev/null | sed -n 's/^CMAKE_ROOT "\(.*\)"/\1/p')/Modules/GoogleTestAddTests.cmake" .carry/
du -sh .carry/build-cuda
