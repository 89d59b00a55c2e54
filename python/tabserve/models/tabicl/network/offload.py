"""Where an offloaded call keeps the column stage's output (tabicl's ``offload_mode``).

The column stage's output ``(tables, features, rows, embedding)`` is the largest tensor of a
call (512 MiB for one table of 10,000 rows and 100 features in fp32). An offloaded call
(:meth:`~.model.TabICLv2.forward_offloaded`) computes it a chunk of feature groups at a time,
keeps it in a store, laid out in blocks of the row stage's chunks of rows, and streams it back a
block at a time to the row stage, so the device holds one chunk of either and every copy is one
contiguous run. A store is a function ``(shape, dtype) -> Tensor``:

* :func:`host_store` itself: host memory, pageable (never pinned, see there).
* :class:`DiskStore`: a file in a folder, mapped into memory (``torch.from_file``), removed when
  the store closes; for outputs larger than the host's memory.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor


def host_store(shape: tuple, dtype: torch.dtype) -> Tensor:
    """The store in pageable host memory, whatever device the model runs on.

    Not pinned: PyTorch's pinned-memory allocator rounds an allocation up to a power of two and
    keeps it, page-locked, once it is freed (``ATen/core/CachingHostAllocator.h``), so the
    20.5 GB store of 4 members x 10,000 rows x 1,000 features in fp32 would lock 32 GiB of host
    memory for the rest of the process, and the call pays for locking it. With pinned stores, the
    H100 offload record's host-offloaded predictions (8,000 + 2,000 rows) took 30.9 s at 1,000
    features, against 5.3 s with the output on the device, and 63.5 s at 2,000 features
    (tabicl: 41.3 and 44.1 s). Copies between the device and pageable memory are staged by the
    driver, and a call holds only its own bytes."""
    return torch.empty(shape, dtype=dtype)


class DiskStore:
    """A store in a memory-mapped file under ``folder`` (made if missing), removed on
    :meth:`close` (``with DiskStore(folder) as store: ...``)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path: Path | None = None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, shape: tuple, dtype: torch.dtype) -> Tensor:
        if self.path is not None:
            raise RuntimeError("a DiskStore holds one tensor; open another for the next")
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix="tabserve-offload-", suffix=".bin", dir=self.folder)
        os.close(handle)
        self.path = Path(name)
        size = math.prod(shape)
        return torch.from_file(str(self.path), shared=True, size=size, dtype=dtype).view(shape)

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


__all__ = ["DiskStore", "host_store"]
