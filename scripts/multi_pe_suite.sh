#!/usr/bin/env bash
# The N-PE job of issue 6, the same on every machine; only the PE count changes:
#   scripts/multi_pe_suite.sh NP [BUILD_DIR]
# With a CUDA build on an N-GPU host each PE gets a GPU; with a HOST build (CI) the PEs are processes.
# Runs, with logs under ${OUT:-/tmp/mori-multi-pe}:
#   1. the SHMEM multi-process suite (mori_shmem_mpi_tests) with NP PEs under each forced transport that the
#      build offers (p2p, rdma over the NIC or the emulated NIC, proxy);
#   2. the channel suites (mori_channels_unit_tests, mori_channels_mp_tests) once (CHANNEL_SUITES=0 leaves them
#      out: ctest, which runs every one of their tests on its own, sets it);
#   3. the all-pairs matrix (shmem_matrix: put bandwidth of 64 MiB (1 MiB on HOST), single-value ping-pong
#      latency) as tables, CSV and an SVG plot (scripts/plot_matrix.py);
#   4. the all-to-all example with 1 MiB per pair under each transport, its time on PE 0.
# Exit status: non-zero when anything failed. summary.md in the output folder holds the tables.
set -uo pipefail
np=${1:?usage: multi_pe_suite.sh NP [BUILD_DIR]}
repo=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${2:-$repo/build-host}" && pwd)
out=${OUT:-/tmp/mori-multi-pe}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
backend=$(sed -n 's/^MORI_GPU_BACKEND:[A-Z]*=//p' "$build/CMakeCache.txt")
transports=${TRANSPORTS:-"p2p rdma proxy"}
mpirun_np=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np")
timeout_s=${SUITE_TIMEOUT_S:-900}
rc=0
summary="$out/summary.md"
tables="$out/tables.md"
: > "$tables"
{
  echo "# mori multi-PE suite: $np PEs, ${backend:-HOST} build, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)"
  command -v nvidia-smi >/dev/null && nvidia-smi -L | sed 's/^/    /'
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
} > "$summary"

step() {  # name, log, command...
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  timeout "$timeout_s" "$@" > "$log" 2>&1
  local r=$?
  local verdict=passed
  [ $r -eq 0 ] || { verdict="FAILED (exit $r, see $(basename "$log"))"; rc=1; }
  echo "| $name | $verdict | $((SECONDS - start)) |" >> "$summary"
  echo "$name: $verdict"
}

for t in $transports; do
  step "SHMEM suite, $t, $np PEs" "$out/shmem_suite_${t}_np$np.log" \
    "${mpirun_np[@]}" -x MORI_SHMEM_TRANSPORT=$t -x MORI_SHMEM_HEAP_SIZE=64m -x MORI_TIMEOUT_S=60 \
    "$build/tests/mori_shmem_mpi_tests"
done
if [ "${CHANNEL_SUITES:-1}" != 0 ]; then
  step "channel suites" "$out/channels.log" \
    bash -c "'$build/tests/mori_channels_unit_tests' && '$build/tests/mori_channels_mp_tests'"
fi

for t in $transports; do
  step "all-pairs matrix, $t" "$out/matrix_${t}_np$np.log" \
    "${mpirun_np[@]}" -x MORI_SHMEM_TRANSPORT=$t -x MORI_SHMEM_HEAP_SIZE=512m \
    "$build/bench/shmem_matrix" --csv "$out/matrix_${t}_np$np.csv"
  step "all-to-all 1 MiB per pair, $t" "$out/all_to_all_${t}_np$np.log" \
    "${mpirun_np[@]}" -x MORI_SHMEM_TRANSPORT=$t -x MORI_SHMEM_HEAP_SIZE=512m \
    "$build/examples/shmem/shmem_all_to_all" 1m
  ms=$(sed -n 's/.* B per pair, \([0-9.]*\) ms on PE 0.*/\1/p' "$out/all_to_all_${t}_np$np.log" | tail -1)
  if [ -f "$out/matrix_${t}_np$np.csv" ]; then
    python3 "$repo/scripts/plot_matrix.py" "$out/matrix_${t}_np$np.csv" "$out/matrix_${t}_np$np.svg" \
      --title "mori SHMEM, $np PEs, ${backend:-HOST}, MORI_SHMEM_TRANSPORT=$t" ${ms:+--all-to-all-ms $ms} || rc=1
  fi
  {
    echo
    echo "## $t"
    echo '```'
    sed -n '/^put bandwidth/,$p' "$out/matrix_${t}_np$np.log"
    echo "all-to-all, 1 MiB per pair: ${ms:-n/a} ms"
    echo '```'
  } >> "$tables"
done
cat "$tables" >> "$summary"
rm -f "$tables"
cat "$summary"
exit $rc
