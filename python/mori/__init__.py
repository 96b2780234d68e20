"""mori: GPU-initiated communication (SHMEM, RDMA, channels). From Python: mori.shmem, symmetric tensors for
PyTorch programs; mori.ep, MoE dispatch and combine. Failures raise mori.MoriError (a RuntimeError) carrying
mori's message."""

from ._mori import MoriError, __version__, backend
from . import shmem
from . import ep

__all__ = ["MoriError", "__version__", "backend", "shmem", "ep"]
