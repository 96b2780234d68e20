#!/usr/bin/env python3
"""Register spills of the SHMEM benchmark's hot kernels, against a budget (CUDA builds).

Compiles bench/shmem_bench.cpp once more with the build's own nvcc command and -Xptxas=-v, reads ptxas's spill
stores and loads for every kernel, and fails when one of the kernels below spills more than its budget. A put
loop is fast only while ptxas keeps it out of local memory: on 2026-11-29 a change to the RDMA posting code,
which the put kernels call out of line and never reach over P2P, moved 4 bytes more of spills into the block
put loop and cost 14-24% of its bandwidth on an H200 (PERF.md, "2026-11-29, night"). Nothing else would have
noticed before a GPU run.

A budget is the kernel's spill bytes when it was last measured fast; exceeding it is a question for an A/B on a
GPU (bench/shmem_bench before and after), not proof of a slowdown. Another nvcc can spill differently: then
measure, and set the budget to what it gives for a build that is as fast.

  scripts/check_spills.py BUILD_DIR     (a configured CUDA build; needs ninja)
"""
import re
import shlex
import subprocess
import sys
import tempfile

# Kernel (unmangled name, as in bench/shmem_bench.cpp) -> most bytes of spill stores and of spill loads.
# nvcc 13.0, sm_90: PutBwKernel 4/4, PutBwWarpKernel 8/8, PingPongKernel 0/0 (8a872af); SignalPingPongKernel
# 64/100 since quiet is called directly again (56/92 before; its latency the same on an H200, PERF.md 2026-11-30).
BUDGET = {
    "PutBwKernel": (4, 4),
    "PutBwWarpKernel": (8, 8),
    "PingPongKernel": (0, 0),
    "SignalPingPongKernel": (64, 100),
}

SOURCE = "shmem_bench.cpp.o"


def compile_command(build_dir):
    out = subprocess.run(["ninja", "-C", build_dir, "-t", "commands", "bench/shmem_bench"], check=True,
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        if SOURCE in line and "nvcc" in line and " -c " in line:
            return shlex.split(line)
    sys.exit(f"check_spills: no nvcc command for {SOURCE} in {build_dir} (a CUDA build with the benchmarks?)")


def with_ptxas_info(args, obj):
    """The command without its dependency file and with its object under obj, ptxas reporting."""
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("-MD",):
            continue
        if a in ("-MT", "-MF", "-o"):
            skip = 1
            continue
        out.append(a)
    return out + ["-o", obj, "-Xptxas=-v"]


def spills(ptxas_output):
    """{mangled function: (stack frame, spill stores, spill loads)} from ptxas -v."""
    found, name = {}, None
    for line in ptxas_output.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            found[name] = tuple(int(x) for x in m.groups())
            name = None
    return found


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build_dir = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = with_ptxas_info(compile_command(build_dir), f"{tmp}/shmem_bench.o")
        run = subprocess.run(cmd, cwd=build_dir, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout + run.stderr)
        sys.exit("check_spills: the compile failed")
    found = spills(run.stdout + run.stderr)
    names = demangle(list(found))
    failed = []
    for kernel, (max_st, max_ld) in BUDGET.items():
        hits = [(m, v) for m, v in found.items() if re.search(rf"::{kernel}\(", names[m])]
        if len(hits) != 1:
            failed.append(f"{kernel}: {len(hits)} kernels of that name in ptxas's output, 1 expected")
            continue
        _, (frame, st, ld) = hits[0]
        verdict = "ok" if st <= max_st and ld <= max_ld else "OVER BUDGET"
        print(f"  {kernel:22} stack {frame:4} B  spill stores {st:4} B (budget {max_st:3})  "
              f"loads {ld:4} B (budget {max_ld:3})  {verdict}")
        if verdict != "ok":
            failed.append(f"{kernel} spills {st}/{ld} bytes (stores/loads), budget {max_st}/{max_ld}")
    if failed:
        print("check_spills: " + "; ".join(failed))
        print("A spill that moves into a put loop cost 14-24% of put bandwidth once (scripts/check_spills.py); "
              "A/B shmem_bench on a GPU before raising a budget.")
        return 1
    print("check_spills: every hot kernel within its spill budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
