"""The TabICL wrapper's categorical step on the device (tabicl 2.2.0 ``TransformToNumerical``).

For a pandas DataFrame, tabicl 2.2.0 (``tabicl/_sklearn/preprocessing.py``) builds a
``ColumnTransformer``: the columns that ``make_column_selector(dtype_include=["string", "object",
"category", "boolean"])`` selects go through ``OrdinalEncoder(dtype=int64,
handle_unknown="use_encoded_value", unknown_value=-1, encoded_missing_value=-1)``, then the
``dtype_include="number"`` columns through ``SimpleImputer(keep_empty_features=True)`` (mean);
other columns (datetime; numpy ``bool`` under pandas 3.1, which pandas 3.0 selects as categorical)
are dropped. The output is float64 [rows, n_cat + n_num],
categorical columns first.

What scikit-learn really does there, and :class:`TabICLEncoder` reproduces:
- categories are the distinct *observed* training values sorted by value (strings by code
  point; category dtype ignores unused categories; ints in a category dtype sort numerically);
- NaN (and pandas' NaN-backed missing strings) encode as -1, at fit and transform;
- ``None`` in an *object* column is a category of its own that sorts after every value: it gets
  a real code when seen at fit (-1 only when unseen). It is kept here as a sentinel label that
  sorts last: byte 0xFF for strings (never in UTF-8), int64 max for integers, +inf for floats
  (so a genuine +inf next to None in one object column is the one case that differs);
- the nullable ``boolean`` dtype encodes False 0, True 1, NA -1.
Where scikit-learn raises (pd.NA in a ``string`` column, strings mixed with numbers in an
object column), this module treats pd.NA as missing (-1) and raises TypeError for mixed types.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from .align import AlignCategories, _fail
from .strings import StringColumn, pack_columns
from .tables import CategoricalColumn, Device, Table, encode_named

#: Column dtypes tabicl 2.2.0 encodes ordinally (``make_column_selector`` ``dtype_include``).
CATEGORICAL_DTYPES = ["string", "object", "category", "boolean"]
#: Column dtypes tabicl 2.2.0 imputes with the training mean.
NUMERICAL_DTYPES = "number"

#: Sentinels standing for ``None`` in object columns: each sorts after every real value.
NONE_LABEL = b"\xff"
NONE_INTEGER = np.iinfo(np.int64).max
NONE_FLOAT = np.inf


def tabicl_columns(frame) -> tuple[tuple, tuple]:
    """(categorical names, numerical names) as tabicl 2.2.0 selects them, in frame order.

    tabicl selects with scikit-learn's ``make_column_selector(dtype_include=...)``, which is
    pandas' ``select_dtypes`` on the frame's first row; pandas is called directly here because
    importing ``sklearn.compose`` costs a fresh process 0.14 s (H200 machine) of its first fit.
    """
    head = frame.iloc[:1]
    categorical = head.select_dtypes(include=CATEGORICAL_DTYPES).columns
    numerical = head.select_dtypes(include=NUMERICAL_DTYPES).columns
    return tuple(map(str, categorical)), tuple(map(str, numerical))


def tabicl_table(
    frame,
    categorical_names: Sequence[str],
    numerical_names: Sequence[str],
    device: Device = None,
) -> Table:
    """The columns of ``frame`` as a Table under tabicl's conventions: the named categorical
    columns (object-column ``None`` kept as a sentinel category, see the module docstring), the
    named numerical columns as float64 with NaN for missing values.

    Raises KeyError for a missing column, TypeError for a column that cannot be encoded.
    """
    positions = {str(name): i for i, name in enumerate(frame.columns)}
    missing = [n for n in (*categorical_names, *numerical_names) if n not in positions]
    if missing:
        raise KeyError(f"frame lacks the fitted columns {missing}")
    columns = [encode_named(n, _tabicl_column, frame.iloc[:, positions[n]]) for n in categorical_names]
    if numerical_names:
        block = frame.iloc[:, [positions[n] for n in numerical_names]].to_numpy(
            dtype=np.float64, na_value=np.nan
        )
        numerical = torch.from_numpy(np.require(block, requirements=["C", "W"]))
    else:
        numerical = torch.empty((len(frame), 0), dtype=torch.float64)
    table = Table._trusted(numerical, columns, tuple(numerical_names), tuple(categorical_names))
    return table.to(device if device is not None else "cpu")


def _training_means(numerical) -> np.ndarray:
    """``SimpleImputer(keep_empty_features=True).fit(numerical).statistics_``, bit for bit: its
    validation (scikit-learn's ``check_array``: the same dtype, the same error for infinities)
    and its masked mean, an all-missing column's mean 0. Importing ``sklearn.impute`` (and
    ``sklearn.metrics`` behind it) would cost a fresh process 0.3 s of its first fit on a
    DataFrame (2-core CPU and H100 host alike) for this one mean."""
    from sklearn.utils.validation import FLOAT_DTYPES, check_array

    values = check_array(
        numerical, dtype=FLOAT_DTYPES, ensure_all_finite="allow-nan", input_name="X"
    )
    means = np.ma.masked_array(values, mask=np.isnan(values)).mean(axis=0)
    fill = np.ma.getdata(means)
    fill[np.ma.getmaskarray(means)] = 0
    return fill


class TabICLEncoder(nn.Module):
    """tabicl 2.2.0's ``TransformToNumerical`` for DataFrames, with the transform on the device.

    ``fit(frame)`` selects the columns as tabicl does, fits an :class:`AlignCategories`
    (``sort_by="value"``) on the categorical ones and the training means of the numerical ones
    (scikit-learn's ``SimpleImputer``'s, bit for bit: :func:`_training_means`). ``forward(table)``
    (table from :meth:`to_table`) returns [rows, n_cat + n_num] in ``dtype`` (default float64,
    the reference's dtype): the ordinal codes (-1 for missing and unseen), then the numerical
    columns with NaN replaced by the training mean. :meth:`transform` takes a DataFrame.

    Fitted state (categories, means, names) is in ``state_dict``. The forward compiles to one
    graph like AlignCategories.
    """

    def __init__(self, dtype: torch.dtype = torch.float64):
        super().__init__()
        self.dtype = dtype
        self.align = AlignCategories(sort_by="value", _mark_sizes=False)
        self.categorical_names: tuple = ()
        self.numerical_names: tuple = ()
        self.register_buffer("numerical_fill", torch.empty(0, dtype=torch.float64))

    def fit(self, frame) -> "TabICLEncoder":
        """Fits on a pandas DataFrame (the training features). Returns self."""
        self._fit(frame, numerical=False)
        return self

    def fit_transform(self, frame, device: Device = None) -> Tensor:
        """``fit(frame)``, then ``transform(frame)`` (the same numbers), the frame's columns
        encoded once: a DataFrame's encoding is most of its host time (a 400-row frame of 4
        string and 26 numeric columns: 3.6 ms a pass, 2.3 of it the string columns).
        ``device``: the encoder moves there once fitted, and encodes there (default: where it
        is)."""
        table = self._fit(frame, numerical=True)
        if device is not None:
            self.to(device)
        return self(table.to(self.numerical_fill.device))

    def _fit(self, frame, numerical: bool) -> Table:
        """Fits on ``frame``; its table (on the host), with the numerical columns where asked."""
        if not hasattr(frame, "columns"):
            raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
        categorical_names, numerical_names = tabicl_columns(frame)
        table = tabicl_table(frame, categorical_names, numerical_names if numerical else ())
        fill = np.zeros(0)
        if numerical_names:
            names = list(map(str, frame.columns))  # once: a frame's column index may be Arrow's
            # From the frame, not the table: the imputer's mean keeps each column's own dtype
            # (a float32 column's mean is float32's) and its own summation order.
            fill = _training_means(frame.iloc[:, [names.index(n) for n in numerical_names]])
        self.align.fit(table)
        self.categorical_names, self.numerical_names = categorical_names, numerical_names
        self.numerical_fill = torch.tensor(fill, dtype=torch.float64).to(self.numerical_fill.device)
        return table

    def to_table(self, frame, device: Device = None) -> Table:
        """The fitted columns of ``frame`` as the Table :meth:`forward` takes (default device:
        the module's)."""
        device = device if device is not None else self.numerical_fill.device
        return tabicl_table(frame, self.categorical_names, self.numerical_names, device)

    def forward(self, table: Table) -> Tensor:
        """Encoded features [rows, n_cat + n_num] in ``self.dtype``."""
        if table.numerical_names != self.numerical_names:
            return _fail(
                table.numerical,
                "ValueError",
                f"table's numerical columns {table.numerical_names} differ from the fitted "
                f"{self.numerical_names}; build it with TabICLEncoder.to_table",
            )
        codes = self.align(table).to(self.dtype)
        numerical = table.numerical.to(torch.float64)
        numerical = torch.where(torch.isnan(numerical), self.numerical_fill, numerical)
        return torch.cat([codes, numerical.to(self.dtype)], dim=1)

    def transform(self, frame, device: Device = None) -> Tensor:
        """Encodes a DataFrame: ``self(self.to_table(frame, device))``."""
        return self(self.to_table(frame, device))

    def get_extra_state(self) -> dict:
        return {
            "version": 1,
            "categorical_names": self.categorical_names,
            "numerical_names": self.numerical_names,
        }

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError(f"unsupported TabICLEncoder state {state!r}")
        self.categorical_names = tuple(state["categorical_names"])
        self.numerical_names = tuple(state["numerical_names"])

    def _load_from_state_dict(self, state_dict, prefix, *args):
        incoming = state_dict.get(prefix + "numerical_fill")
        if isinstance(incoming, Tensor) and incoming.shape != self.numerical_fill.shape:
            self.numerical_fill = self.numerical_fill.new_empty(incoming.shape)
        super()._load_from_state_dict(state_dict, prefix, *args)


def encode_categoricals(
    train, test=None, *, device: Device = None, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Optional[Tensor], TabICLEncoder]:
    """tabicl's ``TransformToNumerical`` on ``train`` (fit + transform) and ``test`` (transform).

    Args:
        train, test: pandas DataFrames with the same columns (``test`` optional).
        device: where the encoder and the outputs live (default CPU).
        dtype: output dtype (float64 = the reference's numbers).

    Returns:
        (train features [n_train, n_cat + n_num], test features or None, the fitted encoder).
    """
    encoder = TabICLEncoder(dtype=dtype)
    train_features = encoder.fit_transform(train, device)
    test_features = None if test is None else encoder.transform(test)
    return train_features, test_features, encoder


def _tabicl_column(series) -> CategoricalColumn:
    """One column under scikit-learn's conventions: object-column None is a category."""
    import pandas as pd

    if not pd.api.types.is_object_dtype(series.dtype):
        return CategoricalColumn.from_pandas(series)
    values = series.to_numpy(dtype=object)
    missing = np.flatnonzero(pd.isna(values))
    none_rows = missing[[values[i] is None for i in missing]] if missing.size else missing
    if none_rows.size == 0:
        return CategoricalColumn.from_pandas(series)
    column = CategoricalColumn.from_pandas(pd.Series(values, name=series.name).where(
        pd.notna(values), np.nan
    ))
    return _with_none_category(column, none_rows)


def _with_none_category(column: CategoricalColumn, rows: np.ndarray) -> CategoricalColumn:
    categories = column.categories
    if isinstance(categories, StringColumn):
        categories, _ = pack_columns([categories, StringColumn.from_pylist([NONE_LABEL])])
        categories = StringColumn._trusted(categories.data, categories.offsets, None)
    elif categories.is_floating_point():
        categories = torch.cat([categories, torch.tensor([NONE_FLOAT], dtype=categories.dtype)])
    else:
        categories = torch.cat(
            [categories.to(torch.int64), torch.tensor([NONE_INTEGER], dtype=torch.int64)]
        )
    codes = column.codes.clone()
    codes[torch.from_numpy(rows)] = len(categories) - 1
    return CategoricalColumn._trusted(codes, categories)
