"""AlignCategories: maps each batch's categories onto the codes fitted on the training table.

Fitted categories of every column, strings and numbers alike, are stored as one packed
vocabulary of byte keys (strings: their UTF-8 bytes; integers: 8 little-endian bytes of the int64
value; floats: 8 bytes of the float64 value, -0.0 folded onto 0.0). So one
``dictionary_lookup`` operator call maps the batch vocabularies of all columns and, by a gather
over the concatenated lookup results, the rows: no per-column work on rows, no size-dependent
branch.

State: the packed vocabulary (``vocabulary_data``, ``vocabulary_offsets``,
``vocabulary_segments``) and the column names and kinds (``_extra_state``) are persistent; the
hash table (``slot_hash``, ``slot_row``) is rebuilt from them at :meth:`AlignCategories.fit` and
by ``_load_from_state_dict`` on every ``load_state_dict``, a method rather than a hook, so it
runs however the module was constructed (under torch.compile included). Fitted categories hold
no nulls, so the vocabulary has no validity mask.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from . import ops
from .strings import StringColumn
from .tables import FLOAT, INTEGER, STRING, CategoricalColumn, Table, category_kind

SORT_BY = ("value", "appearance")

#: Bytes of one numeric key.
KEY_BYTES = 8


class CategoryTypeError(TypeError):
    """A column's categories are strings where numbers were fitted, or the reverse."""


class NotFittedError(RuntimeError):
    """AlignCategories was used before fit or load_state_dict."""


_ERRORS = {
    "CategoryTypeError": CategoryTypeError,
    "NotFittedError": NotFittedError,
    "KeyError": KeyError,
    "ValueError": ValueError,
}


@torch.library.custom_op("tabserve::_raise_error", mutates_args=())
def _raise_error(like: Tensor, error: str, message: str) -> Tensor:
    """Raises ``error(message)``. Structural errors go through this operator so that compiled
    code raises them exactly as eager code does: Dynamo would turn a ``raise`` met while tracing
    into its own exception. The decision is taken at trace time (it depends on structure only);
    the graph of a wrong input calls this operator, which raises when the graph runs."""
    raise _ERRORS[error](message)


@_raise_error.register_fake
def _(like, error, message):
    return like.new_empty((0, 0), dtype=torch.int64)


def _fail(like: Tensor, error: str, message: str) -> Tensor:
    return _raise_error(like, error, message)


#: What a loaded state sets besides the buffers (extra state and the rebuilt index).
_FITTED_ATTRIBUTES = ("sort_by", "column_names", "column_kinds", "slot_hash", "slot_row")


def _unbacked_alias(tensor: Tensor) -> Tensor:
    """A new tensor object over ``tensor``'s storage whose dimension 0 Dynamo traces unbacked."""
    alias = tensor.detach()
    torch._dynamo.decorators.mark_unbacked(alias, 0)
    return alias


def _unbacked_categories(categories):
    if isinstance(categories, StringColumn):
        valid = None if categories.valid is None else _unbacked_alias(categories.valid)
        data, offsets = _unbacked_alias(categories.data), _unbacked_alias(categories.offsets)
        return StringColumn._trusted(data, offsets, valid)
    return _unbacked_alias(categories)


def _unbacked_table(table: Table) -> Table:
    """``table`` over aliases of its tensors (same storage, new tensor objects) whose sizes
    Dynamo traces unbacked, so the caller's tensors carry no marks into other compiled
    functions."""
    columns = [
        CategoricalColumn._trusted(c.codes, _unbacked_categories(c.categories))
        for c in table.columns
    ]
    numerical, codes = _unbacked_alias(table.numerical), _unbacked_alias(table.codes)
    names = (table.numerical_names, table.categorical_names)
    return Table._trusted(numerical, columns, *names, codes=codes)


#: ``_unbacked_table``, disabled for Dynamo once ``_sizes_hook`` has run.
_unbacked_eager = _unbacked_table


def _sizes_dynamic(module: "AlignCategories", args: tuple) -> Optional[tuple]:
    """Forward pre-hook: once Dynamo has traced ``forward`` with static sizes, the next call's
    table reaches it with every size (rows, vocabulary entries, label bytes) unbacked. So
    ``torch.compile(align)`` compiles a static graph at its first call and, at its second, one
    graph that every later batch reuses, sizes 0 and 1 included. Unmarked, Dynamo makes dynamic
    at its first recompile only the sizes that changed then, and compiles again for each size
    that changes later or is 0 or 1.

    It runs eagerly, before Dynamo traces ``forward`` (marks count only when set before), and
    marks one call only: ``forward`` records that Dynamo traced it, and a marked input never
    meets the guards of a static graph, so the call it marks compiles the dynamic graph, whose
    guards admit unmarked tables of any size. Eager use, and every compiled call but the
    second, pay two attribute reads. (Dynamo traces ``isinstance(size, torch.SymInt)`` as
    False, so ``forward`` cannot tell the two graphs apart itself.) Only a call through
    ``torch.compile(align)`` is marked: an eager call between the compiled ones would spend the
    one mark on a call that compiles nothing."""
    if module._sizes_marked or not module._traced:
        return None
    if not torch._dynamo.eval_frame._is_in_optimized_module():
        return None
    if len(args) != 1 or not isinstance(args[0], Table):
        return None
    module._sizes_marked = True
    return (_unbacked_eager(args[0]),)


