#!/usr/bin/env bash
# The main job: installs what is needed, builds mori and runs a real multi-process program.
# With an NVIDIA GPU (and nvcc) it builds the CUDA backend and runs one process per GPU; otherwise it
# builds the HOST backend and runs four processes. The program bootstraps through mpirun, maps the
# memory of same-host peers and has each process's kernel write into its neighbour's; then mori-info
# reports what this machine offers.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null; then ./scripts/install_deps.sh; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
backend=HOST
ranks=4
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  backend=CUDA
  ranks=$(nvidia-smi -L | wc -l)
fi
build=build-main-${backend,,}
cmake -S . -B "$build" -G Ninja -DMORI_GPU_BACKEND=$backend -DMORI_BUILD_TESTS=OFF -DMORI_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --parallel
echo "== ring_exchange: $ranks processes, $backend backend"
mpirun --oversubscribe -np "$ranks" "$build/examples/core/ring_exchange" 64m
echo "== mori-info"
"$build/tools/mori-info"
