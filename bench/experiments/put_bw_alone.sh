#!/usr/bin/env bash
# Run on the GPU machine from the repository root, with the CUDA build staged by scripts/stage_cuda_build.sh
# (carried as .carry/build-cuda). Not part of the build or of gpu_suite.sh.
# put_bw_warp / put_bw at 256 KiB-4 MiB, 32 blocks, mori and NVSHMEM, without MPS (PE 1 idle at a host
# barrier while PE 0 puts, so nothing shares the GPU) and with MPS (50% of the SMs each), two rounds each.
set -uo pipefail
repo=$(pwd)
mkdir -p /work && [ -e /work/main ] || ln -sfn "$repo" /work/main
ln -sfn "$repo/.carry/build-cuda" "$repo/build-cuda"
nv=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem
mpi_inc=$(mpicc -showme:incdirs | sed 's/[^ ]*/-I&/g'); mpi_lib=$(mpicc -showme:libdirs | sed 's/[^ ]*/-L&/g')
nvcc -O3 -std=c++17 -rdc=true -arch=sm_90 -I"$nv/include" $mpi_inc bench/nvshmem_bench.cu "$nv/lib/libnvshmem_device.a" \
  -Xlinker "$nv/lib/libnvshmem_host.so.3" $mpi_lib -lmpi -lcuda -Xlinker -rpath="$nv/lib" -o /tmp/nvshmem_bench || exit 1
args="--min 256k --max 4m --blocks 32"
one() {  # label, extra mpirun args...
  local label=$1; shift
  for b in put_bw_warp put_bw; do
    echo "== $label $b mori"; timeout 60 mpirun --allow-run-as-root "$@" -np 2 ./build-cuda/bench/shmem_bench $b $args 2>&1 | grep -A6 "^$b (mori)"
    echo "== $label $b nvshmem"; timeout 60 mpirun --allow-run-as-root "$@" -np 2 -x LD_LIBRARY_PATH="$nv/lib" -x NVSHMEM_DISABLE_NVLS=1 \
      -x NVSHMEM_REMOTE_TRANSPORT=none /tmp/nvshmem_bench $b $args 2>&1 | grep -A6 "^$b (nvshmem"
  done
}
one "no-MPS r1"; one "no-MPS r2"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mori-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mori-mps-log CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
export NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d
mps=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
one "MPS r1" "${mps[@]}"; one "MPS r2" "${mps[@]}"
echo quit | timeout 20 nvidia-cuda-mps-control
