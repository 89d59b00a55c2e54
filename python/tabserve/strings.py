"""String columns in Arrow layout and the fitted-vocabulary index that maps labels to codes."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import ops

Device = Union[str, torch.device, None]

_ARROW_STRING_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


@dataclass(eq=False)
class StringColumn:
    """A column of byte strings in Arrow's variable-size binary layout, as torch tensors.

    Attributes:
        data: uint8 [total bytes].
        offsets: int64 [rows + 1], non-decreasing, within [0, total bytes]; row i holds
            ``data[offsets[i]:offsets[i + 1]]``. The first offset need not be 0.
        valid: bool [rows], or None when no row is null. A null row is distinct from ``b""``.

    All three live on one device. The constructor checks dtypes, shapes and devices, and, outside
    torch.compile, the offset values (on CUDA that costs one synchronisation; the factories below
    check on the host instead). StringColumn is a pytree node, so compiled functions take it as
    an input.

    Raises:
        TypeError / ValueError naming the argument for malformed tensors.
    """

    data: Tensor
    offsets: Tensor
    valid: Optional[Tensor] = None

    def __post_init__(self):
        _check_layout(self.data, self.offsets, self.valid)
        if not torch.compiler.is_compiling():
            _check_offset_values(self.offsets, self.data.shape[0])

    @classmethod
    def _trusted(cls, data: Tensor, offsets: Tensor, valid: Optional[Tensor]) -> "StringColumn":
        """Builds a column whose offsets were produced or checked by tabserve (no value check)."""
        column = cls.__new__(cls)
        column.data, column.offsets, column.valid = data, offsets, valid
        return column

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_pylist(cls, values: Iterable, device: Device = None) -> "StringColumn":
        """Column from a list of ``str`` (stored as UTF-8), ``bytes`` and ``None`` (null).

        Raises TypeError naming the index of the first value of another type.
        """
        encoded = []
        for i, value in enumerate(values):
            if isinstance(value, str):
                encoded.append(value.encode("utf-8"))
            elif value is None or isinstance(value, (bytes, bytearray, memoryview)):
                encoded.append(value)
            else:
                raise TypeError(
                    f"values[{i}] must be str, bytes or None, got {type(value).__name__}"
                )
        column = cls.from_arrow(pa.array(encoded, type=pa.large_binary()))
        return column.to(device) if device is not None else column

    @classmethod
    def from_arrow(cls, array: Union[pa.Array, pa.ChunkedArray]) -> "StringColumn":
        """Column over a pyarrow string / large_string / binary / large_binary array (on CPU).

        The data buffer is shared without a copy; int64 offsets too (large types), honouring the
        array's slice offset. int32 offsets are widened and the validity bitmap is unpacked to
        bools (both copies); ``valid`` is always a tensor, all True without nulls. Chunked arrays
        are combined first.

        Raises TypeError for other Arrow types.
        """
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
        if not isinstance(array, pa.Array):
            raise TypeError(f"array must be a pyarrow Array or ChunkedArray, got {type(array)}")
        if array.type not in _ARROW_STRING_TYPES:
            if pa.types.is_string_view(array.type) or pa.types.is_binary_view(array.type):
                array = array.cast(pa.large_binary())
            else:
                raise TypeError(
                    "array must hold strings or binary (string, large_string, binary, "
                    f"large_binary), got {array.type}"
                )
        rows = len(array)
        validity, offsets_buffer, data_buffer = array.buffers()[:3]
        wide = array.type in (pa.large_string(), pa.large_binary())
        offsets = _buffer_tensor(
            offsets_buffer, torch.int64 if wide else torch.int32, array.offset, rows + 1
        )
        if offsets.numel() == 0:  # a zero-row array may carry no offsets buffer at all
            offsets = torch.zeros(1, dtype=torch.int64)
        offsets = offsets.to(torch.int64)
        data = _buffer_tensor(data_buffer, torch.uint8, 0, None)
        # Always a mask, also without nulls, so batches with and without nulls have one layout
        # (a compiled function would otherwise recompile when `valid` switches to None).
        if validity is not None and array.null_count > 0:
            valid = torch.from_numpy(np.asarray(array.is_valid(), dtype=np.bool_).copy())
        else:
            valid = torch.ones(rows, dtype=torch.bool)
        return cls._trusted(data, offsets, valid)

    # -- access ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to_pylist(self, encoding: Optional[str] = "utf-8") -> list:
        """The values as Python objects: ``str`` decoded with ``encoding``, or ``bytes`` when
        ``encoding`` is None; null rows give None."""
        data = self.data.cpu().numpy().tobytes()
        offsets = self.offsets.cpu().tolist()
        valid = [True] * len(self) if self.valid is None else self.valid.cpu().tolist()
        values = []
        for i in range(len(self)):
            if not valid[i]:
                values.append(None)
                continue
            raw = data[offsets[i] : offsets[i + 1]]
            values.append(raw.decode(encoding) if encoding is not None else raw)
        return values

    def to(self, device: Device) -> "StringColumn":
        """The column on ``device`` in storage of its own, starting at offset 0.

        The result never views a buffer shared with other columns: compiled code guards on
        storage offsets, so views into one shared buffer would recompile from batch to batch.
        Unused bytes outside the rows' range are dropped when the column is compacted on the
        host.
        """
        device = torch.device(device) if device is not None else self.device
        column = self.compact() if self.device.type == "cpu" else self
        if column.device == device and _owns_storage(column.data):
            return column
        if column.device == device:
            return StringColumn._trusted(
                column.data.clone(), column.offsets.clone(), _clone(column.valid)
            )
        moved = StringColumn._trusted(
            column.data.to(device, copy=True),
            column.offsets.to(device, copy=True),
            None if column.valid is None else column.valid.to(device, copy=True),
        )
        return moved.compact() if device.type == "cpu" else moved

    def compact(self) -> "StringColumn":
        """The same rows with offsets starting at 0 and only the bytes they use (reads the
        offsets: one synchronisation on CUDA)."""
        first, last = int(self.offsets[0]), int(self.offsets[-1])
        if first == 0 and last == self.data.shape[0] and _owns_storage(self.data):
            return self
        return StringColumn._trusted(
            self.data[first:last].clone(), self.offsets - first, _clone(self.valid)
        )


pytree.register_pytree_node(
    StringColumn,
    lambda c: ([c.data, c.offsets, c.valid], None),
    lambda children, _: StringColumn._trusted(*children),
    serialized_type_name="tabserve.StringColumn",
)


class StringIndex:
    """A fitted string vocabulary and its hash table: maps labels to codes.

    The code of a label is its position in the vocabulary; when a label appears several times the
    last position wins; null vocabulary entries never match; unknown labels and null queries give
    -1. Bytes are compared exactly, so hash collisions never give a wrong code.

    ``StringIndex(vocabulary)`` indexes one column; :meth:`from_columns` packs several
    vocabularies into one index for :meth:`lookup_columns`. The index lives on the vocabulary's
    device; building it on CUDA runs on the GPU.
    """

    def __init__(self, vocabulary: StringColumn, *, _hash_bits: int = ops.FULL_HASH_BITS):
        if not isinstance(vocabulary, StringColumn):
            raise TypeError(f"vocabulary must be a StringColumn, got {type(vocabulary).__name__}")
        self._init(vocabulary, _segments(len(vocabulary), vocabulary.device), _hash_bits)

    def _init(self, vocabulary: StringColumn, segments: Tensor, hash_bits: int) -> None:
        self.vocabulary = vocabulary
        self.segments = segments
        self.hash_bits = hash_bits
        self.slot_hash, self.slot_row = ops.string_index_build(
            vocabulary.data, vocabulary.offsets, vocabulary.valid, segments, hash_bits
        )

    @classmethod
    def from_columns(
        cls, vocabularies: Sequence[StringColumn], *, _hash_bits: int = ops.FULL_HASH_BITS
    ) -> "StringIndex":
        """One index over several vocabularies (one per query column), packed back to back."""
        vocabularies = list(vocabularies)
        if not vocabularies:
            raise ValueError("vocabularies must hold at least one StringColumn")
        for i, vocabulary in enumerate(vocabularies):
            if not isinstance(vocabulary, StringColumn):
                raise TypeError(
                    f"vocabularies[{i}] must be a StringColumn, got {type(vocabulary).__name__}"
                )
        packed, segments = pack_columns(vocabularies)
        index = cls.__new__(cls)
        index._init(packed, segments, _hash_bits)
        return index

    @property
    def columns(self) -> int:
        return self.segments.shape[0] - 1

    @property
    def device(self) -> torch.device:
        return self.vocabulary.device

    def __len__(self) -> int:
        return len(self.vocabulary)

    def lookup(self, query: StringColumn, column: int = 0) -> Tensor:
        """Codes int64 [len(query)] of ``query`` in vocabulary column ``column``, on the index's
        device. Raises ValueError when the query sits on another device."""
        self._check_query(query, "query")
        return ops.string_lookup(
            self.vocabulary.data,
            self.vocabulary.offsets,
            self.segments,
            self.slot_hash,
            self.slot_row,
            query.data,
            query.offsets,
            query.valid,
            column,
            self.hash_bits,
            check_offsets=False,  # StringColumn checked its offsets when it was built
        )

    def lookup_columns(self, queries: Sequence[StringColumn]) -> Tensor:
        """Codes of ``queries[c]`` in vocabulary column c for every column, concatenated in column
        order: int64 [sum of len(query)], in one operator call."""
        queries = list(queries)
        if len(queries) != self.columns:
            raise ValueError(
                f"queries must hold one StringColumn per vocabulary column ({self.columns}), "
                f"got {len(queries)}"
            )
        for i, query in enumerate(queries):
            self._check_query(query, f"queries[{i}]")
        return ops.string_lookup_multi(
            self.vocabulary.data,
            self.vocabulary.offsets,
            self.segments,
            self.slot_hash,
            self.slot_row,
            [q.data for q in queries],
            [q.offsets for q in queries],
            [q.valid for q in queries],
            self.hash_bits,
            check_offsets=False,
        )

    def to(self, device: Device) -> "StringIndex":
        """The index on ``device`` (tables are copied, not rebuilt)."""
        device = torch.device(device)
        index = StringIndex.__new__(StringIndex)
        index.vocabulary = self.vocabulary.to(device)
        index.segments = self.segments.to(device)
        index.hash_bits = self.hash_bits
        index.slot_hash = self.slot_hash.to(device)
        index.slot_row = self.slot_row.to(device)
        return index

    def _check_query(self, query, name: str) -> None:
        if not isinstance(query, StringColumn):
            raise TypeError(f"{name} must be a StringColumn, got {type(query).__name__}")
        if query.device != self.device:
            raise ValueError(
                f"{name} is on {query.device} but the index is on {self.device}; "
                "move one with .to(device)"
            )


def pack_columns(columns: Sequence[StringColumn]) -> tuple[StringColumn, Tensor]:
    """Concatenates string columns into one column plus segments int64 [len(columns) + 1]
    (rows of column c: [segments[c], segments[c + 1])). Reads offsets (syncs once on CUDA)."""
    device = columns[0].device
    compact = [column.compact() for column in columns]
    byte_starts = np.cumsum([0] + [c.data.shape[0] for c in compact])
    offsets = [compact[0].offsets[:1]] + [
        c.offsets[1:] + int(start) for c, start in zip(compact, byte_starts)
    ]
    any_null = any(c.valid is not None for c in compact)
    valid = (
        torch.cat(
            [
                c.valid if c.valid is not None else torch.ones(len(c), dtype=torch.bool, device=device)
                for c in compact
            ]
        )
        if any_null
        else None
    )
    packed = StringColumn._trusted(torch.cat([c.data for c in compact]), torch.cat(offsets), valid)
    rows = np.cumsum([0] + [len(c) for c in compact])
    return packed, torch.tensor(rows, dtype=torch.int64, device=device)


def _segments(rows: int, device) -> Tensor:
    return torch.tensor([0, rows], dtype=torch.int64, device=device)


def check_dense(**tensors) -> None:
    """TypeError naming the first of ``tensors`` (name=value) that is a tensor without strided
    storage (sparse, oneDNN): the columns read their tensors' storage directly."""
    for name, tensor in tensors.items():
        if isinstance(tensor, Tensor) and tensor.layout != torch.strided:
            raise TypeError(
                f"{name} must be a dense tensor, got layout {tensor.layout} (.to_dense() makes one)"
            )


