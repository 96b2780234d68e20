#!/usr/bin/env python3
"""Kills one PE of a 4-PE shmem_chaos job with SIGKILL at a random moment, again and again, and checks the rest.
(--signal TERM or INT kills with that signal instead: it must end a mori process just as promptly, by the signal.)

Each kill is a trial with its own seed (derived from --seed and printed; --kill-seed reruns one alone). A trial
starts the ranks itself (mpirun would take the whole job down with the dead rank), waits until every rank has
printed its ready line, waits a random 0.05-0.5 s more (a round takes a few milliseconds, so that lands on a
uniformly random point of the round cycle), and SIGKILLs a random rank. Every survivor must then end within
MORI_TIMEOUT_S + --slack-s of the kill, by itself, with exit code 1 and output that names the dead PE
("PE d", "pe d" or "rank d"), or names a survivor whose own failure leads there (see resolve_naming); it must
not die of a signal, print a sanitizer report, report a corruption, or exit 0. After the trial no process of the
job may remain (found by a tag in the environment), no socket the job held may still exist (/proc/net), nothing
may listen on its bootstrap port, and /dev/shm may hold no new file that no other process holds.

The slack covers what MORI_TIMEOUT_S does not: a survivor's wait can start a little after the kill (it was
between rounds), and the exit itself (joining NIC and proxy threads, unmapping the heap).

With --faults SPEC nobody is killed: every trial runs the job for --rounds rounds under the emulated NIC's random
packet faults (MORI_EMULATED_NIC_FAULTS=SPEC plus the trial's seed; transports rdma and proxy_rdma, the two that
use the NIC). Every rank must then either finish all rounds with exit 0, or every rank must end within --bound-s
with exit 1 and its FAILED line, with an error completion (an mlx5 syndrome) named in some rank's log; a mix, a
hang, a crash, a sanitizer report, a CORRUPTION line or a leak fails the trial. --expect-clean (for delay-only
specs) requires every trial to finish all rounds.

Exit status: 0 when every trial passed, 1 otherwise (each failure prints the command that reruns its seed).
"""

import argparse
import collections
import concurrent.futures
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

RANKS = 4
TRANSPORTS = {
    "p2p": {"MORI_SHMEM_TRANSPORT": "p2p"},
    "rdma": {"MORI_SHMEM_TRANSPORT": "rdma"},
    "proxy_tcp": {"MORI_SHMEM_TRANSPORT": "proxy", "MORI_SHMEM_PROXY_CONN": "tcp"},
    "proxy_rdma": {"MORI_SHMEM_TRANSPORT": "proxy", "MORI_SHMEM_PROXY_CONN": "rdma"},
}
SLOT_BYTES = (512, 4096, 32768)
TAG_VAR = "CHAOS_JOB_TAG"  # not MORI_*: the runtime warns about MORI_* names it does not know
SANITIZER = re.compile(r"ERROR: AddressSanitizer|ERROR: LeakSanitizer|WARNING: ThreadSanitizer|"
                       r"ERROR: ThreadSanitizer|runtime error:|ERROR: UndefinedBehaviorSanitizer")
PORT_IN_USE = re.compile(r"[Aa]ddress already in use")
NIC_TRANSPORTS = ("rdma", "proxy_rdma")
ERROR_COMPLETION = re.compile(r"syndrome 0x[0-9a-f]+")  # an error completion, as the runtime reports it
# The NIC's own line when a request's ack timer expires: the error completion it writes, before anyone polls it.
NIC_RETRY_EXCEEDED = re.compile(r"transport retry counter exceeded, the QP goes to the error state")
NIC_FAULTS = re.compile(r"faults injected: dropped (\d+), corrupted (\d+), reordered (\d+), delayed (\d+); "
                        r"detected: integrity drops (\d+), out of sequence (\d+)")
NIC_FAULT_KEYS = ("dropped", "corrupted", "reordered", "delayed", "integrity drops", "out of sequence")
PROC_SCAN_ERRORS = (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError)


def derive_seeds(seed, count):
    rng = random.Random(seed)
    return [rng.getrandbits(32) for _ in range(count)]


def default_signals():
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def free_port(rng):
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-30000")


def fd_targets(pid):
    """Where the process's descriptors point (socket:[inode], paths); raises when the process is gone."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except PROC_SCAN_ERRORS:
            continue


def shm_name(text):
    """A /dev/shm path as /proc shows it, without the ' (deleted)' of an unlinked file."""
    return text[:-len(" (deleted)")] if text.endswith(" (deleted)") else text


def scan_processes():
    """Every process's socket inodes and /dev/shm files (open or mapped), by pid."""
    sockets, shm = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            for target in fd_targets(pid):
                if target.startswith("socket:["):
                    sockets.setdefault(int(target[8:-1]), pid)
                elif target.startswith("/dev/shm/"):
                    shm.setdefault(shm_name(target), pid)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find("/dev/shm/")
                    if at >= 0:
                        shm.setdefault(shm_name(line[at:].rstrip("\n")), pid)
        except PROC_SCAN_ERRORS:
            continue
    return sockets, shm


