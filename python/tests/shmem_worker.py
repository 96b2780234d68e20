"""One PE of a multi-process mori.shmem job (started by test_multi_pe.py). Each PE writes a rank- and index-
dependent pattern into symmetric tensors of every dtype and reads every peer's through peer_tensor; then writes a
strided block into its right neighbour's copy through a peer view, and checks that its own copy holds exactly
the left neighbour's block and its own pattern elsewhere. Exits non-zero (with the reason) on any mismatch.

    shmem_worker.py env            init() from the launch environment (mpirun, torchrun variables, MORI_*)
    shmem_worker.py gloo           torch.distributed (gloo) over the world, then init_from_process_group()
    shmem_worker.py gloo-subgroup  the same over the group of world ranks 1 and 3 (the others only wait)

MORI_SHMEM_TRANSPORT, when set, is the transport every peer must have.
"""

import datetime
import os
import sys

import torch

import mori
import mori.shmem as shmem
from patterns import DTYPES, expect_device, pattern

ROWS, COLS = 7, 9
EXPECTED = {"p2p": shmem.Transport.P2P, "rdma": shmem.Transport.RDMA, "proxy": shmem.Transport.Proxy}


def check(cond, what):
    if not cond:
        raise AssertionError(f"PE {shmem.my_pe()}: {what}")