def _check_layout(data, offsets, valid) -> None:
    check_dense(data=data, offsets=offsets, valid=valid)
    if not isinstance(data, Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"data must be a 1-D uint8 tensor, got {_describe(data)}")
    if not isinstance(offsets, Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise TypeError(f"offsets must be a 1-D int64 tensor, got {_describe(offsets)}")
    if offsets.shape[0] < 1:
        raise ValueError("offsets must hold rows + 1 >= 1 entries, got an empty tensor")
    if offsets.device != data.device:
        raise ValueError(f"offsets is on {offsets.device} but data is on {data.device}")
    if valid is not None:
        if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.dim() != 1:
            raise TypeError(f"valid must be a 1-D bool tensor or None, got {_describe(valid)}")
        if valid.shape[0] != offsets.shape[0] - 1:
            raise ValueError(
                f"valid must have one entry per row ({offsets.shape[0] - 1}), got {valid.shape[0]}"
            )
        if valid.device != data.device:
            raise ValueError(f"valid is on {valid.device} but data is on {data.device}")


def _check_offset_values(offsets: Tensor, data_size: int) -> None:
    bad = (offsets.min() < 0) | (offsets.max() > data_size)
    if offsets.shape[0] > 1:
        bad = bad | (offsets[1:] < offsets[:-1]).any()
    if bool(bad):
        raise ValueError(
            f"offsets must be non-decreasing and within [0, {data_size}] (the size of data)"
        )


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _owns_storage(t: Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _clone(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.clone()


def _buffer_tensor(buffer, dtype: torch.dtype, start: int, count: Optional[int]) -> Tensor:
    """Zero-copy tensor over an Arrow buffer (elements [start, start + count))."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if buffer is None or buffer.size == 0:
        return torch.empty(0, dtype=dtype)
    if count is None:
        count = buffer.size // itemsize - start
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # Arrow buffers are read-only; tabserve never writes them
        warnings.simplefilter("ignore", UserWarning)
        # Through a memoryview: an immutable Arrow buffer (over bytes, a memory-mapped file or
        # Ray's object store) refuses the buffer request torch.frombuffer makes of it directly.
        view = memoryview(buffer)
        return torch.frombuffer(view, dtype=dtype, count=count, offset=start * itemsize)
