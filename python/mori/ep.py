"""mori.ep: MoE expert-parallel dispatch and combine on torch tensors (the C++ op mori::ep under it).

    op = mori.ep.EpDispatchCombineOp(mori.ep.EpDispatchCombineConfig(hidden_dim=7168, max_tokens_per_rank=4096,
                                     num_experts_per_rank=32, topk=8, dtype=torch.bfloat16))
    tokens, weights, indices, scales, total_recv = op.dispatch(x, topk_idx, topk_weights)
    out = op.combine(expert_out)        # expert_out: [rows, hidden] in the received order

Construction is collective (after mori.shmem.init()); every PE then calls dispatch and combine alternately, in
the same order. The dispatch results are views of the op's buffers, valid until the next dispatch: rows
[0, total_recv) of `tokens` ([world * max_tokens_per_rank, hidden]), with their top-k `weights` and `indices`
and `scales` (None without scales); `total_recv` is a one-element int32 tensor on the device (-1 when the
round was aborted), read without a host synchronisation only when the caller chooses to. `op.src_token_pos`
and `op.expert_counts` hold each row's source (PE * max_tokens_per_rank + position) and the rows per local
expert. Errors the host can see raise mori.MoriError at once; an expert id out of range is found by the
kernels, aborts the round on every PE and is raised by `op.check()` (which waits for the stream).

KERNEL_LOW_LATENCY (decode batches) returns the rows grouped per local expert: `tokens` is
[num_experts_per_rank, world * max_tokens_per_rank, hidden] (expert e's rows are [e, :expert_counts[e]], in
(source, position) order), `weights`, `indices`, `scales` and `op.src_token_pos` the same way, and total_recv
the sum of expert_counts; combine takes `expert_out` of that shape (one output row per received row) and sums
every (token, expert) row with the token's weight for that expert.

Each call has two halves for overlapping work: `op.dispatch_send(...)` then `op.dispatch_recv()` (which
returns what dispatch returns), `op.combine_send(expert_out)` then `op.combine_recv()`.
"""

from dataclasses import dataclass

from . import _mori
from ._mori import MoriError
from . import shmem as _shmem

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp", "KERNEL_INTRA_NODE", "KERNEL_INTER_NODE",
           "KERNEL_LOW_LATENCY"]

KERNEL_INTRA_NODE, KERNEL_INTER_NODE, KERNEL_LOW_LATENCY = "IntraNode", "InterNode", "LowLatency"
_KERNELS = {KERNEL_INTRA_NODE: 0, KERNEL_INTER_NODE: 1, KERNEL_LOW_LATENCY: 2}


def _dtype_codes():
    torch = _shmem._torch()
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    if hasattr(torch, "float8_e4m3fn"):
        codes[torch.float8_e4m3fn] = 3
    return codes


@dataclass
class EpDispatchCombineConfig:
    hidden_dim: int
    max_tokens_per_rank: int
    num_experts_per_rank: int
    topk: int
    dtype: object = None            # torch dtype of the dispatched tokens (default bfloat16)
    scale_dim: int = 0              # float32 scales per token travelling with it (fp8), 0: none
    kernel: str = KERNEL_INTRA_NODE  # IntraNode (P2P), InterNode (RDMA, Proxy, any), LowLatency (any)
    blocks: int = 0
    warps_per_block: int = 0


