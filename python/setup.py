"""pip install --no-build-isolation ./python

Builds mori's libraries and the extension module with CMake, from the repository this directory belongs to, and
packages them with the Python files: mori/ then holds _mori and mori's shared libraries (found through $ORIGIN).
Nothing comes from a package index: CMake, the compiler, pybind11 and the Python headers are the system's.
CMAKE_ARGS adds CMake options, e.g. "-DMORI_GPU_BACKEND=CUDA -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
(the backend is otherwise chosen as a plain CMake build chooses it).
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def mori_version():
    for line in (ROOT / "CMakeLists.txt").read_text().splitlines():
        if line.startswith("project(mori VERSION "):
            return line.split()[2]
    raise RuntimeError(f"no project version in {ROOT / 'CMakeLists.txt'}")


class CMakeExtension(Extension):

    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):

    def build_extension(self, ext):
        temp = Path(self.build_temp).resolve()
        build, stage = temp / "cmake", temp / "stage"
        args = ["-G", "Ninja"] if shutil.which("ninja") else []
        args += [
            f"-DPython3_EXECUTABLE={sys.executable}", "-DMORI_BUILD_PYTHON=ON", "-DMORI_BUILD_TESTS=OFF",
            "-DMORI_BUILD_EXAMPLES=OFF", "-DMORI_BUILD_BENCH=OFF", "-DMORI_BUILD_TOOLS=OFF",
            "-DCMAKE_BUILD_TYPE=Release", "-DMORI_PYTHON_INSTALL_DIR=."
        ]
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build)] + args, check=True)
        jobs = ["--parallel", str(self.parallel)] if self.parallel else []
        subprocess.run(["cmake", "--build", str(build), "--target", "mori_python"] + jobs, check=True)
        shutil.rmtree(stage, ignore_errors=True)
        subprocess.run(["cmake", "--install", str(build), "--component", "python", "--prefix", str(stage)],
                       check=True)
        dest = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        dest.mkdir(parents=True, exist_ok=True)
        for f in (stage / "mori").iterdir():
            if f.name.endswith(".so"):
                shutil.copy2(f, dest / f.name)


setup(
    name="mori",
    version=mori_version(),
    description="mori: GPU-initiated communication (SHMEM symmetric tensors for PyTorch)",
    packages=["mori"],
    package_dir={"mori": "mori"},
    ext_modules=[CMakeExtension("mori._mori")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.8",
    zip_safe=False,
)
