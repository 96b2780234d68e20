#!/usr/bin/env bash
# Run on the GPU machine from the repository root, with the CUDA build staged by scripts/stage_cuda_build.sh
# (carried as .carry/build-cuda). Not part of the build or of gpu_suite.sh.
# put_bw_warp at 32 blocks, mori and NVSHMEM, two PEs under MPS (50% of the SMs each), to find what picks the
# rate of its 1-2 MiB rows (docs/PERF.md, 2026-12-03, eighth session):
#   offsets    512 KiB-4 MiB alone, the source or target moved 0-24 MiB into its allocation (--src-offset /
#              --dst-offset), mori first on every line
#   align      the same with each library's own allocations, with --align 2m (both at one place in a 2 MiB page),
#              2m plus 16 KiB, 2m with 64 MiB allocations and --align 64k; two rounds, the order alternating
#   sequence   `all` (put_bw's block rows first) against put_bw_warp alone, --max 64m --blocks 1,8,32, three
#              rounds, the order alternating; CSVs in $OUT
# Usage: bench/experiments/put_bw_placement.sh [offsets] [align] [sequence]   (default: all three)
set -uo pipefail
repo=$(pwd)
mkdir -p /work && [ -e /work/main ] || ln -sfn "$repo" /work/main
ln -sfn "$repo/.carry/build-cuda" "$repo/build-cuda"
out=${OUT:-/tmp/put_bw_placement}
mkdir -p "$out"
nv=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem
mpi_inc=$(mpicc -showme:incdirs | sed 's/[^ ]*/-I&/g'); mpi_lib=$(mpicc -showme:libdirs | sed 's/[^ ]*/-L&/g')
nvcc -O3 -std=c++17 -rdc=true -arch=sm_90 -I"$nv/include" $mpi_inc bench/nvshmem_bench.cu "$nv/lib/libnvshmem_device.a" \
  -Xlinker "$nv/lib/libnvshmem_host.so.3" $mpi_lib -lmpi -lcuda -Xlinker -rpath="$nv/lib" -o /tmp/nvshmem_bench || exit 1
nvenv=(-x LD_LIBRARY_PATH="$nv/lib" -x NVSHMEM_DISABLE_NVLS=1 -x NVSHMEM_REMOTE_TRANSPORT=none)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mori-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mori-mps-log CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
export NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d
mps=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
# One program's run: program (mori | nvshmem), label, its arguments. Prints the buffers' place in a 2 MiB page
# and the 512 KiB-4 MiB rows of its put_bw_warp table, best over its block counts.
one() {
  local prog=$1 label=$2; shift 2
  if [ "$prog" = mori ]; then
    timeout 90 mpirun --allow-run-as-root "${mps[@]}" -np 2 ./build-cuda/bench/shmem_bench "$@" > /tmp/pbp_last.txt 2>&1
  else
    timeout 90 mpirun --allow-run-as-root "${mps[@]}" -np 2 "${nvenv[@]}" /tmp/nvshmem_bench "$@" > /tmp/pbp_last.txt 2>&1
  fi
  echo "== $label $prog rc=$?: $(grep -o 'source / target at [0-9]* / [0-9]*' /tmp/pbp_last.txt | head -1)"
  grep -E "^put_bw_warp \(" -A20 /tmp/pbp_last.txt | grep -E "^ +(512 KiB|1 MiB|2 MiB|4 MiB) " |
    awk '{printf "%s%s %s  ", $1, $2, $NF} END {print ""}'
  grep -iE "wrong|error" /tmp/pbp_last.txt | head -3
}
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(offsets align sequence)
for mode in "${modes[@]}"; do
  case $mode in
    offsets)
      for o in "--dst-offset 0" "--dst-offset 0" "--dst-offset 4k" "--dst-offset 64k" "--dst-offset 512k" \
               "--dst-offset 1m" "--dst-offset 2m" "--dst-offset 3m" "--dst-offset 8m" "--dst-offset 24m" \
               "--src-offset 1m" "--src-offset 3m" "--src-offset 24m" "--src-offset 3m --dst-offset 3m"; do
        for p in mori nvshmem; do one $p "offsets ${o//--/}" put_bw_warp --min 512k --max 4m --blocks 32 $o; done
      done ;;
    align)
      for r in 1 2; do
        order="mori nvshmem"; [ $r = 2 ] && order="nvshmem mori"
        for cfg in "--max 4m" "--max 64m" "--max 4m --align 2m" "--max 4m --align 2m --src-offset 16k --dst-offset 16k" \
                   "--max 64m --align 2m" "--max 4m --align 64k"; do
          for p in $order; do one $p "align r$r ${cfg//--/}" put_bw_warp --min 512k --blocks 32 $cfg; done
        done
      done ;;
    sequence)
      for r in 1 2 3; do
        order="mori nvshmem"; ((r % 2 == 0)) && order="nvshmem mori"
        for which in all put_bw_warp; do
          for p in $order; do
            one $p "sequence r$r $which" $which --max 64m --blocks 1,8,32 --csv "$out/seq_${p}_${which}_r$r.csv"
          done
        done
      done ;;
    *) echo "unknown mode $mode (offsets, align, sequence)"; break ;;
  esac
done
echo quit | timeout 20 nvidia-cuda-mps-control
