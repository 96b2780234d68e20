#!/usr/bin/env bash
# The GPU job for a machine with NVIDIA GPUs: runs the CUDA build staged by stage_cuda_build.sh (ctest:
# unit, multi-process, GPU and mpirun suites incl. SHMEM, the examples; with BENCH=1 the benchmarks, mori
# beside NVSHMEM) and writes logs to ${OUT:-/tmp/mori-out}/logs, packed at the end into
# ${OUT}/mori-gpu-logs.tgz (a device command brings back only a few files).
# With fewer GPUs than the two PEs of the jobs, the PEs share GPUs under CUDA MPS (their kernels then run at
# the same time instead of in time slices): the script starts the MPS daemon with its pipe and log folders
# under /tmp, gives every rank the MPS variables and 100 / (PEs per GPU) percent of the SMs, and quits the
# daemon at the end. MPS=off keeps it off, MPS=on forces it. CTEST=0 skips the ctest phases and the
# large-message examples (STEPS=<regex> keeps only the named steps of the rest). With BENCH=1,
# SHMEM_BENCH_REPEAT=N (default 2) runs shmem_bench and nvshmem_bench N times each in alternating order and
# compares each round and the best of all rounds (shmem_compare_best.txt); the GPU's clocks, power and
# temperatures through the benchmarks are in gpu_telemetry.csv, every step's start and end in timeline.txt.
# The build holds the absolute paths of the machine it was built on; symbolic links recreate them.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
top=${OUT:-/tmp/mori-out}
out="$top/logs"
mkdir -p "$out"
pack_logs() { tar czf "$top/mori-gpu-logs.tgz" -C "$top" logs 2>/dev/null; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# nvidia-smi lists every GPU; the jobs see those of CUDA_VISIBLE_DEVICES when it is set.
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
mps_env=()
if [ "${MPS:-auto}" = on ] || { [ "${MPS:-auto}" = auto ] && [ "${gpus:-0}" -lt 2 ]; }; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mori-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mori-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  pes_per_gpu=$(( (2 + ${gpus:-1} - 1) / ${gpus:-1} ))
  [ "$pes_per_gpu" -ge 1 ] || pes_per_gpu=2
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / pes_per_gpu))
  export NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1
  if nvidia-cuda-mps-control -d; then
    echo "MPS daemon started: $pes_per_gpu PEs per GPU, $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE% of the SMs each" | tee "$out/mps.txt"
    # The logs are packed first: `quit` waits for every client to leave, and a client stuck in a hung test kept it
    # (and the packing behind it) past the device command's limit once (2026-11-29, afternoon). Then the daemon
    # gets 20 s, and the packing is done again with the MPS logs.
    trap 'cp -r "$CUDA_MPS_LOG_DIRECTORY" "$out/mps-log" 2>/dev/null; pack_logs
          echo quit | timeout 20 nvidia-cuda-mps-control
          cp -r "$CUDA_MPS_LOG_DIRECTORY/." "$out/mps-log" 2>/dev/null; pack_logs' EXIT
  else
    echo "MPS daemon did not start: PEs sharing a GPU take turns in time slices" | tee "$out/mps.txt"
    trap pack_logs EXIT
  fi
  mps_env=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
           -x NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
else
  trap pack_logs EXIT