def job_sockets(pids):
    inodes = set()
    for pid in pids:
        try:
            inodes.update(int(t[8:-1]) for t in fd_targets(pid) if t.startswith("socket:["))
        except PROC_SCAN_ERRORS:
            continue
    return inodes


def kernel_sockets():
    """Inode -> description of every TCP and Unix socket the kernel still has."""
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    state = "LISTEN" if fields[3] == "0A" else f"state {fields[3]}"
                    inode = int(fields[9])
                    if inode != 0:
                        out[inode] = f"{table} {fields[1]} {state}"
        except FileNotFoundError:
            continue
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                out[int(fields[6])] = "unix " + (fields[7] if len(fields) > 7 else "(unnamed)")
    except FileNotFoundError:
        pass
    return out


def port_listener(port, sockets, owners):
    """The listening socket on 127.0.0.1:port in `sockets` (kernel_sockets) and the pid holding it in `owners`
    (scan_processes), each None when there is none. Once every process of a job is gone, a listener on its
    bootstrap port that some live process holds is another job's: ctest runs chaos tests side by side, and when a
    trial kills rank 0 the port is free for another test's next trial to pick (an ASan CI run of c4404cc: that
    job's root then refused this job's survivors' hellos, by their job nonce). One that no process holds is the
    leak."""
    want = f"tcp 0100007F:{port:04X} LISTEN"
    for inode, what in sockets.items():
        if what == want:
            return inode, owners.get(inode)
    return None, None


def process_name(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"
    except OSError:
        return "gone"


def tagged_processes(tag):
    needle = f"{TAG_VAR}={tag}".encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    found.append(int(name))
        except (OSError, ProcessLookupError):
            continue
    return found


def thread_report(pid):
    """What a hung process's threads are doing: gdb backtraces when gdb can attach, else each thread's wchan."""
    gdb = shutil.which("gdb")
    if gdb:
        try:
            r = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 12"],
                               capture_output=True, text=True, timeout=30)
            lines = [l for l in r.stdout.splitlines() if l.startswith(("Thread ", "#"))]
            if lines:
                return "\n".join(lines)
        except (subprocess.TimeoutExpired, OSError):
            pass
    out = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    wchan = f.read().strip()
                out.append(f"thread {tid} {comm}: {wchan}")
            except PROC_SCAN_ERRORS:
                continue
    except PROC_SCAN_ERRORS:
        pass
    return "\n".join(out)


