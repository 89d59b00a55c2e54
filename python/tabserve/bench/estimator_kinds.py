"""The estimator suite's table kinds (as data) and their seeded host tables.

A kind is a table shape and flavour users hand the estimators: NumPy arrays, DataFrames with
string columns, missing values and unseen categories, many rows, many features, many classes,
regression, pandas ``category`` / boolean / integer-named columns (:data:`KINDS`). ``--quick``
runs use each kind's smaller ``quick`` shape. :func:`make_table` builds the seeded table of a kind
in the child process, which times it apart from the engine's work; pandas loads only for the
DataFrame kinds.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np

#: The kind whose fitted, KV-cached estimator predicts many row counts ("fit once, predict many").
PREDICT_MANY_KIND = "wide-rows"
#: Rows predicted by that estimator: full runs, ``--quick`` runs.
PREDICT_SIZES = {"full": (1, 100, 10_000), "quick": (1, 100, 1_000)}


@dataclass(frozen=True)
class Kind:
    """One table kind: train / test rows, features, classes (0: regression), its quick shape."""

    name: str
    n_train: int
    n_test: int
    n_features: int
    n_classes: int
    quick: tuple  # (n_train, n_test, n_features)
    description: str

    @property
    def task(self) -> str:
        return "reg" if self.n_classes == 0 else "clf"

    def shape(self, quick: bool) -> tuple:
        return self.quick if quick else (self.n_train, self.n_test, self.n_features)

    def as_dict(self, quick: bool) -> dict:
        n_train, n_test, n_features = self.shape(quick)
        return {
            **asdict(self),
            "task": self.task,
            "n_train": n_train,
            "n_test": n_test,
            "n_features": n_features,
        }


#: Columns of the ``mixed`` kind besides its numeric ones: (categories per string column).
MIXED_STRING_CATEGORIES = (3, 4, 5, 6)
#: Columns of the ``categories`` kind: numeric, pandas ``category``, boolean.
CATEGORY_KIND_COLUMNS = {"numeric": 6, "category": 3, "bool": 2}

KINDS: tuple = (
    Kind("small", 600, 150, 10, 4, (60, 15, 10), "NumPy, 10 numeric features, 4 classes"),
    Kind(
        "mixed",
        3000,
        1000,
        20,
        3,
        (300, 100, 20),
        "DataFrame: 20 numeric columns (~10% NaN) + 4 string columns (object / string dtype, "
        "~2% unseen at predict), 3 string labels",
    ),
    Kind("wide-rows", 10000, 2000, 50, 2, (1000, 200, 20), "NumPy, 50 features, 2 classes"),
    Kind("wide", 4000, 1000, 150, 5, (400, 100, 40), "NumPy, 150 features, 5 classes"),
    Kind("many-class", 3000, 600, 16, 25, (300, 60, 16), "NumPy, 16 features, 25 classes"),
    Kind("regression", 5000, 1000, 30, 0, (500, 100, 15), "NumPy, 30 features, regression"),
    Kind(
        "categories",
        2000,
        500,
        sum(CATEGORY_KIND_COLUMNS.values()),
        3,
        (200, 50, sum(CATEGORY_KIND_COLUMNS.values())),
        "DataFrame with integer column names 0..10: 6 numeric, 3 pandas category (one with "
        "NaN, one of integers), 2 boolean; 3 integer classes",
    ),
)


def kind_by_name(name: str) -> Kind:
    """The kind named ``name``; raises KeyError listing the known ones."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise KeyError(f"unknown kind {name!r}; known: {', '.join(k.name for k in KINDS)}")


def _rng(kind: Kind, seed: int):
    return np.random.default_rng([seed, zlib.crc32(kind.name.encode())])


def _labels(signal, n_train: int, n_classes: int):
    """Balanced classes: the train signal's quantile bins (every class present in train)."""
    edges = np.quantile(signal[:n_train], np.linspace(0, 1, n_classes + 1)[1:-1])
    return np.searchsorted(edges, signal)


