"""The offline install: `pip install --no-build-isolation --no-index` of a copy of the source tree into a scratch
directory, moved after installing, then used from a clean environment (no PYTHONPATH to the build tree, no
LD_LIBRARY_PATH): mori/ must carry its libraries and find them through $ORIGIN."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = os.environ.get("MORITEST_SOURCE_DIR")

SMOKE = """
import mori, mori.shmem as shmem, torch
assert mori.__file__.startswith(__import__("os").environ["EXPECT_UNDER"]), mori.__file__
shmem.init()
t = shmem.tensor((3, 5), torch.int16)
t.copy_(torch.arange(15, dtype=torch.int16).view(3, 5) * 3 - 7)
assert torch.equal(shmem.peer_tensor(t, 0), torch.arange(15, dtype=torch.int16).view(3, 5) * 3 - 7)
assert shmem.transport(0) == shmem.Transport.Self
shmem.free_tensor(t)
shmem.finalize()
print("installed mori", mori.__version__, mori.backend, "OK")
"""


@pytest.mark.skipif(not SOURCE, reason="MORITEST_SOURCE_DIR (the tree to install from) is not set")
def test_pip_install_offline_into_a_moved_directory(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    for part in ("CMakeLists.txt", "cmake", "include", "src", "python"):
        src = Path(SOURCE) / part
        if src.is_dir():
            shutil.copytree(src, tree / part, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        else:
            shutil.copy2(src, tree / part)
    env = dict(os.environ, CMAKE_ARGS=os.environ.get("MORITEST_CMAKE_ARGS", ""))
    env.pop("PYTHONPATH", None)
    pip = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps",
           "--disable-pip-version-check", "--target", str(tmp_path / "site"), str(tree / "python")]
    built = subprocess.run(pip, env=env, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    shutil.rmtree(tree)  # the installed package must not need the tree it was built from
    moved = tmp_path / "moved"
    (tmp_path / "site").rename(moved)
    clean = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(moved),
             "PYTHONDONTWRITEBYTECODE": "1", "MORI_SHMEM_HEAP_SIZE": "16m", "EXPECT_UNDER": str(moved)}
    run = subprocess.run([sys.executable, "-c", SMOKE], env=clean, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr
