"""MoE dispatch and combine from PyTorch: mori.ep beside what a PyTorch user would otherwise write, a dispatch and
combine over torch.distributed.all_to_all_single (NCCL), on the same routing, timed the same way; the two
combine outputs are compared (an identity expert: every received token comes back as bf16, so each output row is
the sum of the token's top-k weights times the token, whichever way it travelled).

    torchrun --nproc_per_node=2 bench/ep_bench.py [--tokens 4096] [--hidden 7168] [--experts 256] [--topk 8]
             [--impl mori,nccl] [--kernel intra|inter|ll] [--iters 20] [--warmup 3] [--dtype fp8|bf16]
             [--sync mori|dist]

Counted as bench/ep_bench counts (as DeepEP and MORI count): dispatch bandwidth = bytes of the tokens this rank
received (with their fp8 scales) / time; combine = the bf16 rows it sends back / time. The NCCL version is the
usual one: per-destination counts exchanged first (all_to_all_single of the counts, then the split sizes read on
the host), each token sent once per destination rank (its row packed with its scales, expert ids and weights
into one message, so one all_to_all_single moves everything), combine back the same way and a weighted
index_add. NCCL refuses two ranks on one GPU: --impl mori runs there (two PEs under MPS).
PYTHONPATH must reach the mori package (the build's python/ directory, or an installed mori).
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--impl", default="mori,nccl")
    p.add_argument("--kernel", choices=["intra", "inter", "ll"], default="intra")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--profile", type=int, default=0,
                   help="after the timing, profile the host side of N dispatch and combine calls (cProfile, rank 0)")
    p.add_argument("--sync", choices=["mori", "dist"], default="mori",
                   help="the barrier before each timed mori call: mori.shmem.barrier_all (as bench/ep_bench starts "
                        "its calls) or torch.distributed.barrier; a dispatch cannot end before the last rank's "
                        "tokens arrive, so the ranks' skew after the barrier is in its time")
    p.add_argument("--host-split", type=int, default=0,
                   help="after the timing, N more rounds of each of three ways that time each host call on its "
                        "own (mori): the op's dispatch_send, dispatch_recv and combine; the same with combine's "
                        "output passed in; the C++ handle directly (no argument checks, no views)")
    return p.parse_args()


def routing(a, rank, world, device):
    """Top-k distinct experts per token, uniform; weights that differ per (token, k)."""
    g = torch.Generator(device="cpu").manual_seed(a.seed + rank)
    experts = (a.experts // world) * world
    idx = torch.rand(a.tokens, experts, generator=g).argsort(dim=1)[:, : a.topk].to(torch.int32)
    w = torch.rand(a.tokens, a.topk, generator=g) + 0.5
    w = (w / w.sum(dim=1, keepdim=True)).to(torch.float32)
    return idx.to(device), w.to(device)


def inputs(a, rank, device):
    g = torch.Generator(device="cpu").manual_seed(a.seed * 7 + rank)
    x = (torch.rand(a.tokens, a.hidden, generator=g) * 2 - 1).to(device)
    scale_dim = a.hidden // 128 if a.dtype == "fp8" else 0
    if a.dtype == "fp8":
        x = x.to(torch.float8_e4m3fn)
        scales = (torch.rand(a.tokens, scale_dim, generator=g) + 0.5).to(device)
    else:
        x = x.to(torch.bfloat16)
        scales = None
    return x, scales, scale_dim


class Timer:
    """Median times of a dispatch and the combine after it, every rank starting each together (mori's op wants
    the two alternating: a dispatch may not reuse buffers that peers still read for the previous combine)."""

    def __init__(self, a, gpu):
        self.a, self.gpu = a, gpu
        self.barrier = dist.barrier  # how every rank starts each timed call together
        self.host = []  # host microseconds of each timed call (GPU: to queue it)

    def one(self, fn):
        if self.gpu:
            torch.cuda.synchronize()
        self.barrier()
        if self.gpu:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = fn()
            self.host.append((time.perf_counter() - t0) * 1e6)
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) * 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e6

    def rounds(self, dispatch, expert, combine):
        """(dispatch result, combine result, median dispatch us, median combine us) of the last round; the
        expert step between the two is not timed."""
        td, tc = [], []
        for i in range(self.a.warmup + self.a.iters):
            d, t1 = self.one(dispatch)
            e = expert(d)
            c, t2 = self.one(lambda: combine(e))
            if i >= self.a.warmup:
                td.append(t1)
                tc.append(t2)
        td.sort()
        tc.sort()
        if self.host:
            h = sorted(self.host)
            print(f"rank {dist.get_rank()} host us to queue a call (dispatch or combine), median {h[len(h) // 2]:.1f}",
                  flush=True)
            self.host = []
        return d, c, td[len(td) // 2], tc[len(tc) // 2]


def profile_host(a, op, x, idx, w, scales, shmem, rank):
    """Where the host time of a call goes: cProfile around each dispatch and combine only (not the barriers)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(a.profile):
        shmem.barrier_all()
        prof.enable()
        r = op.dispatch(x, idx, w, scales)
        prof.disable()
        e = dequant(r[0])
        prof.enable()
        op.combine(e)
        prof.disable()
    if rank == 0:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def host_split(a, op, x, idx, w, scales, shmem, rank):
    """Host microseconds of each call of a dispatch and combine, after a barrier and a device synchronisation as
    in the timed rounds, three ways in turn: the op's Python methods, the same with combine's output tensor
    passed in (no allocation), and the C++ handle directly (no argument checks, no views): what the Python
    layer itself adds, and what of it is torch's allocator."""
    import mori.shmem as ms
    pc = time.perf_counter
    gpu = torch.cuda.is_available()
    # On HOST the handle's calls return with their kernels queued (the op's own methods wait for them): status()
    # waits, before the tensors they read are dropped.
    sync = torch.cuda.synchronize if gpu else (lambda: op._h.status(0))
    names = ["dispatch_send", "dispatch_recv", "combine"]
    modes = ["op", "op, out given", "C++ handle"]
    times = {(n, m): [] for n in names for m in modes}
    stream = ms._stream_handle(None, "ep_bench")
    ptrs = (x.data_ptr(), idx.data_ptr(), w.data_ptr(), scales.data_ptr() if scales is not None else 0)
    e = out = None
    for i in range(len(modes) * a.host_split):
        mode = modes[i % len(modes)] if e is not None else modes[0]
        raw = mode == modes[2]
        shmem.barrier_all()
        sync()
        t0 = pc()
        if raw:
            op._h.dispatch_send(*ptrs, x.shape[0], stream)
        else:
            op.dispatch_send(x, idx, w, scales)
        t1 = pc()
        if raw:
            op._h.dispatch_recv(stream)
        else:
            r = op.dispatch_recv()
        t2 = pc()
        if not raw:
            e = dequant(r[0])
        sync()
        t3 = pc()
        if raw:
            op._h.combine(e.data_ptr(), out.data_ptr(), stream)
        elif mode == modes[1]:
            op.combine(e, out=out)
        else:
            out = op.combine(e)
        t4 = pc()
        sync()
        for n, dt in zip(names, (t1 - t0, t2 - t1, t4 - t3)):
            times[(n, mode)].append(dt * 1e6)
    calls = 2000
    each = {}
    for what, fn in (("a trivial handle call", op._h.combine_dtype),
                     ("the stream lookup", lambda: ms._stream_handle(None, "ep_bench")),
                     ("one tensor's checks", lambda: op._check(x, "x", op.dtype, tuple(x.shape), "ep_bench")),
                     ("torch.empty of combine's output", lambda: torch.empty(
                         (x.shape[0], op.config.hidden_dim), dtype=op.combine_dtype, device=op._device()))):
        t0 = pc()
        for _ in range(calls):
            fn()
        each[what] = (pc() - t0) * 1e6 / calls
    med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
    row = ", ".join(f"{n} " + " / ".join(f"{med(times[(n, m)]):.1f}" for m in modes) for n in names)
    print(f"rank {rank} host us per call, {' / '.join(modes)} (median of {a.host_split}): {row}; in a loop: " +
          ", ".join(f"{k} {v:.2f}" for k, v in each.items()), flush=True)


