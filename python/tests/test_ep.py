"""mori.ep with two processes started by MORI_* variables, each transport: dispatch exact against a reference
built from every PE's inputs (each PE makes all of them from seeds), combine with identity experts against
(sum of weights) * token within bf16's tolerance, rounds that change the routing and the token counts (zero on
one PE), a dtype the op was not built for, and an expert id out of range that aborts the round everywhere;
every kernel type (LowLatency with its grouped layout), the one-call forms and the two halves."""

import sys

import pytest

from test_multi_pe import base_env, free_port_pair, run_all

PE_SCRIPT = r"""
import sys, torch, mori
import mori.shmem as shmem
import mori.ep as ep
kernel = sys.argv[1]
shmem.init()
me, n = shmem.my_pe(), shmem.n_pes()
dev = torch.device("cpu") if mori.backend == "HOST" else torch.device("cuda", torch.cuda.current_device())
H, M, E, K = 48, 16, 3, 4
op = ep.EpDispatchCombineOp(ep.EpDispatchCombineConfig(hidden_dim=H, max_tokens_per_rank=M, num_experts_per_rank=E,
                                                       topk=K, dtype=torch.bfloat16, kernel=kernel))

def inputs(rank, rnd):
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    count = 0 if (rnd == 3 and rank == 1) else M - (rank + rnd) % 3
    x = (torch.randint(-64, 64, (count, H), generator=g).float() / 16).to(torch.bfloat16)
    idx = torch.randint(0, E * n, (count, K), generator=g, dtype=torch.int32)
    if rnd % 2 == 0 and count > 0:
        idx[:, 1] = idx[:, 0]  # duplicates within a token's top-k
    w = (torch.randint(1, 8, (count, K), generator=g).float() / 8)
    return x, idx, w

ll = kernel == ep.KERNEL_LOW_LATENCY

for rnd in range(1, 7):
    every = [inputs(r, rnd) for r in range(n)]
    x, idx, w = (t.to(dev) for t in every[me])
    split = rnd % 2 == 0  # even rounds call the two halves of dispatch and combine
    if split:
        op.dispatch_send(x, idx, w)
        tokens, wts, ids, scales, total = op.dispatch_recv()
    else:
        tokens, wts, ids, scales, total = op.dispatch(x, idx, w)
    op.check()
    assert scales is None
    got = int(total.item())
    if ll:  # grouped: expert e's rows are tokens[e, :expert_counts[e]], a row per token naming e
        groups = [[(s, t) for s in range(n) for t in range(every[s][0].shape[0])
                   if bool((every[s][1][t] == me * E + e).any())] for e in range(E)]
        assert tokens.shape == (E, n * M, H), tokens.shape
        want_counts = torch.tensor([len(g) for g in groups], dtype=torch.int32)
        where = [((e, i), st) for e, g in enumerate(groups) for i, st in enumerate(g)]
    else:
        rows = [(s, t) for s in range(n) for t in range(every[s][0].shape[0])
                if bool(((every[s][1][t] // E) == me).any())]
        want_counts = torch.zeros(E, dtype=torch.int32)
        for s in range(n):
            for e in every[s][1].flatten().tolist():
                if e // E == me:
                    want_counts[e % E] += 1
        where = [(i, st) for i, st in enumerate(rows)]
    assert got == len(where), f"PE {me} round {rnd}: {got} rows, want {len(where)}"
    for at, (s, t) in where:
        assert torch.equal(tokens[at].cpu(), every[s][0][t]), f"PE {me} round {rnd} row {at}"
        assert torch.equal(ids[at].cpu(), every[s][1][t]) and torch.equal(wts[at].cpu(), every[s][2][t])
        assert int(op.src_token_pos[at]) == s * M + t
    assert torch.equal(op.expert_counts.cpu(), want_counts), (op.expert_counts, want_counts)
    expert_out = tokens.clone() if ll else tokens[:got].clone()  # identity experts
    if split:
        op.combine_send(expert_out)
        out = op.combine_recv()
    else:
        out = op.combine(expert_out)
    op.check()
    want = (x.float() * w.sum(1, keepdim=True)).cpu()
    assert out.shape == (x.shape[0], H) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float().cpu(), want, rtol=1e-2, atol=1e-2), f"PE {me} round {rnd}: combine differs"

x, idx, w = (t.to(dev) for t in inputs(me, 9))
try:
    op.dispatch(x.float(), idx, w)
    raise SystemExit("a float32 input was accepted")
except mori.MoriError as e:
    assert "x is torch.float32, the op needs torch.bfloat16" in str(e), e
if me == n - 1:
    idx[2, 3] = 1000
op.dispatch(x, idx, w)
try:
    op.check()
    raise SystemExit("the bad expert id was not reported")
except mori.MoriError as e:
    words = "token 2, top-k slot 3 names expert 1000" if me == n - 1 else f"PE {n - 1} found bad input"
    assert words in str(e), e
op.combine(torch.zeros((E, n * M, H) if ll else (1, H), dtype=torch.bfloat16, device=dev))
try:
    op.check()  # the aborted round's combine skipped too; the error stays until the next dispatch
except mori.MoriError:
    pass
x, idx, w = (t.to(dev) for t in inputs(me, 10))
tokens, wts, ids, scales, total = op.dispatch(x, idx, w)
op.check()
out = op.combine(tokens.clone() if ll else tokens[:int(total.item())].clone())
op.check()
assert torch.allclose(out.float().cpu(), (x.float() * w.sum(1, keepdim=True)).cpu(), rtol=1e-2, atol=1e-2)
op.close()
shmem.finalize()
print(f"PE {me}: ep OK", flush=True)
"""


@pytest.mark.parametrize("transport,kernel", [("p2p", "IntraNode"), ("p2p", "InterNode"), ("rdma", "InterNode"),
                                              ("proxy", "InterNode"), ("p2p", "LowLatency"),
                                              ("rdma", "LowLatency"), ("proxy", "LowLatency")])
def test_dispatch_combine_two_pes(transport, kernel):
    port = free_port_pair()
    env = lambda r: base_env(MORI_RANK=str(r), MORI_WORLD_SIZE="2", MORI_BOOTSTRAP_ADDR=f"127.0.0.1:{port}",
                             MORI_SHMEM_TRANSPORT=transport)
    report = run_all([([sys.executable, "-c", PE_SCRIPT, kernel], env(r)) for r in range(2)])
    assert report.count(": ep OK\n") == 2, report
