"""mori's SHMEM host API for PyTorch programs.

init() (from mpirun, torchrun or MORI_* variables) or init_from_process_group() starts the runtime once per
process. tensor() allocates on the symmetric heap: collective, every PE asks for the same shape and dtype in the
same order, and each gets its own copy at the same heap offset (a CUDA tensor with a GPU backend, a CPU tensor on
HOST). peer_tensor() views a peer's copy where this process maps it; free_tensor() gives a tensor back
(collective); finalize() ends. Failures raise mori.MoriError with mori's message.

Tensors from tensor() and peer_tensor() do not own their memory: after free_tensor() or finalize() they must not
be used.
"""

import math

from . import _mori
from ._mori import CmpOp, MoriError, SignalOp, Transport

__all__ = [
    "MoriError", "Transport", "init", "init_from_process_group", "finalize", "is_initialized", "my_pe", "n_pes",
    "transport", "heap_bytes", "tensor", "free_tensor", "peer_tensor", "barrier_all", "SignalOp", "CmpOp", "put",
    "get", "put_signal", "signal_wait_until", "quiet", "register_buffer", "unregister_buffer", "Team", "team_world",
    "team_node", "team_split_strided", "module_init", "module_finalize"
]

# DLPack type codes (dlpack.h DLDataTypeCode).
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_COMPLEX = 0, 1, 2, 4, 5

_dlpack_types = None  # torch dtype -> (DLPack code, bits), filled at first use so that importing needs no torch
_live = {}  # address -> bytes of every tensor() not yet freed


def _torch():
    import torch
    import torch.utils.dlpack  # noqa: F401  (a submodule torch does not always import)
    return torch


def _dlpack_type(dtype):
    global _dlpack_types
    torch = _torch()
    if _dlpack_types is None:
        _dlpack_types = {
            torch.float64: (_DL_FLOAT, 64), torch.float32: (_DL_FLOAT, 32), torch.float16: (_DL_FLOAT, 16),
            torch.bfloat16: (_DL_BFLOAT, 16), torch.complex64: (_DL_COMPLEX, 64),
            torch.complex128: (_DL_COMPLEX, 128), torch.int64: (_DL_INT, 64), torch.int32: (_DL_INT, 32),
            torch.int16: (_DL_INT, 16), torch.int8: (_DL_INT, 8), torch.uint8: (_DL_UINT, 8),
            # torch 1.13 does not import DLPack's bool: it travels as uint8 and is viewed as bool after.
            torch.bool: (_DL_UINT, 8),
        }
    if dtype not in _dlpack_types:
        supported = ", ".join(sorted(str(d) for d in _dlpack_types))
        raise TypeError(f"mori.shmem: dtype {dtype} is not supported (supported: {supported})")
    return _dlpack_types[dtype]


def _wrap(address, shape, strides, dtype):
    torch = _torch()
    code, bits = _dlpack_type(dtype)
    t = torch.utils.dlpack.from_dlpack(_mori.to_dlpack(address, list(shape), list(strides), code, bits))
    return t.view(torch.bool) if dtype == torch.bool else t


def init():
    """Starts the runtime from the launch environment: mpirun, torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT: mori's root listens at MASTER_PORT + 1) or MORI_RANK / MORI_WORLD_SIZE / MORI_BOOTSTRAP_ADDR;
    a process started by none of them is a job of one."""
    _mori.init()


def init_from_process_group(group=None):
    """Starts the runtime over the members of a torch.distributed group (default: the world), in group rank
    order: rank 0 makes a unique id and broadcasts it through the group (gloo or nccl). Collective."""
    torch = _torch()
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise MoriError("mori.shmem.init_from_process_group: torch.distributed is not initialised "
                        "(call torch.distributed.init_process_group first)")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise MoriError("mori.shmem.init_from_process_group: this process is not a member of the group")
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    uid = torch.zeros(_mori.unique_id_bytes, dtype=torch.uint8)
    if rank == 0:
        uid = torch.tensor(list(_mori.get_unique_id()), dtype=torch.uint8)
    uid = uid.to(device)
    dist.broadcast(uid, src=_global_rank(dist, group, 0), group=group)
    _mori.init_with_unique_id(rank, size, bytes(uid.cpu().tolist()))