@functools.cache
def _sizes_hook():
    """``_sizes_dynamic`` as Dynamo runs it, built at the first AlignCategories a caller
    constructs: decorating imports ``torch._dynamo`` (1.7 s on a 2-core CPU), which
    ``import tabserve`` and the estimators' eager fits never need."""
    global _unbacked_eager
    # The hook's own frame runs eagerly, the functions it calls would be traced: the marks
    # must be set outside any trace.
    _unbacked_eager = torch.compiler.disable(_unbacked_table)
    hook = torch.compiler.disable(_sizes_dynamic, recursive=False)
    # Pickle stores a module's hooks by name: this one resolves through the module __getattr__.
    hook.__name__ = hook.__qualname__ = "_sizes_pre_hook"

    @torch.compiler.substitute_in_graph(hook)
    def inlined(module, args):
        # Inlined into a larger compiled function, the hook does nothing: that function's
        # inputs were traced before it ran, a disabled call would break the graph, and a read
        # of ``_traced`` would be guarded on and recompile once forward stored it.
        return None

    return hook


def __getattr__(name: str):
    if name == "_sizes_pre_hook":
        return _sizes_hook()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Refused(Exception):
    """A state ``_load_from_state_dict`` reported in ``error_msgs`` (load_state_dict raises)."""


