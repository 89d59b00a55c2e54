"""The reference wrapper's preprocessing, as tensor maths on the model's device.

Per table (``fit`` on train rows, ``transform`` on any rows), in the reference's order:

1. :class:`TableEncoder`: categorical columns first (ordinal codes, sorted categories, unknown or
   missing -> -1), then numeric columns with NaN -> train mean (an all-NaN column -> 0). Other
   dtypes are dropped. DataFrames go through :class:`tabserve.TabICLEncoder` (AlignCategories on
   the device: one string-lookup call for all categorical columns).
2. :class:`ConstantFeatureFilter`: drop columns with a single distinct train value.
3. Per normalisation method (:class:`MemberPreprocessor`): standard scaling (population std
   + 1e-6, clipped to +-100), optional Yeo-Johnson ("power": each column's lambda from
   scikit-learn's search, run on the device by one kernel, :func:`yeo_johnson_lambdas`)
   followed by standardisation, then a soft outlier clip at 4 sigma.
4. :func:`ensemble_plan`: members = (feature permutation, class pattern, normalisation method),
   drawn with Python's ``random.Random(random_state)`` exactly as the reference draws them
   (Latin squares, cyclic class shifts).

All tensors here are float64 (the reference's NumPy precision); members are cast to float32 for
the network.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tabserve.ops import yeo_johnson_lambdas

from ..network.transfer import device_values

#: Above this many features Latin squares are replaced by random permutations (reference rule).
MAX_FEATURES_FOR_LATIN = 4000
SHUFFLE_METHODS = ("none", "shift", "random", "latin")
NORM_METHODS = ("none", "power", "quantile", "quantile_rtdl", "robust")

_SCALE_EPS = 1e-6
_CLIP = 100.0


# ----------------------------------------------------------------------------- table encoder
class TableEncoder:
    """NumPy array or pandas DataFrame -> float64 tensor ``(rows, features)`` with NaN imputed."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def fit(self, X) -> TableEncoder:
        self._fit(X)
        return self

    def fit_transform(self, X) -> Tensor:
        """``fit(X)``, then ``transform(X)`` (the same numbers), ``X`` read once."""
        return self._fit(X, transform=True)

    def _fit(self, X, transform: bool = False) -> Tensor | None:
        if hasattr(X, "columns"):
            # DataFrames go through the device encoder (AlignCategories: one string-lookup call
            # for all categorical columns), which reproduces tabicl's TransformToNumerical, its
            # error for infinities included.
            from tabserve.encoding import TabICLEncoder

            ranks = python_ordered_ranks(X)
            # Fitted on the host, then moved: its vocabularies must live where the tables'
            # codes do (the string lookup takes all of its operands on one device). Its fit
            # refuses infinities, as the transform's check does.
            encoder, frame, encoded = TabICLEncoder(), ranked(X, ranks), None
            if transform:
                encoded = encoder.fit_transform(frame, self.device)
            else:
                encoder.fit(frame).to(self.device)
            self.is_frame_, self.ranks_, self.frame_encoder_ = True, ranks, encoder
            self.columns_ = [str(name) for name in X.columns]
            return encoded
        numeric = self._numeric(X)
        means = numeric.nanmean(dim=0)
        self.is_frame_ = False
        self.fill_ = torch.where(torch.isnan(means), torch.zeros_like(means), means)
        return torch.where(torch.isnan(numeric), self.fill_, numeric) if transform else None

    def _numeric(self, X) -> Tensor:
        """Float64 tensor of a NumPy ``X``; ValueError for infinities or non-numeric data."""
        try:
            values = np.asarray(X, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"a NumPy X must be numeric ({e}); pass a pandas DataFrame for categorical / string columns"
            ) from None
        if values.ndim != 2:
            raise ValueError(f"X must be 2-D (rows, features), got shape {values.shape}")
        if np.isinf(values).any():
            raise ValueError("X contains infinite values; NaN (missing) is supported, inf is not")
        if not values.flags.writeable:
            values = values.copy()
        return torch.from_numpy(values).to(self.device)

    def transform(self, X) -> Tensor:
        if self.is_frame_:
            # The frame's columns are read once, on the host, where the infinities are refused
            # as tabicl's imputer refuses them; then moved, as one table.
            from sklearn.utils import assert_all_finite

            X = ranked(self._by_position(X), getattr(self, "ranks_", {}))
            table = self.frame_encoder_.to_table(X, "cpu")
            assert_all_finite(table.numerical.numpy(), allow_nan=True, input_name="X")
            return self.frame_encoder_(table.to(self.device))
        numeric = self._numeric(X)  # also rejects infinities with a clear message
        return torch.where(torch.isnan(numeric), self.fill_, numeric)

    def _by_position(self, X):
        """The DataFrame ``X`` (the estimator has made an array into one) under the fitted
        frame's column labels. tabicl's column transformer reads a later input by position
        unless both it and the training frame name their columns with strings, and then
        scikit-learn has already refused other names or another order: an array or a frame of
        other labels (which scikit-learn warns of) is read by position. Encoders pickled without
        the labels read by name."""
        labels = getattr(self, "columns_", None)
        if labels is not None and [str(name) for name in X.columns] != labels:
            X = X.set_axis(labels, axis=1)
        return X