def _global_rank(dist, group, group_rank):
    if group is None or group is dist.group.WORLD:
        return group_rank
    if hasattr(dist, "get_global_rank"):  # torch >= 2.0
        return dist.get_global_rank(group, group_rank)
    return dist.distributed_c10d._get_global_rank(group, group_rank)


def finalize():
    """Collective: waits for every PE, then releases the heap. Every tensor on it is invalid afterwards."""
    try:
        _mori.finalize()
    finally:
        _live.clear()


def is_initialized():
    return _mori.is_initialized()


def my_pe():
    return _mori.my_pe()


def n_pes():
    return _mori.n_pes()


def transport(pe):
    """How this PE reaches `pe`: Transport.Self, P2P (its heap is mapped here), RDMA or Proxy."""
    return _mori.transport(pe)


def heap_bytes():
    """Bytes of the symmetric heap available to tensor() (MORI_SHMEM_HEAP_SIZE)."""
    return _mori.heap_bytes()


def tensor(shape, dtype=None):
    """A zero-filled tensor on the symmetric heap. Collective: every PE calls with the same shape and dtype."""
    torch = _torch()
    dtype = torch.float32 if dtype is None else dtype
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"mori.shmem.tensor: negative size in shape {shape}")
    bits = _dlpack_type(dtype)[1]
    nbytes = math.prod(shape) * bits // 8
    address = _mori.allocate(max(nbytes, 1))
    _live[address] = nbytes
    return _wrap(address, shape, [], dtype)