def launcher_rank():
    for var in ("MORI_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise AssertionError("no launcher rank variable")


def check_transports(me, n):
    forced = os.environ.get("MORI_SHMEM_TRANSPORT", "auto")
    for pe in range(n):
        t = shmem.transport(pe)
        if pe == me:
            check(t == shmem.Transport.Self, f"transport to itself is {t}")
        elif forced in EXPECTED:
            check(t == EXPECTED[forced], f"transport to PE {pe} is {t}, MORI_SHMEM_TRANSPORT={forced}")
        elif mori.backend == "HOST":
            check(t == shmem.Transport.P2P, f"transport to same-host PE {pe} is {t}, not P2P")
    for bad in (n, -1):
        try:
            shmem.transport(bad)
        except mori.MoriError as e:
            check(f"PE {bad} is not in [0, {n})" in str(e), f"unexpected message: {e}")
        else:
            check(False, f"transport({bad}) did not raise")


def exchange(me, n, dtype, device):
    t = shmem.tensor((ROWS, COLS), dtype)
    t.copy_(pattern((ROWS, COLS), dtype, me, device))
    shmem.barrier_all()
    mapped = {}
    for pe in range(n):
        peer = shmem.peer_tensor(t, pe)
        mapped[pe] = peer is not None
        check(mapped[pe] == (shmem.transport(pe) in (shmem.Transport.Self, shmem.Transport.P2P)),
              f"peer_tensor to PE {pe} over {shmem.transport(pe)} returned {peer is not None and 'a view'}")
        if peer is not None:
            check(peer.dtype == dtype and tuple(peer.shape) == (ROWS, COLS), f"PE {pe}'s view has the wrong type")
            check(torch.equal(peer.cpu(), pattern((ROWS, COLS), dtype, pe)), f"{dtype}: PE {pe}'s copy differs")
    shmem.barrier_all()
    right, left = (me + 1) % n, (me - 1) % n
    block = (slice(2, 5), slice(1, COLS - 1, 3))
    if mapped[right]:
        view = shmem.peer_tensor(t[block], right)
        view.copy_(pattern(tuple(view.shape), dtype, 100 + me, device))
    shmem.barrier_all()
    expected = pattern((ROWS, COLS), dtype, me)
    if mapped[left]:  # the transports of a same-host job are symmetric: left mapped me as I mapped it
        expected[block] = pattern(tuple(expected[block].shape), dtype, 100 + left)
    check(torch.equal(t.cpu(), expected), f"{dtype}: my copy after the neighbour's write differs:\n{t}\nexpected\n"
          f"{expected}")
    shmem.barrier_all()
    shmem.free_tensor(t)


def ops_and_teams(me, n, device):
    """put_signal around the ring and the wait for it, get from the right, put + quiet + barrier; then the even
    and the odd PEs as teams, each syncing and exchanging within itself while the other does the same."""
    right, left = (me + 1) % n, (me - 1) % n
    cols = 3000
    buf = shmem.tensor((cols,), torch.int32)
    sig = shmem.tensor((1,), torch.int64)
    guard = shmem.tensor((128,), torch.int32)
    mine = pattern((cols,), torch.int32, 500 + me, device)
    src = shmem.tensor((cols,), torch.int32)  # on the heap: every transport reads it
    src.copy_(mine)
    shmem.barrier_all()
    shmem.put_signal(buf, src, sig[0], 3, shmem.SignalOp.Add, right)
    shmem.signal_wait_until(sig[0], shmem.CmpOp.EQ, 3)
    if mori.backend != "HOST":
        torch.cuda.current_stream().synchronize()
    check(torch.equal(buf.cpu(), pattern((cols,), torch.int32, 500 + left)), "put_signal: the left's data")
    back = shmem.tensor((cols,), torch.int32)
    shmem.barrier_all()
    shmem.get(back, buf, right)  # the right's copy holds what this PE sent it
    shmem.quiet()
    shmem.barrier_all(stream=None if mori.backend == "HOST" else torch.cuda.current_stream())
    if mori.backend != "HOST":
        torch.cuda.current_stream().synchronize()
    check(torch.equal(back.cpu(), mine.cpu()), "get from the right")
    check(torch.count_nonzero(guard.cpu()) == 0, "the guard tensor changed")
    world = shmem.team_world()
    evens = shmem.team_split_strided(world, 0, 2, (n + 1) // 2)
    odds = shmem.team_split_strided(world, 1, 2, n // 2)
    team = evens if me % 2 == 0 else odds
    check(team is not None and (odds if me % 2 == 0 else evens) is None, "split: my half only")
    check(team.my_pe() == me // 2 and team.n_pes() == ((n + 1) // 2 if me % 2 == 0 else n // 2), f"{team}")
    check(all(team.translate_pe(i) == 2 * i + me % 2 for i in range(team.n_pes())), "translate to the world")
    slots = shmem.tensor((n,), torch.int64)
    word_src = shmem.tensor((1,), torch.int64)
    word_src.copy_(pattern((1,), torch.int64, 700 + me, device))
    team.sync()
    for i in range(team.n_pes()):
        shmem.put(slots[me:me + 1], word_src, team.translate_pe(i))
    shmem.quiet()
    team.sync(stream=None if mori.backend == "HOST" else torch.cuda.current_stream())
    if mori.backend != "HOST":
        torch.cuda.current_stream().synchronize()
    got = slots.cpu()
    for pe in range(n):
        want = pattern((1,), torch.int64, 700 + pe) if pe % 2 == me % 2 else torch.zeros(1, dtype=torch.int64)
        check(torch.equal(got[pe:pe + 1], want), f"team slot of PE {pe}: {got[pe]}")
    shmem.barrier_all()
    team.destroy()
    for t in (word_src, slots, back, src, guard, sig, buf):
        shmem.free_tensor(t)


def run_pe(launch, group=None):
    me, n = shmem.my_pe(), shmem.n_pes()
    print(f"PE {me} of {n} ({launch}), transport to each: {[shmem.transport(pe).name for pe in range(n)]}",
          flush=True)
    check(n >= 2, f"{n} PEs")
    device = expect_device(mori.backend)
    check_transports(me, n)
    guard = shmem.tensor((257,), torch.int64)
    guard.copy_(pattern((257,), torch.int64, 1000 + me, device))
    if group is not None or launch == "gloo":
        import torch.distributed as dist
        check(me == dist.get_rank(group), f"my_pe {me} is not the group rank {dist.get_rank(group)}")
        # torch.distributed sees the same data mori's peers do.
        t = shmem.tensor((ROWS, COLS), torch.int32)
        t.copy_(pattern((ROWS, COLS), torch.int32, me, device))
        gathered = [torch.zeros(ROWS, COLS, dtype=torch.int32) for _ in range(n)]
        dist.all_gather(gathered, t.cpu(), group=group)
        for pe in range(n):
            peer = shmem.peer_tensor(t, pe)
            if peer is not None:
                check(torch.equal(peer.cpu(), gathered[pe]), f"all_gather and PE {pe}'s copy differ")
        shmem.barrier_all()
        shmem.free_tensor(t)
    else:
        check(me == launcher_rank(), f"my_pe {me} is not the launcher's rank {launcher_rank()}")
    for dtype in DTYPES:
        exchange(me, n, dtype, device)
    check(torch.equal(guard.cpu(), pattern((257,), torch.int64, 1000 + me)), "a tensor outside the exchange changed")
    try:
        shmem.peer_tensor(torch.zeros(4, device=device), (me + 1) % n)
    except mori.MoriError as e:
        check("not on this PE's symmetric heap" in str(e), f"unexpected message: {e}")
    else:
        check(False, "peer_tensor of a tensor off the heap did not raise")
    ops_and_teams(me, n, device)
    shmem.free_tensor(guard)
    shmem.finalize()
    print(f"PE {me} of {n}: OK", flush=True)


def main():
    launch = sys.argv[1]
    if launch == "env":
        shmem.init()
        run_pe(launch)
        return
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    if launch == "gloo":
        shmem.init_from_process_group()
        run_pe(launch)
    elif launch == "gloo-subgroup":
        members = [1, 3]
        group = dist.new_group(members)
        if dist.get_rank() in members:
            shmem.init_from_process_group(group)
            check(shmem.n_pes() == 2 and shmem.my_pe() == members.index(dist.get_rank()), "subgroup ranks")
            run_pe(launch, group)
        else:
            print(f"world rank {dist.get_rank()}: not in the group", flush=True)
    else:
        raise SystemExit(f"unknown launch '{launch}'")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
