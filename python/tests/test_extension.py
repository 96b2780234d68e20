"""A PyTorch C++/CUDA extension with kernels of its own on mori's device API (ext/mori_ring_ext.cpp), built by
torch.utils.cpp_extension.load the way a user's extension is: its kernels must see the runtime that mori.shmem
started (the extension registers its copy of the device state when torch loads it; module_init() checks). One PE
in this process, and two processes that load the same build and all-gather with put-with-signal."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mori
import mori.shmem as shmem

SOURCE = Path(__file__).parent / "ext" / "mori_ring_ext.cpp"
GPU = mori.backend != "HOST"
DEVICE = "cuda" if GPU else "cpu"


def load(build_dir):
    from torch.utils import cpp_extension
    include = os.environ["MORITEST_INCLUDE_DIRS"].split(os.pathsep)
    lib = os.environ["MORITEST_SHMEM_LIB_DIR"]
    source = SOURCE
    cuda_flags = []
    if GPU:  # nvcc compiles .cu sources
        source = Path(build_dir) / "mori_ring_ext.cu"
        if not source.exists():
            shutil.copy(SOURCE, source)
        major, minor = torch.cuda.get_device_capability()
        cuda_flags = ["-std=c++17", "--expt-relaxed-constexpr", f"-arch=sm_{major}{minor}"]
    return cpp_extension.load(name="mori_ring_ext", sources=[str(source)], extra_include_paths=include,
                              extra_cflags=["-std=c++17", "-O2"], extra_cuda_cflags=cuda_flags,
                              extra_ldflags=[f"-L{lib}", "-lmori_shmem", f"-Wl,-rpath,{lib}"],
                              build_directory=str(build_dir), verbose=False)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if not os.environ.get("MORITEST_INCLUDE_DIRS") or not os.environ.get("MORITEST_SHMEM_LIB_DIR"):
        pytest.skip("MORITEST_INCLUDE_DIRS and MORITEST_SHMEM_LIB_DIR are not set (ctest and gpu_suite.sh set them)")
    # MORITEST_EXT_BUILD_DIR: a folder where the extension may have been built already (gpu_suite.sh builds it
    # while ctest runs); load() rebuilds whatever is missing or stale there.
    prebuilt = os.environ.get("MORITEST_EXT_BUILD_DIR")
    d = Path(prebuilt) if prebuilt and os.path.isdir(prebuilt) else tmp_path_factory.mktemp("mori_ext")
    load(d)  # built once here; the processes below load the same build
    return d


def expected_blocks(n, count):
    return torch.stack([torch.arange(count, dtype=torch.float32) * 3 + 100 * pe + 1 for pe in range(n)])


def test_extension_kernels_see_the_runtime_one_pe(build_dir):
    ext = load(build_dir)
    if shmem.is_initialized():
        shmem.finalize()
    shmem.init()
    try:
        shmem.module_init()
        q = ext.query(torch.full((4,), -7, dtype=torch.int32, device=DEVICE))
        if GPU:
            torch.cuda.synchronize()
        assert q.cpu().tolist() == [0, 1, 1, 0]
        count = 1000
        out = shmem.tensor((1, count), torch.float32)
        src = shmem.tensor((count,), torch.float32)
        sig = shmem.tensor((1,), torch.int64)
        src.copy_(expected_blocks(1, count)[0].to(DEVICE))
        ext.all_gather(out, src, sig, 1)
        if GPU:
            torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected_blocks(1, count))
        assert sig.cpu().tolist() == [1]
        for t in (sig, src, out):
            shmem.free_tensor(t)
    finally:
        shmem.finalize()
    with pytest.raises(mori.MoriError, match="before"):
        shmem.module_init()


HANDLE_SOURCE = Path(__file__).parent / "ext" / "handle_kernel.cu"


def _cuda_driver():
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")

    def check(rc, what):
        assert rc == 0, f"{what} failed: CUresult {rc}"
    return ctypes, cu, check


def test_module_loaded_by_handle(build_dir, tmp_path):
    """A cubin loaded with cuModuleLoad (how JIT kernels are loaded): module_init(handle) gives it the state,
    its kernel puts through the heap, it sees finalize and a new init, and module_finalize forgets it. On HOST
    every handle is refused."""
    if shmem.is_initialized():
        shmem.finalize()
    shmem.init()
    try:
        if not GPU:
            with pytest.raises(mori.MoriError, match="HOST"):
                shmem.module_init(0x1234)
            with pytest.raises(mori.MoriError, match="not initialised"):
                shmem.module_finalize(0x1234)
            return
        ctypes, cu, check = _cuda_driver()
        nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        major, minor = torch.cuda.get_device_capability()
        cubin = tmp_path / "handle_kernel.cubin"
        include = [f"-I{d}" for d in os.environ["MORITEST_INCLUDE_DIRS"].split(os.pathsep)]
        subprocess.run([nvcc, "-cubin", f"-arch=sm_{major}{minor}", "-std=c++17", "--expt-relaxed-constexpr",
                        *include, "-o", str(cubin), str(HANDLE_SOURCE)], check=True)
        torch.cuda.synchronize()  # the runtime's context is current on this thread
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        check(cu.cuModuleLoad(ctypes.byref(module), str(cubin).encode()), "cuModuleLoad")
        check(cu.cuModuleGetFunction(ctypes.byref(func), module, b"mori_handle_put"), "cuModuleGetFunction")

        def launch(dst, src, count, out):
            args = [ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_int(count), ctypes.c_int(0),
                    ctypes.c_void_p(out.data_ptr())]
            ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
            check(cu.cuLaunchKernel(func, 1, 1, 1, 128, 1, 1, 0, None, ptrs, None), "cuLaunchKernel")
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

        with pytest.raises(mori.MoriError, match="not initialised"):
            shmem.module_finalize(module.value)
        shmem.module_init(module.value)
        for count in (1, 1000, 65537):
            dst = shmem.tensor((count + 2,), torch.float32)
            dst.fill_(-1.0)
            src = torch.arange(count, dtype=torch.float32, device=DEVICE) * 0.5 + count
            out = torch.full((2,), -7, dtype=torch.int32, device=DEVICE)
            launch(dst[1:].data_ptr(), src.data_ptr(), count, out)
            assert out.cpu().tolist() == [0, 1]
            assert torch.equal(dst[1:count + 1].cpu(), src.cpu()), f"{count} floats through the module"
            assert dst[0].item() == -1.0 and dst[count + 1].item() == -1.0, "the floats around were touched"
            shmem.free_tensor(dst)
        shmem.finalize()
        out = torch.full((2,), -7, dtype=torch.int32, device=DEVICE)
        launch(0, 0, 0, out)
        assert out.cpu().tolist()[1] == 0, "the module still sees PEs after finalize"
        shmem.init()
        dst = shmem.tensor((16,), torch.float32)
        src = torch.arange(16, dtype=torch.float32, device=DEVICE) + 3
        launch(dst.data_ptr(), src.data_ptr(), 16, out)
        assert out.cpu().tolist() == [0, 1] and torch.equal(dst.cpu(), src.cpu()), "after a new init"
        shmem.free_tensor(dst)
        shmem.module_finalize(module.value)
        with pytest.raises(mori.MoriError, match="not initialised"):
            shmem.module_finalize(module.value)
        check(cu.cuModuleUnload(module), "cuModuleUnload")
    finally:
        shmem.finalize()


PE_SCRIPT = """
import os, sys, torch
sys.path.insert(0, os.environ["MORITEST_TESTS_DIR"])
import mori.shmem as shmem
from test_extension import DEVICE, GPU, expected_blocks, load
ext = load(os.environ["MORITEST_EXT_DIR"])
shmem.init()
shmem.module_init()
me, n, count = shmem.my_pe(), shmem.n_pes(), 5000
out = shmem.tensor((n, count), torch.float32)
src = shmem.tensor((count,), torch.float32)
sig = shmem.tensor((1,), torch.int64)
src.copy_(expected_blocks(n, count)[me].to(DEVICE))
shmem.barrier_all()
ext.all_gather(out, src, sig, n)
if GPU:
    torch.cuda.synchronize()
assert torch.equal(out.cpu(), expected_blocks(n, count)), f"PE {me}: the all-gather differs"
shmem.barrier_all()
for t in (sig, src, out):
    shmem.free_tensor(t)
shmem.finalize()
print(f"PE {me}: extension all-gather OK", flush=True)
"""


@pytest.mark.parametrize("transport", ["p2p", "proxy"])
def test_extension_all_gather_two_pes(build_dir, transport):
    from test_multi_pe import base_env, free_port_pair, run_all
    port = free_port_pair()
    env = lambda r: base_env(MORI_RANK=str(r), MORI_WORLD_SIZE="2", MORI_BOOTSTRAP_ADDR=f"127.0.0.1:{port}",
                             MORI_SHMEM_TRANSPORT=transport, MORITEST_EXT_DIR=str(build_dir),
                             MORITEST_TESTS_DIR=str(Path(__file__).parent))
    report = run_all([([sys.executable, "-c", PE_SCRIPT], env(r)) for r in range(2)])
    assert report.count(": extension all-gather OK\n") == 2, report  # (the script itself holds the words too)
