#!/usr/bin/env bash
# The test job (what .ci/run calls): installs what is needed, then
#   1. builds the HOST backend with warnings as errors and runs every test (unit, multi-process,
#      network namespaces, mpirun, GPU suites on host threads, install, the Python package under pytest);
#   2. builds the CUDA backend (compile and link; its tests also run when a GPU is present; without one, a
#      compile check: the tests, examples and benchmarks with nvcc's host compilation at -O0, MORI_UNOPTIMIZED_CHECKS),
#      and holds the hot benchmark kernels' register spills to their budget (scripts/check_spills.py);
#   3. compile-checks the HIP backend, everything at -O0 (at -O2 the tests took 750 s of hipcc for two
#      architectures, and then two library files 165 and 138 s, a third of what was left; -O0 runs the same front
#      end and each architecture's code generation); the tests for the first architecture only, the rest for
#      every one: each architecture is a whole device compile, and the architecture-specific code is in the
#      library headers, which the libraries, examples and benchmarks build for every architecture);
#   4. builds the HOST backend with ASan+UBSan (at -O1) and runs the tests again (the EP suite at 8 PEs under p2p
#      only);
#   5. builds it with TSan (at -O1) and runs the tests again (except the 100k-WQE queue-depth tests, too slow there,
#      the mpirun-launched ones: Open MPI itself is not TSan-clean, and the chaos jobs, whose 200 killed PEs
#      per build take TSan's 1 s sleep at every exit: they run in the HOST and ASan builds);
#   6. builds the libFuzzer targets with clang and runs each for 30 s on its seed corpus (scripts/fuzz.sh).
# Steps can be chosen: test.sh host cuda hip asan tsan fuzz (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(host cuda hip asan tsan fuzz)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
hip_flag=""
want hip && hip_flag=--hip
if command -v apt-get >/dev/null; then ./scripts/install_deps.sh $hip_flag || exit 1; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
jobs=$(nproc)
failed=()
summary=()

run_ctest() {  # name, build dir, extra ctest arguments
  local log="$2/ctest.log" start=$SECONDS
  (cd "$2" && ctest --output-on-failure -j "$jobs" --timeout 600 "${@:3}") > "$log" 2>&1
  local rc=$?
  summary+=("$1: $(grep -E '^[0-9]+% tests passed' "$log" || echo 'ctest did not finish') ($((SECONDS - start)) s)")
  echo "   tests ran for $((SECONDS - start)) s"
  grep -E '^[0-9]+% tests passed|tests? (FAILED|did not run)|^\s+[0-9]+ - ' "$log"
  if [ $rc -ne 0 ]; then
    failed+=("$1 tests")
    # Each failed test's own output (ctest prints it after the test's result line), then the log's end.
    awk '/\*\*\*(Failed|Timeout|Exception)/ {n = 120} n > 0 {print; n--}' "$log" | head -n 400
    tail -n 40 "$log"
  fi
}

build() {  # name, dir, cmake args...
  local name=$1 dir=$2
  shift 2
  echo "== build $name"
  local start=$SECONDS
  # Line tables only (-g1): failures keep file:line in backtraces and sanitizer reports, for a quarter less gcc
  # time than full debug information (cmake/MoriCompileOptions.cmake); the compile checks, which run nothing,
  # pass MORI_DEBUG_INFO=none after it.
  if cmake -S . -B "$dir" -G Ninja -DMORI_WERROR=ON -DMORI_DEBUG_INFO=lines "$@" > "$dir.configure.log" 2>&1 &&
     cmake --build "$dir" --parallel "$jobs" > "$dir.build.log" 2>&1; then
    echo "   built in $((SECONDS - start)) s"
    return 0
  fi
  failed+=("$name build")
  tail -n 60 "$dir.configure.log" "$dir.build.log" 2>/dev/null
  return 1
}

# The Python package is built for, and its tests run with, the interpreter install_deps.sh provisions (Debian's
# python3-torch and python3-pytest), whichever python3 comes first in PATH.
python_args=()
[ -x /usr/bin/python3 ] && python_args=(-DPython3_EXECUTABLE=/usr/bin/python3)
if want host; then
  build host build-ci-host -DMORI_GPU_BACKEND=HOST "${python_args[@]}" && run_ctest host build-ci-host
