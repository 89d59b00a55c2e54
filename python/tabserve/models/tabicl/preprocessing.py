"""The reference wrapper's preprocessing, as tensor maths on the model's device.

Per table (``fit`` on train rows, ``transform`` on any rows), in the reference's order:

1. :class:`TableEncoder`: categorical columns first (ordinal codes, sorted categories, unknown or
   missing -> -1), then numeric columns with NaN -> train mean (an all-NaN column -> 0). Other
   dtypes are dropped. DataFrames go through :class:`tabserve.TabICLEncoder` (AlignCategories on
   the device: one string-lookup call for all categorical columns).
2. :class:`ConstantFeatureFilter`: drop columns with a single distinct train value.
3. Per normalisation method (:class:`MemberPreprocessor`): standard scaling (population std
   + 1e-6, clipped to +-100), optional Yeo-Johnson ("power", lambdas from scikit-learn's fit, the
   transform itself here) followed by standardisation, then a soft outlier clip at 4 sigma.
4. :func:`ensemble_plan`: members = (feature permutation, class pattern, normalisation method),
   drawn with Python's ``random.Random(random_state)`` exactly as the reference draws them
   (Latin squares, cyclic class shifts).

All tensors here are float64 (the reference's NumPy precision); members are cast to float32 for
the network.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

#: Above this many features Latin squares are replaced by random permutations (reference rule).
MAX_FEATURES_FOR_LATIN = 4000
SHUFFLE_METHODS = ("none", "shift", "random", "latin")
NORM_METHODS = ("none", "power")

_SCALE_EPS = 1e-6
_CLIP = 100.0


# ----------------------------------------------------------------------------- table encoder
class TableEncoder:
    """NumPy array or pandas DataFrame -> float64 tensor ``(rows, features)`` with NaN imputed."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def fit(self, X) -> TableEncoder:
        self.is_frame_ = hasattr(X, "columns")
        if self.is_frame_:
            # DataFrames go through the device encoder (AlignCategories: one string-lookup call
            # for all categorical columns), which reproduces tabicl's TransformToNumerical.
            from tabserve.encoding import TabICLEncoder

            # Fitted on the host, then moved: its vocabularies must live where the tables'
            # codes do (the string lookup takes all of its operands on one device).
            self.frame_encoder_ = TabICLEncoder().fit(X).to(self.device)
            self.categorical_ = list(self.frame_encoder_.categorical_names)
            self.numeric_ = list(self.frame_encoder_.numerical_names)
        numeric = self._numeric(X)
        means = numeric.nanmean(dim=0)
        self.fill_ = torch.where(torch.isnan(means), torch.zeros_like(means), means)
        return self

    def _numeric(self, X) -> Tensor:
        """Float64 tensor of the numeric part; ValueError for infinities or non-numeric data."""
        if self.is_frame_:
            values = X[self.numeric_].to_numpy(dtype=np.float64, na_value=np.nan)
        else:
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
        numeric = self._numeric(X)  # also rejects infinities with a clear message
        if self.is_frame_:
            return self.frame_encoder_.transform(X, device=self.device)
        return torch.where(torch.isnan(numeric), self.fill_, numeric)


class ConstantFeatureFilter:
    """Keeps columns with more than one distinct train value (all columns if <= 1 train row)."""

    def fit(self, X: Tensor) -> ConstantFeatureFilter:
        if X.shape[0] <= 1:
            keep = torch.ones(X.shape[1], dtype=torch.bool, device=X.device)
        else:
            keep = (X != X[:1]).any(dim=0)
            if not keep.any():
                keep[0] = True
        self.keep_ = keep
        return self

    def transform(self, X: Tensor) -> Tensor:
        return X[:, self.keep_]


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


def _like(values, like: Tensor) -> Tensor:
    return torch.as_tensor(np.asarray(values), dtype=like.dtype, device=like.device)