class NcclEp:
    """Dispatch and combine as a PyTorch user writes them with all_to_all_single."""

    def __init__(self, a, world, experts_per_rank):
        self.a, self.world, self.epr = a, world, experts_per_rank

    def dispatch(self, x, scales, idx, w):
        a, world = self.a, self.world
        pe = idx.long() // self.epr                                            # [T, k] destination rank
        mask = torch.zeros(a.tokens, world, dtype=torch.bool, device=x.device)
        mask.scatter_(1, pe, True)                                             # token goes once per rank
        dst, tok = mask.t().nonzero(as_tuple=True)                             # rank-major (dst, token) pairs
        send_counts = mask.sum(dim=0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()   # the host synchronisation
        parts = [x[tok].view(torch.uint8)]
        if scales is not None:
            parts.append(scales[tok].view(torch.uint8))
        parts += [idx[tok].view(torch.uint8), w[tok].view(torch.uint8)]
        send = torch.cat(parts, dim=1)
        recv = torch.empty(sum(recv_split), send.shape[1], dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(recv, send, recv_split, send_split)
        self.state = (dst, tok, send_split, recv_split)
        return recv

    def unpack(self, recv, x, scales):
        """Received rows -> (tokens, scales); views of the message buffer."""
        hb = self.a.hidden * x.element_size()
        tokens = recv[:, :hb].view(x.dtype)
        sc = recv[:, hb: hb + scales.shape[1] * 4].contiguous().view(torch.float32) if scales is not None else None
        return tokens, sc

    def combine(self, expert_out, idx, w):
        dst, tok, send_split, recv_split = self.state
        back = torch.empty(len(tok), self.a.hidden, dtype=expert_out.dtype, device=expert_out.device)
        # As bytes: the same rows, and gloo (the CPU stand-in) has no 16-bit types.
        dist.all_to_all_single(back.view(torch.uint8), expert_out.view(torch.uint8), send_split, recv_split)
        on_dst = (idx[tok].long() // self.epr) == dst.unsqueeze(1)               # the token's experts on that rank
        weight = (w[tok] * on_dst).sum(dim=1, keepdim=True)
        out = torch.zeros(self.a.tokens, self.a.hidden, dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, tok, back.float() * weight)
        return out.to(expert_out.dtype)


def dequant(tokens):
    """The identity expert's output for received rows: the token itself as bf16 (scales are carried, not
    applied, by both implementations, so the comparison needs none)."""
    return tokens.to(torch.bfloat16).contiguous()


def report(rank, name, a, received, row_bytes, d_us, c_us):
    d_bytes = received * (row_bytes + (a.hidden // 128 * 4 if a.dtype == "fp8" else 0))
    c_bytes = received * a.hidden * 2
    print(f"rank {rank} {name:<14} {a.dtype} tokens {a.tokens} hidden {a.hidden} top-{a.topk} experts {a.experts}: "
          f"received {received} | dispatch {d_us:8.1f} us {d_bytes / d_us / 1e3:7.1f} GB/s | "
          f"combine {c_us:8.1f} us {c_bytes / c_us / 1e3:7.1f} GB/s", flush=True)


def main():
    a = parse()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if gpu:
        torch.cuda.set_device(local % torch.cuda.device_count())
    impls = a.impl.split(",")
    # The NCCL version needs NCCL on a GPU; on a machine without one (mori's HOST backend) gloo plays it.
    backend = "nccl" if gpu and "nccl" in impls else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    epr = max(1, a.experts // world)
    a.experts = epr * world
    idx, w = routing(a, rank, world, device)
    x, scales, scale_dim = inputs(a, rank, device)
    row_bytes = a.hidden * x.element_size()
    timer = Timer(a, gpu)
    outputs = {}

    if "nccl" in impls:
        nc = NcclEp(a, world, epr)

        recv, outputs["nccl"], d_us, c_us = timer.rounds(lambda: nc.dispatch(x, scales, idx, w),
                                                         lambda recv: dequant(nc.unpack(recv, x, scales)[0]),
                                                         lambda e: nc.combine(e, idx, w))
        report(rank, "nccl a2a", a, recv.shape[0], row_bytes, d_us, c_us)

    if "mori" in impls:
        import mori.ep as ep
        import mori.shmem as shmem
        shmem.init_from_process_group()
        kernel = {"intra": ep.KERNEL_INTRA_NODE, "inter": ep.KERNEL_INTER_NODE, "ll": ep.KERNEL_LOW_LATENCY}[a.kernel]
        cfg = ep.EpDispatchCombineConfig(hidden_dim=a.hidden, max_tokens_per_rank=a.tokens, num_experts_per_rank=epr,
                                         topk=a.topk, dtype=x.dtype, scale_dim=scale_dim, kernel=kernel)
        op = ep.EpDispatchCombineOp(cfg)
        if a.sync == "mori":
            timer.barrier = shmem.barrier_all
        r, outputs["mori"], d_us, c_us = timer.rounds(lambda: op.dispatch(x, idx, w, scales),
                                                      lambda r: dequant(r[0]), op.combine)
        op.check()
        received = int(r[4].item())  # the result's views hold until the next dispatch (the rounds below)
        if a.profile > 0:
            profile_host(a, op, x, idx, w, scales, shmem, rank)
        if a.host_split > 0:
            host_split(a, op, x, idx, w, scales, shmem, rank)
        # LowLatency receives a row per (token, local expert), as DeepEP's low-latency kernels count.
        report(rank, f"mori {a.kernel}", a, received, row_bytes, d_us, c_us)

    # Weights sum to 1 per token and the expert is the identity: every output row is the token itself.
    want = x.to(torch.bfloat16).float()
    bad = False
    for name, out in outputs.items():
        err = ((out.float() - want).abs() / want.abs().clamp_min(1e-2)).max().item()
        ok = torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2)
        bad = bad or not ok
        print(f"rank {rank} {name} combine output against the tokens: max relative difference {err:.2e} "
              f"({'exact within bf16' if ok else 'WRONG'})", flush=True)
    if bad:
        sys.exit(1)

    if "mori" in impls:
        op.close()
        shmem.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
