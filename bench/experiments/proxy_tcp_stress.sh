#!/usr/bin/env bash
# Stress for the proxy-over-TCP hang under MPS (docs/PERF.md): shmem_all_to_all with 4 PEs over proxy/tcp,
# repeated beside an atomic_counter job over proxy/rdma. When a round runs past HANG_S, every thread of every
# rank is dumped (gdb or cuda-gdb) before the job's own bounded waits end it.
#   bench/experiments/proxy_tcp_stress.sh [rounds]   (the CUDA build staged in .carry/build-cuda)
# CHURN=1 adds short proxy/rdma all-to-all jobs starting and ending beside the two.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
B=$repo/.carry/build-cuda
# The build holds the absolute paths of the machine it was built on (as in scripts/gpu_suite.sh).
built_at=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$B/CMakeCache.txt")
if [ "$built_at" != "$repo" ]; then mkdir -p "$(dirname "$built_at")"; ln -sfn "$repo" "$built_at"; fi
ln -sfn "$B" "$repo/build-cuda"
out=${OUT:-/tmp/mori-out}/stress
mkdir -p "$out"
rounds=${1:-6}
HANG_S=${HANG_S:-20}
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mori-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mori-mps-log CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun --allow-run-as-root --oversubscribe -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY
     -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x MORI_SHMEM_HEAP_SIZE=256m -x MORI_TIMEOUT_S=${MORI_TIMEOUT_S:-40})
dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
echo "debugger: ${dbg:-none}" | tee "$out/summary.txt"
fails=0
for r in $(seq "$rounds"); do
  "${mpi[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=proxy -x MORI_SHMEM_PROXY_CONN=rdma "$B/examples/shmem/shmem_atomic_counter" \
    >"$out/counter_$r.log" 2>&1 &
  bg=$!
  sleep 2
  "${mpi[@]}" -np 4 -x MORI_SHMEM_TRANSPORT=proxy -x MORI_SHMEM_PROXY_CONN=tcp "$B/examples/shmem/shmem_all_to_all" \
    >"$out/a2a_$r.log" 2>&1 &
  job=$!
  # CHURN=1: short jobs starting and ending beside them (as ctest -j3 runs the suite's examples).
  if [ "${CHURN:-0}" = 1 ]; then
    ( for c in 1 2 3 4 5 6; do
        "${mpi[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=proxy -x MORI_SHMEM_PROXY_CONN=rdma \
          "$B/examples/shmem/shmem_all_to_all" >>"$out/churn_$r.log" 2>&1
      done ) &
  fi
  t0=$SECONDS
  dumped=0
  while kill -0 $job 2>/dev/null; do
    if [ $dumped = 0 ] && [ $((SECONDS - t0)) -ge "$HANG_S" ]; then
      dumped=1
      for pid in $(pgrep -f "examples/shmem/shmem_all_to_all" | grep -v "^$job$"); do
        [ "$(cat /proc/$pid/comm)" = shmem_all_to_al ] || continue
        { echo "== pid $pid"; for t in /proc/$pid/task/*; do echo "$(basename $t) $(cat $t/comm) $(cat $t/wchan 2>/dev/null)"; done
          [ -n "$dbg" ] && timeout 60 "$dbg" -p $pid -batch -ex "thread apply all bt 25" 2>&1 | grep -v "^\[New LWP\|^warning"
        } >"$out/stacks_${r}_$pid.txt" 2>&1
      done
      nvidia-smi >"$out/smi_$r.txt" 2>&1
    fi
    sleep 1
  done
  wait $job; rc=$?
  wait $bg; bgrc=$?
  echo "round $r: all_to_all rc=$rc ($((SECONDS - t0)) s), atomic_counter rc=$bgrc" | tee -a "$out/summary.txt"
  [ $rc = 0 ] || fails=$((fails + 1))
done
echo "all_to_all failed $fails of $rounds" | tee -a "$out/summary.txt"
echo quit | nvidia-cuda-mps-control
cp -r $CUDA_MPS_LOG_DIRECTORY "$out/mps-log" 2>/dev/null
tar czf "${OUT:-/tmp/mori-out}/stress.tgz" -C "${OUT:-/tmp/mori-out}" stress
