"""mori.shmem across processes: shmem_worker.py started by mpirun (each transport forced, 2 and 4 PEs), by
torch.distributed with gloo (the world, and a subgroup), with torchrun's variables and with MORI_* variables.
Every job is bounded: MORI_TIMEOUT_S inside, a deadline on the processes outside."""

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("shmem_worker.py")
DEADLINE_S = 240


def free_port_pair():
    """A port p with p + 1 also free (torchrun's store takes MASTER_PORT, mori's root MASTER_PORT + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports")


def base_env(**extra):
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MORI_RANK", "MORI_WORLD_SIZE",
                "MORI_BOOTSTRAP_ADDR", "MORI_SHMEM_TRANSPORT"):
        env.pop(var, None)
    tests_dir = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH", "")) if p)
    env.setdefault("MORI_TIMEOUT_S", "60")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_all(commands, exit_codes=None):
    """Starts every (argv, env) at once, waits for all within the deadline, and fails with everyone's output if
    any exits with another code than expected (0 unless `exit_codes` says) or runs out of time."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, logs = [], []
        for i, (argv, env) in enumerate(commands):
            log = open(Path(tmp) / f"proc{i}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outputs = []
        for i, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            outputs.append(f"--- process {i} (exit {p.returncode}): {' '.join(commands[i][0])}\n{log.read()}")
            log.close()
        report = "\n".join(outputs)
        assert not timed_out, f"job ran past {DEADLINE_S} s\n{report}"
        assert [p.returncode for p in procs] == (exit_codes or [0] * len(procs)), report
        return report


def pe_commands(n, mode, per_rank_env):
    return [([sys.executable, str(WORKER), mode], base_env(**per_rank_env(rank))) for rank in range(n)]


@pytest.mark.parametrize("transport,np", [("p2p", 2), ("rdma", 2), ("proxy", 2), ("p2p", 4), ("rdma", 4), ("proxy", 4)])
def test_mpirun(transport, np):
    mpirun = os.environ.get("MORITEST_MPIRUN")
    if not mpirun:
        pytest.skip("mori was built without MPI (no MORITEST_MPIRUN)")
    env = base_env(MORI_SHMEM_TRANSPORT=transport)
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np)]
    for var in ("PYTHONPATH", "MORI_SHMEM_TRANSPORT", "MORI_TIMEOUT_S", "MORI_SHMEM_HEAP_SIZE", "OMP_NUM_THREADS"):
        if var in env:
            argv += ["-x", var]
    report = run_all([(argv + [sys.executable, str(WORKER), "env"], env)])
    assert report.count(": OK") == np, report


def test_torch_distributed_gloo():
    port = free_port_pair()
    report = run_all(pe_commands(2, "gloo", lambda r: dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                              MASTER_PORT=str(port))))
    assert report.count(": OK") == 2, report


def test_torch_distributed_gloo_subgroup():
    port = free_port_pair()
    report = run_all(pe_commands(4, "gloo-subgroup", lambda r: dict(RANK=str(r), WORLD_SIZE="4",
                                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))))
    assert report.count(": OK") == 2 and report.count("not in the group") == 2, report


@pytest.mark.parametrize("transport", ["p2p", "rdma", "proxy"])
def test_torchrun_variables(transport):
    port = free_port_pair()
    report = run_all(pe_commands(2, "env", lambda r: dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                             MORI_SHMEM_TRANSPORT=transport)))
    assert report.count(": OK") == 2, report


def test_mori_variables():
    port = free_port_pair()
    report = run_all(pe_commands(2, "env", lambda r: dict(MORI_RANK=str(r), MORI_WORLD_SIZE="2",
                                                             MORI_BOOTSTRAP_ADDR=f"127.0.0.1:{port}")))
    assert report.count(": OK") == 2, report


PEER_FAILURE = """
import os
import mori, mori.shmem as shmem
rank = int(os.environ["MORI_RANK"])
if rank == 1 and os.environ["CASE"] == "missing":
    raise SystemExit(0)  # never starts mori
try:
    shmem.init()
    if rank == 1:
        os._exit(3)  # dies without finalize
    shmem.barrier_all()
except mori.MoriError as e:
    print("MoriError:", e, flush=True)
    os._exit(0)
raise SystemExit("no MoriError")
"""


# A dead peer is found by the receive that sees its socket close, by a send it resets, or by a send to a rank
# whose connection the receiver already found closed, whichever comes first: each message names rank 1.
@pytest.mark.parametrize("case,causes", [("missing", ["rank(s) 1 of 2 never registered"]),
                                         ("dies", ["rank 1 closed its bootstrap connection",
                                                   "rank 1 closed the connection (process gone?)",
                                                   "cannot send to rank 1: closed its bootstrap connection"])])
def test_a_missing_or_dead_peer_raises_instead_of_hanging(case, causes):
    port = free_port_pair()
    report = run_all([([sys.executable, "-c", PEER_FAILURE],
                       base_env(CASE=case, MORI_TIMEOUT_S="5", MORI_RANK=str(r), MORI_WORLD_SIZE="2",
                                MORI_BOOTSTRAP_ADDR=f"127.0.0.1:{port}")) for r in range(2)],
                     exit_codes=[0, 0 if case == "missing" else 3])
    assert "MoriError: mori.shmem." in report and any(c in report for c in causes), report


EXAMPLE = Path(__file__).parent.parent / "examples" / "allgather.py"


@pytest.mark.parametrize("np,transport", [(2, "p2p"), (4, "p2p"), (2, "proxy")])
def test_allgather_example_with_torchrun_variables(np, transport):
    """The example as torchrun starts it (Debian's torchrun fails on its Python: its variables, set here), checked
    against torch.distributed.all_gather."""
    port = free_port_pair()
    report = run_all([([sys.executable, str(EXAMPLE), "3000", "3"],
                       base_env(RANK=str(r), WORLD_SIZE=str(np), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), MORI_SHMEM_TRANSPORT=transport)) for r in range(np)])
    assert report.count("allgather OK") == np and report.count("verified") == 3 * np, report


def test_allgather_example_under_mpirun():
    mpirun = os.environ.get("MORITEST_MPIRUN")
    if not mpirun:
        pytest.skip("mori was built without MPI (no MORITEST_MPIRUN)")
    env = base_env(MORI_SHMEM_TRANSPORT="rdma")
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    for var in ("PYTHONPATH", "MORI_SHMEM_TRANSPORT", "MORI_TIMEOUT_S", "MORI_SHMEM_HEAP_SIZE", "OMP_NUM_THREADS"):
        argv += ["-x", var]
    report = run_all([(argv + [sys.executable, str(EXAMPLE), "5000", "2"], env)])
    assert report.count("allgather OK") == 2, report