class EpDispatchCombineOp:
    def __init__(self, config):
        torch = _shmem._torch()
        self.config = config
        self.dtype = config.dtype if config.dtype is not None else torch.bfloat16
        codes = _dtype_codes()
        if self.dtype not in codes:
            raise MoriError(f"mori.ep: dtype {self.dtype} is not supported (float32, bfloat16, float16, "
                            "float8_e4m3fn)")
        if config.kernel not in _KERNELS:
            raise MoriError(f"mori.ep: kernel {config.kernel!r} is not one of {sorted(_KERNELS)}")
        self._dev = None
        self._device()
        self._h = _mori.EpHandle(config.hidden_dim, config.max_tokens_per_rank, config.num_experts_per_rank,
                                 config.topk, codes[self.dtype], config.scale_dim, _KERNELS[config.kernel],
                                 config.blocks, config.warps_per_block)
        combine_code = self._h.combine_dtype()
        self.combine_dtype = next(d for d, c in codes.items() if c == combine_code)
        self._rows = _shmem.n_pes() * config.max_tokens_per_rank
        self._grouped = config.kernel == KERNEL_LOW_LATENCY
        self._num_tokens = None
        self._pending = None
        self._keep = None
        self.src_token_pos = None
        self.expert_counts = None
        # Tensors over the result buffers, by their addresses: LowLatency's row count alternates between two
        # control blocks from round to round, so two sets are kept.
        self._views = {}

    def _device(self):
        """Where the op's tensors live: the heap's GPU, the current device when the op was built (asked once: it
        is several microseconds of every call otherwise)."""
        if self._dev is None:
            torch = _shmem._torch()
            self._dev = torch.device("cpu") if _mori.backend == "HOST" else torch.device(
                "cuda", torch.cuda.current_device())
        return self._dev

    def _check(self, t, name, dtype, shape, op):
        if t.dtype != dtype:
            raise MoriError(f"{op}: {name} is {t.dtype}, the op needs {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise MoriError(f"{op}: {name} has shape {tuple(t.shape)}, the op needs {tuple(shape)}")
        if not t.is_contiguous():
            raise MoriError(f"{op}: {name} must be contiguous")
        if t.device != self._dev:
            raise MoriError(f"{op}: {name} is on {t.device}, the op's tensors are on {self._dev}")

    def _view(self, address, shape, dtype):
        torch = _shmem._torch()
        if dtype in (torch.float32, torch.int32, torch.bfloat16, torch.float16):
            return _shmem._wrap(address, shape, [], dtype)
        return _shmem._wrap(address, shape, [], torch.uint8).view(dtype)  # fp8 crosses as bytes

    def dispatch(self, x, indices, weights, scales=None, stream=None):
        """x [n, hidden] of the op's dtype, indices [n, topk] int32 expert ids, weights [n, topk] float32, scales
        [n, scale_dim] float32 or None. Returns (tokens, weights, indices, scales, total_recv)."""
        self.dispatch_send(x, indices, weights, scales, stream)
        return self.dispatch_recv(stream)

    def dispatch_send(self, x, indices, weights, scales=None, stream=None):
        """The first half of dispatch: this PE's tokens leave (queued on the stream)."""
        torch = _shmem._torch()
        op, c = "mori.ep.dispatch", self.config
        n = x.shape[0] if x.dim() >= 1 else -1
        self._check(x, "x", self.dtype, (n, c.hidden_dim), op)
        self._check(indices, "indices", torch.int32, (n, c.topk), op)
        self._check(weights, "weights", torch.float32, (n, c.topk), op)
        if c.scale_dim > 0:
            if scales is None:
                raise MoriError(f"{op}: the op carries {c.scale_dim} scales per token; pass scales")
            self._check(scales, "scales", torch.float32, (n, c.scale_dim), op)
        elif scales is not None:
            raise MoriError(f"{op}: scales given, but the op was built with scale_dim 0")
        self._h.dispatch_send(x.data_ptr(), indices.data_ptr(), weights.data_ptr(),
                              scales.data_ptr() if scales is not None else 0, n, _shmem._stream_handle(stream, op))
        self._pending = n
        self._settle((x, indices, weights, scales))

    def dispatch_recv(self, stream=None):
        """The second half: waits (on the stream) for every PE's tokens; returns what dispatch returns."""
        op = "mori.ep.dispatch_recv"
        addr = tuple(self._h.dispatch_recv(_shmem._stream_handle(stream, op)))
        self._num_tokens, self._pending = self._pending, None
        self._settle(self._keep)
        views = self._views.get(addr)
        if views is None:
            if len(self._views) >= 4:
                self._views.clear()
            views = self._views[addr] = self._make_views(addr)
        tokens, w, idx, s, total, self.src_token_pos, self.expert_counts = views
        return tokens, w, idx, s, total

    def _make_views(self, addr):
        """Tensors over the op's result buffers. The buffers stay where they are for the op's life, so the views
        are made once: making seven through DLPack cost about 50 us per dispatch (H100, 2026-11-26), more than
        a whole 128-token dispatch kernel."""
        torch = _shmem._torch()
        c = self.config
        lead = (c.num_experts_per_rank, self._rows) if self._grouped else (self._rows,)
        k = c.topk
        return (self._view(addr[0], lead + (c.hidden_dim,), self.dtype),
                self._view(addr[1], lead + (k,), torch.float32),
                self._view(addr[2], lead + (k,), torch.int32),
                self._view(addr[3], lead + (c.scale_dim,), torch.float32) if c.scale_dim > 0 else None,
                self._view(addr[4], (1,), torch.int32),
                self._view(addr[5], lead, torch.int32),
                self._view(addr[6], (c.num_experts_per_rank,), torch.int32))

    def _expert_out(self, expert_out, op):
        c = self.config
        if self._num_tokens is None:
            raise MoriError(f"{op}: combine without a dispatch before it")
        if self._grouped:
            shape = (c.num_experts_per_rank, self._rows, c.hidden_dim)
        else:
            shape = (expert_out.shape[0] if expert_out.dim() == 2 else -1, c.hidden_dim)
        self._check(expert_out, "expert_out", self.combine_dtype, shape, op)

    def combine(self, expert_out, stream=None, out=None):
        """expert_out [rows >= total_recv, hidden] of combine_dtype in the received order (LowLatency: the
        grouped [num_experts_per_rank, world * max_tokens_per_rank, hidden]) -> [n, hidden]: per token, the
        sum over the PEs it went to of (its weights for that PE's experts) * that PE's row (LowLatency: of
        each expert's row times the token's weight for it)."""
        torch = _shmem._torch()
        op, c = "mori.ep.combine", self.config
        self._expert_out(expert_out, op)
        if out is None:
            out = torch.empty((self._num_tokens, c.hidden_dim), dtype=self.combine_dtype, device=self._device())
        self._check(out, "out", self.combine_dtype, (self._num_tokens, c.hidden_dim), op)
        self._h.combine(expert_out.data_ptr(), out.data_ptr(), _shmem._stream_handle(stream, op))
        self._settle((expert_out, out))
        return out

    def combine_send(self, expert_out, stream=None):
        """The first half of combine: this PE's expert outputs go back to their sources."""
        op = "mori.ep.combine_send"
        self._expert_out(expert_out, op)
        self._h.combine_send(expert_out.data_ptr(), _shmem._stream_handle(stream, op))
        self._settle((expert_out,))

    def combine_recv(self, stream=None, out=None):
        """The second half: waits for every PE's rows and returns the [n, hidden] output."""
        torch = _shmem._torch()
        op, c = "mori.ep.combine_recv", self.config
        if self._num_tokens is None:
            raise MoriError(f"{op}: combine_recv without a dispatch before it")
        if out is None:
            out = torch.empty((self._num_tokens, c.hidden_dim), dtype=self.combine_dtype, device=self._device())
        self._check(out, "out", self.combine_dtype, (self._num_tokens, c.hidden_dim), op)
        self._h.combine_recv(out.data_ptr(), _shmem._stream_handle(stream, op))
        self._settle(tuple(self._keep or ()) + (out,))
        return out

    def _settle(self, tensors):
        """The kernels read the caller's tensors after the call returns. On a GPU the op keeps them until its
        next call (torch's allocator reuses memory in stream order after that); on HOST, where a freed CPU
        tensor is reused at once, the call waits for its kernels (errors they found stay for check())."""
        if _mori.backend == "HOST":
            self._h.status(0)
            self._keep = None
        else:
            self._keep = tensors

    def check(self, stream=None):
        """Waits for the stream and raises MoriError when the kernels of the last call found bad input here or
        on another PE (the round was then skipped everywhere)."""
        rc, message = self._h.status(_shmem._stream_handle(stream, "mori.ep.check"))
        if rc != 0:
            raise MoriError(f"mori.ep: {message}")

    def close(self):
        """Gives the buffers back to the heap (collective)."""
        self._h.close()
