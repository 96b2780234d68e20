#!/bin/bash
# The proxy-over-TCP stall of docs/PERF.md (2026-11-25, fifth session): the EP suite's first test over the
# Proxy transport with TCP connections, 2 PEs on one GPU, with one setting changed per run. Run from the
# repository root of a CUDA build (build-cuda); prints one line per run: its exit status and the first stalled
# copy, if any. Usage: bench/experiments/copy_queue_stall.sh [runs per setting]
set -u
runs=${1:-2}
cd build-cuda || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mori-stall-mps CUDA_MPS_LOG_DIRECTORY=/tmp/mori-stall-mps-log
out=${OUT:-/tmp/mori-stall}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" "$out"
one() {  # name, then mpirun -x arguments
  local name=$1
  shift
  timeout 60 mpirun --allow-run-as-root -np 2 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY "$@" \
    -x MORI_SHMEM_TRANSPORT=proxy -x MORI_SHMEM_PROXY_CONN=tcp -x MORI_SHMEM_HEAP_SIZE=256m -x MORI_TIMEOUT_S=8 \
    ./tests/mori_ep_mpi_tests --gtest_filter='EpTest.EveryRoutingAndDtype' > "$out/$name.log" 2>&1
  printf "%-24s exit %-3s %s\n" "$name" $? "$(grep -m1 -o 'copying [0-9]* bytes[^(]*' "$out/$name.log")"
}
nvidia-cuda-mps-control -d && sleep 1
for i in $(seq "$runs"); do
  one "mps_default_$i" -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
  one "mps_mori_off_$i" -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 -x MORI_CUDA_MAX_CONNECTIONS=0
  for c in 2 4 8 16; do one "mps_queues${c}_$i" -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 -x CUDA_DEVICE_MAX_CONNECTIONS=$c; done
  for ch in 1 8; do one "mps_off_channels${ch}_$i" -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 -x MORI_CUDA_MAX_CONNECTIONS=0 -x MORI_TCP_CHANNELS=$ch; done
done
echo quit | nvidia-cuda-mps-control
sleep 1
for i in $(seq "$runs"); do
  for c in 1 2; do one "nomps_queues${c}_$i" -x CUDA_DEVICE_MAX_CONNECTIONS=$c; done
  one "nomps_default_$i"
done
