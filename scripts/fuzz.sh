#!/usr/bin/env bash
# Builds mori's libFuzzer targets (fuzz/, docs/FUZZ.md) with clang, ASan and UBSan, and runs each for a bounded
# time on a copy of its seed corpus (fuzz/corpus/<target>; what a run adds stays in the copy).
#   fuzz.sh [SECONDS_PER_TARGET] [BUILD_DIR]     defaults: 60, build-fuzz
# FUZZ_SEED: libFuzzer's random seed (default 1, so that a run repeats the mutations of the last one on the same
# corpus and a CI result does not depend on luck; FUZZ_SEED=0 lets libFuzzer pick one, for longer searches).
# Prints executions, executions per second and the outcome per target; a crash keeps its input (the path is
# printed) and makes the script exit 1.
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
dir=${2:-build-fuzz}
targets=(fuzz_bootstrap_id fuzz_bootstrap_stream fuzz_registered_memory fuzz_tcp_wire fuzz_tcp_stream
         fuzz_emulated_wire fuzz_emulated_nic fuzz_fd_channel fuzz_shmem_proxy fuzz_port_channel)

cxx=$(command -v clang++-14 || command -v clang++ || true)
cc=$(command -v clang-14 || command -v clang || true)
if [ -z "$cxx" ] || [ -z "$cc" ]; then
  echo "fuzz: clang not found (install_deps.sh installs clang-14 and libclang-rt-14-dev)"
  exit 1
fi
generator=()
command -v ninja >/dev/null && [ ! -f "$dir/CMakeCache.txt" ] && generator=(-G Ninja)
start=$SECONDS
# The seed writer is built too (not run), so that a change that breaks it fails here.
# -O1 with line tables: quick to build on a small machine, fast enough to fuzz, sanitizer reports name lines.
if ! CC=$cc CXX=$cxx cmake -S . -B "$dir" "${generator[@]}" -DMORI_GPU_BACKEND=HOST -DMORI_BUILD_FUZZ=ON \
       -DMORI_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" \
       -DMORI_BUILD_TESTS=OFF -DMORI_BUILD_EXAMPLES=OFF -DMORI_BUILD_BENCH=OFF -DMORI_BUILD_TOOLS=OFF \
       -DMORI_BUILD_PYTHON=OFF -DMORI_ENABLE_MPI=OFF > "$dir.configure.log" 2>&1 ||
   ! cmake --build "$dir" --parallel "$(nproc)" --target "${targets[@]}" fuzz_seed_corpus > "$dir.build.log" 2>&1; then
  tail -n 60 "$dir.configure.log" "$dir.build.log" 2>/dev/null
  echo "fuzz: build failed"
  exit 1
fi
echo "fuzz: built in $((SECONDS - start)) s ($dir)"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# The targets run FUZZ_JOBS at a time (default: one per core; each is one single-threaded process, so every
# target gets its whole time on a core of its own either way).
jobs=${FUZZ_JOBS:-$(nproc)}
fuzz_one() {  # target: runs it, leaves its exit status in fuzz-run/<target>/rc
  local t=$1 run="$dir/fuzz-run/$1"
  "$dir/fuzz/$t" -max_total_time="$seconds" -timeout=10 -seed="${FUZZ_SEED:-1}" -print_final_stats=1 \
    -artifact_prefix="$run/artifacts/" "$run/corpus" > "$run/log" 2>&1
  echo $? > "$run/rc"
}
for t in "${targets[@]}"; do
  run="$dir/fuzz-run/$t"
  rm -rf "$run"
  mkdir -p "$run/corpus" "$run/artifacts"
  cp fuzz/corpus/"$t"/* "$run/corpus/" 2>/dev/null
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  fuzz_one "$t" &
done
wait
crashed=()
printf '%-24s %12s %10s  %s\n' target executions exec/s result
for t in "${targets[@]}"; do
  run="$dir/fuzz-run/$t"
  rc=$(cat "$run/rc" 2>/dev/null || echo "none")
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$run/log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$run/log" | tail -1)
  if [ "$rc" = 0 ]; then
    result="no crash"
  else
    artifact=$(sed -n 's/.*Test unit written to //p' "$run/log" | tail -1)
    result="CRASHED (exit $rc) input ${artifact:-none written}, log $run/log"
    crashed+=("$t")
  fi
  printf '%-24s %12s %10s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "$result"
done
if [ ${#crashed[@]} -gt 0 ]; then
  for t in "${crashed[@]}"; do
    echo "== $t"
    grep -m1 -B2 -A30 -E "ERROR: |runtime error|fuzz property failed|deadly signal" "$dir/fuzz-run/$t/log"
  done
  echo "fuzz: crashed: ${crashed[*]}"
  exit 1
fi
echo "fuzz: no target crashed (${seconds} s each, $jobs at a time, $((SECONDS - start)) s in all)"
