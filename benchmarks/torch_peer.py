"""The pure-PyTorch string lookup that tabserve's native operator is measured against.

It follows the approach of the seed (../shared/seeds/001_*): hash every label's bytes with torch
ops, find each query hash among the sorted hashes of the fitted labels with ``torch.searchsorted``,
and confirm the candidate by comparing bytes, so a hash collision never gives a wrong code.
Semantics match ``tabserve.StringIndex``: code = position in the vocabulary, the last duplicate
wins, null vocabulary rows never match, unknown and null queries give -1.

How the work is laid out (static shapes, so ``torch.compile(fullgraph=True)`` traces it whole):

* A label is read in *slots* of ``width`` bytes (8 to 64, from the column's average label length,
  so short labels are not padded to 64). A column of n rows and B data bytes needs at most
  ``n + B // width`` slots; slot s belongs to the row found by ``searchsorted`` over the running
  count of slots per row. Each slot gathers its label's bytes as little-endian 8-byte words
  (a gather over ``unfold(0, 8, 1)`` windows of the data), masked past the label's end.
* The hash is a sum over the label's 8-byte words of ``fmix64(word ^ (word_position * GOLDEN +
  salt))``, finished with the length: the same value whatever the slot width. Sums wrap modulo
  2**64; a row's slots are contiguous, so per-row sums are differences of one running sum over
  the slots (a scatter-add was 100x slower compiled: Inductor lowers it to a serial kernel).
* Fitting retries with seeds 0, 1, ... until distinct labels have distinct hashes (checked by
  comparing the bytes of equal-hash neighbours), so a query has exactly one candidate, and keeps
  the last position of each label. A sentinel key with row -1 ends the sorted keys, so an empty
  vocabulary needs no branch.
* Eager code walks the slots in blocks of about ``block_bytes`` bytes to bound temporaries;
  under ``torch.compile`` one block covers everything and Inductor fuses the gathers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from tabserve import StringColumn

#: Label bytes read per eager block (its int64 temporaries are a few times this).
DEFAULT_BLOCK_BYTES = {"cpu": 1 << 20, "cuda": 1 << 24}
MAX_SEEDS = 16
#: Inductor options to compile :func:`lookup` with (``torch.compile(..., options=...)``). With
#: 512-bit vectors (a CPU with AVX-512) Inductor's code for the whole lookup returned -1 for
#: matching rows (Intel Xeon with AVX-512 and AMX, torch 2.14.1), while its 256-bit and scalar
#: code and every part compiled alone agree with eager; CUDA code ignores the option.
COMPILE_OPTIONS = {"cpp.simdlen": 256}


def _s64(value: int) -> int:
    """A 64-bit unsigned constant as the int64 torch stores."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = _s64(0x9E3779B97F4A7C15)
FMIX1 = _s64(0xFF51AFD7ED558CCD)
FMIX2 = _s64(0xC4CEB9FE1A85EC53)
LENGTH_MULTIPLIER = _s64(0xD6E8FEB86659FD93)
SENTINEL_KEY = (1 << 63) - 1
_LOW31 = (1 << 31) - 1  # masks an arithmetic right shift by 33 into a logical one


def _fmix64(x: Tensor) -> Tensor:
    """MurmurHash3's 64-bit finaliser on int64 (logical shifts; multiplies wrap)."""
    x = x ^ ((x >> 33) & _LOW31)
    x = x * FMIX1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * FMIX2
    return x ^ ((x >> 33) & _LOW31)