#: pandas' names (``infer_dtype``) of values that Python orders and the device encoder does not
#: take (dates, decimals, intervals as ``pd.cut`` makes them, timestamps in a category, ...).
PYTHON_ORDERED = frozenset(
    {"date", "datetime", "datetime64", "decimal", "interval", "period", "time", "timedelta",
     "timedelta64"}
)  # fmt: skip


def python_ordered_ranks(frame) -> dict:
    """``{column name: {value: rank}}`` for the object and category columns of ``frame`` (which
    tabicl encodes ordinally) whose values are :data:`PYTHON_ORDERED`: tabicl's ordinal encoder
    sorts such values with Python, so their ranks among the observed training values (``None``
    after them when seen, as scikit-learn places it) are their codes, and a column of ranks
    encodes as they do. The check reads each object column's first value and each category's
    categories: 0.35 ms for the suite's ``mixed`` table (2-core CPU).

    Raises TypeError naming the column when its values cannot be ordered."""
    import pandas as pd
    from pandas.api.types import infer_dtype

    ranks = {}
    for position, dtype in enumerate(frame.dtypes):
        if isinstance(dtype, pd.CategoricalDtype):
            values = dtype.categories
        elif dtype == object:  # its first value tells: mixed kinds raise either way
            series = frame.iloc[:, position]
            present = series.notna().to_numpy()
            values = series.iloc[present.argmax() : present.argmax() + 1] if present.any() else ()
        else:  # numbers, and the string and boolean dtypes the device encoder takes
            continue
        if len(values) == 0 or infer_dtype(values, skipna=True) not in PYTHON_ORDERED:
            continue
        name = str(frame.columns[position])
        seen = frame.iloc[:, position].astype(object)
        try:
            order = sorted(set(seen[seen.notna()]))
        except TypeError as error:
            raise TypeError(f"column {name!r} cannot be a categorical column: {error}") from None
        if any(value is None for value in seen):
            order.append(None)
        ranks[name] = {value: rank for rank, value in enumerate(order)}
    return ranks


def ranked(frame, ranks: dict):
    """``frame`` with each column of ``ranks`` replaced by a category of its values' ranks
    (unseen and missing values missing: tabicl codes both -1)."""
    if not ranks:
        return frame
    import pandas as pd

    names = [str(name) for name in frame.columns]
    frame = frame.copy(deep=False)
    for name, rank in ranks.items():
        position = names.index(name)
        values = frame.iloc[:, position].astype(object)
        codes = [rank.get(v) if v is None or not pd.isna(v) else None for v in values]
        frame.isetitem(position, pd.Categorical(codes, categories=range(len(rank))))
    return frame


class ConstantFeatureFilter:
    """Keeps columns with more than one distinct train value (all columns if <= 1 train row).

    The kept columns are a shape (the members' feature count), so ``fit`` reads their number on
    the host once; ``transform`` gathers them by index and never waits on the device.
    """

    def fit(self, X: Tensor) -> ConstantFeatureFilter:
        if X.shape[0] <= 1:
            keep = torch.ones(X.shape[1], dtype=torch.bool, device=X.device)
        else:
            keep = (X != X[:1]).any(dim=0)
            keep[0] |= ~keep.any()  # an all-constant table keeps its first column
        self.keep_ = keep.nonzero().squeeze(1)
        return self

    def transform(self, X: Tensor) -> Tensor:
        return X.index_select(1, self.keep_)


