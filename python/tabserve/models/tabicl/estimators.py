"""scikit-learn style estimators around :class:`TabICLv2`: ``TabICLClassifier``, ``TabICLRegressor``.

They reproduce the reference ``tabicl`` 2.2.0 wrappers (same parameter names and defaults where
they mean the same thing, same preprocessing and ensembling, see :mod:`.preprocessing`) on top of
our model. Differences: ``model_path`` is required (no download), inference runs the serving
``recipe`` (no FlashAttention-3), and preprocessing runs as tensor maths on ``device``.

``recipe``: a serving preset's name (:func:`tabserve.serving_presets`: ``exact``, ``medium``,
``small``, ``large``, ``large-fp8``), a :class:`~.options.ServingOptions`, ``"auto"``: the
preset the benchmark driver measured fastest on this device for the closest workload
(:func:`~.options.auto_options`), or None (the default): ``"auto"`` on CUDA, like tabicl's own
``use_amp="auto"``, and ``exact`` on the CPU. ``recipe="exact"`` keeps fp32 parity with the
reference (within 1e-5) on every device. ``allow_fp8=False``: ``"auto"`` never serves a preset
that computes in fp8 (on the H200 the promotion for thousands of train rows runs the in-context
attention in fp8). ``bucket_grid``: the :class:`tabserve.buckets.BucketGrid` of bucketed options
(default grid when None).

A preset that compiles never makes a call wait for its compiler: each kind of call (entry point
and shapes) is answered by ``medium``, which compiles nothing, until a background thread has
compiled and captured it (:mod:`.background`); estimators of one configuration share what has
compiled (:mod:`.model_cache`). :func:`tabserve.wait_for_compiles` waits for the background.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted
from torch import Tensor

from tabserve.buckets import BucketGrid

from .preprocessing import (
    ConstantFeatureFilter,
    MemberPreprocessor,
    TableEncoder,
    ensemble_plan,
    member_labels,
    member_tables,
)
from .model_cache import read_checkpoint, served_model
from .options import auto_options, resolve_options

DEFAULT_NORM_METHODS = ("none", "power")


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _atomic_fit(fit):
    """A fit that raises leaves the estimator as it was: a fitted one keeps its classes, model
    and plan (fit only rebinds attributes, so a shallow copy of ``__dict__`` restores them)."""

    @functools.wraps(fit)
    def wrapper(self, X, y):
        before = dict(self.__dict__)
        try:
            return fit(self, X, y)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    return wrapper


def _num_rows(X) -> int:
    shape = getattr(X, "shape", None)
    if shape is None:
        X = np.asarray(X, dtype=object)
        shape = X.shape
    if len(shape) != 2:
        raise ValueError(f"X must be 2-D (rows, features), got shape {tuple(shape)}")
    return int(shape[0])


class _TabICLBase(BaseEstimator):
    """Shared fit / member plumbing; subclasses define the task."""

    _classification = True

    # ------------------------------------------------------------------ fit
    def _check_X(self, X, reset: bool) -> None:
        rows = _num_rows(X)
        n_features = int(X.shape[1]) if hasattr(X, "shape") else len(np.asarray(X, dtype=object)[0])
        names = list(map(str, X.columns)) if hasattr(X, "columns") else None
        if reset:
            if rows == 0:
                raise ValueError("X has zero rows; fit needs at least one train row")
            if n_features == 0:
                raise ValueError("X has no features")
            self.n_features_in_ = n_features
            if names is not None:
                self.feature_names_in_ = np.asarray(names, dtype=object)
            elif hasattr(self, "feature_names_in_"):
                del self.feature_names_in_
            return
        if n_features != self.n_features_in_:
            raise ValueError(
                f"X has {n_features} features, but {type(self).__name__} was fitted with "
                f"{self.n_features_in_}"
            )
        fitted = getattr(self, "feature_names_in_", None)
        if fitted is not None and names is not None and list(fitted) != names:
            raise ValueError(
                f"X columns {names} differ from the columns seen at fit {list(fitted)}"
            )

    def _recipe(self):
        """The recipe asked for: None means ``"auto"`` on CUDA, ``exact`` elsewhere."""
        if self.recipe is None:
            return "auto" if self.device_.type == "cuda" else "exact"
        return self.recipe

    def _load_model(self, n_train: int, n_classes: int | None = None):
        recipe = self._recipe()
        if not (isinstance(recipe, str) and recipe == "auto"):
            resolve_options(recipe)  # a bad name or type fails before the model loads
        if self.bucket_grid is not None and not isinstance(self.bucket_grid, BucketGrid):
            raise TypeError(
                f"bucket_grid must be a tabserve.BucketGrid or None, got "
                f"{type(self.bucket_grid).__name__}"
            )
        if self.model_path is None:
            raise ValueError(
                "model_path is required: the path of a TabICLv2 .ckpt or tabserve .safetensors file"
            )
        config, _ = read_checkpoint(Path(self.model_path))  # once per process and file
        if config.is_regression == self._classification:
            kind = "regression" if config.is_regression else "classification"
            raise ValueError(
                f"{self.model_path} is a {kind} checkpoint; {type(self).__name__} needs the other kind"
            )
        if isinstance(recipe, str) and recipe == "auto":
            recipe = auto_options(
                self.device_,
                n_train,
                self.n_features_in_,
                bool(self.kv_cache),
                task="clf" if self._classification else "reg",
                n_classes=n_classes,
                many_classes_above=config.max_classes,
                allow_fp8=bool(self.allow_fp8),
            )
        # Shared by every estimator of this checkpoint, device and configuration in the process:
        # loaded, compiled and captured once (model_cache), compiled in the background.
        options = resolve_options(recipe)
        return served_model(
            Path(self.model_path), self.device_, options, self.bucket_grid, background=True
        )

    def _fit_members(self, X, y: Tensor, n_classes: int) -> None:
        if self.n_estimators < 1:
            raise ValueError(f"n_estimators must be >= 1, got {self.n_estimators}")
        norm_methods = self.norm_methods or DEFAULT_NORM_METHODS
        norm_methods = [norm_methods] if isinstance(norm_methods, str) else list(norm_methods)
        self.encoder_ = TableEncoder(self.device_).fit(X)
        table = self.encoder_.transform(X)
        self.filter_ = ConstantFeatureFilter().fit(table)
        table = self.filter_.transform(table)
        self.plan_ = ensemble_plan(
            table.shape[1],
            n_classes,
            self.n_estimators,
            norm_methods,
            self.feat_shuffle_method,
            self.class_shuffle_method if self._classification else "none",
            self.random_state,
        )
        self.preprocessors_ = {
            m: MemberPreprocessor(m, self.outlier_threshold).fit(table) for m in self.plan_
        }
        self.y_train_ = y
        self.cache_ = None
        if self.kv_cache:
            if self.kv_cache not in (True, "kv"):
                raise ValueError(f"kv_cache must be False, True or 'kv', got {self.kv_cache!r}")
            self.cache_ = self._build_caches()

    def _build_caches(self) -> dict:
        """``method -> [KV cache of each chunk of batch_size members]``."""
        return {
            method: [self.model_.build_cache(X_m, y_m) for X_m, y_m in self._chunks(method, None)]
            for method in self.plan_
        }

    def _chunks(self, method: str, X_test: Tensor | None):
        """Member tables of one normalisation group, ``batch_size`` members at a time.

        Yields ``(X (members, N [+ M], H) float32, y_train (members, N) float32)``; without
        ``X_test`` only train rows (for the cache).
        """
        members = self.plan_[method]
        prep = self.preprocessors_[method]
        rows = prep.train_ if X_test is None else torch.cat([prep.train_, prep.transform(X_test)])
        step = self.batch_size or len(members)
        for start in range(0, len(members), step):
            part = members[start : start + step]
            yield member_tables(rows, part).float(), member_labels(self.y_train_, part).float()

    def _test_table(self, X) -> Tensor:
        check_is_fitted(self, "plan_")
        if isinstance(X, np.ndarray) and X.ndim == 1:
            raise ValueError("X is one-dimensional; reshape it to (rows, features)")
        self._check_X(X, reset=False)
        return self.filter_.transform(self.encoder_.transform(X))

    def _member_outputs(self, X_test: Tensor, run, run_cached) -> list:
        """Per-member outputs in plan order, from ``run(X, y)`` or ``run_cached(X_test, cache)``."""
        outputs = []
        for method, members in self.plan_.items():
            if self.cache_ is None:
                outputs.extend(run(X_m, y_m) for X_m, y_m in self._chunks(method, X_test))
                continue
            X_members = member_tables(
                self.preprocessors_[method].transform(X_test), members
            ).float()
            step = self.batch_size or len(members)
            for start, cache in zip(range(0, len(members), step), self.cache_[method]):
                outputs.append(run_cached(X_members[start : start + step], cache))
        return outputs

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.non_deterministic = True
        return tags


class TabICLClassifier(ClassifierMixin, _TabICLBase):
    """TabICLv2 classifier with the reference wrapper's preprocessing and ensembling.

    Parameters (reference names and defaults): ``n_estimators=8``, ``norm_methods=None`` (->
    ``["none", "power"]``), ``feat_shuffle_method="latin"``, ``class_shuffle_method="shift"``,
    ``outlier_threshold=4.0``, ``softmax_temperature=0.9``, ``average_logits=True``,
    ``support_many_classes=True``, ``batch_size=8`` (members per model call), ``kv_cache=False``,
    ``model_path`` (required), ``device=None`` (CUDA if available), ``random_state=42``;
    tabserve's own: ``recipe=None`` (``"auto"`` on CUDA, ``exact`` on the CPU), ``allow_fp8=True`` and
    ``bucket_grid=None`` (module docstring).
    """

    _classification = True

    def __init__(
        self,
        n_estimators: int = 8,
        norm_methods: str | Sequence[str] | None = None,
        feat_shuffle_method: str = "latin",
        class_shuffle_method: str = "shift",
        outlier_threshold: float = 4.0,
        softmax_temperature: float = 0.9,
        average_logits: bool = True,
        support_many_classes: bool = True,
        batch_size: int | None = 8,
        kv_cache: bool | str = False,
        model_path: str | Path | None = None,
        device: str | torch.device | None = None,
        random_state: int | None = 42,
        recipe=None,
        allow_fp8: bool = True,
        bucket_grid=None,
    ):
        self.n_estimators = n_estimators
        self.norm_methods = norm_methods
        self.feat_shuffle_method = feat_shuffle_method
        self.class_shuffle_method = class_shuffle_method
        self.outlier_threshold = outlier_threshold
        self.softmax_temperature = softmax_temperature
        self.average_logits = average_logits
        self.support_many_classes = support_many_classes
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        self.model_path = model_path
        self.device = device
        self.random_state = random_state
        self.recipe = recipe
        self.allow_fp8 = allow_fp8
        self.bucket_grid = bucket_grid

    @_atomic_fit
    def fit(self, X, y) -> TabICLClassifier:
        """Fit preprocessing and the member plan (and the KV cache if ``kv_cache``).

        Raises:
            ValueError: zero rows, a single class, NaN labels, length mismatch, infinite features,
            too many classes for the requested mode, bad checkpoint.
        """
        if y is None:
            raise ValueError("TabICLClassifier.fit needs y")
        self._check_X(X, reset=True)
        y = np.asarray(y)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.ravel()
        if y.ndim != 1 or len(y) != _num_rows(X):
            raise ValueError(
                f"y must be 1-D with one label per row of X ({_num_rows(X)}), got shape {y.shape}"
            )
        if y.dtype.kind == "f" and np.isnan(y).any():
            raise ValueError("y contains NaN labels")
        self.classes_, codes = np.unique(y, return_inverse=True)
        if len(self.classes_) < 2:
            raise ValueError(
                f"classification needs at least 2 classes, y has only {list(self.classes_)}"
            )
        self.n_classes_ = len(self.classes_)
        self.device_ = _resolve_device(self.device)
        self.model_ = self._load_model(_num_rows(X), self.n_classes_)
        max_classes = self.model_.config.max_classes
        if self.n_classes_ > max_classes and self.kv_cache:
            raise ValueError(
                f"kv_cache is not supported with {self.n_classes_} classes (> {max_classes})"
            )
        if self.n_classes_ > max_classes and not self.support_many_classes:
            raise ValueError(
                f"{self.n_classes_} classes exceed max_classes={max_classes}; "
                "set support_many_classes=True"
            )
        labels = torch.as_tensor(codes.reshape(-1), dtype=torch.float64, device=self.device_)
        self._fit_members(X, labels, self.n_classes_)
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``(rows, n_classes)`` float32, columns in ``classes_`` order."""
        X_test = self._test_table(X)
        kwargs = {
            "return_logits": bool(self.average_logits),
            "softmax_temperature": self.softmax_temperature,
        }
        outputs = torch.cat(
            self._member_outputs(
                X_test,
                lambda X_m, y_m: self.model_(X_m, y_m, **kwargs),
                lambda X_m, cache: self.model_.forward_with_cache(X_m, cache, **kwargs),
            )
        )
        patterns = torch.tensor(
            [p for members in self.plan_.values() for _, p in members], device=outputs.device
        )
        # Member i saw original class c as label pattern_i[c]: read its column back.
        aligned = outputs.gather(2, patterns[:, None, :].expand(-1, outputs.shape[1], -1))
        avg = aligned.mean(dim=0)
        if self.average_logits:
            avg = torch.softmax(avg / self.softmax_temperature, dim=-1)
        return (avg / avg.sum(dim=1, keepdim=True)).cpu().numpy()

    def predict(self, X) -> np.ndarray:
        """Most probable class label of each row."""
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(axis=1)]