def _salt(seed: int) -> int:
    """splitmix64 of the seed, as a Python int (a compile-time constant)."""
    z = (seed * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return _s64(z ^ (z >> 31))


def slot_plan(data_bytes: int, lengths: Tensor) -> tuple[int, int]:
    """(slots, width): bytes per slot and how many slots to walk for rows of ``lengths`` over
    ``data_bytes`` bytes of data.

    width is the power of two in [8, 64] at most a quarter of the average label length, so the
    bound ``n + data_bytes // width`` on the slots rows need wastes at most about a fifth of them.
    Under torch.compile that bound is walked (a static shape); eager code reads the exact count
    (one host synchronisation on CUDA) and so walks no unused slot.
    """
    n = lengths.shape[0]
    average = data_bytes // max(n, 1)
    width = 8
    while width < 64 and width * 8 <= average:
        width *= 2
    if torch.compiler.is_compiling():
        return n + data_bytes // width, width
    return int(((lengths + (width - 1)) // width).sum()), width


# ---------------------------------------------------------------------------------------------
# Slots: which row and which words of it each slot reads


def _blocks(slots: int, width: int, block_bytes: Optional[int]):
    """Slot ranges [start, stop): one range under torch.compile or when block_bytes is None."""
    if block_bytes is None or torch.compiler.is_compiling():
        yield 0, slots
        return
    step = max(block_bytes // width, 1)
    for start in range(0, slots, step):
        yield start, min(start + step, slots)


def _slot_ends(lengths: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(counts, ends): slots each row needs and their running total, int64 [n]."""
    counts = (lengths + (width - 1)) // width
    return counts, torch.cumsum(counts, 0)


def _slot_words(lengths: Tensor, counts: Tensor, ends: Tensor, width: int, start: int, stop: int):
    """For slots [start, stop): the row (clamped to n - 1 for unused slots), the byte position in
    its row of every word the slot reads, int64 [slots, width // 8], and how many of each word's
    bytes lie inside the row (<= 0: none, also for unused slots)."""
    n = lengths.shape[0]
    slot = torch.arange(start, stop, device=lengths.device)
    row = torch.searchsorted(ends, slot, right=True)
    safe = row.clamp(max=n - 1)
    piece = slot - (ends[safe] - counts[safe])
    position = piece[:, None] * width + torch.arange(0, width, 8, device=lengths.device)
    inside_bytes = torch.where((row < n)[:, None], lengths[safe][:, None] - position, 0)
    return safe, position, inside_bytes


def _row_sums(slot_values: list[Tensor], counts: Tensor, ends: Tensor) -> Tensor:
    """Per-row sums (wrapping int64) of per-slot values: a row's slots are contiguous, so a
    running sum read at the row's first and last slot gives it (no scatter)."""
    if not slot_values:  # no slots: every row is empty
        return torch.zeros_like(counts)
    values = torch.cat(slot_values) if len(slot_values) > 1 else slot_values[0]
    running = torch.cat([values.new_zeros(1), torch.cumsum(values, 0)])
    return running[ends] - running[ends - counts]


_SHIFTS = tuple(range(0, 64, 8))


def _words(data: Tensor, index: Tensor, inside_bytes: Tensor) -> Tensor:
    """Little-endian int64 words of ``data[index : index + min(inside_bytes, 8)]``, zero-padded;
    0 where ``inside_bytes <= 0``. ``data`` holds at least 8 bytes (see :func:`_padded`)."""
    last = data.shape[0] - 8
    inside = inside_bytes > 0
    index = torch.where(inside, index, 0)
    start = index.clamp(max=last)  # a word near the end is read from the last window, shifted
    raw = data.unfold(0, 8, 1)[start]  # [..., 8] uint8, a gather of 8-byte windows
    if torch.compiler.is_compiling():  # Inductor fuses shifts; a dtype view would not fuse
        shifts = torch.tensor(_SHIFTS, device=data.device)
        word = (raw.to(torch.int64) << shifts).sum(-1)
    else:
        word = raw.view(torch.int64).squeeze(-1)
    word = word >> ((index - start) * 8)
    keep = torch.where(
        inside_bytes >= 8, -1, torch.bitwise_left_shift(torch.ones_like(inside_bytes), inside_bytes.clamp(0, 7) * 8) - 1
    )  # the sign fill of the shift above lands in bits that ``keep`` clears
    return torch.where(inside, word & keep, 0)


def _padded(data: Tensor) -> Tensor:
    """``data``, or a copy padded with zeros to 8 bytes when it is shorter."""
    if data.shape[0] >= 8:
        return data
    return torch.cat([data, data.new_zeros(8 - data.shape[0])])


# ---------------------------------------------------------------------------------------------
# Hashing and byte comparison of rows given by (starts, lengths)


def hash_rows(
    data: Tensor,
    starts: Tensor,
    lengths: Tensor,
    seed: int,
    slots: int,
    width: int,
    block_bytes: Optional[int] = None,
) -> Tensor:
    """int64 [n] hash of rows ``data[starts[i] : starts[i] + lengths[i]]``; ``slots`` must be at
    least ``sum(ceil(lengths / width))``. The value does not depend on ``width``."""
    n = lengths.shape[0]
    if n == 0:
        return lengths.new_empty(0)
    data = _padded(data)
    salt = _salt(seed)
    counts, ends = _slot_ends(lengths, width)
    slot_values = []
    for start, stop in _blocks(slots, width, block_bytes):
        safe, position, inside_bytes = _slot_words(lengths, counts, ends, width, start, stop)
        words = _words(data, starts[safe][:, None] + position, inside_bytes)
        mixed = _fmix64(words ^ ((position >> 3) * GOLDEN + salt))
        slot_values.append(torch.where(inside_bytes > 0, mixed, 0).sum(-1))
    sums = _row_sums(slot_values, counts, ends)
    return _fmix64(sums ^ (lengths * LENGTH_MULTIPLIER + salt))


def rows_differ(
    query_data: Tensor,
    query_starts: Tensor,
    lengths: Tensor,
    vocabulary_data: Tensor,
    vocabulary_starts: Tensor,
    slots: int,
    width: int,
    block_bytes: Optional[int] = None,
) -> Tensor:
    """bool [n]: whether the first ``lengths[i]`` bytes of query row i and vocabulary row i
    differ (rows of length 0 never differ; callers compare lengths themselves)."""
    n = lengths.shape[0]
    if n == 0:
        return lengths.new_empty(0, dtype=torch.bool)
    query_data, vocabulary_data = _padded(query_data), _padded(vocabulary_data)
    counts, ends = _slot_ends(lengths, width)
    slot_values = []
    for start, stop in _blocks(slots, width, block_bytes):
        safe, position, inside_bytes = _slot_words(lengths, counts, ends, width, start, stop)
        query_words = _words(query_data, query_starts[safe][:, None] + position, inside_bytes)
        vocabulary_words = _words(
            vocabulary_data, vocabulary_starts[safe][:, None] + position, inside_bytes
        )
        slot_values.append((query_words != vocabulary_words).any(-1).to(torch.int64))
    return _row_sums(slot_values, counts, ends) > 0


# ---------------------------------------------------------------------------------------------
# The index


class PeerIndex(NamedTuple):
    """A fitted vocabulary for :func:`lookup` (a pytree, so compiled functions take it whole).

    keys: int64 [K + 1] sorted hashes of the distinct valid labels, then a sentinel.
    rows: int64 [K + 1] the last vocabulary position of each key's label, then -1.
    vocabulary_data, vocabulary_offsets: the vocabulary's bytes (at least 1) and offsets
        (int64 [rows + 2]: one more empty row at the end).
    seed: the hash seed under which the distinct labels have distinct hashes.
    hash_mask: the hash bits kept: -1 (all) in production; tests keep a few to force collisions.
    """

    keys: Tensor
    rows: Tensor
    vocabulary_data: Tensor
    vocabulary_offsets: Tensor
    seed: int
    hash_mask: int = -1


def fit(
    vocabulary: StringColumn, block_bytes: Optional[int] = -1, *, hash_bits: int = 64
) -> PeerIndex:
    """Hashes the vocabulary, retrying seeds until distinct labels hash apart (eager; reads
    tensors on the host). ``block_bytes=-1`` picks the device's default, None one block.
    ``hash_bits`` < 64 keeps fewer hash bits, to force collisions in tests.

    Raises RuntimeError if MAX_SEEDS seeds all collide (never seen with 64-bit hashes).
    """
    device = vocabulary.device
    block_bytes = _block_bytes(block_bytes, device)
    data, offsets = _padded(vocabulary.data), vocabulary.offsets
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    n = lengths.shape[0]
    slots, width = slot_plan(vocabulary.data.shape[0], lengths)
    positions = torch.arange(n, device=device)
    if vocabulary.valid is not None:
        positions = positions[vocabulary.valid]
    hash_mask = -1 if hash_bits >= 64 else (1 << hash_bits) - 1
    for seed in range(MAX_SEEDS):
        hashes = hash_rows(data, starts, lengths, seed, slots, width, block_bytes)[positions]
        hashes = _mask(hashes, hash_mask)
        hashes, order = torch.sort(hashes, stable=True)
        sorted_positions = positions[order]
        same = hashes[1:] == hashes[:-1]
        if bool(same.any()) and not _equal_rows(
            data, starts, lengths, sorted_positions[:-1][same], sorted_positions[1:][same],
            block_bytes,
        ):
            continue  # two distinct labels share a hash: try the next seed
        # Stable sort keeps vocabulary order within a run of equal labels: keep the last.
        last = torch.ones_like(hashes, dtype=torch.bool)
        last[:-1] = ~same
        sentinel = torch.tensor([SENTINEL_KEY], dtype=torch.int64, device=device)
        return PeerIndex(
            keys=torch.cat([hashes[last], sentinel]),
            rows=torch.cat([sorted_positions[last], -torch.ones_like(sentinel)]),
            vocabulary_data=data,
            # One more empty row, so the sentinel's row -1 (clamped to 0) reads in bounds.
            vocabulary_offsets=torch.cat([offsets, offsets[-1:]]),
            seed=seed,
            hash_mask=hash_mask,
        )
    raise RuntimeError(f"torch_peer.fit: distinct labels collided under {MAX_SEEDS} seeds")


def _equal_rows(data, starts, lengths, a: Tensor, b: Tensor, block_bytes) -> bool:
    """Whether rows a[i] and b[i] hold the same bytes for every i."""
    same_length = lengths[a] == lengths[b]
    if not bool(same_length.all()):
        return False
    slots, width = slot_plan(int(lengths[a].sum()), lengths[a])
    differ = rows_differ(
        data, starts[a], lengths[a], data, starts[b], slots, width, block_bytes
    )
    return not bool(differ.any())


def _mask(hashes: Tensor, hash_mask: int) -> Tensor:
    return hashes if hash_mask == -1 else hashes & hash_mask


def _block_bytes(block_bytes: Optional[int], device: torch.device) -> Optional[int]:
    if block_bytes == -1:
        return DEFAULT_BLOCK_BYTES.get(device.type, DEFAULT_BLOCK_BYTES["cuda"])
    return block_bytes


def lookup(index: PeerIndex, query: StringColumn, block_bytes: Optional[int] = -1) -> Tensor:
    """int64 [len(query)] codes of ``query`` in the fitted vocabulary (-1: unknown or null).

    No host synchronisation; traceable by ``torch.compile(fullgraph=True)``.
    ``block_bytes=-1`` picks the device's default, None one block (ignored when compiling).
    """
    block_bytes = _block_bytes(block_bytes, query.device)
    offsets = query.offsets
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    slots, width = slot_plan(query.data.shape[0], lengths)
    hashes = hash_rows(query.data, starts, lengths, index.seed, slots, width, block_bytes)
    hashes = _mask(hashes, index.hash_mask)
    position = torch.searchsorted(index.keys, hashes)  # <= K: the sentinel ends the keys
    candidate = index.rows[position]
    row = candidate.clamp(min=0)
    vocabulary_starts = index.vocabulary_offsets[row]
    vocabulary_lengths = index.vocabulary_offsets[row + 1] - vocabulary_starts
    hit = (index.keys[position] == hashes) & (candidate >= 0) & (vocabulary_lengths == lengths)
    if query.valid is not None:
        hit = hit & query.valid
    # Only hits are compared: the others get length 0 and so no slots.
    compared = torch.where(hit, lengths, 0)
    slots, width = slot_plan(query.data.shape[0], compared)
    differ = rows_differ(
        query.data,
        starts,
        compared,
        index.vocabulary_data,
        vocabulary_starts,
        slots,
        width,
        block_bytes,
    )
    return torch.where(hit & ~differ, candidate, -1)


def fit_columns(vocabularies: Sequence[StringColumn]) -> list[PeerIndex]:
    """One :class:`PeerIndex` per column."""
    return [fit(vocabulary) for vocabulary in vocabularies]


def lookup_columns(indexes: Sequence[PeerIndex], queries: Sequence[StringColumn]) -> Tensor:
    """Codes of ``queries[c]`` in ``indexes[c]``, concatenated in column order."""
    return torch.cat([lookup(index, query) for index, query in zip(indexes, queries)])