def _span_bytes(t):
    """Bytes from t's first element to just past its last (torch strides are never negative)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def free_tensor(t):
    """Gives a tensor from tensor() back to the heap. Collective: every PE frees its copy, in the same order."""
    _mori.require_init("mori.shmem.free_tensor")
    address, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if _live.get(address) != nbytes:
        raise MoriError(f"mori.shmem.free_tensor: the {t.dtype} tensor of shape {tuple(t.shape)} at {address:#x} is "
                        "not a live tensor from mori.shmem.tensor() (freed already, a view of part of one, or "
                        "not on the symmetric heap)")
    _mori.free(address)
    del _live[address]


def peer_tensor(t, pe):
    """A tensor viewing PE `pe`'s copy of `t` (a tensor from tensor(), or a view of one), with t's shape and
    strides, where the transport to `pe` maps its heap here (Self, P2P); None where it does not (RDMA, Proxy)."""
    address = _mori.peer_address(t.data_ptr(), _span_bytes(t), pe)
    if address is None:
        return None
    return _wrap(address, t.shape, t.stride(), t.dtype)


def barrier_all(stream=None):
    """Waits until every PE has arrived. stream=None: on the host, after this PE's queued GPU work has finished.
    With a torch stream: a barrier ordered with the work on that stream (the host does not wait)."""
    if stream is None:
        _mori.barrier_all()
    else:
        _mori.barrier_all_on_stream(_stream_handle(stream, "mori.shmem.barrier_all"))


# ---- data movement from the host, ordered on a stream ----
#
# put, get, put_signal, signal_wait_until and quiet run as small kernels on a stream: `stream` is a torch stream,
# None meaning torch's current stream of the heap's GPU. On HOST (no GPU; CPU tensors) each call returns when
# its work is done. Symmetric arguments (put's dst, get's src, the signal) are tensors from tensor() or views of
# one; the other side is any contiguous tensor on this PE's device (over RDMA or the proxy it must be on the heap
# or registered with register_buffer()). Instead of a torch tensor, any array with __cuda_array_interface__ (CuPy,
# Numba; on HOST __array_interface__: NumPy) is accepted, C-contiguous, e.g. a CuPy view of a symmetric
# tensor. Puts are non-blocking: a put is complete at its target, and its source
# may be written again, only after a later quiet() or barrier on the same stream (a put-with-signal's signal
# says its data arrived, not that the sender may reuse the source).


def _stream_handle(stream, op):
    if _mori.backend == "HOST":
        if stream is not None:
            raise MoriError(f"{op}: streams need a GPU backend (this mori is {_mori.backend}); pass stream=None")
        return 0
    torch = _torch()
    if stream is None:
        # torch's current stream of the current device, read by the two C calls torch.cuda.current_stream()
        # makes after Python-level device checks that cost tens of microseconds per call (measured on an H100
        # host, 2026-11-27: a 128-token EP dispatch spent more time there than in its kernels).
        raw, device = getattr(torch._C, "_cuda_getCurrentRawStream", None), getattr(torch._C, "_cuda_getDevice", None)
        if raw is not None and device is not None:
            return int(raw(device()))
        stream = torch.cuda.current_stream()
    return int(stream.cuda_stream)


def _interface(obj):
    """The array interface of a non-torch array: __cuda_array_interface__ (CuPy, Numba, ...) on a GPU backend,
    __array_interface__ (NumPy) on HOST; None when obj has neither."""
    name = "__array_interface__" if _mori.backend == "HOST" else "__cuda_array_interface__"
    return getattr(obj, name, None)


def _interface_span(ai, what, op):
    """Address and bytes of a C-contiguous array described by an array interface dict."""
    shape = tuple(int(x) for x in ai["shape"])
    typestr = ai["typestr"]
    itemsize = int(typestr[2:])
    if typestr[0] == ">":
        raise MoriError(f"{op}: {what} is big-endian ({typestr})")
    strides = ai.get("strides")
    if strides is not None:
        want = itemsize
        for size, stride in reversed(list(zip(shape, strides))):
            if size > 1 and stride != want:
                raise MoriError(f"{op}: {what} must be contiguous (shape {shape}, strides {tuple(strides)} bytes)")
            want *= size
    count = 1
    for size in shape:
        count *= size
    return int(ai["data"][0]), count * itemsize, typestr


def _span(t, what, op):
    """Address and bytes of a contiguous torch tensor or array with an array interface."""
    if not hasattr(t, "data_ptr"):
        ai = _interface(t)
        if ai is None:
            kind = "__array_interface__" if _mori.backend == "HOST" else "__cuda_array_interface__"
            raise MoriError(f"{op}: {what} is a {type(t).__name__}, neither a torch tensor nor an array with {kind}")
        address, nbytes, _ = _interface_span(ai, what, op)
        return address, nbytes
    if not t.is_contiguous():
        raise MoriError(f"{op}: {what} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return t.data_ptr(), t.numel() * t.element_size()


def _same_bytes(op, dst, src):
    d, nd = _span(dst, "dst", op)
    s, ns = _span(src, "src", op)
    if nd != ns:
        raise MoriError(f"{op}: dst has {nd} bytes and src {ns}")
    return d, s, nd


def _signal_word(sig, op):
    ai = None if hasattr(sig, "data_ptr") else _interface(sig)
    if ai is not None:
        address, nbytes, typestr = _interface_span(ai, "the signal", op)
        if typestr[1:] not in ("i8", "u8") or nbytes != 8:
            raise MoriError(f"{op}: the signal must be one 64-bit integer of a symmetric array (got {typestr}, "
                            f"{nbytes} bytes)")
        return address
    torch = _torch()
    if sig.dtype not in (torch.int64, getattr(torch, "uint64", torch.int64)) or sig.numel() != 1:
        raise MoriError(f"{op}: the signal must be one int64 element of a symmetric tensor (got {sig.dtype}, "
                        f"{sig.numel()} elements)")
    return sig.data_ptr()


def put(dst, src, pe, stream=None):
    """Copies src (local) into PE `pe`'s copy of dst (symmetric)."""
    op = "mori.shmem.put"
    d, s, n = _same_bytes(op, dst, src)
    _mori.put(d, s, n, pe, _stream_handle(stream, op))


def get(dst, src, pe, stream=None):
    """Copies PE `pe`'s copy of src (symmetric) into dst (local)."""
    op = "mori.shmem.get"
    d, s, n = _same_bytes(op, dst, src)
    _mori.get(d, s, n, pe, _stream_handle(stream, op))