class TabICLRegressor(RegressorMixin, _TabICLBase):
    """TabICLv2 regressor (999-quantile head) with the reference wrapper's preprocessing.

    Parameters as :class:`TabICLClassifier` minus the class-related ones. ``predict`` returns the
    member average of the requested statistic mapped back to target units (``variance`` through the
    same affine map, as the reference does).
    """

    _classification = False

    def __init__(
        self,
        n_estimators: int = 8,
        norm_methods: str | Sequence[str] | None = None,
        feat_shuffle_method: str = "latin",
        outlier_threshold: float = 4.0,
        batch_size: int | None = 8,
        kv_cache: bool | str = False,
        model_path: str | Path | None = None,
        device: str | torch.device | None = None,
        random_state: int | None = 42,
        recipe=None,
        allow_fp8: bool = True,
        bucket_grid=None,
    ):
        self.n_estimators = n_estimators
        self.norm_methods = norm_methods
        self.feat_shuffle_method = feat_shuffle_method
        self.outlier_threshold = outlier_threshold
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        self.model_path = model_path
        self.device = device
        self.random_state = random_state
        self.recipe = recipe
        self.allow_fp8 = allow_fp8
        self.bucket_grid = bucket_grid

    @_atomic_fit
    def fit(self, X, y) -> TabICLRegressor:
        """Standardise y, fit preprocessing / members (and the KV cache if ``kv_cache``)."""
        if y is None:
            raise ValueError("TabICLRegressor.fit needs y")
        self._check_X(X, reset=True)
        try:
            y = np.asarray(y, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"regression targets must be numeric: {e}") from None
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.ravel()
        if y.ndim != 1 or len(y) != _num_rows(X):
            raise ValueError(
                f"y must be 1-D with one target per row of X ({_num_rows(X)}), got shape {y.shape}"
            )
        if not np.isfinite(y).all():
            raise ValueError("y contains NaN or infinite targets")
        self.y_mean_ = float(np.mean(y, dtype=np.float64))
        std = float(np.std(y, dtype=np.float64))
        self.y_scale_ = std if std >= 10 * np.finfo(np.float64).eps else 1.0
        self.device_ = _resolve_device(self.device)
        self.model_ = self._load_model(_num_rows(X))
        y_scaled = ((y - np.float32(self.y_mean_)) / np.float32(self.y_scale_)).astype(np.float32)
        self._fit_members(X, torch.as_tensor(y_scaled, dtype=torch.float64, device=self.device_), 0)
        return self

    def predict(
        self,
        X,
        output_type: str | Sequence[str] = "mean",
        alphas: Sequence[float] | None = None,
    ) -> np.ndarray | dict[str, np.ndarray]:
        """``mean`` (default), ``median``, ``variance``: ``(rows,)``; ``quantiles``:
        ``(rows, len(alphas))``; ``raw_quantiles``: ``(rows, 999)``; a list gives a dict."""
        X_test = self._test_table(X)
        kinds = [output_type] if isinstance(output_type, str) else list(output_type)
        outputs = self._member_outputs(
            X_test,
            lambda X_m, y_m: self.model_.predict_stats(X_m, y_m, kinds, alphas),
            lambda X_m, cache: self.model_.predict_stats_with_cache(X_m, cache, kinds, alphas),
        )
        outputs = [o if isinstance(o, dict) else {kinds[0]: o} for o in outputs]
        results = {}
        for kind in kinds:
            stats = torch.cat([o[kind] for o in outputs]).double() * self.y_scale_ + self.y_mean_
            results[kind] = stats.mean(dim=0).cpu().numpy()
        return results[kinds[0]] if isinstance(output_type, str) else results
