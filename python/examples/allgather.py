"""All-gather of a symmetric tensor with put-with-signal, from PyTorch, checked against
torch.distributed.all_gather.

Every PE puts its block into row `me` of every PE's copy of `out` and adds 1 to that PE's signal; then it waits
until its own signal counts every PE's block, on the current stream (no host barrier in between), and quiets
its own puts before the next round rewrites their source. The result is
compared with torch.distributed.all_gather of the same blocks (gloo on CPU tensors, whatever the backend).

    torchrun --nproc_per_node=2 python/examples/allgather.py [elements per PE, default 1048576] [rounds, default 3]
    mpirun -np 4 python python/examples/allgather.py          (init() reads mpirun's variables; no all_gather
                                                               check without torch.distributed)
PYTHONPATH must reach the mori package (the build's python/ directory, or an installed mori).
"""

import datetime
import os
import sys
import time

import torch

import mori
import mori.shmem as shmem


def block(pe, rnd, count, device):
    """PE `pe`'s block in round `rnd`: exact in float32 and different for every PE, round and element."""
    i = torch.arange(count, dtype=torch.int64, device=device)
    return ((i * 13 + pe * 1009 + rnd * 7919) % 65521).to(torch.float32)


def main():
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    dist = None
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun: a gloo group to check against
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        shmem.init_from_process_group()
    else:
        shmem.init()
    me, n = shmem.my_pe(), shmem.n_pes()
    device = "cpu" if mori.backend == "HOST" else "cuda"
    gpu = mori.backend != "HOST"
    out = shmem.tensor((n, count), torch.float32)   # row p: PE p's block
    mine = shmem.tensor((count,), torch.float32)    # the source: on the heap, so every transport reads it
    sig = shmem.tensor((1,), torch.int64)
    guard = shmem.tensor((4096,), torch.float32)
    stream = torch.cuda.current_stream() if gpu else None
    shmem.barrier_all()
    for rnd in range(rounds):
        mine.copy_(block(me, rnd, count, device))
        shmem.barrier_all(stream)  # nobody writes round rnd into a row that its owner still reads
        start = time.perf_counter()
        for k in range(n):
            pe = (me + k) % n  # everyone starts with a different destination
            shmem.put_signal(out[me], mine, sig[0], 1, shmem.SignalOp.Add, pe, stream)
        shmem.signal_wait_until(sig[0], shmem.CmpOp.GE, n * (rnd + 1), stream)
        # The puts are non-blocking: this PE's own puts may still read `mine` (over RDMA or the proxy) until a
        # quiet, and the next round rewrites it.
        shmem.quiet(stream)
        if gpu:
            stream.synchronize()
        seconds = time.perf_counter() - start
        got = out.cpu()
        want = torch.stack([block(pe, rnd, count, "cpu") for pe in range(n)])
        bad = (got != want)
        wrong = int(bad.sum())
        if wrong:
            rows = [pe for pe in range(n) if bool(bad[pe].any())]
            first = int(bad[rows[0]].nonzero()[0])
            print(f"PE {me}: round {rnd}: rows of PEs {rows} differ; row {rows[0]} element {first} is "
                  f"{got[rows[0], first].item()}, not {want[rows[0], first].item()}; signal {int(sig.cpu()[0])}",
                  flush=True)
        if dist is not None:
            gathered = [torch.empty(count, dtype=torch.float32) for _ in range(n)]
            dist.all_gather(gathered, mine.cpu())
            if not torch.equal(torch.stack(gathered), got):
                wrong = max(wrong, 1)
                print(f"PE {me}: round {rnd}: differs from torch.distributed.all_gather", flush=True)
        if int(torch.count_nonzero(guard.cpu())) != 0:
            wrong += 1
            print(f"PE {me}: round {rnd}: a tensor outside the all-gather changed", flush=True)
        gbps = n * count * 4 / seconds / 1e9
        print(f"PE {me}/{n}: round {rnd}: {n} x {count} floats, {seconds * 1e3:.3f} ms ({gbps:.2f} GB/s received), "
              f"{'verified' if wrong == 0 else f'{wrong} WRONG'}", flush=True)
        if wrong:
            raise SystemExit(1)
    shmem.barrier_all()
    for t in (guard, sig, mine, out):
        shmem.free_tensor(t)
    shmem.finalize()
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    print(f"PE {me}: allgather OK", flush=True)


if __name__ == "__main__":
    main()