fi
# Every mpirun of this script (an array, not a function: `timeout` runs it): ranks started by the local
# daemon inherit the environment anyway; -x says so.
mpirun_=(mpirun --allow-run-as-root "${mps_env[@]}")
# Under MPS the two PEs of a benchmark share a GPU: its bandwidths are copies inside one GPU's memory, and
# compare_shmem.py checks only the ratios to NVSHMEM, not the NVLink targets.
one_gpu=$([ ${#mps_env[@]} -gt 0 ] && echo --one-gpu)
built_at=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$repo/.carry/build-cuda/CMakeCache.txt")
if [ "$built_at" != "$repo" ]; then
  mkdir -p "$(dirname "$built_at")"
  ln -sfn "$repo" "$built_at"
fi
ln -sfn "$repo/.carry/build-cuda" "$repo/build-cuda"
# ctest's test discovery uses the GoogleTest module of the CMake that configured the build.
gtest_module=$(grep -ho '/[^ ]*/GoogleTestAddTests.cmake' "$repo"/.carry/build-cuda/tests/*include.cmake 2>/dev/null | head -1)
if [ -n "$gtest_module" ] && [ ! -f "$gtest_module" ]; then
  mkdir -p "$(dirname "$gtest_module")"
  cp "$repo/.carry/GoogleTestAddTests.cmake" "$gtest_module"
fi
# The install test calls cmake by the path found at build time.
want=$(sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$repo/.carry/build-cuda/CMakeCache.txt")
if [ -n "$want" ] && [ ! -x "$want" ] && command -v cmake >/dev/null; then ln -sfn "$(command -v cmake)" "$want"; fi
# The tests call mpirun by the path found at build time.
want=$(sed -n 's/^MORI_MPIRUN:FILEPATH=//p' "$repo/.carry/build-cuda/CMakeCache.txt")
if [ -n "$want" ] && [ ! -x "$want" ] && command -v mpirun >/dev/null; then ln -sfn "$(command -v mpirun)" "$want"; fi
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
{
  date -u; uname -a; nvidia-smi -L; nvidia-smi topo -m
  which mpirun cmake ctest c++ nvcc
} > "$out/machine.txt" 2>&1
cd "$built_at/build-cuda"
./tools/mori-info > "$out/mori-info.txt" 2>&1
# Focused modes (ONLY=...) run each command bounded by STEP_TIMEOUT_S, one at a time (processes spinning on one
# GPU take turns), and summarise into $out/summary.txt.
rc=0
t=${STEP_TIMEOUT_S:-240}
# SUITE_DEADLINE_S: seconds after which every step still running is stopped (a device command has a hard
# limit; stopping before it leaves time to quit MPS and pack the logs).
left() {
  local l=$(( ${SUITE_DEADLINE_S:-1000000} - SECONDS ))
  [ "$l" -gt 1 ] && echo "$l" || echo 1
}
bounded() { timeout -k 10 "$(left)" "$@"; }
run() {  # log name, command... (only the names matching the regular expression STEPS, when given)
  [[ "$1" =~ ${STEPS:-.} ]] || return 0
  local log="$out/$1.log"
  shift
  local start=$SECONDS
  local limit=$t why=""
  if [ "$(left)" -lt "$limit" ]; then
    limit=$(left)
    why=" (stopped by the suite's deadline, SUITE_DEADLINE_S=$SUITE_DEADLINE_S, with $limit s left for it)"
  else
    why=" (ran past STEP_TIMEOUT_S=$t)"
  fi
  echo "$(date -u +%T.%N | cut -c1-12) start $(basename "$log" .log)" >> "$out/timeline.txt"
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  local r=$?
  # Only a step that ran until its limit was stopped by it (a step may exit 124 by itself).
  { [ $r -eq 124 ] || [ $r -eq 137 ]; } && [ $((SECONDS - start)) -ge $((limit - 1)) ] || why=""
  echo "$(date -u +%T.%N | cut -c1-12) end $(basename "$log" .log) exit $r" >> "$out/timeline.txt"
  echo "$(basename "$log" .log): exit $r, $((SECONDS - start)) s$why" | tee -a "$out/summary.txt"
  [ $r -eq 0 ] || rc=1
}
report_failures() {
  for f in "$out"/*.log; do grep -lE "FAILED|Failure|trap|error" "$f" >/dev/null && { echo "== $f"; grep -E "FAILED|Failure|trap|rror" "$f" | head -20; }; done
}
# mori's shmem_bench (with and without the device API's argument checks) beside NVSHMEM's nvshmem_bench, the
# comparison, the FIFO round trip, and the SASS of the benchmark kernels. NVSHMEM is not on the build machine:
# nvshmem_bench is compiled here (relocatable device code, its device library, the host library by path), as
# BASELINES.md describes.
nv=${NVSHMEM_HOME:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem}
# The compile (about 15 s of nvcc, no GPU) runs in the background, beside rdma_post_rate and mori's first round.
nvshmem_build_pid=
nvshmem_build_start() {
  [ -d "$nv/include" ] && [ -z "$nvshmem_build_pid" ] || return 0  # no NVSHMEM, or started already
  (
    mpi_inc=$(mpicc -showme:incdirs | sed 's/[^ ]*/-I&/g')
    mpi_lib=$(mpicc -showme:libdirs | sed 's/[^ ]*/-L&/g')
    run nvshmem_build nvcc -O3 -std=c++17 -rdc=true -arch=sm_90 -I"$nv/include" $mpi_inc "$repo/bench/nvshmem_bench.cu" \
      "$nv/lib/libnvshmem_device.a" -Xlinker "$nv/lib/libnvshmem_host.so.3" $mpi_lib -lmpi -lcuda \
      -Xlinker -rpath="$nv/lib" -o /tmp/nvshmem_bench
    exit $rc
  ) &
  nvshmem_build_pid=$!
}
# The comparison to show: over every round when there were several, else round 1's.
shmem_comparison() {
  if [ -f "$out/shmem_compare_best.txt" ]; then echo "$out/shmem_compare_best.txt"; else echo "$out/shmem_compare.txt"; fi
}
# The GPU's clocks, power, temperatures and clock-limit reasons every 250 ms while the benchmarks run
# (gpu_telemetry.csv, beside the steps' start and end times in timeline.txt): some put_bw rows take one of two
# rates run by run, and whether the GPU's state follows what ran before is what this records.
telemetry_pid=
telemetry_start() {
  command -v nvidia-smi >/dev/null || return 0
  local fields=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory reasons
  for reasons in clocks_event_reasons.active clocks_throttle_reasons.active ""; do
    nvidia-smi --query-gpu="$fields${reasons:+,$reasons}" --format=csv,noheader >/dev/null 2>&1 && break
  done
  nvidia-smi --query-gpu="$fields${reasons:+,$reasons}" --format=csv -lms 250 > "$out/gpu_telemetry.csv" 2>&1 &
  telemetry_pid=$!
}
telemetry_stop() {
  [ -n "$telemetry_pid" ] || return 0
  kill "$telemetry_pid" 2>/dev/null
  wait "$telemetry_pid" 2>/dev/null
  telemetry_pid=
}
# SHMEM_BENCH_ARGS go to both programs. `--places 4` measures put_bw at four places in its buffers (a copy's rate
# depends on its target's physical page, docs/PERF.md 2026-12-03 ninth session); it takes each run 2-3 times as
# long (about 90 s more in the whole job with --max 64m --blocks 1,8,32), so it is not the default.
bench_shmem() {
  local args=${SHMEM_BENCH_ARGS:-}
  nvshmem_build_start
  telemetry_start
  # Both programs, SHMEM_BENCH_REPEAT=N rounds (default 2), each compared on its own (how much a ratio of one
  # run moves between runs; round 1's files have no suffix), then all rounds together in
  # shmem_compare_best.txt: each row the best of its program's N runs. On an H200 some rows move by up to 20%
  # from one process of a program to the next (warp puts of 512 KiB-2 MiB: docs/PERF.md, 2026-12-03), so one
  # run of each made those ratios partly a draw. Even rounds run NVSHMEM first, so that neither program always
  # has the first turn on a GPU that was idle.
  local r sfx rounds=${SHMEM_BENCH_REPEAT:-2} morifiles="" nvfiles=""
  for ((r = 1; r <= rounds; r++)); do
    sfx=$([ "$r" -gt 1 ] && echo "_$r")
    if ((r % 2 == 1)); then
      run shmem_bench$sfx "${mpirun_[@]}" -np 2 ./bench/shmem_bench all --csv "$out/shmem_mori$sfx.csv" $args
    fi
    if [ -n "$nvshmem_build_pid" ] && [ "$nvshmem_build_pid" != done ]; then  # it had mori's round to finish in
      wait "$nvshmem_build_pid" || rc=1
      nvshmem_build_pid=done
    fi
    [ -x /tmp/nvshmem_bench ] && run nvshmem_bench$sfx "${mpirun_[@]}" -np 2 -x LD_LIBRARY_PATH="$nv/lib" \
      -x NVSHMEM_DISABLE_NVLS=1 -x NVSHMEM_REMOTE_TRANSPORT=none /tmp/nvshmem_bench all \
      --csv "$out/shmem_nvshmem$sfx.csv" $args
    if ((r % 2 == 0)); then
      run shmem_bench$sfx "${mpirun_[@]}" -np 2 ./bench/shmem_bench all --csv "$out/shmem_mori$sfx.csv" $args
    fi
    python3 "$repo/bench/compare_shmem.py" "$out/shmem_mori$sfx.csv" "$out/shmem_nvshmem$sfx.csv" $one_gpu \
      > "$out/shmem_compare$sfx.txt" 2>&1
    [ -f "$out/shmem_mori$sfx.csv" ] && morifiles+=${morifiles:+,}$out/shmem_mori$sfx.csv
    [ -f "$out/shmem_nvshmem$sfx.csv" ] && nvfiles+=${nvfiles:+,}$out/shmem_nvshmem$sfx.csv
  done
  if ((rounds > 1)) && [ -n "$morifiles" ]; then
    { echo "each row the best of: $morifiles against $nvfiles"
      python3 "$repo/bench/compare_shmem.py" "$morifiles" ${nvfiles:+"$nvfiles"} $one_gpu; } \
      > "$out/shmem_compare_best.txt" 2>&1
  fi
  [ -x ./bench/shmem_bench_nochecks ] &&
    run shmem_bench_nochecks "${mpirun_[@]}" -np 2 ./bench/shmem_bench_nochecks all --csv "$out/shmem_mori_nochecks.csv" $args
  [ -f "$out/shmem_mori_nochecks.csv" ] && python3 "$repo/bench/compare_shmem.py" "$out/shmem_mori.csv" \
    "$out/shmem_mori_nochecks.csv" $one_gpu > "$out/shmem_checks_cost.txt" 2>&1
  run fifo_bench ./bench/fifo_bench
  # The port channel's small-message time: two forked ranks put-with-signal to each other through their
  # proxies over CudaIpc, 1 and 4 KiB, time per round.
  run port_channel_small ./examples/channels/bidir_port_channel --transport CudaIpc --max-bytes 4k --iters 2000
  telemetry_stop
  if command -v cuobjdump >/dev/null; then
    cuobjdump -res-usage ./bench/shmem_bench > "$out/sass_res_mori.txt" 2>&1
    cuobjdump -sass ./bench/shmem_bench > "$out/sass_mori.txt" 2>&1
    [ -x /tmp/nvshmem_bench ] && cuobjdump -res-usage /tmp/nvshmem_bench > "$out/sass_res_nvshmem.txt" 2>&1
    [ -x /tmp/nvshmem_bench ] && cuobjdump -sass /tmp/nvshmem_bench 2>/dev/null | \
      awk '/Function : .*(PutBw|PingPong)/{p=1} /Function : /{if ($0 !~ /(PutBw|PingPong)/) p=0} p' > "$out/sass_nvshmem.txt"
  fi
}

# ep_bench with the DeepSeek-V3 shape (4096 tokens) and with 128 tokens, 2 PEs (the 128-token run also with its
# kernel times from CUPTI, as profilers report them).
bench_ep() {
  run ep_bench "${mpirun_[@]}" -np 2 -x MORI_SHMEM_HEAP_SIZE=2g -x MORI_TIMEOUT_S=60 ./bench/ep_bench ${EP_BENCH_ARGS:-}
  run ep_bench_128 "${mpirun_[@]}" -np 2 -x MORI_SHMEM_HEAP_SIZE=2g -x MORI_TIMEOUT_S=60 ./bench/ep_bench \
    --tokens 128 --kernel all --kernel-time 1 ${EP_BENCH_ARGS:-}
}

# Killed jobs (scripts/killed_job_check.sh): a 2-PE job ended by TERM, INT or KILL to mpirun, or TERM to one rank,
# under p2p and rdma; no rank may outlive mpirun and the next job on the GPU must pass.
# KILL_CASES="SIGNAL:TARGET ..." picks the cases; KILL_ROUNDS=N repeats each N times; KILL_BASELINE=1 then runs the same again with MORI_STOP_ON_SIGNAL=0
# (ranks that die in their kernels, as before the stop existed), for comparison in the same run. Under MPS the
# daemon is restarted between the two (a server left "not ready" by one would fail the other's jobs).
killed_jobs() {
  local sig target tr round stop
  local stops=(1)
  [ "${KILL_BASELINE:-0}" = 1 ] && stops=(1 0)
  for stop in "${stops[@]}"; do
    if [ "$stop" = 0 ] && [ ${#mps_env[@]} -gt 0 ]; then
      echo quit | nvidia-cuda-mps-control; sleep 2; nvidia-cuda-mps-control -d && echo "MPS daemon restarted"
    fi
    for round in $(seq "${KILL_ROUNDS:-1}"); do
      for tr in p2p rdma; do
        for case in ${KILL_CASES:-TERM:launcher INT:launcher KILL:launcher TERM:rank}; do
          sig=${case%%:*} target=${case##*:}
          MORI_STOP_ON_SIGNAL=$stop run "killed_job_${tr}_${sig,,}_${target}_stop${stop}_r$round" \
            "$repo/scripts/killed_job_check.sh" "$sig" "$target" "$tr" "${mpirun_[@]}"
        done
      done
    done
  done
  grep -h "^killed_job" "$out"/killed_job_*.log > "$out/killed_jobs.txt" 2>/dev/null
}
# ONLY=kill: the killed jobs alone (after the tests of the stop on SIGTERM, each in its own process).
if [ "${ONLY:-}" = kill ]; then
  run stop_tests ctest --output-on-failure --timeout 120 -R 'ShmemSingleTest.(TheStopWord|StopHandlers)|ShmemStopTest'
  grep -E '^[0-9]+% tests passed' "$out/stop_tests.log" | sed 's/^/stop tests: /' | tee -a "$out/summary.txt"
  killed_jobs
  cat "$out/summary.txt" "$out/killed_jobs.txt"
  exit $rc
fi
# ONLY=perf: the benchmarks alone.
if [ "${ONLY:-}" = perf ]; then
  bench_shmem
  cat "$out/summary.txt" "$(shmem_comparison)" 2>/dev/null
  grep -A12 "FIFO round trip" "$out/fifo_bench.log" 2>/dev/null
  exit $rc
fi

# ONLY=shmem: the SHMEM mpirun suite (gtest filter SHMEM_MPI_FILTER) and the put example with 2 PEs under
# each transport of SHMEM_TRANSPORTS (default: p2p rdma).
if [ "${ONLY:-}" = shmem ]; then
  for tr in ${SHMEM_TRANSPORTS:-p2p rdma}; do
    run mpi_shmem_$tr "${mpirun_[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=$tr -x MORI_SHMEM_HEAP_SIZE=64m \
      -x MORI_TIMEOUT_S=60 ./tests/mori_shmem_mpi_tests ${SHMEM_MPI_FILTER:-}
    run ex_shmem_put_$tr "${mpirun_[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=$tr -x MORI_TIMEOUT_S=60 \
      ./examples/shmem/shmem_put
  done
  cat "$out/summary.txt"
  report_failures
  exit $rc
fi
# ONLY=ep: the MoE dispatch/combine suite with 2 PEs under each transport of SHMEM_TRANSPORTS (default: p2p rdma
# proxy), gtest filter EP_FILTER; EP_BENCH=1 adds ep_bench.
if [ "${ONLY:-}" = ep ]; then
  for tr in ${SHMEM_TRANSPORTS:-p2p rdma proxy}; do
    run mpi_ep_$tr "${mpirun_[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=$tr -x MORI_SHMEM_HEAP_SIZE=256m \
      -x MORI_TIMEOUT_S=60 ./tests/mori_ep_mpi_tests ${EP_FILTER:-}
  done
  [ -n "${EP_BENCH:-}" ] && bench_ep
  cat "$out/summary.txt"
  report_failures
  exit $rc
fi
# ONLY=channels: the channel layer and the SHMEM Proxy transport alone (suites, examples, benchmarks).
if [ "${ONLY:-}" = channels ]; then
  # Through ctest: one process per test, so forked children never inherit a CUDA context.
  run channels_unit ctest --output-on-failure --timeout 120 -R '^(FifoTest|Packets|PortChannelOrderTest|ProducerTrapTest|ProxyServiceTest|ProxyTest|ProxyTriggerTest|RegisteredMemoryWire|TcpListener|TcpOptions|TcpReceiver|TcpRegistry|TcpWire|Transport|TransportFlags)\.'
  run channels_mp ctest --output-on-failure --timeout 120 -R '^(CommunicatorMp|MemoryChannelMp|TcpLinkMp|TcpLoopbackMp|TcpTwoHosts|Transports/ConnectEachTransport|Transports/PortChannelMp|Transports/RdmaConnectionMp)\.'
  run shmem_single_proxy ctest --output-on-failure --timeout 200 -R 'ShmemSingleTest.Proxy|ShmemPairTest.*proxy_'
  for conn in tcp rdma; do
    run mpi_shmem_proxy_$conn "${mpirun_[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=proxy \
      -x MORI_SHMEM_PROXY_CONN=$conn -x MORI_SHMEM_HEAP_SIZE=64m -x MORI_TIMEOUT_S=60 ./tests/mori_shmem_mpi_tests ${SHMEM_MPI_FILTER:-}
    for ex in shmem_put shmem_put_signal_pingpong shmem_atomic_counter shmem_ring_allgather shmem_all_to_all; do
      run ex_${ex}_proxy_$conn "${mpirun_[@]}" -np 2 -x MORI_SHMEM_TRANSPORT=proxy \
        -x MORI_SHMEM_PROXY_CONN=$conn -x MORI_SHMEM_HEAP_SIZE=256m -x MORI_TIMEOUT_S=60 ./examples/shmem/$ex
    done
  done
  run fifo_bench ./bench/fifo_bench
  for tr in CudaIpc Emulated Tcp; do run bidir_port_channel_$tr ./examples/channels/bidir_port_channel --transport $tr ${BIDIR_ARGS:-}; done
  run perf_memory_channel ./examples/channels/perf_memory_channel
  run multi_channel_tcp ./examples/channels/multi_channel_tcp --bench
  run multi_pe_suite_np2 env OUT="$out/multi_pe_np2" "$repo/scripts/multi_pe_suite.sh" 2 .
  cat "$out/summary.txt"
  report_failures
  exit $rc
fi
# BENCH=1: the benchmarks first, on a quiet GPU (EP_BENCH=1 adds ep_bench, as in ONLY=ep).
if [ -n "${BENCH:-}" ]; then
  nvshmem_build_start
  run rdma_post_rate ./bench/rdma_post_rate ${RDMA_BENCH_ARGS:-}
  bench_shmem
  [ -n "${EP_BENCH:-}" ] && bench_ep
fi
# Tests that end a GPU context or a process on purpose: a kernel that traps (bad input, a bounded wait that
# runs out) or a peer that gets killed.
isolated='Trap|Dies|Died|Killed|RunsOut|TimeOutNaming|TimesOutNaming|InvalidConfiguration|OutOfRangeFailTheProxy'
ctest_summary() { grep -E '^[0-9]+% tests passed|^no test matches' "$1" || echo "no summary (cut off?)"; }
# CTEST_FILTER=<regex>: every ctest phase runs only those of its tests whose names match it too. ctest takes one
# -R, so the phase's selection (the array `sel`) and the filter are intersected here by name and `sel` becomes
# an -R of the names left; with none left the phase's log (argument) says so and it returns 1. CTEST_ARGS is for
# other ctest options (a -R there would replace a phase's own, sending a filtered trap test under MPS).
filter_sel() {
  [ -n "${CTEST_FILTER:-}" ] || return 0
  local names
  names=$(ctest -N "${sel[@]}" | sed -n 's/^ *Test *#[0-9]*: //p' | grep -E -- "$CTEST_FILTER" |
    sed 's/[][\.*^$+?(){}|]/\\&/g' | paste -sd'|')
  if [ -z "$names" ]; then
    echo "no test matches CTEST_FILTER=$CTEST_FILTER here" > "$1"
    return 1
  fi
  sel=(-R "^($names)\$")
}
# The Python package with the device machine's torch (PYTHON=0 skips): the carried build is for the build
# machine's Python, so the module is built here for this interpreter (libraries and module only), and then the
# test extension of test_extension.py (nvcc, about a minute), both in the background while ctest runs (niced,
# 4 compile jobs: the tests' proxy threads spin on the CPU); the Python phase below waits for them.
py=${MORI_PYTHON:-/opt/torch/.venv/bin/python}
torchrun=$(dirname "$py")/torchrun
have_pytest=0
[ -x "$py" ] && "$py" -c "import pytest" 2>/dev/null && have_pytest=1
pyb=/tmp/mori-python-build
python_step() { [[ "$1" =~ ${STEPS:-.} ]]; }
python_wanted() {
  [ "${PYTHON:-1}" != 0 ] && [ -x "$py" ] &&
    { python_step python_tests || python_step python_allgather_torchrun ||
      { [ -n "${EP_BENCH:-}" ] && python_step python_ep_bench; }; }
}
python_env=(PYTHONPATH="$pyb/python" PYTHONDONTWRITEBYTECODE=1 MORITEST_MPIRUN="$(command -v mpirun)"
            MORITEST_INCLUDE_DIRS="$repo/include:$pyb/include" MORITEST_SHMEM_LIB_DIR="$pyb/src/shmem"
            MORITEST_EXT_BUILD_DIR="$pyb/ext")
python_prebuild() {
  local start=$SECONDS r
  {
    bounded nice -n 10 cmake -S "$repo" -B "$pyb" -DMORI_GPU_BACKEND=CUDA -DPython3_EXECUTABLE="$py" \
      -DMORI_BUILD_PYTHON=ON -DMORI_BUILD_TESTS=OFF -DMORI_BUILD_EXAMPLES=OFF -DMORI_BUILD_BENCH=OFF \
      -DMORI_BUILD_TOOLS=OFF && bounded nice -n 10 cmake --build "$pyb" --target mori_python -j 4
  } > "$out/python_build.log" 2>&1
  r=$?
  echo "python module build: exit $r, $((SECONDS - start)) s" >> "$out/python_build.log"
  if [ $r -eq 0 ] && [ $have_pytest = 1 ]; then
    start=$SECONDS
    mkdir -p "$pyb/ext"
    # A failure here only costs the time: the test builds the extension again and reports what went wrong.
    bounded env "${python_env[@]}" MAX_JOBS=4 nice -n 10 "$py" -c "import sys; sys.path.insert(0, '$repo/python/tests')
import test_extension; test_extension.load('$pyb/ext')" > "$out/python_ext_build.log" 2>&1
    echo "test extension build: exit $?, $((SECONDS - start)) s" >> "$out/python_ext_build.log"
  fi
  echo "$r" > "$out/python_build.rc"
  return $r
}
python_prebuild_pid=
rm -f "$out/python_build.rc"  # a folder reused from an earlier run must not say the build is done
if python_wanted; then
  python_prebuild &
  python_prebuild_pid=$!
fi
# The Python phase (a function: under MPS it runs in the background beside the 2-PE mpirun group, see below).
# It waits for the module built in the background (its status in python_build.rc: the builder is no child of a
# background phase, so `wait` cannot take it; a builder that ended without writing it counts as failed) and
# returns 1 when a step failed.
python_phase() {
  local rc=0 start=$SECONDS pyrc
  while [ ! -f "$out/python_build.rc" ] && kill -0 "$python_prebuild_pid" 2>/dev/null; do sleep 1; done
  pyrc=$(cat "$out/python_build.rc" 2>/dev/null || echo 1)
  echo "python module build: exit $pyrc, waited $((SECONDS - start)) s for it ($(tail -n 1 "$out/python_build.log" |
    sed -n 's/.*exit [0-9]*, //p') in the background; $(tail -n 1 "$out/python_ext_build.log" 2>/dev/null))" |
    tee -a "$out/summary.txt"
  if [ $pyrc -eq 0 ]; then
    export "${python_env[@]}"
    if [ -n "${EP_BENCH:-}" ] && [ -x "$torchrun" ]; then
      impl=mori,nccl
      [ ${#mps_env[@]} -gt 0 ] && impl=mori
      for shape in "intra 4096" "ll 128" "intra 128"; do
        read -r kernel tokens <<< "$shape"
        run "python_ep_bench_${kernel}_$tokens" env MORI_TIMEOUT_S=60 MORI_SHMEM_HEAP_SIZE=2g "$torchrun" --standalone \
          --nproc_per_node=2 "$repo/bench/ep_bench.py" --impl $impl --kernel "$kernel" --tokens "$tokens" ${EP_BENCH_PY_ARGS:-}
      done
    fi
    if [ $have_pytest = 1 ]; then
      # Two pytest processes at once (most tests start two to four Python processes that import torch, 4-7 s
      # each; under MPS their kernels run side by side): the multi-PE launch tests, and the rest.
      pytest_=("$py" -m pytest -q --durations=10 -p no:cacheprovider)
      run python_tests_multi_pe env MORI_TIMEOUT_S=60 MORI_SHMEM_HEAP_SIZE=256m "${pytest_[@]}" \
        --basetemp=/tmp/mori-pytest-multi-pe "$repo/python/tests/test_multi_pe.py" &
      multi_pe_pid=$!
      run python_tests env MORI_TIMEOUT_S=60 MORI_SHMEM_HEAP_SIZE=256m "${pytest_[@]}" \
        --basetemp=/tmp/mori-pytest-rest "$repo/python/tests/test_single_pe.py" \
        "$repo/python/tests/test_extension.py" "$repo/python/tests/test_ep.py"
      wait "$multi_pe_pid"
      if python_step python_tests_multi_pe && ! grep -q '^python_tests_multi_pe: exit 0,' "$out/summary.txt"; then rc=1; fi
      # The all-gather example as a PyTorch user starts it: torchrun, two processes on this GPU.
      [ -x "$torchrun" ] && run python_allgather_torchrun env MORI_TIMEOUT_S=60 MORI_SHMEM_HEAP_SIZE=256m \
        "$torchrun" --standalone --nproc_per_node=2 "$repo/python/examples/allgather.py" 1048576 3
    else
      for tr in p2p rdma proxy; do
        run "python_worker_$tr" env PYTHONPATH="$repo/python/tests:$PYTHONPATH" MORI_TIMEOUT_S=60 \
          MORI_SHMEM_HEAP_SIZE=256m "${mpirun_[@]}" -np 2 -x PYTHONPATH -x MORI_TIMEOUT_S -x MORI_SHMEM_HEAP_SIZE \
          -x MORI_SHMEM_TRANSPORT="$tr" "$py" "$repo/python/tests/shmem_worker.py" env
      done
    fi
  else
    rc=1
  fi
  return $rc
}
# Under MPS: whether a new client can start (a test that allocates and copies), noted in the summary when it cannot.
# After a fault in any client the server refuses new ones until every client of that moment has gone: in one whole
# run (2026-11-29, afternoon) a stale test module faulted in the 2-PE group and every later test failed with "MPS
# client failed to connect ..." or "MPS server is not ready to accept new MPS client requests"; this says when.
mps_probe() {
  [ ${#mps_env[@]} -gt 0 ] || return 0
  timeout 30 ./tests/mori_unit_tests --gtest_filter=GpuBufferTest.DeviceAndHostPinnedMemoryHoldData \
    > "$out/mps_probe.txt" 2>&1 && return 0
  echo "MPS: a new client could not start before $1 ($(grep -m1 -i 'mps\|error' "$out/mps_probe.txt"))" |
    tee -a "$out/summary.txt"
  cp -r "$CUDA_MPS_LOG_DIRECTORY" "$out/mps-log-at-probe" 2>/dev/null
}
python_pid= python_started=0
python_start() {  # starts the Python phase in the background (once, when the module is being built)
  [ -n "$python_prebuild_pid" ] && [ $python_started = 0 ] || return 0
  python_started=1
  python_phase &
  python_pid=$!
}
python_finish() {  # waits for the Python phase, starting it first when it has not started yet
  python_start
  [ -n "$python_pid" ] || return 0
  wait "$python_pid" || rc=1
  python_pid=
}
start=$SECONDS
if [ "${CTEST:-1}" = 0 ]; then
  echo "ctest skipped (CTEST=0)" | tee -a "$out/summary.txt"
elif [ ${#mps_env[@]} -gt 0 ]; then
  # Under MPS a fault in one client (the trap tests trap on purpose) ends every client of the server. Those
  # tests run first, beside each other, with contexts of their own (time slices, no MPS); everything else, the
  # mpirun suites and examples included, runs under MPS, several tests at once: their kernels run side by side
  # instead of waiting for time slices (a kernel spinning on a flag in a time-sliced context waits
  # milliseconds for its turn, and a test that makes 100000 round trips through the emulated NIC then takes
  # minutes).
  sel=(-R "$isolated")
  if filter_sel "$out/ctest_isolated.log"; then
    bounded env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE \
      ctest --output-on-failure --timeout 300 "${sel[@]}" -j "${CTEST_JOBS:-6}" ${CTEST_ARGS:-} \
      > "$out/ctest_isolated.log" 2>&1 || rc=1
  fi
  echo "ctest, trap and kill tests without MPS: $(ctest_summary "$out/ctest_isolated.log"), $((SECONDS - start)) s" |
    tee -a "$out/summary.txt"
  start=$SECONDS
  sel=(-E "$isolated" -LE 'mpi|example')
  if filter_sel "$out/ctest.log"; then
    bounded ctest --output-on-failure --timeout 300 "${sel[@]}" -j "${CTEST_JOBS:-6}" ${CTEST_ARGS:-} \
      > "$out/ctest.log" 2>&1 || rc=1
  fi
  echo "ctest, single processes and forked pairs under MPS: $(ctest_summary "$out/ctest.log"), $((SECONDS - start)) s" |
    tee -a "$out/summary.txt"
  # The mpirun suites and examples, every one with its proxy and emulated-NIC threads spinning on the CPU and
  # kernels spinning on the GPU; fewer at once. Grouped by PEs per job, each group with its MPS share of the
  # SMs (100 / PEs per GPU): a job of 8 PEs with the 2-PE share (50% each, 4 GPUs' worth) starves its own
  # clients of SMs and stalls (EP over proxy, docs/PERF.md); with 12% each it passes.
  # The EP suite over the proxy with 4 PEs runs alone: beside another 4-PE job its proxies' copies stalled behind
  # spinning kernels until the 60-s bounds (docs/PERF.md, 2026-11-25 and 2026-11-27), alone it passes.
  # The Python phase runs beside the 2-PE group (about 150 s of its 180: two pytest processes of 2-PE jobs and
  # single processes; the job did not fit a 600-s device command with the two one after the other) and is waited
  # for before the 4-PE group, whose jobs take a smaller share of the SMs each.
  for group in 2 4 ep4 8; do
    mps_probe "the mpirun group of $group"
    [ "$group" = 2 ] && python_start
    [ "$group" = 4 ] && python_finish
    start=$SECONDS
    what="mpirun suites and examples of $group PEs or fewer"
    case $group in
      2) np=2 sel=(-E "$isolated|_np4\$|_np8\$" -L 'mpi|example') jobs=${CTEST_MPI_JOBS:-3} ;;
      4) np=4 sel=(-E "$isolated|^mpi_ep_proxy_np4\$" -R "_np4\$" -L 'mpi|example') jobs=2 ;;
      ep4) np=4 sel=(-R "^mpi_ep_proxy_np4\$") jobs=1 what="the EP suite over the proxy with 4 PEs, alone" ;;
      8) np=8 sel=(-E "$isolated" -R "_np8\$" -L 'mpi|example') jobs=1 ;;
    esac
    share=$((100 / ((np + ${gpus:-1} - 1) / ${gpus:-1})))
    if filter_sel "$out/ctest_mpi_$group.log"; then
      bounded env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$share ctest --output-on-failure --timeout 300 "${sel[@]}" \
        -j "$jobs" ${CTEST_ARGS:-} > "$out/ctest_mpi_$group.log" 2>&1 || rc=1
    fi
    echo "ctest, $what under MPS ($share% of the SMs each): $(ctest_summary "$out/ctest_mpi_$group.log"), \
$((SECONDS - start)) s" | tee -a "$out/summary.txt"
  done
else
  sel=()
  if filter_sel "$out/ctest.log"; then
    bounded ctest --output-on-failure --timeout 300 "${sel[@]}" -j "${CTEST_JOBS:-4}" ${CTEST_ARGS:-} > "$out/ctest.log" 2>&1 ||
      rc=1
  fi
  echo "ctest: $(ctest_summary "$out/ctest.log"), $((SECONDS - start)) s" | tee -a "$out/summary.txt"
fi
# ctest runs every example at its test size; these add large messages.
start=$SECONDS
if [ "${CTEST:-1}" != 0 ]; then
  {
    bounded "${mpirun_[@]}" -np 2 ./examples/core/ring_exchange 256m || rc=1
    for op in write read atomic; do bounded "${mpirun_[@]}" -np 2 ./examples/dist_rdma_ops/dist_rdma_ops $op 16777216 || rc=1; done
  } > "$out/examples.log" 2>&1
  echo "large-message examples: $((SECONDS - start)) s" | tee -a "$out/summary.txt"
fi
[ "${CTEST:-1}" != 0 ] && killed_jobs
# The CUDA build's Debian package, when one was built on the development machine and carried
# (cmake --build build-cuda --target package; cp build-cuda/mori_*.deb .carry/): extracted into a scratch
# root, mori-info and a two-PE SHMEM example run from it with a clean environment.
for deb in "$repo"/.carry/mori_*.deb; do
  [ -f "$deb" ] || continue
  version=$(dpkg-deb -f "$deb" Version)
  run package_deb env MORI_PACKAGE_DEB="$deb" "$repo/tests/package/run_package_test.sh" . /tmp/mori-package-test \
    "$version" "$(command -v mpirun)"
done
# The Python suites, on the module built in the background above: pytest when the interpreter has it, else the
# multi-PE worker under mpirun.
# EP_BENCH=1 adds bench/ep_bench.py (step python_ep_bench*): mori.ep from PyTorch beside the same dispatch and
# combine written with torch.distributed.all_to_all_single over NCCL, at 4096 tokens (IntraNode) and 128
# (LowLatency and IntraNode); NCCL refuses two ranks on one GPU, so with PEs sharing a GPU mori runs alone.
# EP_BENCH_PY_ARGS: more arguments for each of those runs (e.g. --host-split 20).
python_finish
grep -hE "\*\*\*|tests passed|Total Test time" "$out"/ctest*.log | tail -n 40
cat "$out/summary.txt" "$(shmem_comparison)" 2>/dev/null | tail -n 80
exit $rc