class Trial:
    def __init__(self, args, seed, index):
        self.args = args
        self.seed = seed
        self.index = index
        rng = random.Random(seed)
        self.victim = rng.randrange(RANKS)
        # steady: after every rank's ready line; init: after the ranks start, somewhere in their ShmemInit
        self.delay = rng.uniform(0.05, 0.5) if args.phase == "steady" else rng.uniform(0.0, args.init_window_s)
        self.bytes = rng.choice(SLOT_BYTES)
        self.port_rng = random.Random(seed ^ 0x5A5A5A5A)  # retries change the port, not the trial
        self.tag = f"{os.getpid()}-{seed:08x}"
        self.problems = []  # failures of this trial, one line each
        self.notes = []  # remarks that are not failures
        self.survivors = {}  # rank -> what it did: outcome, seconds after the kill, the PEs it named
        self.leaks = 0
        self.log = ""  # every rank's output

    def fail(self, category, text):
        self.problems.append((category, text))

    def start(self, workdir):
        port = free_port(self.port_rng)
        base = dict(os.environ)
        for name in [n for n in base if n.startswith("MORI_")]:
            del base[name]
        base.update(TRANSPORTS[self.args.transport])
        if self.args.faults is not None:
            spec = [f for f in self.args.faults.split(",") if f and not f.startswith("seed=")]
            if not any(f.startswith("ack_timeout_ms=") for f in spec):
                spec.append(f"ack_timeout_ms={self.args.ack_timeout_ms}")
            base["MORI_EMULATED_NIC_FAULTS"] = ",".join([f"seed={self.seed}"] + spec)
        base.update({
            "MORI_WORLD_SIZE": str(RANKS),
            "MORI_BOOTSTRAP_ADDR": f"127.0.0.1:{port}",
            "MORI_BOOTSTRAP_SECRET": f"chaos-{self.tag}",
            "MORI_SHMEM_HEAP_SIZE": self.args.heap,
            "MORI_TIMEOUT_S": str(self.args.timeout_s),
            TAG_VAR: self.tag,
        })
        if self.args.phase == "steady":
            # A kill comes after every rank is ready, so the join may take as long as start-up may: under a
            # sanitizer, with two trials on two cores, one rank can start seconds after the others, and with the
            # 2 s MORI_TIMEOUT_S the ranks already registered gave up on it (a CI failure before any kill). A
            # --faults job must end within --bound-s whatever happens, so its join takes at most half of that.
            # With --phase init the kill lands in the join, whose waits must then end within MORI_TIMEOUT_S.
            join_s = self.args.ready_timeout_s
            if self.args.faults is not None:
                join_s = min(join_s, self.args.bound_s / 2)
            base["MORI_BOOTSTRAP_JOIN_TIMEOUT_S"] = str(max(1, int(join_s)))
        procs, files = [], []
        self.spawned = time.monotonic()
        for rank in range(RANKS):
            env = dict(base, MORI_RANK=str(rank))
            path = os.path.join(workdir, f"rank{rank}.log")
            f = open(path, "w+b")
            files.append(f)
            argv = [self.args.program, "--bytes", str(self.bytes), "--barrier-every", str(self.args.barrier_every)]
            if self.args.faults is not None:
                argv += ["--rounds", str(self.args.rounds)]
            # SIGINT and SIGTERM as a shell's foreground job gets them, even if this driver was started with them
            # ignored (a background job of a shell without job control ignores SIGINT).
            procs.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=default_signals))
        self.port = port
        return procs, files, port

    @staticmethod
    def output(files, rank):
        f = files[rank]
        f.flush()
        f.seek(0)
        return f.read().decode(errors="replace")

    def run(self):
        with tempfile.TemporaryDirectory(prefix="mori-chaos-") as workdir:
            shm_before = set(os.listdir("/dev/shm"))
            for attempt in range(5):
                procs, files, port = self.start(workdir)
                if self.args.phase == "init":
                    break  # the kill lands during start-up: no ready lines to wait for
                ready, early = self.wait_ready(procs, files)
                if ready:
                    break
                self.kill_all(procs)
                rank0 = self.output(files, 0)
                self.log = "".join(f"---- rank {r}\n{self.output(files, r)}" for r in range(RANKS))
                for f in files:
                    f.close()
                if PORT_IN_USE.search(rank0) and attempt < 4:
                    continue
                self.fail("startup", f"the job did not reach its ready lines ({early})")
                return self
            else:
                return self
            try:
                self.kill_and_watch(procs, files)
            finally:
                self.kill_all(procs)
                self.log = "".join(f"---- rank {r}\n{self.output(files, r)}" for r in range(RANKS))
                for f in files:
                    f.close()
            self.check_leaks(procs, shm_before)
        return self

    def wait_ready(self, procs, files):
        deadline = time.monotonic() + self.args.ready_timeout_s
        while time.monotonic() < deadline:
            if all(" ready after " in self.output(files, r) for r in range(RANKS)):
                return True, ""
            for r, p in enumerate(procs):
                if p.poll() is not None:
                    return False, f"rank {r} exited with {p.returncode} before it was ready"
            time.sleep(0.01)
        return False, f"not every rank was ready after {self.args.ready_timeout_s} s"

    @staticmethod
    def kill_all(procs):
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def kill_and_watch(self, procs, files):
        pids = [p.pid for p in procs]
        if self.args.phase == "init":
            # The delay counts from the start; the sockets the job opened so far are read just before the kill
            # (the victim's own go with it; the survivors' are read again afterwards).
            time.sleep(max(0.0, self.spawned + self.delay - time.monotonic()))
            self.sockets = set()
        else:
            self.sockets = job_sockets(pids)
            time.sleep(self.delay)
            self.sockets |= job_sockets(pids)
        for r, p in enumerate(procs):
            if p.poll() is not None:
                self.fail("early exit", f"rank {r} exited with {p.returncode} before the kill")
        self.ready_at_kill = sum(" ready after " in self.output(files, r) for r in range(RANKS))
        procs[self.victim].send_signal(self.args.signal)
        killed_at = time.monotonic()
        if self.args.phase == "init":
            self.kill_after_start = killed_at - self.spawned
            self.sockets |= job_sockets(pids)  # the survivors' (they run on until they notice)
        self.killed_at = killed_at
        bound = self.args.timeout_s + self.args.slack_s
        ended = {}
        survivors = [r for r in range(RANKS) if r != self.victim]
        self.victim_gone = None
        while len(ended) < len(survivors) and time.monotonic() < killed_at + bound:
            for r in survivors:
                if r not in ended and procs[r].poll() is not None:
                    ended[r] = time.monotonic() - killed_at
            if self.victim_gone is None and procs[self.victim].poll() is not None:
                self.victim_gone = time.monotonic() - killed_at
            time.sleep(0.005)
        hung_report = {}
        for r in survivors:
            if r not in ended:
                hung_report[r] = thread_report(procs[r].pid)
                procs[r].kill()
        procs[self.victim].wait()
        if procs[self.victim].returncode != -self.args.signal:
            self.fail("victim", f"rank {self.victim} ended with {procs[self.victim].returncode}, not by the "
                      f"{self.args.signal.name} (it had exited before, or handled the signal and exited)")
        for r in survivors:
            procs[r].wait()
            text = self.output(files, r)
            rc = procs[r].returncode
            info = {"seconds": ended.get(r), "rc": rc, "reported": None}
            stamp = re.search(r" FAILED .*\[monotonic ([0-9.]+) s\]", text)
            if stamp:  # when it printed its report (both clocks are CLOCK_MONOTONIC)
                info["reported"] = float(stamp.group(1)) - killed_at
            self.survivors[r] = info
            # Killed during start-up, a survivor may have no ready line: all its output counts then.
            after_ready = text[text.find(" ready after "):] if " ready after " in text else "\n" + text
            lines = after_ready.splitlines()[1:]
            # PEs the runtime's messages name (its log prefix names this rank itself: left out).
            info["runtime_names"] = {int(pe) for l in lines if not l.startswith("shmem_chaos:")
                                     for pe in re.findall(r"\b(?:PE|pe|rank|rank\(s\)) (\d+)\b", l)} - {r}
            # PEs whose signal the job waited for in vain: the dead one, and any PE stuck behind it or gone.
            info["job_names"] = {int(pe) for l in lines if l.startswith("shmem_chaos:")
                                 for m in [re.search(r"no round-\d+ signal from (.*?); ", l)] if m
                                 for pe in re.findall(r"PE (\d+)", m.group(1))}
            if r in hung_report:
                info["outcome"] = "hang"
                self.fail("hang", f"rank {r} still ran {bound:.1f} s after the kill; its threads:\n"
                          f"{hung_report[r]}")
            elif rc < 0:
                info["outcome"] = "crash"
                self.fail("crash", f"rank {r} died of signal {-rc} ({signal.Signals(-rc).name})")
            elif SANITIZER.search(text):
                info["outcome"] = "crash"
                self.fail("crash", f"rank {r} printed a sanitizer report (exit {rc})")
            elif "CORRUPTION" in text:
                info["outcome"] = "corruption"
                self.fail("corruption", f"rank {r} found data it should not have (exit {rc})")
            elif rc == 0:
                info["outcome"] = "unnoticed"
                self.fail("unnoticed", f"rank {r} exited 0 although rank {self.victim} was killed")
            elif rc != 1 or " FAILED" not in after_ready:
                info["outcome"] = "unexpected"
                self.fail("unexpected", f"rank {r} exited {rc} without its FAILED line")
            else:
                info["outcome"] = "ok"
        self.resolve_naming()

    def resolve_naming(self):
        """Whether each survivor named the dead PE, directly or through a chain of failures.

        A survivor that learns of the death stops at once and sends nothing more (its kernel traps; a failed proxy
        drops every later request), and one that is stuck on the dead PE sends nothing either. A survivor waiting
        for it then sees it go silent (or its NIC or connection vanish) and may name only it: a true report, that
        leads to the dead PE when that PE's own report does ("cascade"). The runtime lists at exit the peers whose
        NICs it lost, first first, so every survivor must name the dead PE itself: one that names only a PE whose
        report leads there fails as a cascade, one whose names lead nowhere (none, or only each other) as unnamed.
        """
        for info in self.survivors.values():
            info["named"] = "direct" if self.victim in info["runtime_names"] | info["job_names"] else "unnamed"
            info["runtime_named"] = self.victim in info["runtime_names"]
            info["job_named"] = self.victim in info["job_names"]
            info["job_exact"] = info["job_names"] == {self.victim}
        changed = True
        while changed:
            changed = False
            for r, info in self.survivors.items():
                if info["named"] != "unnamed":
                    continue
                if any(self.survivors.get(p, {}).get("named") in ("direct", "cascade")
                       for p in info["runtime_names"] | info["job_names"]):
                    info["named"] = "cascade"
                    changed = True
        if self.args.phase == "init":
            # Killed during start-up, a rank that never joined the job can name only the root that turned it away,
            # and ranks in a collective with the dead one may name each other: counted, not failed (docs/CHAOS.md).
            return
        for r, info in self.survivors.items():
            named = sorted(info["runtime_names"] | info["job_names"])
            if info["outcome"] == "ok" and info["named"] == "unnamed":
                info["outcome"] = "unnamed"
                self.fail("unnamed", f"rank {r} names neither PE {self.victim} nor a PE whose failure leads to it "
                          f"(named: {named or 'none'})")
            elif info["outcome"] == "ok" and info["named"] == "cascade" and self.victim_still_there(info):
                # It reported while the killed process was still being torn down (its sockets and the NIC's wire
                # connections close last, after its memory: seconds for a big ASan process under load), so no
                # runtime could have seen the death yet: the cascade is all there was to name. Counted, not failed.
                info["named"] = "cascade before the death showed"
            elif info["outcome"] == "ok" and info["named"] == "cascade":
                info["outcome"] = "unnamed"
                self.fail("cascade", f"rank {r} names not PE {self.victim} but only PEs whose failures lead to it "
                          f"(named: {named})")

    def victim_still_there(self, info):
        """Whether the killed process had not yet ended (as the driver polls it) when this survivor reported (its
        FAILED line; when it printed none, when it ended). The end is no measure by itself: an ASan process takes
        a while to exit after its last line (in a local CI run of a29e020 two survivors reported 0.05 s before the
        victim's connections closed, printed their exit lines, and ended 0.15 s after it)."""
        gone = getattr(self, "victim_gone", None)
        when = info.get("reported")
        if when is None:
            when = info["seconds"]
        return when is not None and (gone is None or gone > when)

    def check_leaks(self, procs, shm_before):
        left = tagged_processes(self.tag)
        if left:
            self.leaks += len(left)
            self.fail("leak", f"processes of the job still exist: {left}")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        still = kernel_sockets()
        kept = {i: still[i] for i in self.sockets if i in still}
        owners, shm_owners = scan_processes()
        kept = {i: d for i, d in kept.items() if i not in owners}  # a reused inode now belongs to someone else
        if kept:
            self.leaks += len(kept)
            self.fail("leak", "sockets of the job outlive it: " +
                      ", ".join(f"{d} (inode {i})" for i, d in kept.items()))
        listener, owner = port_listener(self.port, still, owners)
        if listener is not None and owner is None:
            self.leaks += 1
            self.fail("leak", f"the job's bootstrap port {self.port} still has a listener (inode {listener}) "
                              "that no process holds")
        elif listener is not None:
            self.notes.append(f"port {self.port} was taken after the job's root closed it, by pid {owner} "
                              f"({process_name(owner)}), not of this job")
        # Open MPI's shared-memory segments are never this job's (its PEs start without mpirun and do not
        # initialise MPI): ctest runs mpirun suites beside it, and an ended Open MPI job can leave one behind.
        gained = {g for g in set(os.listdir("/dev/shm")) - shm_before if not g.startswith("vader_segment.")}
        orphans = sorted(g for g in gained if f"/dev/shm/{g}" not in shm_owners)
        if orphans:
            self.leaks += len(orphans)
            self.fail("leak", f"/dev/shm gained files that no process holds: {orphans}")
        elif gained:
            self.notes.append(f"/dev/shm gained {len(gained)} files held by other processes (not this job's)")

    def rerun_command(self):
        a = self.args
        faults = "" if a.faults is None else (
            f"--faults '{a.faults}' --rounds {a.rounds} --bound-s {a.bound_s} --ack-timeout-ms {a.ack_timeout_ms} " +
            ("--expect-clean " if a.expect_clean else ""))
        return (f"{sys.executable} {os.path.abspath(__file__)} --program {a.program} --transport {a.transport} "
                f"--timeout-s {a.timeout_s} --slack-s {a.slack_s} --heap {a.heap} --barrier-every {a.barrier_every} "
                f"{faults}--kill-seed {self.seed:#010x}")

    def summary(self):
        parts = []
        for r, info in sorted(self.survivors.items()):
            secs = "-" if info["seconds"] is None else f"{info['seconds']:.2f} s"
            by = "runtime+job" if info["runtime_named"] and info["job_named"] else (
                "runtime" if info["runtime_named"] else "job" if info["job_named"] else "nobody")
            how = f"named by {by}" if info["named"] == "direct" else (
                f"{info['named']} via {sorted(info['runtime_names'] | info['job_names'])}"
                if info["named"].startswith("cascade") else "unnamed")
            parts.append(f"{r}:{info['outcome']} {secs} {how}")
        gone = "-" if getattr(self, "victim_gone", None) is None else f"{self.victim_gone:.2f} s"
        when = "after ready" if self.args.phase == "steady" else \
            f"after start (killed {getattr(self, 'kill_after_start', 0):.3f} s after it, " \
            f"{getattr(self, 'ready_at_kill', 0)} of {RANKS} ready)"
        return (f"kill {self.index} seed {self.seed:#010x}: rank {self.victim} {self.delay:.3f} s {when} "
                f"(gone {gone} later), {self.bytes} B per pair; survivors " + ", ".join(parts) +
                ("; " + "; ".join(self.notes) if self.notes else "") +
                ("" if not self.problems else "  <-- FAILED: " + ", ".join(sorted({c for c, _ in self.problems}))))