class MemberPreprocessor:
    """Standard scaling, optional Yeo-Johnson, soft outlier clipping; fitted on train rows."""

    def __init__(self, method: str = "none", outlier_threshold: float = 4.0):
        if method not in NORM_METHODS:
            raise ValueError(
                f"unsupported normalisation method {method!r}; expected one of {NORM_METHODS}"
            )
        self.method = method
        self.outlier_threshold = outlier_threshold

    def fit(self, X: Tensor) -> MemberPreprocessor:
        # Statistics are fitted in NumPy on the host (bit-identical to the reference, and the
        # Yeo-Johnson lambda search is sensitive to the last bit of its input); every transform
        # runs as tensor maths on X's device.
        host = X.cpu().numpy()
        self.mean_ = _like(np.mean(host, axis=0), X)
        self.scale_ = _like(np.std(host, axis=0) + _SCALE_EPS, X)
        z = self._scale(X)
        if self.method == "power":
            from sklearn.preprocessing import PowerTransformer

            z_host = z.cpu().numpy()
            lambdas = PowerTransformer(method="yeo-johnson", standardize=False).fit(z_host).lambdas_
            self.lambdas_ = _like(lambdas, X)
            self.z_min_, self.z_max_ = z.min(dim=0).values, z.max(dim=0).values
            y = yeo_johnson(z, self.lambdas_).cpu().numpy()
            std = np.std(y, axis=0)
            self.yj_mean_ = _like(np.mean(y, axis=0), X)
            self.yj_scale_ = _like(np.where(std < 10 * np.finfo(std.dtype).eps, 1.0, std), X)
            z = (_like(y, X) - self.yj_mean_) / self.yj_scale_
        self._fit_outliers(z.cpu().numpy())
        self.train_ = self._clip_outliers(z)
        return self

    def _scale(self, X: Tensor) -> Tensor:
        return ((X - self.mean_) / self.scale_).clamp(-_CLIP, _CLIP)

    def _fit_outliers(self, z: np.ndarray) -> None:
        ddof = 1 if z.shape[0] > 1 else 0
        k = self.outlier_threshold
        mean, std = np.nanmean(z, axis=0), np.maximum(np.nanstd(z, axis=0, ddof=ddof), _SCALE_EPS)
        inliers = np.where((z < mean - k * std) | (z > mean + k * std), np.nan, z)
        mean, std = (
            np.nanmean(inliers, axis=0),
            np.maximum(np.nanstd(inliers, axis=0, ddof=ddof), _SCALE_EPS),
        )
        self.lower_ = torch.as_tensor(mean - k * std, device=self.mean_.device)
        self.upper_ = torch.as_tensor(mean + k * std, device=self.mean_.device)

    def _clip_outliers(self, z: Tensor) -> Tensor:
        z = torch.maximum(self.lower_ - torch.log1p(z.abs()), z)
        return torch.minimum(self.upper_ + torch.log1p(z.abs()), z)

    def transform(self, X: Tensor) -> Tensor:
        z = self._scale(X)
        if self.method == "power":
            y = yeo_johnson(z, self.lambdas_)
            if not torch.isfinite(
                y
            ).all():  # reference: retry the whole batch clipped to the train range
                y = yeo_johnson(
                    torch.minimum(torch.maximum(z, self.z_min_), self.z_max_), self.lambdas_
                )
            z = (y - self.yj_mean_) / self.yj_scale_
        return self._clip_outliers(z)


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
    perms = torch.tensor([perm for perm, _ in members], device=X.device)
    return X[:, perms].permute(1, 0, 2)


def member_labels(y: Tensor, members: Sequence[Member]) -> Tensor:
    """Class-shifted labels ``(members, rows)``; plain copies for regression (pattern ``None``)."""
    if members[0][1] is None:
        return y.expand(len(members), -1)
    patterns = torch.tensor([pattern for _, pattern in members], device=y.device)
    return patterns[:, y.long()].to(y.dtype)


__all__ = [
    "ConstantFeatureFilter",
    "MemberPreprocessor",
    "TableEncoder",
    "ensemble_plan",
    "shuffle_patterns",
    "yeo_johnson",
]
