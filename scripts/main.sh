#!/usr/bin/env bash
# The main job: installs what is needed, builds mori and runs real multi-process SHMEM programs.
# With an NVIDIA GPU (and nvcc) it builds the CUDA backend and runs one PE per GPU; otherwise it builds
# the HOST backend and runs four PEs. Each kernel moves data with the SHMEM device API: an all-to-all with
# put-with-signal through the RDMA transport (IBGDA on the emulated NIC when there is no real one), then a
# ring all-gather over the transport mori picks (P2P on one host); both verify every byte. Then mori-info
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
echo "== shmem_all_to_all: $ranks PEs, $backend backend, RDMA transport (IBGDA)"
mpirun --oversubscribe -np "$ranks" -x MORI_SHMEM_TRANSPORT=rdma -x MORI_SHMEM_HEAP_SIZE=512m \
  "$build/examples/shmem/shmem_all_to_all" 4m
echo "== shmem_ring_allgather: $ranks PEs, $backend backend, transport chosen per pair"
mpirun --oversubscribe -np "$ranks" -x MORI_SHMEM_HEAP_SIZE=512m "$build/examples/shmem/shmem_ring_allgather" 16m
echo "== mori-info"
"$build/tools/mori-info"