class FaultTrial(Trial):
    """One run of the job under random packet faults: nobody is killed; every rank ends by itself."""

    def __init__(self, args, seed, index):
        super().__init__(args, seed, index)
        self.outcome = None  # "completed" or "failed" when the trial passed
        self.nic = collections.Counter()  # the NICs' fault counters, summed over the ranks
        self.seconds = None
        self.named = 0  # ranks whose log names an error completion (the runtime's report of it)
        self.nic_named = 0  # ranks whose NIC logged a request's ack timeout

    def run(self):
        with tempfile.TemporaryDirectory(prefix="mori-chaos-faults-") as workdir:
            shm_before = set(os.listdir("/dev/shm"))
            for attempt in range(5):
                procs, files, port = self.start(workdir)
                try:
                    retry = self.watch(procs, files) and attempt < 4
                finally:
                    self.kill_all(procs)
                    self.log = "".join(f"---- rank {r}\n{self.output(files, r)}" for r in range(RANKS))
                    for f in files:
                        f.close()
                if not retry:
                    break
                self.problems.clear()
            self.check_leaks(procs, shm_before)
        return self

    def watch(self, procs, files):
        """Waits for every rank and judges the job; returns True when it must be rerun (its port was taken)."""
        pids = [p.pid for p in procs]
        self.sockets = set()
        start = time.monotonic()
        deadline = start + self.args.bound_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            self.sockets |= job_sockets(pids)
            time.sleep(0.02)
        self.seconds = time.monotonic() - start
        hung = {r: thread_report(p.pid) for r, p in enumerate(procs) if p.poll() is None}
        for r in hung:
            procs[r].kill()
        for p in procs:
            p.wait()
        texts = [self.output(files, r) for r in range(RANKS)]
        if PORT_IN_USE.search(texts[0]):
            return True
        rcs = [p.returncode for p in procs]
        for r, text in enumerate(texts):
            for m in NIC_FAULTS.finditer(text):
                for key, value in zip(NIC_FAULT_KEYS, m.groups()):
                    self.nic[key] += int(value)
            if r in hung:
                self.fail("hang", f"rank {r} still ran {self.args.bound_s:.1f} s after the start; its threads:\n"
                          f"{hung[r]}")
            elif rcs[r] < 0:
                self.fail("crash", f"rank {r} died of signal {-rcs[r]} ({signal.Signals(-rcs[r]).name})")
            elif SANITIZER.search(text):
                self.fail("crash", f"rank {r} printed a sanitizer report (exit {rcs[r]})")
            elif "CORRUPTION" in text:
                self.fail("corruption", f"rank {r} found data it should not have (exit {rcs[r]})")
        self.named = sum(1 for t in texts if ERROR_COMPLETION.search(t))
        self.nic_named = sum(1 for t in texts if NIC_RETRY_EXCEEDED.search(t))
        if self.problems:
            return False
        done = [rc == 0 and f" done: {self.args.rounds} rounds verified" in t for rc, t in zip(rcs, texts)]
        failed = [rc == 1 and " FAILED" in t for rc, t in zip(rcs, texts)]
        if all(done):
            self.outcome = "completed"
        elif all(failed) and self.named + self.nic_named > 0:
            self.outcome = "failed"
        elif all(failed):
            self.fail("unnamed", "every rank failed and none names an error completion (an mlx5 syndrome, or its NIC's "
                      "transport-retry-exceeded line)")
        else:
            self.fail("mixed", "ranks ended differently: " + ", ".join(
                f"{r}: exit {rc}{' done' if d else ' FAILED' if f else ''}"
                for r, (rc, d, f) in enumerate(zip(rcs, done, failed))))
        if self.outcome == "failed" and self.args.expect_clean:
            self.fail("failed", "the job failed under faults that lose nothing (--expect-clean)")
        return False

    def summary(self):
        nic = ", ".join(f"{k} {self.nic[k]}" for k in NIC_FAULT_KEYS)
        return (f"run {self.index} seed {self.seed:#010x}: {self.bytes} B per pair, "
                f"{self.outcome or 'FAILED'} after {self.seconds or 0:.2f} s, error completion named by "
                f"{self.named} of {RANKS} ranks (NIC ack timeouts logged by {self.nic_named}); NICs: {nic}" +
                ("" if not self.problems else "  <-- FAILED: " + ", ".join(sorted({c for c, _ in self.problems}))))