# ----------------------------------------------------------------------------- per-member maths
def yeo_johnson(x: Tensor, lambdas: Tensor) -> Tensor:
    """Yeo-Johnson transform with per-column ``lambdas`` (scipy's formulation: expm1 / log1p)."""
    eps = torch.finfo(x.dtype).eps
    positive = x >= 0
    log_pos = torch.log1p(x.clamp(min=0))
    log_neg = torch.log1p((-x).clamp(min=0))
    lam, two_minus = lambdas.expand_as(x), (2 - lambdas).expand_as(x)
    pos = torch.where(lam.abs() < eps, log_pos, torch.expm1(lam * log_pos) / lam)
    neg = torch.where(
        (lam - 2).abs() > eps, -torch.expm1(two_minus * log_neg) / two_minus, -log_neg
    )
    return torch.where(positive, pos, neg)


# ----------------------------------------------------------------------------- quantile / robust
#: scikit-learn's BOUNDS_THRESHOLD: inputs this close to the outer quantiles map onto them.
_BOUNDS = 1e-7
#: The reference's quantile transforms: QuantileTransformer's defaults, and the RTDL variant's
#: noise, quantile count rule and sample cap (tabicl's RTDLQuantileTransformer).
QUANTILES, QUANTILE_SUBSAMPLE = 1000, 10_000
RTDL_NOISE, RTDL_ROWS_PER_QUANTILE, RTDL_MIN_QUANTILES, RTDL_SUBSAMPLE = 1e-3, 30, 10, 1_000_000_000


def _interp(x: Tensor, xp: Tensor, fp: Tensor) -> Tensor:
    """``numpy.interp`` of every column: ``x (rows, cols)`` on the points ``xp (n, cols)``
    (ascending per column, repeats allowed) with values ``fp (n,)``; the same segment choice
    (the last point at or below x), slope formula and end values as NumPy's."""
    if xp.shape[0] == 1:
        return fp[0].expand_as(x).clone()
    xs, points = x.T.contiguous(), xp.T.contiguous()
    j = (torch.searchsorted(points, xs, right=True) - 1).clamp(0, xp.shape[0] - 2)
    x0, x1 = points.gather(1, j), points.gather(1, j + 1)
    y0, y1 = fp[j], fp[j + 1]
    slope = (y1 - y0) / (x1 - x0)
    out = slope * (xs - x0) + y0
    # NumPy's fall-backs where that is NaN: from the right end, then the flat segment's value
    right = slope * (xs - x1) + y1
    out = torch.where(torch.isnan(out), torch.where(torch.isnan(right) & (y0 == y1), y0, right), out)
    out = torch.where(xs >= points[:, -1:], fp[-1], out)
    out = torch.where(xs < points[:, :1], fp[0], out)
    return out.T


def _ppf_bounds(dtype) -> tuple[float, float]:
    """scikit-learn's clip of the normal output: ppf(BOUNDS - spacing(1)) and its mirror,
    evaluated on the host (two constants: no wait on the estimator's device)."""
    inner = torch.tensor([_BOUNDS - np.spacing(1), 1 - (_BOUNDS - np.spacing(1))], dtype=dtype)
    low, high = torch.special.ndtri(inner).tolist()
    return low, high


