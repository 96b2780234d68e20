"""mori: GPU-initiated communication (SHMEM, RDMA, channels). From Python: mori.shmem, symmetric tensors for
PyTorch programs. Failures raise mori.MoriError (a RuntimeError) carrying mori's message."""

from ._mori import MoriError, __version__, backend
from . import shmem

__all__ = ["MoriError", "__version__", "backend", "shmem"]
