"""Fake kernels and documented Python wrappers of the `torch.ops.tabserve` operators.

The schemas, CPU kernels and CUDA kernels live in csrc/ops/<family>.cpp and
csrc/ops/cuda/<family>.cu; docs/ops.md gives every operator's contract. The fake kernels here
describe output shapes and dtypes so that torch.compile, torch.export and opcheck can trace the
operators without running them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

#: Hash bits kept in production. Tests pass fewer to force hash collisions.
FULL_HASH_BITS = 64


def table_capacity(rows: int) -> int:
    """Slots of the table built for ``rows`` vocabulary rows: max(16, next power of two >= 2 rows).

    Mirrors ``core::table_capacity`` (csrc/core/string_hash.h); a test checks they agree.
    """
    capacity = 16
    while capacity < 2 * rows:
        capacity *= 2
    return capacity


# ---------------------------------------------------------------------------------------------
# String lookup (csrc/ops/string_lookup.cpp, csrc/ops/cuda/string_lookup.cu)


@torch.library.register_fake("tabserve::string_index_build")
def _string_index_build_fake(
    vocabulary_data, vocabulary_offsets, vocabulary_valid, vocabulary_segments, hash_bits=64
):
    rows = vocabulary_offsets.shape[0] - 1
    if isinstance(rows, int):
        capacity = table_capacity(rows)
    else:  # symbolic vocabulary size: the capacity is a data-independent but opaque function
        capacity = torch.library.get_ctx().new_dynamic_size(min=16)
    return (
        vocabulary_offsets.new_empty(capacity),
        vocabulary_offsets.new_empty(capacity),
    )


@torch.library.register_fake("tabserve::string_lookup")
def _string_lookup_fake(
    vocabulary_data,
    vocabulary_offsets,
    vocabulary_segments,
    slot_hash,
    slot_row,
    query_data,
    query_offsets,
    query_valid,
    column=0,
    hash_bits=64,
    check_offsets=True,
):
    return query_offsets.new_empty(query_offsets.shape[0] - 1, dtype=torch.int64)


@torch.library.register_fake("tabserve::string_lookup_multi")
def _string_lookup_multi_fake(
    vocabulary_data,
    vocabulary_offsets,
    vocabulary_segments,
    slot_hash,
    slot_row,
    query_data,
    query_offsets,
    query_valid,
    hash_bits=64,
    check_offsets=True,
):
    rows = sum(offsets.shape[0] - 1 for offsets in query_offsets)
    return vocabulary_offsets.new_empty(rows, dtype=torch.int64)


def string_index_build(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_valid: Optional[Tensor],
    vocabulary_segments: Tensor,
    hash_bits: int = FULL_HASH_BITS,
) -> tuple[Tensor, Tensor]:
    """Builds the hash table of a packed string vocabulary.

    Args:
        vocabulary_data: uint8 [bytes], the labels' bytes.
        vocabulary_offsets: int64 [rows + 1], non-decreasing, within [0, bytes]; row i is
            ``data[offsets[i]:offsets[i + 1]]``. The first offset need not be 0.
        vocabulary_valid: bool [rows] or None; null rows never match.
        vocabulary_segments: int64 [columns + 1], on the same device: column c owns rows
            ``[segments[c], segments[c + 1])``; ``segments[0] == 0`` and ``segments[-1] == rows``.
        hash_bits: low hash bits kept, in [0, 64]; fewer than 64 only to force collisions in tests.

    Returns:
        ``(slot_hash, slot_row)``, int64 [capacity] on the vocabulary's device,
        capacity = :func:`table_capacity` (rows).

    Raises:
        RuntimeError naming the argument for wrong dtypes, ranks, devices, decreasing offsets,
        offsets past the data or malformed segments. On CUDA the checks synchronise once.
    """
    return torch.ops.tabserve.string_index_build(
        vocabulary_data, vocabulary_offsets, vocabulary_valid, vocabulary_segments, hash_bits
    )


def string_lookup(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_segments: Tensor,
    slot_hash: Tensor,
    slot_row: Tensor,
    query_data: Tensor,
    query_offsets: Tensor,
    query_valid: Optional[Tensor] = None,
    column: int = 0,
    hash_bits: int = FULL_HASH_BITS,
    check_offsets: bool = True,
) -> Tensor:
    """Codes of one query column in vocabulary column ``column``.

    Returns int64 [query rows] on the vocabulary's device: the label's position in that column's
    vocabulary (the last position when it repeats), -1 for unknown labels and null queries.
    ``check_offsets`` verifies the query offsets (CPU: a scan; CUDA: one reduction and one host
    synchronisation, skipped during CUDA graph capture). With it off, malformed offsets give
    unspecified codes but never out-of-bounds reads.
    """
    return torch.ops.tabserve.string_lookup(
        vocabulary_data,
        vocabulary_offsets,
        vocabulary_segments,
        slot_hash,
        slot_row,
        query_data,
        query_offsets,
        query_valid,
        column,
        hash_bits,
        check_offsets,
    )


def string_lookup_multi(
    vocabulary_data: Tensor,
    vocabulary_offsets: Tensor,
    vocabulary_segments: Tensor,
    slot_hash: Tensor,
    slot_row: Tensor,
    query_data: Sequence[Tensor],
    query_offsets: Sequence[Tensor],
    query_valid: Sequence[Optional[Tensor]],
    hash_bits: int = FULL_HASH_BITS,
    check_offsets: bool = True,
) -> Tensor:
    """Codes of query column c in vocabulary column c, for every column, in one call.

    The three query lists hold one entry per vocabulary column. Returns int64
    [sum of query rows], the columns' codes concatenated in column order (CUDA: one kernel launch
    per 32 columns).
    """
    return torch.ops.tabserve.string_lookup_multi(
        vocabulary_data,
        vocabulary_offsets,
        vocabulary_segments,
        slot_hash,
        slot_row,
        list(query_data),
        list(query_offsets),
        list(query_valid),
        hash_bits,
        check_offsets,
    )