class QuantileNormal:
    """scikit-learn's ``QuantileTransformer(output_distribution="normal")`` on the device:
    linear percentiles of the train rows (a seeded subsample past ``subsample`` rows, drawn as
    scikit-learn draws it), both-way interpolation, the normal quantile function, its clip."""

    def __init__(self, n_quantiles: int, subsample: int | None, random_state):
        self.n_quantiles, self.subsample, self.random_state = n_quantiles, subsample, random_state

    def fit(self, z: Tensor) -> QuantileNormal:
        from sklearn.utils import check_random_state, resample

        rows = z.shape[0]
        count = max(1, min(self.n_quantiles, rows))
        references = np.linspace(0, 1, count, endpoint=True)
        if self.subsample is not None and self.subsample < rows:
            chosen = resample(
                np.arange(rows), replace=False, n_samples=self.subsample,
                random_state=check_random_state(self.random_state),
            )  # fmt: skip
            z = z[torch.as_tensor(chosen, device=z.device)]
        # NumPy's percentiles take q / 100 of q = references * 100: the same rounding here
        q = torch.as_tensor(references * 100 / 100, dtype=z.dtype, device=z.device)
        self.quantiles_ = torch.quantile(z, q, dim=0)
        self.references_ = torch.as_tensor(references, dtype=z.dtype, device=z.device)
        self.clip_ = _ppf_bounds(z.dtype)
        return self

    def transform(self, x: Tensor) -> Tensor:
        q, ref = self.quantiles_, self.references_
        lower, upper = x - _BOUNDS < q[0], x + _BOUNDS > q[-1]
        # both ways and averaged, as scikit-learn does for repeated quantiles
        u = 0.5 * (_interp(x, q, ref) - _interp(-x, -q.flip(0), -ref.flip(0)))
        u = torch.where(lower, 0.0, torch.where(upper, 1.0, u))
        return torch.special.ndtri(u).clamp(*self.clip_)