def report_problems(trial, counts, failed, verbose):
    """Counts a finished trial's problems and leaks, prints each problem with the command that reruns the trial,
    and its ranks' output when it failed (always with --verbose)."""
    for category, _ in trial.problems:
        counts["problem " + category] += 1
    counts["leaks"] += trial.leaks
    if trial.problems:
        failed.append(trial)
        for category, text in trial.problems:
            print(f"  [{category}] {text}".replace("\n", "\n    "), flush=True)
        print(f"  reproduce: {trial.rerun_command()}", flush=True)
    if verbose or trial.problems:
        print("    " + trial.log.rstrip("\n").replace("\n", "\n    "), flush=True)


def run_faults(args, seeds):
    """The --faults mode: every seed one run of the job under random packet faults."""
    start = time.monotonic()
    counts = collections.Counter()
    nic = collections.Counter()
    failed = []
    seconds = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(FaultTrial(args, s, i + 1).run) for i, s in enumerate(seeds)]
        for fut in concurrent.futures.as_completed(futures):
            trial = fut.result()
            print(trial.summary(), flush=True)
            counts[trial.outcome or "problem"] += 1
            if trial.outcome == "failed" and trial.named == 0:
                counts["nic only"] += 1
            nic.update(trial.nic)
            seconds.append(trial.seconds or 0)
            report_problems(trial, counts, failed, args.verbose)
    elapsed = time.monotonic() - start
    print(f"chaos_faults_{args.transport}: {len(seeds)} runs of {args.rounds} rounds under '{args.faults}': "
          f"completed {counts['completed']}, failed with error completions {counts['failed']} (of them named only "
          f"in the NIC's log, not by the runtime: {counts['nic only']}); hangs "
          f"{counts['problem hang']}, crashes {counts['problem crash']}, silent corruptions "
          f"{counts['problem corruption']}, mixed endings {counts['problem mixed']}, unnamed failures "
          f"{counts['problem unnamed']}, leaks {counts['leaks']}; NICs injected: dropped {nic['dropped']}, "
          f"corrupted {nic['corrupted']}, reordered {nic['reordered']}, delayed {nic['delayed']}; detected: "
          f"integrity drops {nic['integrity drops']}, out of sequence {nic['out of sequence']}; runs took "
          f"{min(seconds):.2f}..{max(seconds):.2f} s (bound {args.bound_s:.1f} s); {elapsed:.1f} s", flush=True)
    if failed:
        print(f"FAILED: {len(failed)} of {len(seeds)} runs; rerun one with --kill-seed (see 'reproduce' above)" +
              (f"; this run: --seed {args.seed:#x}" if args.seed is not None else ""), flush=True)
        return 1
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", required=True, help="the shmem_chaos executable")
    parser.add_argument("--transport", required=True, choices=sorted(TRANSPORTS))
    parser.add_argument("--kills", type=int, default=50, help="trials, one kill each (default 50)")
    parser.add_argument("--signal", type=lambda s: signal.Signals["SIG" + s.upper().removeprefix("SIG")],
                        default=signal.SIGKILL, help="what kills the victim: KILL (default), TERM or INT; it must end "
                        "the process as SIGKILL does, by the signal, within the same bound")
    parser.add_argument("--seed", type=lambda s: int(s, 0), default=None,
                        help="derives every trial's seed (default: a random one, printed)")
    parser.add_argument("--kill-seed", type=lambda s: int(s, 0), default=None, help="run only the trial of this seed")
    parser.add_argument("--timeout-s", type=int, default=2, help="MORI_TIMEOUT_S of the job (default 2)")
    parser.add_argument("--slack-s", type=float, default=1.5,
                        help="how much longer than MORI_TIMEOUT_S after the kill a survivor may take to end "
                        "(default 1.5)")
    parser.add_argument("--heap", default="32m", help="MORI_SHMEM_HEAP_SIZE (default 32m)")
    parser.add_argument("--phase", choices=["steady", "init"], default="steady",
                        help="when the kill lands: steady (default: rounds running, after every ready line) or init "
                        "(uniformly within --init-window-s of the start: bootstrap, ShmemInit, the first barrier)")
    parser.add_argument("--init-window-s", type=float, default=0.6,
                        help="with --phase init, the kill lands in [0, this) s after the ranks start (default 0.6)")
    parser.add_argument("--barrier-every", type=int, default=0,
                        help="the job's host ShmemBarrierAll every so many rounds (default 0: none)")
    parser.add_argument("--jobs", type=int, default=2, help="trials run at the same time (default 2)")
    parser.add_argument("--ready-timeout-s", type=float, default=30, help="bound on start-up (default 30)")
    parser.add_argument("--verbose", action="store_true", help="print every rank's output (failed trials always)")
    parser.add_argument("--faults", default=None, metavar="SPEC",
                        help="no kill: run the job under MORI_EMULATED_NIC_FAULTS=SPEC (without the seed: each run "
                        "adds its own), --kills times; transports rdma and proxy_rdma")
    parser.add_argument("--rounds", type=int, default=200, help="rounds of each --faults run (default 200)")
    parser.add_argument("--bound-s", type=float, default=20,
                        help="how long a --faults run may take from its start to its last rank's end (default 20)")
    parser.add_argument("--ack-timeout-ms", type=int, default=500,
                        help="the NICs' ack timeout in a --faults run unless SPEC sets one (default 500)")
    parser.add_argument("--expect-clean", action="store_true",
                        help="every --faults run must finish all rounds (for specs that lose nothing: delay)")
    args = parser.parse_args()
    args.program = os.path.abspath(args.program)
    if args.faults is not None and args.transport not in NIC_TRANSPORTS:
        parser.error(f"--faults needs a transport over the emulated NIC: {', '.join(NIC_TRANSPORTS)}")

    if args.kill_seed is not None:
        seeds = [args.kill_seed]
        print(f"chaos {args.transport}: one trial by {args.signal.name}, seed {args.kill_seed:#010x}", flush=True)
    else:
        if args.seed is None:
            args.seed = random.SystemRandom().getrandbits(32)
        seeds = derive_seeds(args.seed, args.kills)
        what = (f"{args.kills} kills by {args.signal.name}" if args.faults is None else
                f"{args.kills} runs of {args.rounds} rounds under faults '{args.faults}'")
        print(f"chaos {args.transport}: {what} from --seed {args.seed:#x}, MORI_TIMEOUT_S={args.timeout_s}, "
              f"{args.jobs} at a time", flush=True)

    if args.faults is not None:
        return run_faults(args, seeds)

    start = time.monotonic()
    lock = threading.Lock()
    counts = collections.Counter()
    seconds = []
    reported = []
    exits = []  # from the report to the end of the process
    failed = []

    def report(trial):
        with lock:
            print(trial.summary(), flush=True)
            for info in trial.survivors.values():
                counts[info["outcome"]] += 1
                counts["survivors"] += 1
                counts["runtime_named"] += info["runtime_named"]
                counts["job_named"] += info["job_named"]
                counts["job_exact"] += info["job_exact"]
                counts["named " + info["named"]] += 1
                if info["seconds"] is not None:
                    seconds.append(info["seconds"])
                if info["reported"] is not None:
                    reported.append(info["reported"])
                    if info["seconds"] is not None:
                        exits.append(info["seconds"] - info["reported"])
            report_problems(trial, counts, failed, args.verbose)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(Trial(args, s, i + 1).run) for i, s in enumerate(seeds)]
        for fut in concurrent.futures.as_completed(futures):
            report(fut.result())

    elapsed = time.monotonic() - start
    other = counts["unexpected"] + counts["problem startup"] + counts["problem early exit"] + counts["problem victim"]
    span = f"{min(seconds):.2f}..{max(seconds):.2f} s" if seconds else "-"
    told = f"{min(reported):.2f}..{max(reported):.2f} s" if reported else "-"
    exit_span = f"{max(0.0, min(exits)):.2f}..{max(exits):.2f} s" if exits else "-"
    print(f"chaos_shmem_{args.transport}: {len(seeds)} kills, {counts['survivors']} survivors: "
          f"hangs {counts['hang']}, crashes {counts['crash']}, silent corruptions {counts['corruption']}, "
          f"unnoticed deaths {counts['unnoticed']}, dead PE unnamed {counts['unnamed']}, leaks {counts['leaks']}, "
          f"other failures {other}; dead PE named directly by {counts['named direct']} (in the runtime's "
          f"messages {counts['runtime_named']}, in the job's {counts['job_named']}, the job's naming it alone "
          f"{counts['job_exact']}), only through a cascade by {counts['named cascade']} (and "
          f"{counts['named cascade before the death showed']} more that reported before the killed process was gone), "
          f"by no chain {counts['named unnamed']}; survivors reported {told} "
          f"and ended {span} after the kill (bound {args.timeout_s + args.slack_s:.1f} s; report to exit "
          f"{exit_span}); {elapsed:.1f} s", flush=True)
    if failed:
        print(f"FAILED: {len(failed)} of {len(seeds)} trials; rerun one with --kill-seed (see 'reproduce' above); "
              f"this run: --seed {args.seed:#x}" if args.seed is not None else "FAILED", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
