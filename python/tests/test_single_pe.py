"""mori.shmem in one process (a job of one: no launcher variables): lifecycle, symmetric tensors of every dtype,
views, and every error a user can make raising mori.MoriError with the cause."""

import os

import pytest
import torch

import mori
import mori.shmem as shmem
from patterns import DTYPES, expect_device, pattern

for var in ("RANK", "WORLD_SIZE", "MORI_RANK", "MORI_WORLD_SIZE", "MORI_BOOTSTRAP_ADDR", "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
    os.environ.pop(var, None)


@pytest.fixture()
def pe():
    if not shmem.is_initialized():
        shmem.init()
    yield shmem.my_pe()


def teardown_module():
    if shmem.is_initialized():
        shmem.finalize()


def test_lifecycle_and_use_before_init():
    if shmem.is_initialized():  # another test ran first
        shmem.finalize()
    for call in (shmem.my_pe, shmem.n_pes, shmem.heap_bytes, shmem.barrier_all, lambda: shmem.transport(0),
                 lambda: shmem.tensor((4,)), lambda: shmem.free_tensor(torch.zeros(4)),
                 lambda: shmem.peer_tensor(torch.zeros(4), 0)):
        with pytest.raises(mori.MoriError, match=r"called before mori\.shmem\.init\(\)"):
            call()
    with pytest.raises(mori.MoriError, match="ShmemFinalize without ShmemInit"):
        shmem.finalize()
    shmem.init()
    assert shmem.is_initialized() and shmem.my_pe() == 0 and shmem.n_pes() == 1
    with pytest.raises(mori.MoriError, match="already initialised"):
        shmem.init()
    shmem.finalize()
    assert not shmem.is_initialized()
    with pytest.raises(mori.MoriError, match="before"):
        shmem.tensor((4,))
    shmem.init()  # a second run in the same process
    t = shmem.tensor((16,), torch.int32)
    t.copy_(pattern((16,), torch.int32, 5))
    assert torch.equal(shmem.peer_tensor(t, 0).cpu(), pattern((16,), torch.int32, 5))
    shmem.free_tensor(t)
    shmem.finalize()


def test_is_a_runtime_error():
    assert issubclass(mori.MoriError, RuntimeError)


def test_transport_to_self(pe):
    assert shmem.transport(pe) == shmem.Transport.Self
    assert {t.name for t in (shmem.Transport.Self, shmem.Transport.P2P, shmem.Transport.RDMA,
                             shmem.Transport.Proxy)} == {"Self", "P2P", "RDMA", "Proxy"}


def test_tensors_of_every_dtype_are_zeroed_disjoint_and_keep_their_data(pe):
    shape = (5, 7)
    tensors = {dtype: shmem.tensor(shape, dtype) for dtype in DTYPES}
    spans = []
    for seed, (dtype, t) in enumerate(tensors.items()):
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()
        assert t.device.type == expect_device(mori.backend)
        assert not (t != 0).any().item(), f"{dtype} tensor not zero-filled"
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        t.copy_(pattern(shape, dtype, seed, t.device))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "heap blocks overlap"
    for seed, (dtype, t) in enumerate(tensors.items()):
        assert torch.equal(t.cpu(), pattern(shape, dtype, seed)), f"{dtype} data changed"
        own = shmem.peer_tensor(t, pe)
        assert own.data_ptr() == t.data_ptr() and own.dtype == dtype and torch.equal(own, t)
    for t in tensors.values():
        shmem.free_tensor(t)


def test_peer_tensor_of_a_strided_view_writes_only_its_elements(pe):
    t = shmem.tensor((6, 8), torch.int64)
    t.copy_(pattern((6, 8), torch.int64, 1, t.device))
    view = t[1:5, 2:7:2]
    peer = shmem.peer_tensor(view, pe)
    assert peer.shape == view.shape and peer.stride() == view.stride() and peer.data_ptr() == view.data_ptr()
    peer.copy_(pattern(tuple(view.shape), torch.int64, 9, t.device))
    expected = pattern((6, 8), torch.int64, 1)
    expected[1:5, 2:7:2] = pattern(tuple(view.shape), torch.int64, 9)
    assert torch.equal(t.cpu(), expected)
    shmem.free_tensor(t)


def test_scalar_shape_and_int_shape(pe):
    a = shmem.tensor(10, torch.float16)
    b = shmem.tensor((), torch.int32)
    assert tuple(a.shape) == (10,) and b.dim() == 0 and b.item() == 0
    shmem.free_tensor(b)
    shmem.free_tensor(a)


def test_bad_pe_raises(pe):
    t = shmem.tensor((4,), torch.float32)
    for bad in (1, -1, 1000):
        with pytest.raises(mori.MoriError, match=rf"PE {bad} is not in \[0, 1\)"):
            shmem.transport(bad)
        with pytest.raises(mori.MoriError, match=rf"PE {bad} is not in \[0, 1\)"):
            shmem.peer_tensor(t, bad)
    shmem.free_tensor(t)


def test_tensor_not_on_the_heap_raises(pe):
    foreign = torch.arange(8, dtype=torch.float32, device=expect_device(mori.backend))
    with pytest.raises(mori.MoriError, match="is not on this PE's symmetric heap"):
        shmem.peer_tensor(foreign, pe)
    with pytest.raises(mori.MoriError, match=r"not a live tensor from mori\.shmem\.tensor\(\)"):
        shmem.free_tensor(foreign)
    # The runtime's own check, past the package's bookkeeping.
    with pytest.raises(mori.MoriError, match="not a block from ShmemMalloc"):
        mori._mori.free(foreign.data_ptr())
    assert torch.equal(foreign.cpu(), torch.arange(8, dtype=torch.float32))


def test_free_twice_or_a_partial_view_raises(pe):
    t = shmem.tensor((4, 4), torch.int32)
    with pytest.raises(mori.MoriError, match="not a live tensor"):
        shmem.free_tensor(t[1:])
    with pytest.raises(mori.MoriError, match="not a live tensor"):
        shmem.free_tensor(t[:2])  # starts where t does, but covers half of it
    shmem.free_tensor(t)
    with pytest.raises(mori.MoriError, match="not a live tensor"):
        shmem.free_tensor(t)


def test_out_of_heap_raises_and_leaves_the_heap_usable(pe):
    total = shmem.heap_bytes()
    with pytest.raises(mori.MoriError, match="the symmetric heap cannot hold it"):
        shmem.tensor((total + 1,), torch.uint8)
    big = shmem.tensor((total // 2,), torch.uint8)
    with pytest.raises(mori.MoriError, match="cannot hold"):
        shmem.tensor((total // 2 + 4096,), torch.uint8)
    shmem.free_tensor(big)
    again = shmem.tensor((total // 2 + 4096,), torch.uint8)  # the space came back
    again[-1] = 7
    assert again[-1].item() == 7
    shmem.free_tensor(again)


def test_bad_arguments_raise(pe):
    with pytest.raises(ValueError, match="negative"):
        shmem.tensor((2, -1))
    with pytest.raises(TypeError, match="not supported"):
        shmem.tensor((2,), torch.complex32)
    if mori.backend == "HOST":
        with pytest.raises(mori.MoriError, match="streams need a GPU backend"):
            shmem.barrier_all(stream=object())
    shmem.barrier_all()


def test_put_get_signal_and_quiet_to_itself(pe):
    device = "cpu" if mori.backend == "HOST" else "cuda"
    dst = shmem.tensor((1000,), torch.int32)
    guard = shmem.tensor((64,), torch.int32)
    sig = shmem.tensor((2,), torch.int64)
    src = torch.arange(1000, dtype=torch.int32, device=device) * 3 + 11
    shmem.put(dst, src, 0)
    shmem.quiet()
    shmem.barrier_all()
    assert torch.equal(dst.cpu(), src.cpu())
    half = shmem.tensor((500,), torch.int32)
    shmem.put_signal(half, src[250:750], sig[1], 9, shmem.SignalOp.Add, 0)
    shmem.signal_wait_until(sig[1], shmem.CmpOp.GE, 9)
    shmem.barrier_all()
    assert torch.equal(half.cpu(), src[250:750].cpu())
    assert sig.cpu().tolist() == [0, 9]
    back = torch.zeros(1000, dtype=torch.int32, device=device)
    shmem.get(back, dst, 0)
    shmem.barrier_all()
    assert torch.equal(back.cpu(), src.cpu())
    assert torch.count_nonzero(guard.cpu()) == 0, "nothing outside the targets changed"
    with pytest.raises(mori.MoriError, match="dst has 4000 bytes and src 400"):
        shmem.put(dst, src[:100], 0)
    with pytest.raises(mori.MoriError, match="must be contiguous"):
        shmem.put(dst[::2], src[::2], 0)
    with pytest.raises(mori.MoriError, match="target pe 1 is not in"):
        shmem.put(dst, src, 1)
    with pytest.raises(mori.MoriError, match="not inside the symmetric heap"):
        shmem.put(torch.zeros(1000, dtype=torch.int32, device=device), src, 0)
    with pytest.raises(mori.MoriError, match="one int64 element"):
        shmem.put_signal(dst, src, sig, 1, shmem.SignalOp.Set, 0)
    shmem.barrier_all()
    assert torch.equal(dst.cpu(), src.cpu()), "refused calls wrote nothing"
    for t in (half, sig, guard, dst):
        shmem.free_tensor(t)


class InterfaceOnly:
    """An array known only by its array interface, as a CuPy or Numba array (GPU) or a NumPy array (HOST) is:
    __cuda_array_interface__ of a CUDA tensor, __array_interface__ of a CPU tensor's NumPy view."""

    def __init__(self, t, strides=None):
        self.t = t
        if mori.backend == "HOST":
            ai = dict(t.numpy().__array_interface__)
        else:
            ai = dict(t.__cuda_array_interface__)
        if strides is not None:
            ai["strides"] = strides
        setattr(self, "__array_interface__" if mori.backend == "HOST" else "__cuda_array_interface__", ai)


def test_arrays_with_an_array_interface(pe):
    device = "cpu" if mori.backend == "HOST" else "cuda"
    dst = shmem.tensor((3, 333), torch.float32)
    guard = shmem.tensor((64,), torch.float32)
    sig = shmem.tensor((1,), torch.int64)
    src = (torch.arange(999, dtype=torch.float32, device=device) * 0.25 - 7).reshape(3, 333)
    shmem.put_signal(InterfaceOnly(dst), InterfaceOnly(src), InterfaceOnly(sig), 5, shmem.SignalOp.Set, 0)
    shmem.signal_wait_until(InterfaceOnly(sig), shmem.CmpOp.EQ, 5)
    shmem.quiet()
    shmem.barrier_all()
    assert torch.equal(dst.cpu(), src.cpu())
    back = torch.zeros(999, dtype=torch.float32, device=device)
    shmem.get(InterfaceOnly(back), InterfaceOnly(dst), 0)
    shmem.barrier_all()
    assert torch.equal(back.cpu(), src.reshape(-1).cpu())
    assert torch.count_nonzero(guard.cpu()) == 0, "nothing outside the targets changed"
    with pytest.raises(mori.MoriError, match="must be contiguous"):
        shmem.put(InterfaceOnly(dst, strides=(8, 4)), InterfaceOnly(src), 0)
    with pytest.raises(mori.MoriError, match="one 64-bit integer"):
        shmem.put_signal(InterfaceOnly(dst), InterfaceOnly(src), InterfaceOnly(dst), 1, shmem.SignalOp.Set, 0)
    with pytest.raises(mori.MoriError, match="neither a torch tensor nor an array"):
        shmem.put(object(), InterfaceOnly(src), 0)
    with pytest.raises(mori.MoriError, match="not inside the symmetric heap"):
        shmem.put(InterfaceOnly(back), InterfaceOnly(src.reshape(-1)), 0)
    for t in (sig, guard, dst):
        shmem.free_tensor(t)


def test_teams_of_one_pe(pe):
    world, node = shmem.team_world(), shmem.team_node()
    assert (world.my_pe(), world.n_pes(), node.my_pe(), node.n_pes()) == (0, 1, 0, 1)
    t = shmem.team_split_strided(world, 0, 1, 1)
    assert t is not None and t not in (world, node)
    assert (t.my_pe(), t.n_pes(), t.translate_pe(0), t.translate_pe(0, node), t.translate_pe(1)) == (0, 1, 0, 0, -1)
    t.sync()
    t.destroy()
    assert t.n_pes() == -1
    with pytest.raises(mori.MoriError, match="stride >= 1"):
        shmem.team_split_strided(world, 0, 0, 1)
    with pytest.raises(mori.MoriError, match="not a team this PE belongs to"):
        t.sync()


def test_init_from_process_group_needs_torch_distributed(pe):
    with pytest.raises(mori.MoriError, match="torch.distributed is not initialised"):
        shmem.init_from_process_group()
