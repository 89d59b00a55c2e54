"""What the model's modules need from the kernels on every path, fused or not, without loading
Triton or registering the kernel operators (both wait for the first fused call): the row
layout of the column stage's output and CUDA's grid limit."""

from __future__ import annotations

import torch
from torch import Tensor

#: CUDA's limit on a grid's second and third axes: the most batch entries (or heads) one
#: launch covers; the attention kernels split larger batches into several launches.
MAX_GRID_BATCH = 65_535


def to_rows(out: Tensor, row_prefix: Tensor | None) -> Tensor:
    """The ``row_prefix`` layout from the sets layout as ATen ops: ``out (B, S, L, E)`` ->
    ``(B, L, P + S, E)``, every row led by the prefix's P tokens (in out's dtype)."""
    if row_prefix is None:
        return out
    batch, _, length, _ = out.shape
    lead = row_prefix.to(out.dtype).expand(batch, length, *row_prefix.shape)
    return torch.cat([lead, out.transpose(1, 2)], dim=2)