fi
if want cuda; then
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
  if [ -z "$nvcc" ]; then
    echo "== cuda: no nvcc on this machine, CUDA backend NOT checked"
    summary+=("cuda: not checked (no nvcc)")
  else
    gpu=0
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && gpu=1
    check_args=()
    # Without a GPU nothing of this build runs: no debug information either.
    [ $gpu = 1 ] || check_args=(-DMORI_UNOPTIMIZED_CHECKS=ON -DMORI_DEBUG_INFO=none)
    if build cuda build-ci-cuda -DMORI_GPU_BACKEND=CUDA -DCMAKE_CUDA_COMPILER="$nvcc" "${check_args[@]}" \
         "${python_args[@]}"; then
      # The hot put kernels' register spills against their budget (a spill moved into the put loop once cost
      # 14-24% of put bandwidth, and only a GPU run would have shown it).
      if python3 scripts/check_spills.py build-ci-cuda > build-ci-cuda.spills.log 2>&1; then
        summary+=("cuda spills: $(tail -n 1 build-ci-cuda.spills.log)")
      else
        cat build-ci-cuda.spills.log
        failed+=("cuda spill budget")
      fi
      if [ $gpu = 1 ]; then
        run_ctest cuda build-ci-cuda
      else
        summary+=("cuda: compiled and linked (no GPU here to run on; tests, examples and benchmarks host code at -O0)")
      fi
    fi
  fi
fi
if want hip; then
  if command -v hipcc >/dev/null; then
    build hip build-ci-hip -DMORI_GPU_BACKEND=HIP -DMORI_UNOPTIMIZED_CHECKS=ON -DMORI_UNOPTIMIZED_LIBRARIES=ON \
      -DMORI_DEBUG_INFO=none \
      -DMORI_HIP_TEST_ARCHS=gfx90a \
      "${python_args[@]}" && summary+=("hip: compiled and linked ($(sed -n 's/.*architectures //p' build-ci-hip.configure.log | head -1); tests $(sed -n 's/.*HIP tests compile for //p' build-ci-hip.configure.log | head -1))")
  else
    echo "== hip: no hipcc, HIP backend NOT checked"
    summary+=("hip: not checked (no hipcc)")
  fi
fi
if want asan; then
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  # The EP suite at 8 PEs runs under p2p only here (the rdma and proxy runs took 159 and 187 s of 1168; the
  # plain HOST build runs all three, and ASan runs the three transports at 2 and 4 PEs). The multi-PE job (at 8
  # PEs: 314 s run alone, a quarter of the ASan ctest of 7b505db; at 4 PEs 120 s) repeats what mpi_shmem_*_np2/4
  # (every transport), the channel suites, the examples and the EP suite at 8 PEs run here already; the job
  # itself runs at 4 and 8 PEs in the HOST build.
  # At -O1, as the sanitizers' documentation advises and fuzz.sh builds (a Debug build otherwise: -O0): at -O0 the
  # emulated NIC's polling loop, its std::unique_ptr accessors not inlined, took most of the CPU, and
  # mpi_shmem_proxy_rdma_np4 ran 109 s against 8.6 s in the plain build; at -O1 18.7 s, the whole ASan ctest 330 s
  # instead of 602 (2 cores, 2026-12-02), the build 236 s instead of 181.
  build asan build-ci-asan -DMORI_GPU_BACKEND=HOST -DMORI_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug \
    "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" &&
    run_ctest asan+ubsan build-ci-asan -E "^(mpi_ep_(rdma|proxy)_np8|multi_pe_suite_np[48])$"
fi
if want tsan; then
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  # At -O1 too (ThreadSanitizer's documentation advises -O1 or -O2): the TSan ctest 217 s instead of 256.
  build tsan build-ci-tsan -DMORI_GPU_BACKEND=HOST -DMORI_SANITIZE=thread -DCMAKE_BUILD_TYPE=Debug \
    "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g" -DMORI_BUILD_EXAMPLES=OFF -DMORI_BUILD_BENCH=OFF &&
    run_ctest tsan build-ci-tsan -E "Depths/|mpi_|chaos_"
fi
if want fuzz; then
  echo "== fuzz"
  fuzz_start=$SECONDS
  ./scripts/fuzz.sh 30 build-ci-fuzz > build-ci-fuzz.log 2>&1
  rc=$?
  grep -E '^fuzz_|^fuzz: ' build-ci-fuzz.log
  crashes=$(grep -c 'CRASHED' build-ci-fuzz.log)
  if [ $rc -eq 0 ]; then
    summary+=("fuzz: no crash, 30 s per target ($((SECONDS - fuzz_start)) s with the build)")
  else
    summary+=("fuzz: $crashes target(s) crashed, or the build failed (build-ci-fuzz.log)")
    failed+=("fuzz")
    tail -n 80 build-ci-fuzz.log
  fi
fi

echo
echo "== summary"
printf '   %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
