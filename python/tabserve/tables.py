"""Dictionary-encoded categorical columns and tables of them, as torch tensors.

A :class:`CategoricalColumn` is Arrow's dictionary layout: int64 ``codes`` per row (-1 = null)
into a small per-batch vocabulary, ``categories`` (a :class:`~tabserve.strings.StringColumn`, or
an integer / float / bool tensor). A :class:`Table` holds a float block of numerical columns and
named categorical columns.

Both are registered as pytree nodes (plain dataclasses, not tensor subclasses). Why: Dynamo
traces them as ordinary Python objects whose tensor attributes become graph inputs, so the only
things it guards on are what a reader would call the table's structure (column names, how many
columns, whether categories are strings or numbers, dtypes, whether a validity mask exists) plus
tensor shapes, which become dynamic after the first recompile. A tensor subclass would instead
carry its layout as ``__tensor_flatten__`` metadata compared by equality on every call (the
seed's recompile-per-batch trap). The pytree registration serves ``torch.export`` and
``pytree.tree_map`` (e.g. moving a table).

Every factory gives each vocabulary storage of its own starting at offset 0 and normalises
dtypes (codes int64; integer categories int64, float categories float64), so batches differ only
in sizes and compiled functions do not recompile from batch to batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .strings import StringColumn, check_dense

Device = Union[str, torch.device, None]
Categories = Union[StringColumn, Tensor]

#: Kinds of categories. The kind is structure, not data: compiled code branches on it at trace
#: time, and Dynamo guards on it (a StringColumn and a tensor flatten differently).
STRING, INTEGER, FLOAT = "string", "integer", "float"


def category_kind(categories: Categories) -> str:
    """``"string"`` for a StringColumn, ``"float"`` for a floating tensor, ``"integer"`` for an
    integer or bool tensor. Raises TypeError for anything else."""
    if isinstance(categories, StringColumn):
        return STRING
    if isinstance(categories, Tensor):
        if categories.is_floating_point():
            return FLOAT
        if not categories.is_complex():
            return INTEGER
    raise TypeError(
        "categories must be a StringColumn or a 1-D integer, bool or float tensor, got "
        f"{_describe(categories)}"
    )


@dataclass(eq=False)
class CategoricalColumn:
    """A dictionary-encoded column.

    Attributes:
        codes: int32 or int64 [rows]; row i holds ``categories[codes[i]]``, -1 = null.
        categories: the batch's vocabulary: a StringColumn [k] or a 1-D integer / bool / float
            tensor [k]. Labels may repeat and may be unused; NaN float categories and null
            string categories never match anything.

    Both live on one device. The constructor checks dtypes, ranks and devices, and outside
    torch.compile that every code lies in [-1, k) (one synchronisation on CUDA; the factories
    check on the host instead).

    Raises:
        TypeError / ValueError naming the argument for malformed input.
    """

    codes: Tensor
    categories: Categories

    def __post_init__(self):
        _check_layout(self.codes, self.categories)
        if not torch.compiler.is_compiling():
            _check_code_values(self.codes.cpu().numpy(), len(self.categories))

    @classmethod
    def _trusted(cls, codes: Tensor, categories: Categories) -> "CategoricalColumn":
        column = cls.__new__(cls)
        column.codes, column.categories = codes, categories
        return column

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_arrow(cls, array: Union[pa.Array, pa.ChunkedArray]) -> "CategoricalColumn":
        """Column from a pyarrow DictionaryArray or ChunkedArray of them (dictionaries are
        unified), or any string / binary / integer / float / bool array (dictionary-encoded
        first). Null indices and indices of null (or NaN) dictionary entries become -1.
        String dictionaries are shared without a copy where Arrow's layout allows.

        Raises TypeError for other Arrow types.
        """
        array = _as_dictionary_array(array)
        codes = pc.fill_null(array.indices.cast(pa.int64()), -1).to_numpy(zero_copy_only=False)
        codes = np.array(codes, dtype=np.int64, copy=True)
        dictionary = array.dictionary
        categories, unusable = _categories_from_arrow(dictionary)
        if unusable is not None and unusable.any() and codes.size:
            codes[(codes >= 0) & unusable[np.maximum(codes, 0)]] = -1
        _check_code_values(codes, len(categories))
        return cls._trusted(torch.from_numpy(codes), categories)

    @classmethod
    def from_pandas(cls, series) -> "CategoricalColumn":
        """Column from a pandas Series of category, object, string, bool or boolean dtype (or
        any dtype Arrow converts: integer and float series become numeric categories).

        Category dtype keeps pandas' codes and categories (unused categories stay in the
        vocabulary). Other dtypes are dictionary-encoded in order of appearance. None, NaN, pd.NA
        and NaT become null (-1).

        Raises TypeError naming the series when its values mix strings and numbers or have a type
        Arrow cannot encode.
        """
        try:
            array = pa.array(series, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as error:
            raise TypeError(
                f"column {series.name!r} (dtype {series.dtype}) cannot be dictionary-encoded: "
                f"{error}"
            ) from None
        return cls.from_arrow(array)

    @classmethod
    def from_pylist(
        cls, values: Iterable, device: Device = None
    ) -> "CategoricalColumn":
        """Column from Python values (str, bytes, int, float, bool, None), dictionary-encoded in
        order of appearance."""
        values = list(values)
        if any(isinstance(v, (bytes, bytearray)) for v in values):
            array = pa.array(values, type=pa.large_binary())
        else:
            array = pa.array(values, from_pandas=True)
        column = cls.from_arrow(array)
        return column.to(device) if device is not None else column

    # -- access ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.codes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def kind(self) -> str:
        """``"string"``, ``"integer"`` or ``"float"``: see :func:`category_kind`."""
        return category_kind(self.categories)

    def to(self, device: Device) -> "CategoricalColumn":
        """The column on ``device``, codes and categories each in storage of their own at
        offset 0 (compiled code guards on layout; views into shared buffers would recompile)."""
        device = torch.device(device) if device is not None else self.device
        categories = (
            self.categories.to(device)
            if isinstance(self.categories, StringColumn)
            else _own(self.categories, device)
        )
        return CategoricalColumn._trusted(_own(self.codes, device), categories)

    def to_pylist(self) -> list:
        """Each row's category as a Python value (str for UTF-8 labels, else bytes), None for
        null rows."""
        if isinstance(self.categories, StringColumn):
            labels = [_decode(v) for v in self.categories.to_pylist(encoding=None)]
        else:
            labels = self.categories.cpu().tolist()
        return [None if c < 0 else labels[c] for c in self.codes.cpu().tolist()]


pytree.register_pytree_node(
    CategoricalColumn,
    lambda c: ([c.codes, c.categories], None),
    lambda children, _: CategoricalColumn._trusted(*children),
    serialized_type_name="tabserve.CategoricalColumn",
)


@dataclass(eq=False)
class Table:
    """A numerical block plus named categorical columns, all on one device.

    Attributes:
        numerical: float tensor [rows, n_num] (NaN = missing); [rows, 0] when there is none.
        columns: the categorical columns, a tuple of :class:`CategoricalColumn` [rows].
        numerical_names: tuple of n_num column names.
        categorical_names: tuple of names, one per categorical column.
        codes: int64 [rows, n_cat], every categorical column's codes side by side (derived from
            ``columns``, in storage of its own). Compiled code reads this one tensor instead of
            one codes tensor per column: each tensor a compiled function takes costs a guard and,
            with dynamic sizes, a size read on every call.

    Names are unique across both groups. Names and the number of columns are structure
    (compiled code specialises on them); row counts and vocabulary sizes are not.

    Raises:
        TypeError / ValueError for malformed input (checked outside torch.compile).
    """

    numerical: Tensor
    columns: tuple
    numerical_names: tuple
    categorical_names: tuple

    def __post_init__(self):
        self.columns = tuple(self.columns)
        self.numerical_names = tuple(self.numerical_names)
        self.categorical_names = tuple(self.categorical_names)
        if not torch.compiler.is_compiling():
            _check_table(self)
        self.codes = _codes_matrix(self.numerical, self.columns)

    @classmethod
    def _trusted(
        cls, numerical, columns, numerical_names, categorical_names, codes=None
    ) -> "Table":
        table = cls.__new__(cls)
        table.numerical, table.columns = numerical, tuple(columns)
        table.numerical_names, table.categorical_names = numerical_names, categorical_names
        table.codes = _codes_matrix(numerical, table.columns) if codes is None else codes
        return table

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_pandas(
        cls,
        frame,
        device: Device = None,
        *,
        categorical: Optional[Sequence[str]] = None,
        numerical_dtype: torch.dtype = torch.float32,
    ) -> "Table":
        """Table from a pandas DataFrame.

        Columns of category, object, string, bool and boolean dtype are categorical, and so are
        the columns named in ``categorical``; other numeric columns form the numerical block
        (cast to ``numerical_dtype``, missing values as NaN), in frame order. Each column is
        encoded on the host (:meth:`CategoricalColumn.from_pandas`) and copied to ``device`` on
        its own.

        Raises:
            TypeError naming a column of another dtype (datetime, ...) or one that cannot be
            encoded; ValueError for duplicate column names or an unknown name in
            ``categorical``.
        """
        if not (hasattr(frame, "columns") and hasattr(frame, "dtypes")):
            raise TypeError(
                f"Table.from_pandas: frame must be a pandas DataFrame, got {type(frame).__name__}"
                " (pd.DataFrame(...) makes one from a dict of columns)"
            )
        names = [str(name) for name in frame.columns]
        if len(set(names)) != len(names):
            raise ValueError("frame has duplicate column names")
        forced = _forced_names(categorical, names)
        categorical_names, numerical_names = [], []
        for name, dtype in zip(names, frame.dtypes):
            if name in forced or _is_categorical_dtype(dtype):
                categorical_names.append(name)
            elif _is_numerical_dtype(dtype):
                numerical_names.append(name)
            else:
                raise TypeError(
                    f"column {name!r} has dtype {dtype}, which is neither categorical nor "
                    "numerical; drop or convert it"
                )
        positions = {name: i for i, name in enumerate(names)}
        columns = [
            encode_named(name, CategoricalColumn.from_pandas, frame.iloc[:, positions[name]])
            for name in categorical_names
        ]
        if numerical_names:
            block = frame.iloc[:, [positions[n] for n in numerical_names]].to_numpy(
                dtype=_numpy_dtype(numerical_dtype), na_value=np.nan
            )
            numerical = torch.from_numpy(np.require(block, requirements=["C", "W"]))
        else:
            numerical = torch.empty((len(frame), 0), dtype=numerical_dtype)
        table = cls._trusted(numerical, columns, tuple(numerical_names), tuple(categorical_names))
        return table.to(device if device is not None else "cpu")

    @classmethod
    def from_arrow(
        cls,
        table: pa.Table,
        device: Device = None,
        *,
        categorical: Optional[Sequence[str]] = None,
        numerical_dtype: torch.dtype = torch.float32,
    ) -> "Table":
        """Table from a pyarrow Table: dictionary, string, binary and bool columns (and those
        named in ``categorical``) are categorical, integer and floating columns numerical.

        Raises TypeError naming a column of another type.
        """
        names = [str(name) for name in table.column_names]
        if len(set(names)) != len(names):
            raise ValueError("table has duplicate column names")
        forced = _forced_names(categorical, names)
        columns, categorical_names, blocks, numerical_names = [], [], [], []
        for name, column in zip(names, table.columns):
            kind = column.type
            if name in forced or _is_categorical_arrow(kind):
                columns.append(encode_named(name, CategoricalColumn.from_arrow, column))
                categorical_names.append(name)
            elif pa.types.is_integer(kind) or pa.types.is_floating(kind):
                values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
                blocks.append(np.asarray(values, dtype=_numpy_dtype(numerical_dtype)))
                numerical_names.append(name)
            else:
                raise TypeError(
                    f"column {name!r} has Arrow type {kind}, which is neither categorical nor "
                    "numerical; drop or convert it"
                )
        if blocks:
            numerical = torch.from_numpy(np.require(np.stack(blocks, axis=1), requirements=["C", "W"]))
        else:
            numerical = torch.empty((table.num_rows, 0), dtype=numerical_dtype)
        result = cls._trusted(numerical, columns, tuple(numerical_names), tuple(categorical_names))
        return result.to(device if device is not None else "cpu")

    # -- access ----------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return self.numerical.shape[0]

    def __len__(self) -> int:
        return self.numerical.shape[0]

    @property
    def device(self) -> torch.device:
        return self.numerical.device

    @property
    def categorical(self) -> dict:
        """``{name: CategoricalColumn}`` in column order."""
        return dict(zip(self.categorical_names, self.columns))

    def column(self, name: str) -> Union[CategoricalColumn, Tensor]:
        """The categorical column ``name``, or the numerical column ``name`` as a float tensor
        [rows]. Raises KeyError for an unknown name."""
        if name in self.categorical_names:
            return self.columns[self.categorical_names.index(name)]
        if name in self.numerical_names:
            return self.numerical[:, self.numerical_names.index(name)]
        raise KeyError(f"table has no column {name!r}; it has {self.names}")

    @property
    def names(self) -> tuple:
        """All column names: categorical, then numerical."""
        return self.categorical_names + self.numerical_names

    def to(self, device: Device) -> "Table":
        """The table on ``device``, every tensor (every vocabulary included) in storage of its
        own at offset 0."""
        device = torch.device(device) if device is not None else self.device
        return Table._trusted(
            _own(self.numerical, device),
            [column.to(device) for column in self.columns],
            self.numerical_names,
            self.categorical_names,
            codes=_own(self.codes, device),
        )


pytree.register_pytree_node(
    Table,
    lambda t: ([t.numerical, t.codes, *t.columns], (t.numerical_names, t.categorical_names)),
    lambda children, context: Table._trusted(
        children[0], children[2:], *context, codes=children[1]
    ),
    serialized_type_name="tabserve.Table",
)


def mark_dynamic(table: Table) -> Table:
    """Marks every size in ``table`` (rows, vocabulary sizes, label bytes) as dynamic for
    torch.compile, without Dynamo's specialisation of sizes 0 and 1, and returns the table.

    Unmarked, a compiled function compiles a static graph for the first batch, one dynamic graph
    at the second and one more for any later batch with a size of 0 or 1 (a single-category or
    all-null column, a one-row batch). Marked batches share one graph from the first call. Call
    it on each batch, outside the compiled function (the marks live on the tensors).
    """
    for leaf in pytree.tree_leaves(table):  # dimension 0: rows, labels, vocabulary entries
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            torch._dynamo.decorators.mark_unbacked(leaf, 0)
    return table


# ---------------------------------------------------------------------------------------------
# helpers


def _as_dictionary_array(array) -> pa.DictionaryArray:
    if isinstance(array, pa.ChunkedArray):
        if pa.types.is_dictionary(array.type):
            array = array.unify_dictionaries()
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if not isinstance(array, pa.Array):
        raise TypeError(f"array must be a pyarrow Array or ChunkedArray, got {type(array).__name__}")
    if not pa.types.is_dictionary(array.type):
        if not _is_categorical_arrow(array.type) and not _is_numeric_arrow(array.type):
            raise TypeError(f"cannot dictionary-encode an Arrow array of type {array.type}")
        array = pc.dictionary_encode(array)
    return array


def _categories_from_arrow(dictionary: pa.Array) -> tuple[Categories, Optional[np.ndarray]]:
    """(categories, mask of dictionary entries that can never match or None)."""
    kind = dictionary.type
    unusable = None
    if dictionary.null_count:
        unusable = np.asarray(dictionary.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_null(kind):
        # Only nulls: every code becomes -1 (``unusable``), and the vocabulary is empty.
        empty = StringColumn._trusted(
            torch.empty(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64), None
        )
        return empty, np.ones(len(dictionary), dtype=bool)
    if _is_string_arrow(kind):
        strings = StringColumn.from_arrow(dictionary)
        return StringColumn._trusted(strings.data, strings.offsets, None), unusable
    if pa.types.is_boolean(kind):
        values = pc.fill_null(dictionary, False).to_numpy(zero_copy_only=False)
        return torch.from_numpy(np.array(values, dtype=np.bool_)), unusable
    if pa.types.is_integer(kind):
        if pa.types.is_uint64(kind) and len(dictionary) and pc.max(dictionary).as_py() > 2**63 - 1:
            raise TypeError("uint64 categories above 2**63 - 1 are not supported")
        values = pc.fill_null(dictionary.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return torch.from_numpy(np.array(values, dtype=np.int64)), unusable
    if pa.types.is_floating(kind):
        values = np.array(
            dictionary.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64
        )
        nan = np.isnan(values)
        unusable = nan if unusable is None else (unusable | nan)
        return torch.from_numpy(values), (unusable if unusable.any() else None)
    raise TypeError(
        f"categories must be strings, binary, integers, floats or bools, got Arrow type {kind}"
    )


def _is_string_arrow(kind) -> bool:
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_string_view(kind)
        or pa.types.is_binary_view(kind)
    )


def _is_numeric_arrow(kind) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _is_categorical_arrow(kind) -> bool:
    return (
        pa.types.is_dictionary(kind)
        or _is_string_arrow(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_null(kind)
    )


def _is_categorical_dtype(dtype) -> bool:
    import pandas as pd

    return (
        isinstance(dtype, pd.CategoricalDtype)
        or pd.api.types.is_object_dtype(dtype)
        or pd.api.types.is_string_dtype(dtype)
        or pd.api.types.is_bool_dtype(dtype)
    )


def _is_numerical_dtype(dtype) -> bool:
    """Real numbers: bools are categories, and a complex column has no float value to keep."""
    import pandas as pd

    types = pd.api.types
    return types.is_numeric_dtype(dtype) and not (types.is_bool_dtype(dtype) or types.is_complex_dtype(dtype))


def encode_named(name: str, encode, column):
    """``encode(column)``, its TypeError / ValueError naming the column (a list- or
    struct-valued column cannot be dictionary-encoded, and pyarrow's message names no column)."""
    try:
        return encode(column)
    except (TypeError, ValueError, pa.ArrowException) as error:
        raise TypeError(f"column {name!r} cannot be a categorical column: {error}") from error


def _forced_names(categorical, names) -> set:
    forced = set(categorical or ())
    unknown = forced.difference(names)
    if unknown:
        raise ValueError(f"categorical names columns that do not exist: {sorted(unknown)}")
    return forced


def _numpy_dtype(dtype: torch.dtype):
    if not dtype.is_floating_point:
        raise TypeError(f"numerical_dtype must be a floating dtype, got {dtype}")
    return torch.empty(0, dtype=dtype).numpy().dtype


def _own(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device`` in storage of its own at offset 0 (a copy only when needed).

    Empty tensors are recreated: numpy can hand them over with stride 0, and Dynamo guards on
    strides."""
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    owns = (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
    if tensor.device == device and owns:
        return tensor
    return tensor.to(device, copy=True).contiguous()


def _codes_matrix(numerical: Tensor, columns: Sequence) -> Tensor:
    """int64 [rows, n_cat]: the columns' codes side by side, in storage of its own."""
    if not columns:
        return torch.empty((numerical.shape[0], 0), dtype=torch.int64, device=numerical.device)
    return torch.stack([column.codes.to(torch.int64) for column in columns], dim=1)


def _check_layout(codes, categories) -> None:
    if not isinstance(codes, Tensor) or codes.dim() != 1 or codes.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(f"codes must be a 1-D int32 or int64 tensor, got {_describe(codes)}")
    check_dense(codes=codes, categories=categories)
    category_kind(categories)
    if isinstance(categories, Tensor) and categories.dim() != 1:
        raise TypeError(f"categories must be 1-D, got {_describe(categories)}")
    if categories.device != codes.device:
        raise ValueError(f"categories are on {categories.device} but codes are on {codes.device}")


def _check_code_values(codes: np.ndarray, size: int) -> None:
    if codes.size and (codes.min() < -1 or codes.max() >= size):
        raise ValueError(
            f"codes must lie in [-1, {size}) (-1 = null, else an index into the {size} "
            f"categories), got values in [{codes.min()}, {codes.max()}]"
        )


def _check_table(table: Table) -> None:
    numerical = table.numerical
    if not isinstance(numerical, Tensor) or numerical.dim() != 2 or not numerical.is_floating_point():
        raise TypeError(f"numerical must be a 2-D float tensor, got {_describe(numerical)}")
    check_dense(numerical=numerical)
    if len(table.numerical_names) != numerical.shape[1]:
        raise ValueError(
            f"numerical has {numerical.shape[1]} columns but numerical_names holds "
            f"{len(table.numerical_names)} names"
        )
    if len(table.categorical_names) != len(table.columns):
        raise ValueError(
            f"columns holds {len(table.columns)} columns but categorical_names holds "
            f"{len(table.categorical_names)} names"
        )
    names = table.categorical_names + table.numerical_names
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"column names must be unique strings, got {names}")
    for name, column in zip(table.categorical_names, table.columns):
        if not isinstance(column, CategoricalColumn):
            raise TypeError(f"column {name!r} must be a CategoricalColumn, got {_describe(column)}")
        if len(column) != numerical.shape[0]:
            raise ValueError(
                f"column {name!r} has {len(column)} rows but the table has {numerical.shape[0]}"
            )
        if column.device != numerical.device:
            raise ValueError(
                f"column {name!r} is on {column.device} but numerical is on {numerical.device}"
            )


def _decode(value: Optional[bytes]):
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
