#!/usr/bin/env python3
"""Puts the CSV files of shmem_bench (mori) and nvshmem_bench side by side and checks the issue's targets.

    python3 bench/compare_shmem.py MORI.csv[,MORI2.csv...] [NVSHMEM.csv[,NVSHMEM2.csv...]] [--strict] [--one-gpu]

Both files hold rows `bench,impl,size,blocks,value,unit` (the programs' --csv); rows are joined on
(bench, size, blocks). The ratio is mori / nvshmem: above 1 is better for bandwidth (GBps), below 1 is better
for latency (us). Compare only files from one run on one machine (BASELINES.md: runs differ by up to 30%).
Several files of one side, comma-separated (one per run of that program), give each row its best value over
them (the highest bandwidth, the lowest time): on an H200 some rows move by up to 20% from one process to the
next (docs/PERF.md, 2026-12-03), so gpu_suite.sh runs each program more than once, in alternating order.

Targets (issue text; MISS marks a row that misses one):
  put_bw, put_bw_warp
               best over the block counts at each size >= nvshmem's best at that size, >= 1.05 x it from 2 MiB
               up, and (two GPUs) >= 380 GB/s from 16 MiB up (a row per block count only notes "below nvshmem",
               it is not a target by itself)
  p_latency    half round trip <= nvshmem's; (two GPUs) <= 0.8 us
  signal       put-with-signal half round trip, 8 B and 4 KiB, every scope: <= nvshmem's; (two GPUs) 8 B <= 1.0 us
--one-gpu: both PEs shared one GPU (MPS): bandwidths are copies inside one GPU, so the absolute NVLink
targets do not apply; the ratios do.

Exit status 0, or with --strict 1 when a target is missed (or a file cannot be read).
"""

import csv
import sys

PUT_BW_BENCHES = ["put_bw", "put_bw_warp"]
LATENCY_ORDER = ["p_latency", "signal_latency_thread", "signal_latency_warp", "signal_latency_block"]
LARGE_FROM = 2 << 20
LARGE_RATIO = 1.05
LATENCY_VS_NVSHMEM_SIZES = (8, 4096)
PUT_BW_FLOOR_GBPS = 380.0
PUT_BW_FLOOR_FROM = 16 << 20
P_LATENCY_MAX_US = 0.8
SIGNAL_8B_MAX_US = 1.0


def read_rows(path):
    """{(bench, size, blocks): (value, unit)}; a later row of the same key replaces an earlier one."""
    rows = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"bench", "size", "blocks", "value", "unit"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for r in reader:
            rows[(r["bench"], int(r["size"]), int(r["blocks"]))] = (float(r["value"]), r["unit"])
    return rows


LOWER_IS_BETTER = {"us", "ms", "ns"}


def read_best(paths):
    """read_rows over the comma-separated `paths`, each row's best value over the files that have it."""
    best = {}
    for path in paths.split(","):
        for key, (value, unit) in read_rows(path).items():
            have = best.get(key)
            if have is not None and have[1] != unit:
                raise ValueError(f"{path}: {key[0]} {key[1]} B is in {unit} here and in {have[1]} before")
            lower = unit in LOWER_IS_BETTER
            if have is None or (value < have[0] if lower else value > have[0]):
                best[key] = (value, unit)
    return best


def human_size(n):
    for shift, name in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {name}"
    return f"{n} B"


def fmt(v):
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.2f}"


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    flags = [a for a in argv[1:] if a.startswith("--")]
    strict = "--strict" in flags
    one_gpu = "--one-gpu" in flags
    if not 1 <= len(args) <= 2 or any(f not in ("--strict", "--one-gpu") for f in flags):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        mori = read_best(args[0])
        nv = read_best(args[1]) if len(args) == 2 else {}
    except (OSError, ValueError, KeyError) as e:
        print(f"compare_shmem: {e}", file=sys.stderr)
        return 1

    misses = []
    lines = []

    def row(bench, size, blocks, m, n, unit, note):
        ratio = "-" if m is None or n is None or n == 0 else f"{m / n:.2f}"
        lines.append((bench, human_size(size), str(blocks), fmt(m), fmt(n), unit, ratio, note))

    # put_bw: one row per block count, then the best of each at that size, which carries the targets.
    keys = set(mori) | set(nv)
    for bw in PUT_BW_BENCHES:
        for size in sorted({k[1] for k in keys if k[0] == bw}):
            best_m = best_n = None
            for blocks in sorted({k[2] for k in keys if k[0] == bw and k[1] == size}):
                m = mori.get((bw, size, blocks), (None, ""))[0]
                n = nv.get((bw, size, blocks), (None, ""))[0]
                best_m = m if best_m is None or (m is not None and m > best_m) else best_m
                best_n = n if best_n is None or (n is not None and n > best_n) else best_n
                below = m is not None and n is not None and m < n
                row(bw, size, blocks, m, n, "GBps", "below nvshmem" if below else "")
            notes = []
            want = LARGE_RATIO if size >= LARGE_FROM else 1.0
            if best_m is None:
                notes.append("MISS: no mori row")
            else:
                if best_n is not None and best_m < want * best_n:
                    notes.append(f"MISS: below {want:g} x nvshmem")
                if not one_gpu and size >= PUT_BW_FLOOR_FROM and best_m < PUT_BW_FLOOR_GBPS:
                    notes.append(f"MISS: below {PUT_BW_FLOOR_GBPS:.0f} GB/s")
            if notes:
                misses.append(f"{bw} {human_size(size)}: " + ", ".join(n[6:] for n in notes))
            elif best_n is not None or (not one_gpu and size >= PUT_BW_FLOOR_FROM):
                notes.append("ok")
            row(bw, size, "best", best_m, best_n, "GBps", "; ".join(notes))

    for bench in LATENCY_ORDER + sorted({k[0] for k in keys} - set(LATENCY_ORDER) - set(PUT_BW_BENCHES)):
        for key in sorted(k for k in keys if k[0] == bench):
            m = mori.get(key, (None, ""))[0]
            n = nv.get(key, (None, ""))[0]
            unit = (mori.get(key) or nv.get(key))[1]
            limit = None
            if not one_gpu and bench == "p_latency":
                limit = P_LATENCY_MAX_US
            elif not one_gpu and bench.startswith("signal_latency") and key[1] == 8:
                limit = SIGNAL_8B_MAX_US
            versus = n is not None and (bench == "p_latency" or
                                        (bench.startswith("signal_latency") and key[1] in LATENCY_VS_NVSHMEM_SIZES))
            notes = []
            if m is None:
                notes.append("MISS: no mori row")
            else:
                if limit is not None and m > limit:
                    notes.append(f"MISS: above {limit} us")
                if versus and m > n:
                    notes.append("MISS: above nvshmem")
            if notes:
                misses.append(f"{bench} {human_size(key[1])}: " + ", ".join(x[6:] for x in notes))
            elif limit is not None or versus:
                notes.append("ok")
            note = "; ".join(notes)
            row(bench, key[1], key[2], m, n, unit, note)

    header = ("bench", "size", "blocks", "mori", "nvshmem", "unit", "mori/nv", "target")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    for i, cols in enumerate([header] + lines):
        cells = (c.ljust(w) if j in (0, 5, 7) else c.rjust(w) for j, (c, w) in enumerate(zip(cols, widths)))
        print("  ".join(cells).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if not nv:
        print("\n(no NVSHMEM file: only the absolute targets are checked)")
    print(f"\ntargets missed: {len(misses)}" + "".join(f"\n  {m}" for m in misses))
    return 1 if strict and misses else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
