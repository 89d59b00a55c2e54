"""Small host values onto a device without waiting for it."""

from __future__ import annotations

import torch
from torch import Tensor


def device_values(values, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` (index lists, counts, labels).

    On a CUDA device the values are copied from pinned memory on the current stream, queued
    behind the work already there. ``torch.tensor(values, device=...)`` copies from pageable
    memory and then synchronizes the stream: the host waits for all the work queued before the
    copy, and the device then idles while the host launches what follows (before each packed
    call of many tables, and between the ensemble members' preprocessing and their tables).
    """
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