def put_signal(dst, src, sig, value, op, pe, stream=None):
    """put(dst, src, pe), then PE `pe`'s copy of `sig` is set to (SignalOp.Set) or increased by (SignalOp.Add)
    `value`, never before the data is there."""
    name = "mori.shmem.put_signal"
    d, s, n = _same_bytes(name, dst, src)
    _mori.put_signal(d, s, n, _signal_word(sig, name), int(value), op, pe, _stream_handle(stream, name))


def signal_wait_until(sig, cmp, value, stream=None):
    """Work queued on the stream after this waits until this PE's `sig` compares `cmp` with `value` (bounded by
    MORI_TIMEOUT_S); on HOST the call returns then."""
    name = "mori.shmem.signal_wait_until"
    _mori.signal_wait_until(_signal_word(sig, name), cmp, int(value), _stream_handle(stream, name))


def quiet(stream=None):
    """Every put and get issued before on this PE is complete at its target."""
    _mori.quiet(_stream_handle(stream, "mori.shmem.quiet"))


def module_init(handle=None):
    """After loading a separately built module that uses mori's device API.

    Without a handle (a PyTorch C++/CUDA extension, any shared library that includes the device API): checks
    that it, and every other such module, holds the runtime's device state (they register themselves when
    loaded; this uploads the state again and raises if a module cannot take it).

    With a handle (an int: a CUmodule from cuModuleLoad*, a JIT-compiled kernel's module such as Triton's
    ``kernel.module``, a hipModule_t): the module, compiled with -DMORI_SHMEM_MODULE_BY_HANDLE, gets the state
    now and at every later init and finalize until ``module_finalize(handle)``, called before it is unloaded.
    """
    _mori.module_init(0 if handle is None else int(handle))


def module_finalize(handle):
    """Forgets a module given to ``module_init(handle)``; raises when it was not given."""
    _mori.module_finalize(int(handle))


def register_buffer(t):
    """Lets the NIC or the proxy read and write a contiguous tensor outside the heap (put sources, get
    destinations over RDMA and Proxy). Not collective."""
    address, nbytes = _span(t, "the tensor", "mori.shmem.register_buffer")
    _mori.register_buffer(address, nbytes)


def unregister_buffer(t):
    """Undoes register_buffer(t), after a quiet() that covers every operation on it."""
    _mori.unregister_buffer(_span(t, "the tensor", "mori.shmem.unregister_buffer")[0])


# ---- teams ----


class Team:
    """A subset of the PEs numbered 0..n_pes()-1, the same handle on every member. team_world() and team_node()
    (the PEs of this host) always exist; team_split_strided() makes others."""

    def __init__(self, handle):
        self.handle = handle

    def __repr__(self):
        return f"Team({self.handle}: PE {self.my_pe()} of {self.n_pes()})"

    def __eq__(self, other):
        return isinstance(other, Team) and other.handle == self.handle

    def __hash__(self):
        return hash(self.handle)

    def my_pe(self):
        """This PE's number in the team (-1 once destroyed)."""
        return _mori.team_my_pe(self.handle)

    def n_pes(self):
        return _mori.team_n_pes(self.handle)

    def translate_pe(self, pe, to=None):
        """The number in team `to` (default: the world) of this team's member `pe`, -1 when it is not in `to`."""
        return _mori.team_translate_pe(self.handle, pe, (to or team_world()).handle)

    def sync(self, stream=None):
        """Waits until every member has called it: on the host (after this PE's queued GPU work) with
        stream=None, else ordered on the stream."""
        if stream is None:
            _mori.team_sync(self.handle)
        else:
            _mori.team_sync(self.handle, _stream_handle(stream, "mori.shmem.Team.sync"))

    def destroy(self):
        """Local; after the team's last sync on every member. World and node cannot be destroyed."""
        _mori.team_destroy(self.handle)


def team_world():
    _mori.require_init("mori.shmem.team_world")
    return Team(_mori.team_world)


def team_node():
    _mori.require_init("mori.shmem.team_node")
    return Team(_mori.team_node)


def team_split_strided(parent, start, stride, size):
    """Collective over `parent`: its members start, start + stride, ... (size of them) form a new team. Returns
    it on the members and None on the other PEs of the parent."""
    handle = _mori.team_split_strided(parent.handle, start, stride, size)
    return None if handle == _mori.team_invalid else Team(handle)
