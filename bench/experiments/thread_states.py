#!/usr/bin/env python3
# What every thread of some processes is doing, by name: samples /proc/<pid>/task/<tid>/{comm,stat,wchan,syscall}
# at a fixed rate for a while and prints, per thread, the CPU time it got and its most frequent states. A thread
# runnable (R) in every sample that gets no CPU time is waiting for a CPU (a binding too narrow, docs/PERF.md
# 2026-12-02 second session); one asleep in poll or a futex is waiting for something else. mori names its own
# threads (mori-proxy:<gpu>, mori-nic:<n>, mori-tcp-tx, ...). No tools beyond Python 3 and /proc.
#
#   thread_states.py SECONDS INTERVAL PID [PID ...]
#   thread_states.py 8 0.01 $(pgrep -x shmem_atomic_co)
import collections
import os
import sys
import time


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def syscall_text(text):
    # "nr arg1 arg2 ... sp pc", or "running", or "-1 sp pc" (in the kernel, not in a system call)
    if not text:
        return "-"
    parts = text.split()
    if parts[0] in ("running", "-1") or len(parts) < 4:
        return parts[0]
    return f"sys{parts[0]}({int(parts[1], 16)},{parts[2]},{int(parts[3], 16)})"


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__ or "usage: thread_states.py SECONDS INTERVAL PID [PID ...]")
    duration, interval = float(sys.argv[1]), float(sys.argv[2])
    pids = [int(p) for p in sys.argv[3:]]
    states = collections.defaultdict(collections.Counter)
    first_ticks, last_ticks, names = {}, {}, {}
    end = time.time() + duration
    samples = 0
    while time.time() < end:
        samples += 1
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                base = f"/proc/{pid}/task/{tid}"
                comm, stat = read(base + "/comm"), read(base + "/stat")
                if comm is None or stat is None:
                    continue
                fields = stat[stat.rfind(")") + 2:].split()  # the name may hold spaces: cut after it
                key = (pid, int(tid))
                names[key] = comm
                ticks = int(fields[11]) + int(fields[12])  # utime + stime
                first_ticks.setdefault(key, ticks)
                last_ticks[key] = ticks
                wchan = read(base + "/wchan") or "-"
                states[key][f"{fields[0]} {wchan} {syscall_text(read(base + '/syscall'))}"] += 1
        time.sleep(interval)
    hz = os.sysconf("SC_CLK_TCK")
    print(f"{samples} samples over {duration} s")
    for key in sorted(states):
        cpu = (last_ticks[key] - first_ticks[key]) / hz
        print(f"pid {key[0]} tid {key[1]} {names[key]}: cpu {cpu:.2f} s")
        for what, count in states[key].most_common(4):
            print(f"    {count:5d}  {what}")


if __name__ == "__main__":
    main()