def make_table(kind: Kind, quick: bool = False, seed: int = 0, n_test: int | None = None) -> dict:
    """The seeded host table of ``kind``: ``X_train``, ``y_train``, ``X_test``, ``y_test``.

    NumPy float64 arrays, or DataFrames for ``mixed`` and ``categories``; labels are integers
    (strings for ``mixed``), targets float64. ``n_test`` overrides the kind's test rows (the
    fit-once, predict-many pool); the train rows do not depend on it.
    """
    n_train, default_test, n_features = kind.shape(quick)
    n_test = default_test if n_test is None else n_test
    rng = _rng(kind, seed)
    rows = n_train + n_test
    if kind.name == "categories":
        return _categories_table(kind, rng, n_train, rows)
    scale = rng.uniform(0.1, 3.1, n_features)
    X = rng.standard_normal((rows, n_features)) * scale
    weights = rng.standard_normal(min(n_features, 8))
    signal = X[:, : len(weights)] / scale[: len(weights)] @ weights
    signal = signal + 0.5 * rng.standard_normal(rows)
    if kind.name == "mixed":
        return _mixed_table(kind, rng, X, signal, n_train)
    y = signal if kind.task == "reg" else _labels(signal, n_train, kind.n_classes)
    return _split(X, y, n_train)


def _split(X, y, n_train: int) -> dict:
    """The first ``n_train`` rows to fit, the others to predict (DataFrames indexed from 0)."""
    if hasattr(X, "iloc"):
        train = X.iloc[:n_train].reset_index(drop=True)
        test = X.iloc[n_train:].reset_index(drop=True)
    else:
        train, test = X[:n_train], X[n_train:]
    return {"X_train": train, "y_train": y[:n_train], "X_test": test, "y_test": y[n_train:]}


def _mixed_table(kind: Kind, rng, X, signal, n_train: int) -> dict:
    import pandas as pd

    rows = X.shape[0]
    X = X.copy()
    X[rng.random(X.shape) < 0.10] = np.nan
    frame = pd.DataFrame(X, columns=[f"num_{j:02d}" for j in range(X.shape[1])])
    for j, size in enumerate(MIXED_STRING_CATEGORIES):
        categories = np.array([f"s{j}_{v}" for v in range(size)], dtype=object)
        codes = rng.integers(0, size, rows)
        signal = signal + 0.3 * (codes - size / 2)
        values = categories[codes]
        unseen = (np.arange(rows) >= n_train) & (rng.random(rows) < 0.02)
        values[unseen] = [f"s{j}_unseen_{k}" for k in range(int(unseen.sum()))]
        # two object columns, two pandas string-dtype columns
        frame[f"str_{j}"] = pd.Series(values, dtype=object if j < 2 else "string")
    names = np.array(["alpha", "beta", "gamma"], dtype=object)
    return _split(frame, names[_labels(signal, n_train, kind.n_classes)], n_train)


def _categories_table(kind: Kind, rng, n_train: int, rows: int) -> dict:
    import pandas as pd

    numeric = CATEGORY_KIND_COLUMNS["numeric"]
    X = rng.standard_normal((rows, numeric)) * rng.uniform(0.1, 3.1, numeric)
    frame = pd.DataFrame(X)  # integer column names 0..numeric-1
    signal = X[:, :3] @ rng.standard_normal(3) + 0.5 * rng.standard_normal(rows)
    pools = (["low", "mid", "high"], ["a", "b", "c", "d"], [10, 20, 30])
    for j, pool in enumerate(pools):
        codes = rng.integers(0, len(pool), rows)
        signal = signal + 0.4 * codes
        values = pd.Categorical.from_codes(codes, categories=pool)
        if j == 0:  # missing values in one categorical column
            values = values.copy()
            values[rng.random(rows) < 0.05] = np.nan
        frame[numeric + j] = values
    for j in range(CATEGORY_KIND_COLUMNS["bool"]):
        flags = rng.random(rows) < 0.4
        signal = signal + 0.5 * flags
        frame[numeric + len(pools) + j] = flags
    return _split(frame, _labels(signal, n_train, kind.n_classes), n_train)