class QuantileRTDL:
    """tabicl's ``quantile_rtdl``: QuantileNormal fitted on the train rows plus seeded noise
    (NumPy's generator, so the same draws), with n // 30 quantiles (10 to 1,000), then
    scikit-learn's StandardScaler."""

    def __init__(self, random_state):
        self.random_state = random_state

    def fit(self, z: Tensor) -> QuantileRTDL:
        count = max(min(z.shape[0] // RTDL_ROWS_PER_QUANTILE, QUANTILES), RTDL_MIN_QUANTILES)
        std = z.std(dim=0, correction=0, keepdim=True)
        noise = np.random.default_rng(self.random_state).standard_normal(tuple(z.shape))
        noisy = z + RTDL_NOISE / torch.clamp(std, min=RTDL_NOISE) * torch.as_tensor(
            noise, dtype=z.dtype, device=z.device
        )
        self.quantile_ = QuantileNormal(count, RTDL_SUBSAMPLE, self.random_state).fit(noisy)
        u = self.quantile_.transform(z)
        rows = u.shape[0]
        self.mean_ = u.mean(dim=0)
        var = u.var(dim=0, correction=0)
        eps = torch.finfo(u.dtype).eps
        constant = var <= rows * eps * var + (rows * self.mean_ * eps) ** 2
        self.scale_ = torch.where(constant, 1.0, var.sqrt())
        return self

    def transform(self, x: Tensor) -> Tensor:
        return (self.quantile_.transform(x) - self.mean_) / self.scale_


class RobustUnitVariance:
    """scikit-learn's ``RobustScaler(unit_variance=True)``: the median removed, scaled by the
    interquartile range over the standard normal's (a range below 10 eps counts as 1)."""

    def fit(self, z: Tensor) -> RobustUnitVariance:
        q = torch.quantile(z, torch.tensor([0.25, 0.5, 0.75], dtype=z.dtype, device=z.device), dim=0)
        self.center_ = q[1]
        spread = q[2] - q[0]
        spread = torch.where(spread < 10 * torch.finfo(z.dtype).eps, 1.0, spread)
        normal = torch.special.ndtri(torch.tensor([0.75, 0.25], dtype=z.dtype, device=z.device))
        self.scale_ = spread / (normal[0] - normal[1])
        return self

    def transform(self, x: Tensor) -> Tensor:
        return (x - self.center_) / self.scale_


class MemberPreprocessor:
    """Standard scaling, one normalisation (:data:`NORM_METHODS`: Yeo-Johnson, the quantile
    transforms, robust scaling, or none), soft outlier clipping; fitted on train rows.
    ``random_state`` seeds the quantile transforms' sampling and noise, as the reference's."""

    def __init__(self, method: str = "none", outlier_threshold: float = 4.0, random_state=None):
        if method not in NORM_METHODS:
            raise ValueError(
                f"unsupported normalisation method {method!r}; expected one of {NORM_METHODS}"
            )
        self.method = method
        self.outlier_threshold = outlier_threshold
        self.random_state = random_state

    def fit(self, X: Tensor) -> MemberPreprocessor:
        # Every statistic is float64 tensor maths on X's device: no host round trip, no wait.
        # Torch's reductions sum in another order than NumPy's, so the scaled input differs from
        # the reference's in its last bits; the lambdas then move by about the search's
        # tolerance (1.5e-8), far inside the exact path's 1e-5 parity on probabilities.
        self.mean_ = X.mean(dim=0)
        self.scale_ = X.std(dim=0, correction=0) + _SCALE_EPS
        z = self._scale(X)
        if self.method == "power":
            self.lambdas_ = yeo_johnson_lambdas(z)
            self.z_min_, self.z_max_ = z.min(dim=0).values, z.max(dim=0).values
            y = yeo_johnson(z, self.lambdas_)
            std = y.std(dim=0, correction=0)
            self.yj_mean_ = y.mean(dim=0)
            self.yj_scale_ = torch.where(std < 10 * torch.finfo(std.dtype).eps, 1.0, std)
            z = (y - self.yj_mean_) / self.yj_scale_
        elif self.method != "none":
            self.normalizer_ = self._normalizer().fit(z)
            z = self.normalizer_.transform(z)
        self._fit_outliers(z)
        self.train_ = self._clip_outliers(z)
        return self

    def _scale(self, X: Tensor) -> Tensor:
        return ((X - self.mean_) / self.scale_).clamp(-_CLIP, _CLIP)

    def _fit_outliers(self, z: Tensor) -> None:
        ddof = 1 if z.shape[0] > 1 else 0
        self.lower_, self.upper_ = _outlier_bounds(z, ddof, self.outlier_threshold)

    def _clip_outliers(self, z: Tensor) -> Tensor:
        return _soft_clip(z, self.lower_, self.upper_)

    def transform(self, X: Tensor) -> Tensor:
        z = self._scale(X)
        if self.method == "power":
            y = yeo_johnson(z, self.lambdas_)
            # The reference transforms the whole batch again, clipped to the train range, when
            # any value overflows; selecting on the device keeps the host from waiting.
            clipped = yeo_johnson(torch.minimum(torch.maximum(z, self.z_min_), self.z_max_), self.lambdas_)
            y = torch.where(torch.isfinite(y).all(), y, clipped)
            z = (y - self.yj_mean_) / self.yj_scale_
        elif self.method != "none":
            z = self.normalizer_.transform(z)
        return self._clip_outliers(z)

    def _normalizer(self):
        if self.method == "quantile":
            return QuantileNormal(QUANTILES, QUANTILE_SUBSAMPLE, self.random_state)
        if self.method == "quantile_rtdl":
            return QuantileRTDL(self.random_state)
        return RobustUnitVariance()


def _nan_mean_std(z: Tensor, ddof) -> tuple[Tensor, Tensor]:
    """Per column: NumPy's ``nanmean`` and ``nanstd(ddof=ddof)`` (floored at 1e-6; ``ddof`` may
    be a tensor, one per column), NaN where a column has no values (the outlier bounds then
    leave it as it is)."""
    valid = ~torch.isnan(z)
    count = valid.sum(dim=0, dtype=z.dtype)
    zeroed = torch.where(valid, z, 0.0)
    mean = zeroed.sum(dim=0) / count
    var = torch.where(valid, z - mean, 0.0).square().sum(dim=0) / (count - ddof)
    return mean, torch.clamp(var.sqrt(), min=_SCALE_EPS)


def _outlier_bounds(z: Tensor, ddof, k: float) -> tuple[Tensor, Tensor]:
    """Per column: mean -/+ ``k`` std of the values within ``k`` std of the mean (the
    reference's outlier bounds; ``ddof`` as :func:`_nan_mean_std`'s)."""
    mean, std = _nan_mean_std(z, ddof)
    inliers = torch.where((z < mean - k * std) | (z > mean + k * std), math.nan, z)
    mean, std = _nan_mean_std(inliers, ddof)
    return mean - k * std, mean + k * std


def _soft_clip(z: Tensor, lower: Tensor, upper: Tensor) -> Tensor:
    """Values past the bounds pulled back to them, plus the log of their size."""
    z = torch.maximum(lower - torch.log1p(z.abs()), z)
    return torch.minimum(upper + torch.log1p(z.abs()), z)


# ----------------------------------------------------------------------------- many tables at once
#: The normalisations :func:`preprocess_many` runs for many tables at once (the estimators'
#: defaults); the others run table by table.
BATCHED_METHODS = ("none", "power")


def preprocess_many(
    tables: Sequence[tuple[Tensor, Tensor]], method: str, outlier_threshold: float
) -> list:
    """For each ``(train (n, h), test (m, h))`` float64 table (encoded, no NaN), the rows
    ``MemberPreprocessor(method, outlier_threshold).fit(train)`` gives: its ``train_`` followed
    by its ``transform(test)``, ``(n + m, h)``; computed for all the tables at once (``method``
    in :data:`BATCHED_METHODS`), so their count of tensor operations is one table's.

    The tables' columns stand side by side, each NaN past its own table's rows, and every
    statistic skips NaN (the Yeo-Johnson search does too), so each table's answer is its own;
    sums run in another order than one table's, which moves the results in their last bits.
    """
    if method not in BATCHED_METHODS:
        raise ValueError(f"preprocess_many runs {BATCHED_METHODS}, got {method!r}")
    if not tables:
        return []
    widths = [train.shape[1] for train, _ in tables]
    train = _side_by_side([t for t, _ in tables])  # (max rows, all columns)
    test = _side_by_side([t for _, t in tables])
    # per column: its table, its table's train rows (the outlier statistics' ddof: 0 for one row)
    table_of = device_values(
        [i for i, width in enumerate(widths) for _ in range(width)], torch.int64, train.device
    )
    n = device_values([t.shape[0] for t, _ in tables], train.dtype, train.device)[table_of]
    mean, std = _mean_std(train, n)
    scale = std + _SCALE_EPS

    def scaled(X: Tensor) -> Tensor:
        return ((X - mean) / scale).clamp(-_CLIP, _CLIP)

    z, z_test = scaled(train), scaled(test)
    if method == "power":
        lambdas = yeo_johnson_lambdas(z)
        valid = ~torch.isnan(z)
        z_min = torch.where(valid, z, math.inf).amin(dim=0)
        z_max = torch.where(valid, z, -math.inf).amax(dim=0)
        y = yeo_johnson(z, lambdas)
        yj_mean, yj_std = _mean_std(y, n)
        yj_scale = torch.where(yj_std < 10 * torch.finfo(yj_std.dtype).eps, 1.0, yj_std)
        z = (y - yj_mean) / yj_scale
        # as MemberPreprocessor.transform: a table any of whose test values overflows is
        # transformed again clipped to its train range (NaN, the padding, counts as finite)
        y_test = yeo_johnson(z_test, lambdas)
        clipped = yeo_johnson(torch.minimum(torch.maximum(z_test, z_min), z_max), lambdas)
        overflow = (~torch.isfinite(y_test) & ~torch.isnan(z_test)).any(dim=0)
        per_table = torch.zeros(len(tables), dtype=z.dtype, device=z.device).index_add_(
            0, table_of, overflow.to(z.dtype)
        )
        z_test = (torch.where(per_table[table_of] > 0, clipped, y_test) - yj_mean) / yj_scale
    lower, upper = _outlier_bounds(z, (n > 1).to(z.dtype), outlier_threshold)
    train_out, test_out = _soft_clip(z, lower, upper), _soft_clip(z_test, lower, upper)
    out, first = [], 0
    for (t, u), width in zip(tables, widths):
        columns = slice(first, first + width)
        out.append(torch.cat([train_out[: t.shape[0], columns], test_out[: u.shape[0], columns]]))
        first += width
    return out


def _mean_std(x: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """Each column's mean and population standard deviation over its ``n`` rows of ``x``
    (NaN past them)."""
    mean = x.nansum(dim=0) / n
    spread = torch.where(torch.isnan(x), 0.0, x - mean).square().sum(dim=0)
    return mean, (spread / n).sqrt()


def _side_by_side(tables: Sequence[Tensor]) -> Tensor:
    """``(max rows, all columns)``: the tables' columns side by side, NaN past each one's rows."""
    rows, columns = max(t.shape[0] for t in tables), sum(t.shape[1] for t in tables)
    out = tables[0].new_full((rows, columns), math.nan)
    first = 0
    for t in tables:
        out[: t.shape[0], first : first + t.shape[1]] = t
        first += t.shape[1]
    return out


# ----------------------------------------------------------------------------- ensemble plan
def _latin_square(n: int, rng: random.Random) -> list[list[int]]:
    """The reference's random Latin square (same RNG calls, built bottom-up instead of recursively)."""
    symbols, chosen = list(range(n)), []
    while len(symbols) > 1:
        symbol = rng.choice(symbols)
        symbols.remove(symbol)
        chosen.append(symbol)
    square = [symbols]
    for symbol in reversed(chosen):
        square.append(square[0].copy())
        for i, row in enumerate(square):
            row.insert(i, symbol)
    rng.shuffle(square)
    columns = list(zip(*square))
    rng.shuffle(columns)
    return [list(c) for c in columns]


def shuffle_patterns(
    n: int, method: str, n_estimators: int, random_state: int | None
) -> list[list[int]]:
    """Permutations of ``range(n)`` used by the members (reference ``Shuffler.shuffle``)."""
    if method not in SHUFFLE_METHODS:
        raise ValueError(f"unknown shuffle method {method!r}; expected one of {SHUFFLE_METHODS}")
    rng = random.Random(random_state)
    identity = list(range(n))
    if method == "latin" and n > MAX_FEATURES_FOR_LATIN:
        method = "random"
    if method == "none" or n_estimators == 1:
        return [identity]
    if method == "shift":
        return [identity[-i:] + identity[:-i] for i in range(n)]
    if method == "random":
        if n <= 5:
            perms = [list(p) for p in itertools.permutations(identity)]
            return rng.sample(perms, min(n_estimators, len(perms)))
        return [rng.sample(identity, n) for _ in range(n_estimators)]
    return _latin_square(n, rng)


Member = tuple[list[int], list[int] | None]


def ensemble_plan(
    n_features: int,
    n_classes: int,
    n_estimators: int,
    norm_methods: Sequence[str],
    feat_shuffle_method: str,
    class_shuffle_method: str,
    random_state: int | None,
) -> OrderedDict[str, list[Member]]:
    """Members grouped by normalisation method: ``method -> [(feature perm, class pattern)]``.

    ``n_classes == 0`` (regression) gives ``None`` class patterns. Up to ``n_estimators`` members.
    """
    feature_perms = shuffle_patterns(n_features, feat_shuffle_method, n_estimators, random_state)
    if n_classes:
        class_patterns = shuffle_patterns(
            n_classes, class_shuffle_method, n_estimators, random_state
        )
    else:
        class_patterns = [None]
    configs = list(itertools.product(feature_perms, class_patterns))
    random.Random(random_state).shuffle(configs)
    chosen = list(itertools.product(configs, norm_methods))[:n_estimators]
    plan: OrderedDict[str, list[Member]] = OrderedDict()
    for config, method in chosen:
        plan.setdefault(method, []).append(config)
    return plan


def member_tables(X: Tensor, members: Sequence[Member]) -> Tensor:
    """Stack the feature permutations of a preprocessed table: ``(rows, H) -> (members, rows, H)``."""
    perms = device_values([perm for perm, _ in members], torch.int64, X.device)
    return X[:, perms].permute(1, 0, 2)


def member_labels(y: Tensor, members: Sequence[Member]) -> Tensor:
    """Class-shifted labels ``(members, rows)``; plain copies for regression (pattern ``None``)."""
    if members[0][1] is None:
        return y.expand(len(members), -1)
    patterns = device_values([pattern for _, pattern in members], torch.int64, y.device)
    return patterns[:, y.long()].to(y.dtype)


__all__ = [
    "ConstantFeatureFilter",
    "MemberPreprocessor",
    "TableEncoder",
    "ensemble_plan",
    "shuffle_patterns",
    "yeo_johnson",
]