class AlignCategories(nn.Module):
    """Aligns the categorical columns of tables with the categories of a fitted table.

    ``fit(table)`` records the categories observed in every categorical column (null rows and
    unused vocabulary entries ignored; repeated labels count once), ordered by value
    (``sort_by="value"``: strings by UTF-8 bytes, which is code-point order; numbers
    numerically) or by first appearance in the rows (``"appearance"``). The fitted code of a
    category is its position in that order.

    ``forward(table)`` (alias :meth:`transform`) returns int64 [rows, n_columns] on the table's
    device: the fitted code of each row's category per fitted column (in fitted order), -1 for
    null rows and categories not seen at fit. Extra table columns are ignored.

    Integer, bool and float categories align too, with each other by numeric equality (1 ==
    1.0 == True; NaN never matches). String categories never align with numeric ones: that raises
    :class:`CategoryTypeError`, the same exception and message in eager and compiled mode.

    Under ``torch.compile(fullgraph=True)``: no graph break, and at most one recompile: a
    static graph at the first call, then at the first batch of other sizes one dynamic graph
    that batches of any row count, vocabulary size and label bytes (0 and 1 included) reuse,
    without ``mark_dynamic`` or ``dynamic=True`` (the module marks its input's sizes itself).
    Constructing one imports ``torch._dynamo`` for that (once per process; ``import tabserve``
    and the estimators do not).

    Raises:
        NotFittedError before fit; ValueError for a missing column; CategoryTypeError as above.
    """

    def __init__(self, sort_by: str = "value", *, _mark_sizes: bool = True):
        super().__init__()
        _check_sort_by(sort_by)
        self.sort_by = sort_by
        self.column_names: Optional[tuple] = None  # None until fitted
        self.column_kinds: tuple = ()
        self.register_buffer("vocabulary_data", torch.empty(0, dtype=torch.uint8))
        self.register_buffer("vocabulary_offsets", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("vocabulary_segments", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("slot_hash", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("slot_row", torch.empty(0, dtype=torch.int64), persistent=False)
        self._traced = False  # stored by forward while Dynamo traces it: see _sizes_dynamic
        self._sizes_marked = False
        if _mark_sizes:  # a module compiled inside a larger function needs no marks
            self.register_forward_pre_hook(_sizes_hook())

    # -- fitting ---------------------------------------------------------------------------

    def fit(
        self,
        table: Table,
        sort_by: Optional[str] = None,
        columns: Optional[Sequence[str]] = None,
    ) -> "AlignCategories":
        """Records the categories of ``columns`` (default: every categorical column of
        ``table``). Runs on the host; the state lands on the module's device. Returns self.

        Raises TypeError for a non-Table, KeyError for an unknown or numerical column,
        ValueError for a bad ``sort_by``.
        """
        if not isinstance(table, Table):
            raise TypeError(f"table must be a tabserve Table, got {type(table).__name__}")
        if sort_by is not None:
            _check_sort_by(sort_by)
            self.sort_by = sort_by
        names = tuple(table.categorical_names if columns is None else columns)
        keys, kinds = [], []
        for name in names:
            if name not in table.categorical_names:
                raise KeyError(f"table has no categorical column {name!r}")
            column = table.columns[table.categorical_names.index(name)]
            kind = column.kind
            keys.append(_encode_keys(_observed_categories(column, self.sort_by), kind))
            kinds.append(kind)
        self._set_state(names, tuple(kinds), keys)
        return self

    def _set_state(self, names: tuple, kinds: tuple, keys: Sequence[Sequence[bytes]]) -> None:
        device = self.vocabulary_data.device
        lengths = [len(key) for column in keys for key in column]
        data = b"".join(key for column in keys for key in column)
        self.vocabulary_data = torch.tensor(np.frombuffer(data, dtype=np.uint8), device=device)
        self.vocabulary_offsets = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int64).to(
            device
        )
        self.vocabulary_segments = torch.tensor(
            np.cumsum([0] + [len(column) for column in keys]), dtype=torch.int64
        ).to(device)
        self.column_names, self.column_kinds = names, kinds
        self._build_index()

    def _build_index(self) -> None:
        """Rebuilds the non-persistent hash table from the persistent vocabulary."""
        if not self.column_names:  # unfitted or no column: forward never looks anything up
            self.slot_hash = self.vocabulary_offsets.new_empty(0)
            self.slot_row = self.vocabulary_offsets.new_empty(0)
            return
        self.slot_hash, self.slot_row = ops.string_index_build(
            self.vocabulary_data, self.vocabulary_offsets, None, self.vocabulary_segments
        )

    # -- state -----------------------------------------------------------------------------

    def get_extra_state(self) -> dict:
        return {
            "version": 1,
            "sort_by": self.sort_by,
            "column_names": self.column_names,
            "column_kinds": self.column_kinds,
        }

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError(f"unsupported AlignCategories state {state!r}")
        self.sort_by = state["sort_by"]
        names = state["column_names"]
        self.column_names = None if names is None else tuple(names)
        self.column_kinds = tuple(state["column_kinds"])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A state that fails (a bad offset the index build rejects, a column count that does
        # not match) leaves the module as it was: what loading replaces is put back.
        saved_buffers = dict(self._buffers)
        saved_state = {name: getattr(self, name) for name in _FITTED_ATTRIBUTES}
        # Fresh buffers of the incoming sizes (the fitted vocabulary's size differs from the
        # constructed one's): the default loader copies into them, and the saved ones keep
        # their values.
        for name in ("vocabulary_data", "vocabulary_offsets", "vocabulary_segments"):
            incoming = state_dict.get(prefix + name)
            if isinstance(incoming, Tensor):
                self._buffers[name] = self._buffers[name].new_empty(incoming.shape)
        missing_before, errors_before = len(missing_keys), len(error_msgs)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                error_msgs,
            )  # fmt: skip
            if len(missing_keys) != missing_before or len(error_msgs) != errors_before:
                raise _Refused()
            expected = 1 + len(self.column_names or ())
            if self.vocabulary_segments.shape[0] != expected:
                error_msgs.append(
                    f"{prefix}vocabulary_segments holds {self.vocabulary_segments.shape[0]} "
                    f"entries but the state names {expected - 1} columns"
                )
                raise _Refused()
            self._build_index()
        except BaseException as error:
            self._buffers.update(saved_buffers)
            for name, value in saved_state.items():
                setattr(self, name, value)
            if not isinstance(error, _Refused):
                raise

    def categories(self, name: str) -> list:
        """The fitted categories of column ``name`` in code order, as Python values (str, or
        bytes for labels that are not UTF-8; int; float)."""
        if self.column_names is None or name not in self.column_names:
            raise KeyError(f"no fitted column {name!r}")
        c = self.column_names.index(name)
        segments = self.vocabulary_segments.tolist()
        offsets = self.vocabulary_offsets.tolist()
        data = self.vocabulary_data.cpu().numpy().tobytes()
        keys = [data[offsets[r] : offsets[r + 1]] for r in range(segments[c], segments[c + 1])]
        return [_decode_key(key, self.column_kinds[c]) for key in keys]

    # -- alignment -------------------------------------------------------------------------

    def forward(self, table: Table) -> Tensor:
        """Aligned codes int64 [rows, n_fitted_columns]; see the class docstring."""
        if torch.compiler.is_compiling():
            # Dynamo replays this store at each call of the graph it traced. It only stores: a
            # read here would be guarded on, and recompile once the value changed.
            self._traced = True
        like = table.numerical
        if self.column_names is None:
            return _fail(like, "NotFittedError", "AlignCategories is not fitted: call fit first")
        columns, positions = [], []
        for name, fitted_kind in zip(self.column_names, self.column_kinds):
            if name not in table.categorical_names:
                return _fail(
                    like,
                    "ValueError",
                    f"table has no categorical column {name!r} (it has {table.categorical_names})",
                )
            positions.append(table.categorical_names.index(name))
            column = table.columns[positions[-1]]
            kind = category_kind(column.categories)
            if (kind == STRING) != (fitted_kind == STRING):
                return _fail(
                    like,
                    "CategoryTypeError",
                    f"column {name!r} holds {kind} categories but was fitted with "
                    f"{fitted_kind} categories; convert the column or refit",
                )
            columns.append(column)
        if not columns:
            return like.new_empty((like.shape[0], 0), dtype=torch.int64)

        queries = [
            _query_keys(column.categories, kind) for column, kind in zip(columns, self.column_kinds)
        ]
        # Every column in one operator call: each batch category looked up in its fitted
        # vocabulary, then each row's batch code replaced by its category's fitted code (-1 for
        # null and unknown; empty vocabularies included). The rows' codes come from the table's
        # one codes matrix, read in place: one graph input instead of one per column. On CUDA this
        # is two kernel launches, where per-column tensor maths compiled to two launches a column.
        return ops.dictionary_lookup(
            self.vocabulary_data,
            self.vocabulary_offsets,
            self.vocabulary_segments,
            self.slot_hash,
            self.slot_row,
            [q.data for q in queries],
            [q.offsets for q in queries],
            [q.valid for q in queries],
            table.codes,
            None if positions == list(range(table.codes.shape[1])) else positions,
            check_offsets=False,  # tabserve built or checked every query's offsets
        )

    def transform(self, table: Table) -> Tensor:
        """Same as calling the module."""
        return self(table)

    def extra_repr(self) -> str:
        fitted = "unfitted" if self.column_names is None else f"columns={len(self.column_names)}"
        return f"sort_by={self.sort_by!r}, {fitted}"


# ---------------------------------------------------------------------------------------------
# keys


def _query_keys(categories, fitted_kind: str) -> StringColumn:
    """The batch categories as byte keys comparable with the fitted ones (traceable)."""
    if isinstance(categories, StringColumn):
        return categories
    valid = None
    if fitted_kind == INTEGER:
        if categories.is_floating_point():
            values = categories.to(torch.float64)
            valid = (values == torch.trunc(values)) & (values.abs() < 2.0**63)
            keys = torch.where(valid, values, 0.0).to(torch.int64)
        else:
            keys = categories.to(torch.int64)
    else:
        values = categories.to(torch.float64)
        if categories.is_floating_point():
            valid = ~torch.isnan(values)
        keys = torch.where(values == 0.0, 0.0, values)  # -0.0 matches 0.0
    keys = keys.contiguous()
    data = keys.view(torch.uint8)
    offsets = torch.arange(keys.shape[0] + 1, dtype=torch.int64, device=keys.device) * KEY_BYTES
    return StringColumn._trusted(data, offsets, valid)


def _observed_categories(column: CategoricalColumn, sort_by: str) -> list:
    """Distinct categories used by the column's rows, as Python values, in fitted order."""
    codes = column.codes.cpu().numpy()
    used, first = np.unique(codes[codes >= 0], return_index=True)
    used = used[np.argsort(first, kind="stable")]  # in order of first appearance
    categories = column.categories
    if isinstance(categories, StringColumn):
        labels = categories.to_pylist(encoding=None)
        values = [labels[i] for i in used if labels[i] is not None]
    else:
        array = categories.cpu().numpy()[used]
        if categories.is_floating_point():
            array = array.astype(np.float64)
            array = array[~np.isnan(array)]
            array[array == 0.0] = 0.0
        else:
            array = array.astype(np.int64)
        values = array.tolist()
    values = list(dict.fromkeys(values))  # repeated labels count once, first appearance kept
    return sorted(values) if sort_by == "value" else values


def _encode_keys(values: list, kind: str) -> list:
    if kind == STRING:
        return [bytes(v) for v in values]
    dtype = np.float64 if kind == FLOAT else np.int64
    return [v.tobytes() for v in np.asarray(values, dtype=dtype).reshape(-1, 1)]


def _decode_key(key: bytes, kind: str):
    if kind == STRING:
        try:
            return key.decode("utf-8")
        except UnicodeDecodeError:
            return key
    return np.frombuffer(key, dtype=np.float64 if kind == FLOAT else np.int64)[0].item()


def _check_sort_by(sort_by) -> None:
    if sort_by not in SORT_BY:
        raise ValueError(f"sort_by must be one of {SORT_BY}, got {sort_by!r}")
