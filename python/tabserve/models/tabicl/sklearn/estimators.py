"""scikit-learn style estimators around :class:`TabICLv2`: ``TabICLClassifier``, ``TabICLRegressor``.

They reproduce the reference ``tabicl`` 2.2.0 wrappers (same parameter names and defaults where
they mean the same thing, same preprocessing and ensembling, see :mod:`.preprocessing`) on top of
our model. They take every tabicl 2.2.0 constructor argument (:mod:`.reference_args`):
``model_path=None`` finds the released checkpoint (``checkpoint_version``) through the Hugging
Face Hub cache, downloading it where ``allow_auto_download``; ``use_amp=False`` serves ``exact``
(fp32); ``use_fa3`` is accepted (tabserve's presets bring their own attention kernels);
``offload_mode`` ``"cpu"`` / True keep the column stage's output in host memory and ``"disk"`` in
a file under ``disk_offload_dir``, streamed back a chunk of rows at a time (one-shot
predictions); ``"auto"``, ``"gpu"``, False keep it on the device while it fits, and where it
does not, a call on a GPU takes host memory or disk as tabicl's rule does; ``n_jobs``
sets PyTorch's CPU threads for each call; ``verbose`` logs on the ``tabserve`` logger;
``inference_config`` (a dict of stage settings or tabicl's ``InferenceConfig``) as tabicl reads it,
where tabserve acts on its device, precision, offload and verbose settings
(:func:`.reference_args.reference_settings`). Inference runs the serving ``recipe``
and preprocessing runs as tensor maths on ``device``. A fitted estimator pickles without the
network (:meth:`save` / :meth:`load`).

``recipe``: a serving preset's name (:func:`tabserve.serving_presets`: ``exact``, ``medium``,
``small``, ``large``, ``large-fp8``), a :class:`~..serving.options.ServingOptions`, ``"auto"``: the
preset the benchmark driver measured fastest on this device for the closest workload
(:func:`~..serving.options.auto_options`), or None (the default): ``"auto"`` on CUDA, like tabicl's own
``use_amp="auto"``, and ``exact`` on the CPU. ``recipe="exact"`` keeps fp32 parity with the
reference (within 1e-5) on every device. ``allow_fp8=False``: ``"auto"`` never serves a preset
that computes in fp8 (on the H200 the promotion for thousands of train rows runs the in-context
attention in fp8). ``bucket_grid``: the :class:`tabserve.buckets.BucketGrid` of bucketed options
(default grid when None).

A preset that compiles never makes a call wait for its compiler: each kind of call (entry point
and shapes) is answered by ``medium``, which compiles nothing, until a background thread has
compiled and captured it (:mod:`..serving.background`); estimators of one configuration share what has
compiled (:mod:`..serving.model_cache`). :func:`tabserve.wait_for_compiles` waits for the background.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import hashlib
import io
import itertools
import numbers
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import (
    check_array,
    check_consistent_length,
    check_is_fitted,
    column_or_1d,
    validate_data,
)
from torch import Tensor

from tabserve.buckets import BucketGrid

from ..network.checkpoint import read_checkpoint
from ..network.engine import Engine
from ..network.quantiles import quantile_stats
from ..network.transfer import device_values
from ..serving.background import foreground
from ..serving.model_cache import served_model
from ..serving.options import auto_options, describe, resolve_options, user_cache_dir
from . import many
from .devices import SPLITS, choose_split, first_tensor, moved_to, resolve_devices, row_blocks, spread
from .preprocessing import (
    NORM_METHODS,
    SHUFFLE_METHODS,
    ConstantFeatureFilter,
    MemberPreprocessor,
    TableEncoder,
    ensemble_plan,
    member_labels,
    member_tables,
)
from .reference_args import (
    check_reference_args,
    checkpoint_path,
    offload_store,
    reference_settings,
    say,
    torch_threads,
)

DEFAULT_NORM_METHODS = ("none", "power")

#: The most cells (train + test rows, times features) of a table whose one-shot calls span the
#: normalisation groups on a GPU (:meth:`_TabICLBase._joins_groups`): the largest tables the
#: choice was measured on hold 96,000 and 102,196. Past them a call of every member would hold
#: twice the activations of a group's call for a gain that had shrunk to 0.95-0.97x.
JOINED_CALL_MAX_CELLS = 102_400


#: The device :meth:`_TabICLBase.load` unpickles onto (None: the estimator's ``device``).
_load_device: contextvars.ContextVar = contextvars.ContextVar("tabserve_load_device", default=None)


@dataclass(frozen=True)
class SaveChoices:
    """What a pickle of a fitted estimator holds beyond its fitted state (``save``'s
    arguments; a plain ``pickle.dumps`` takes these defaults, tabicl's)."""

    model_weights: bool = False
    training_data: bool = True
    kv_cache: bool = True


@dataclass(frozen=True)
class _Kept:
    """A result that stays where it was made (a KV cache on its device)."""

    value: object


def _check_count(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        some = "None or an integer" if allow_none else "an integer"
        raise ValueError(f"{name} must be {some} >= 1, got {value!r}")


def _check_split(value) -> None:
    if not (isinstance(value, str) and value in SPLITS):
        raise ValueError(f"device_split must be one of {SPLITS}, got {value!r}")


def _by_rows(rows: Tensor, step: int | None, predict):
    """``predict(part)`` on ``step`` rows at a time (all at once for None), joined."""
    if step is None or rows.shape[0] <= step:
        return predict(rows)
    return _joined([predict(rows[i : i + step]) for i in range(0, rows.shape[0], step)])


def _joined(parts: list):
    """Answers of consecutive row blocks (tensors, or dicts of them) as one."""
    if isinstance(parts[0], dict):
        return {kind: torch.cat([p[kind] for p in parts]) for kind in parts[0]}
    return torch.cat(parts)


def _joined_members(parts: list) -> Tensor:
    """Member tables (or labels) of one model call stacked along the members: the one part
    as it is, or several concatenated."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _is_fitted_name(name: str) -> bool:
    """scikit-learn's convention: fitted attributes end with an underscore."""
    return name.endswith("_") and not name.startswith("_")


def _without_train_rows(preprocessor: MemberPreprocessor) -> MemberPreprocessor:
    light = copy.copy(preprocessor)
    light.train_ = None
    return light


def _stored_checkpoint(data: bytes, suffix: str) -> Path:
    """A checkpoint embedded in a saved estimator, written once into tabserve's cache
    directory under its SHA-256."""
    folder = user_cache_dir() / "checkpoints"
    path = folder / f"{hashlib.sha256(data).hexdigest()}{suffix or '.ckpt'}"
    if path.is_file() and path.stat().st_size == len(data):
        return path
    _write_whole(path, data)
    return path


def _write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (its folders made), whole or not at all: written under a name of
    this process's, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _resolve_device(device) -> torch.device:
    """The device that preprocesses and answers: the first of ``device``'s
    (:func:`.devices.resolve_devices`)."""
    return resolve_devices(device)[0]


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


def _estimator_call(method):
    """A public fit / predict: it runs with ``n_jobs`` PyTorch CPU threads (tabicl's meaning),
    and background compiles wait until it has returned (:func:`background.foreground`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with torch_threads(self.n_jobs), foreground():
            return method(self, *args, **kwargs)

    return wrapper


class _TabICLBase(BaseEstimator):
    """Shared fit / member plumbing; subclasses define the task."""

    _classification = True

    # ------------------------------------------------------------------ fit
    def _validate_X(self, X, reset: bool):
        """``X`` checked with scikit-learn's helpers (``n_features_in_`` and
        ``feature_names_in_`` recorded at fit, compared at predict). DataFrames stay as they
        are: their column kinds decide the encoding. Anything else becomes a 2-D numeric array,
        NaN allowed; sparse, complex, 1-D, empty and infinite data raise. An estimator fitted on
        a DataFrame reads a later array as tabicl does: by position, as a frame of its values
        (strings kept)."""
        encoder = getattr(self, "encoder_", None)
        if not reset and getattr(encoder, "is_frame_", False) and not hasattr(X, "columns"):
            import pandas as pd

            X = pd.DataFrame(check_array(X, dtype=None, ensure_all_finite=False, input_name="X"))
        if hasattr(X, "columns") and hasattr(X, "dtypes"):
            X = validate_data(self, X, reset=reset, skip_check_array=True)
            rows, columns = X.shape
            if rows < 1:
                raise ValueError(
                    f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 is "
                    "required."
                )
            if columns < 1:
                raise ValueError(
                    f"Found array with 0 feature(s) (shape={X.shape}) while a minimum of 1 is "
                    "required."
                )
            return X
        return validate_data(
            self, X, reset=reset, dtype="numeric", ensure_all_finite="allow-nan",
            accept_sparse=False,
        )  # fmt: skip

    @staticmethod
    def _target(X, y, estimator: str):
        """``y`` as a 1-D array of one entry per row of ``X`` (a column vector warns, as
        scikit-learn's estimators do)."""
        if y is None:
            raise ValueError(f"{estimator} requires y to be passed, but the target y is None.")
        y = column_or_1d(y, warn=True)
        check_consistent_length(X, y)
        return y

    def _check_params(self) -> None:
        """Every constructor argument, checked in one place at the start of ``fit`` (before
        the data is validated or a checkpoint read): ValueError / TypeError naming it."""
        _check_count("n_estimators", self.n_estimators, allow_none=False)
        _check_count("batch_size", self.batch_size)
        _check_count("test_chunk_rows", self.test_chunk_rows)
        _check_split(self.device_split)
        methods = self.norm_methods or ()  # None or empty: the default methods
        methods = [methods] if isinstance(methods, str) else list(methods)
        unknown = [m for m in methods if m not in NORM_METHODS]
        if unknown:
            raise ValueError(
                f"norm_methods: unsupported normalisation method {unknown[0]!r}; expected "
                f"None or some of {NORM_METHODS}"
            )
        shuffles = ["feat_shuffle_method"] + (["class_shuffle_method"] if self._classification else [])
        for name in shuffles:
            if getattr(self, name) not in SHUFFLE_METHODS:
                raise ValueError(
                    f"{name}: unknown shuffle method {getattr(self, name)!r}; expected one of "
                    f"{SHUFFLE_METHODS}"
                )
        positive = ["outlier_threshold"] + (["softmax_temperature"] if self._classification else [])
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < np.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        flags = ["allow_fp8"] + (["average_logits", "support_many_classes"] if self._classification else [])
        for name in flags:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        kv = self.kv_cache
        if not (kv is True or kv is False or (isinstance(kv, str) and kv in ("kv", "repr"))):
            raise ValueError(f"kv_cache must be False, True, 'kv' or 'repr', got {kv!r}")
        seed = self.random_state
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise ValueError(f"random_state must be None or an integer, got {seed!r}")
        if self.model_path is not None and not isinstance(self.model_path, (str, os.PathLike)):
            raise TypeError(
                f"model_path must be None or a path, got {type(self.model_path).__name__}"
            )
        resolve_devices(self.device)  # ValueError naming the entry that is no device
        if self.bucket_grid is not None and not isinstance(self.bucket_grid, BucketGrid):
            raise TypeError(
                f"bucket_grid must be a tabserve.BucketGrid or None, got "
                f"{type(self.bucket_grid).__name__}"
            )
        settings = check_reference_args(self, self._task)
        recipe = self.recipe
        if recipe is not None and not (isinstance(recipe, str) and recipe == "auto"):
            if resolve_options(recipe).precision != "fp32" and settings.use_amp is False:
                where = "use_amp=False" if self.use_amp is False else "inference_config's use_amp=False"
                raise ValueError(
                    f"{where} asks for fp32, but recipe={recipe!r} computes in reduced "
                    "precision; leave one of them out"
                )

    def _recipe(self):
        """The recipe asked for: None means ``"auto"`` on CUDA, ``exact`` elsewhere, and
        ``exact`` wherever ``use_amp=False`` (tabicl's fp32; ``inference_config``'s too)."""
        if self.recipe is None:
            if reference_settings(self).use_amp is False:
                return "exact"
            return "auto" if self.device_.type == "cuda" else "exact"
        return self.recipe

    def _load_model(self, n_train: int, n_classes: int | None = None):
        path = checkpoint_path(self.model_path, self.allow_auto_download, self.checkpoint_version)
        config, _ = read_checkpoint(path)  # once per process and file
        if config.is_regression == self._classification:
            kind = "regression" if config.is_regression else "classification"
            raise ValueError(
                f"{path} is a {kind} checkpoint; {type(self).__name__} needs the other kind"
            )
        options = self._options(path, n_train, n_classes)
        say(self, "fit: %s on %s, %d train rows, %d features", describe(options), self.device_,
            n_train, self.n_features_in_)  # fmt: skip
        self.model_path_, self.served_options_ = path, options
        self.model_config_, self.n_samples_in_ = config.to_reference_dict(), n_train  # as tabicl's
        self.checkpoint_size_ = path.stat().st_size
        return self._served()

    @property
    def _task(self) -> str:
        return "clf" if self._classification else "reg"

    def _options(self, path, n_train: int, n_classes: int | None):
        """The :class:`ServingOptions` of ``recipe`` on ``device_`` for a table of ``n_train``
        train rows (``"auto"`` reads the table's size)."""
        recipe = self._recipe()
        if isinstance(recipe, str) and recipe == "auto":
            recipe = auto_options(
                self.device_,
                n_train,
                self.n_features_in_,
                bool(self.kv_cache),
                task=self._task,
                n_classes=n_classes,
                many_classes_above=read_checkpoint(path)[0].max_classes,
                allow_fp8=bool(self.allow_fp8),
            )
        return resolve_options(recipe)

    def _served(self, device: torch.device | None = None) -> Engine:
        # Shared by every estimator of this checkpoint, device and configuration in the process:
        # loaded, compiled and captured once (model_cache), compiled in the background.
        return served_model(
            self.model_path_,
            device or self.device_,
            self.served_options_,
            self.bucket_grid,
            background=True,
        )

    def _engines(self) -> list:
        """The engine of each of ``devices_`` (``model_`` the first's)."""
        return [self.model_] + [self._served(d) for d in self.devices_[1:]]

    def _spread(self, jobs: list) -> list:
        """``job(engine, device)`` of each job over ``devices_`` (:func:`.devices.spread`)."""
        return spread(jobs, self.devices_, self._engines() if len(self.devices_) > 1 else [self.model_])

    # ------------------------------------------------------------------ saving
    def __getstate__(self):
        """Pickles what was fitted without the network, its tensors through ``torch.save`` so
        that unpickling maps them onto the device it settles (a file written on a GPU machine
        loads on any machine): the weights are read again from the checkpoint file when
        unpickled, unless :meth:`save` embeds them. The KV cache and
        the training data are kept (tabicl's defaults); :meth:`save` can leave either out."""
        state = dict(super().__getstate__())  # a copy: object.__getstate__ is the live dict
        keep = state.pop("_save", SaveChoices())
        state.pop("model_", None)
        state.pop("_cache_copies", None)
        if "plan_" not in state:
            return state
        fitted = {name: state.pop(name) for name in list(state) if _is_fitted_name(name)}
        if not keep.kv_cache:
            fitted["cache_"] = None
        if not keep.training_data:
            fitted["preprocessors_"] = {
                method: _without_train_rows(prep) for method, prep in fitted["preprocessors_"].items()
            }
            fitted["y_train_"] = None
        buffer = io.BytesIO()  # torch.save: unpickled with map_location, on any device
        torch.save(fitted, buffer)
        state["_fitted"] = buffer.getvalue()
        if keep.model_weights:
            state["_checkpoint"] = Path(self.model_path_).read_bytes()
        return state

    def __setstate__(self, state):
        """Unpickles on ``device`` (re-read as tabicl does: None is CUDA where there is one), or
        on the device :meth:`load` names; a fit on another kind of device serves ``recipe`` as
        a fit there would, and its KV cache is rebuilt from the training data."""
        state = dict(state)
        state.setdefault("device_split", "auto")  # a pickle written without the argument
        fitted = state.pop("_fitted", None)
        embedded = state.pop("_checkpoint", None)
        super().__setstate__(state)
        if fitted is None:
            return
        override = _load_device.get()
        if override is not None:
            self.device = override
        devices = resolve_devices(self.device)
        device = devices[0]
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"this {type(self).__name__} serves on device={self.device!r}, and this machine "
                f"has no CUDA GPU: load it with {type(self).__name__}.load(path, device='cpu')"
            )
        self.__dict__.update(torch.load(io.BytesIO(fitted), map_location=device, weights_only=False))
        if isinstance(self.__dict__.get("cache_"), dict):  # caches kept per normalisation group
            self.__dict__.pop("cache_steps_", None)
            if self.y_train_ is None:
                raise ValueError(
                    "this estimator's KV cache has a layout this tabserve does not read, and it "
                    "was saved without its training data to rebuild it from: fit it again"
                )
            self.cache_ = None  # rebuilt below
        fitted_on, self.device_, self.devices_ = self.device_, device, devices
        self.encoder_.device = device
        if embedded is not None:
            self.model_path_ = _stored_checkpoint(embedded, Path(self.model_path_).suffix)
        path = Path(self.model_path_)
        if not path.is_file() or path.stat().st_size != self.checkpoint_size_:
            raise FileNotFoundError(
                f"the checkpoint this estimator was fitted with, {path} "
                f"({self.checkpoint_size_:,} bytes), is not there (or is another file); put it "
                "back, or fit again (or save it with save_model_weights=True)"
            )
        if device.type != fitted_on.type:
            self._serve_elsewhere(fitted_on)
        self.model_ = self._served()
        if self.kv_cache and self.cache_ is None and not self._certain():
            self.cache_ = self._build_caches()

    def _serve_elsewhere(self, fitted_on: torch.device) -> None:
        """Settles the options for a device of another kind than the fit's (as a fit there
        would); a KV cache built under other options is dropped, to be rebuilt from the
        training data."""
        trained = self.y_train_ is not None
        recipe = self._recipe()
        certain = self._certain()  # nothing cached to rebuild
        if trained or certain or not (isinstance(recipe, str) and recipe == "auto"):
            n_train = self.y_train_.shape[0] if trained else 0  # "auto" alone reads it
            options = self._options(self.model_path_, n_train, getattr(self, "n_classes_", None))
            if options == self.served_options_:
                return
            if trained or certain:
                self.served_options_, self.cache_ = options, None
                return
        raise ValueError(
            f"this estimator was saved without its training data, and its KV cache serves "
            f"{describe(self.served_options_)} on {fitted_on.type}: load it on a "
            f"{fitted_on.type} device"
        )

    def save(
        self,
        path,
        save_model_weights: bool = False,
        save_training_data: bool = True,
        save_kv_cache: bool = True,
    ) -> None:
        """Writes the fitted estimator to ``path`` (a pickle; missing folders are made), with
        tabicl 2.2.0's choices:

        * ``save_model_weights``: embed the checkpoint file, so the file loads where the
          checkpoint is not (it is written once into tabserve's cache directory,
          ``$TABSERVE_CACHE_DIR`` or the platform's, under its SHA-256). Without it the
          weights are read again from the checkpoint's path on :meth:`load`: kilobytes.
        * ``save_training_data=False``: leave the training rows out (smaller, and the file
          does not hold the data); only with a KV cache saved, which predicts without them.
        * ``save_kv_cache``: keep the KV cache (``kv_cache=True``), so the loaded estimator
          predicts without rebuilding it.

        Raises:
            NotFittedError: not fitted.
            ValueError: ``save_training_data=False`` without a KV cache to save.

        Security: loading a pickle runs code; load only files you wrote."""
        check_is_fitted(self, "plan_")
        predicts = self._certain() or (save_kv_cache and self.cache_ is not None)
        if not save_training_data and not predicts:
            raise ValueError(
                "save_training_data=False needs the KV cache to predict from: fit with "
                "kv_cache=True and keep save_kv_cache=True, or keep the training data"
            )
        self._save = SaveChoices(bool(save_model_weights), bool(save_training_data), bool(save_kv_cache))
        try:
            data = pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            del self._save
        _write_whole(Path(path), data)

    @classmethod
    def load(cls, path, device=None):
        """An estimator written by :meth:`save` (or pickled), on ``device`` (tabicl's meaning:
        None keeps the estimator's ``device`` argument, re-read on this machine; a device
        becomes its ``device``). Raises TypeError when the file holds another kind of estimator.

        Security: this unpickles; load only files you wrote."""
        if device is not None:
            device = torch.device(device)
        with open(path, "rb") as file:
            token = _load_device.set(device)
            try:
                estimator = pickle.load(file)
            finally:
                _load_device.reset(token)
        if not isinstance(estimator, cls):
            kind = type(estimator)
            hint = ""
            if kind.__module__.split(".")[0] == "tabicl":  # tabicl's estimators and tabserve's share names
                hint = (
                    ": a file tabicl saved, which tabicl's load reads; tabserve reads the files "
                    "its estimators save (fit tabserve's on the same data: the answers are tabicl's)"
                )
            raise TypeError(
                f"{path} holds a {kind.__module__}.{kind.__qualname__}, not a "
                f"{cls.__module__.split('.')[0]}.{cls.__name__}{hint}"
            )
        return estimator

    def _fit_members(self, X, y: Tensor, n_classes: int) -> None:
        norm_methods = self.norm_methods or DEFAULT_NORM_METHODS
        norm_methods = [norm_methods] if isinstance(norm_methods, str) else list(norm_methods)
        self.encoder_ = TableEncoder(self.device_)
        table = self.encoder_.fit_transform(X)
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
        self.y_train_ = y
        self.cache_ = self.cache_step_ = None  # (a refit without kv_cache keeps neither)
        self.cache_mode_ = ("repr" if self.kv_cache == "repr" else "kv") if self.kv_cache else None
        self._cache_copies = {}
        if self.__dict__.get("_members_later"):  # the packed path preprocesses many at once
            self._train_table = table
            return
        self._fit_preprocessors(table)

    def _fit_preprocessors(self, table: Tensor) -> None:
        """The members' preprocessing of the encoded train ``table`` (and the KV cache)."""
        self.preprocessors_ = {
            m: MemberPreprocessor(m, self.outlier_threshold, self.random_state).fit(table)
            for m in self.plan_
        }
        if self.kv_cache and not self._certain():
            self.cache_ = self._build_caches()

    def _build_caches(self) -> list:
        """The KV caches of the members' chunks, ``batch_size`` members across the normalisation
        groups (:meth:`_member_chunks`; ``kv_cache="repr"``:
        representation caches)."""
        mode = "repr" if self.kv_cache == "repr" else "kv"
        step = self._step(self._entries())
        jobs = [
            lambda engine, device, X_m=X_m, y_m=y_m: _Kept(
                engine.build_cache(X_m.to(device), y_m.to(device), mode=mode)
            )
            for X_m, y_m in self._member_chunks(
                self._entries(), lambda method: self.preprocessors_[method].train_, step
            )
        ]
        # A chunk's cache stays on the device that built it (job i on devices_[i % n]; the
        # predictions number their chunks alike): only its outputs travel.
        caches = spread(jobs, self.devices_, self._engines() if len(self.devices_) > 1 else [self.model_])
        # The members per chunk the caches were built with: a prediction reads the chunks alike
        # even where it runs on another count of devices (an estimator unpickled elsewhere).
        self.cache_step_ = step
        return [cache.value for cache in caches]

    def _certain(self) -> bool:
        """Whether the answers are known without the members' outputs (the classifier's)."""
        return False

    def _entries(self) -> list:
        """``(method, member)`` of every member, in plan order."""
        return [(method, member) for method, members in self.plan_.items() for member in members]

    def _member_chunks(self, entries: list, rows_of, step: int, labels: bool = True):
        """The member tables of ``entries`` (``(method, member)`` in plan order), ``step``
        members per model call: ``(X (members, rows, H) float32, y_train (members, N) float32,
        or None without ``labels``)``, ``rows_of(method)`` being the group's preprocessed rows
        (read once per group). A call may hold members of several normalisation groups.

        The KV caches take their chunks across the groups: a cached prediction of few rows
        reads the network's weights once per call, and one call of a table's 8 members instead
        of one per normalisation group (4 and 4) took a 1-row prediction from 76-78 ms to
        58-62 ms (full-size network, 1,000 train rows, 50 features, 2-core CPU; 100 and 1,000
        rows within the noise, 0.84-1.06x). A one-shot prediction on a GPU does likewise
        (:meth:`_joins_groups`)."""
        rows = {}
        for start in range(0, len(entries), step):
            tables, ys = [], []
            for method, group in itertools.groupby(entries[start : start + step], key=lambda e: e[0]):
                members = [member for _, member in group]
                if method not in rows:
                    rows[method] = rows_of(method).float()  # cast once, before the members' copies
                tables.append(member_tables(rows[method], members))
                if labels:
                    ys.append(member_labels(self.y_train_, members).float())
            yield _joined_members(tables), _joined_members(ys) if labels else None

    def _cache_on(self, index: int, device: torch.device):
        """Chunk ``index``'s KV cache on ``device``: the one built there, else a copy made at
        the first call that needs it and kept (a prediction split by test rows runs every chunk
        on every device; an unpickled estimator holds its caches on ``device_``)."""
        cache = self.cache_[index]
        if first_tensor(cache).device == device:
            return cache
        copies = self.__dict__.setdefault("_cache_copies", {})
        key = (index, device)
        if key not in copies:  # two callers may both copy: one copy is kept, both answer alike
            copies[key] = moved_to(cache, device)
        return copies[key]

    def _chunks(self, method: str, X_test: Tensor | None, rows: Tensor | None = None):
        """Member tables of one normalisation group, ``batch_size`` members at a time (a
        one-shot prediction's calls on the CPU: :meth:`_one_shot_chunks`).

        Yields ``(X (members, N + M, H) float32, y_train (members, N) float32)``
        (:meth:`_member_chunks`); ``rows``: the group's preprocessed train and test rows, given
        (the packed path's).
        """
        if rows is None:
            prep = self.preprocessors_[method]
            rows = torch.cat([prep.train_, prep.transform(X_test)])
        members = [(method, member) for member in self.plan_[method]]
        return self._member_chunks(members, lambda _: rows, self._step(members))

    def _one_shot(self, engine: Engine, X: Tensor, y_train: Tensor, **kwargs) -> Tensor:
        """``engine``'s one-shot call, or its offloaded call where ``offload_mode`` keeps the
        column stage's output on the host or on disk (:func:`.reference_args.offload_target`).
        That output holds an embedding per cell of ``X`` (tables, rows, features), in its dtype
        (every device's engine serves ``model_``'s checkpoint)."""
        output_bytes = X.numel() * self.model_.config.embed_dim * X.element_size()
        with offload_store(self, output_bytes) as store:
            if store is None:
                return engine(X, y_train, **kwargs)
            return engine.forward_offloaded(X, y_train, store, **kwargs)

    def fit_predict_many(self, tasks, method: str = "predict", *, errors: str = "raise", **params) -> list:
        """Fits and predicts many tables in one call: for each task ``(X_train, y_train,
        X_test)`` of ``tasks``, what ``clone(self).fit(X_train, y_train).<method>(X_test,
        **params)`` answers, in order, the tables' ensemble members packed into shared padded
        buckets (:mod:`.many`). ``method``: ``"predict"``, or ``"predict_proba"`` for the
        classifier; ``params``: the regressor's ``output_type`` / ``alphas``. Each task keeps its
        own columns, dtypes, classes and sizes; a regressor's tasks are regression tasks, a
        classifier's classification tasks (a continuous target is that task's error).

        ``errors="raise"``: the first refused task raises :class:`~.many.TaskError` naming its
        index; ``errors="return"``: its slot holds the :class:`~.many.TaskError` and the others
        are answered. This estimator is neither fitted nor changed.

        Raises:
            ValueError / TypeError: a bad ``method``, ``errors`` or constructor argument,
            before any task is read.
        """
        return list(self.fit_predict_iter(tasks, method, errors=errors, **params))

    def fit_predict_iter(self, tasks, method: str = "predict", *, errors: str = "raise", **params):
        """As :meth:`fit_predict_many`, yielding the answers in order while reading ``tasks``
        (any iterable) :data:`~.many.GROUP_TASKS` at a time: for more tasks than memory holds."""
        return many.fit_predict_iter(self, tasks, method, errors, params)

    def _test_table(self, X) -> Tensor:
        check_is_fitted(self, "plan_")
        X = self._validate_X(X, reset=False)
        return self.filter_.transform(self.encoder_.transform(X))

    def _step(self, members) -> int:
        """Members per model call among ``members`` (a normalisation group's, or all of them
        for the KV caches): ``batch_size``, and fewer where several devices share them (every
        device gets a chunk)."""
        step = self.batch_size or len(members)
        devices = len(getattr(self, "devices_", ()) or (None,))
        return min(step, -(-len(members) // devices))

    def _member_outputs(self, X_test: Tensor, run, run_cached, on: tuple | None = None) -> list:
        """Per-member outputs in plan order, from ``run(engine, X, y)`` or
        ``run_cached(engine, X_test, cache)``: chunks spread over ``devices_``, or all run on
        ``on = (engine, device)`` in this thread (a block of a prediction split by rows)."""
        if self.cache_ is not None:
            chunks = self._member_chunks(
                self._entries(),
                lambda method: self.preprocessors_[method].transform(X_test),
                self._cache_step(),
                labels=False,
            )
            jobs = [
                lambda engine, device, part=part, index=index: run_cached(
                    engine, part.to(device), self._cache_on(index, device)
                )
                for index, (part, _) in enumerate(chunks)
            ]
        else:
            jobs = [
                lambda engine, device, X_m=X_m, y_m=y_m: run(engine, X_m.to(device), y_m.to(device))
                for X_m, y_m in self._one_shot_chunks(X_test)
            ]
        if on is not None:
            return [job(*on) for job in jobs]
        return self._spread(jobs)

    def _joins_groups(self, n_test: int) -> bool:
        """Whether a one-shot prediction of ``n_test`` rows spans the normalisation groups in its
        model calls (``batch_size`` members across them, like the KV caches' chunks) or takes
        one group per call: across them on GPUs, for tables of at most
        :data:`JOINED_CALL_MAX_CELLS` cells (train and test rows of a call, times features).

        The measured choice differs by device, the answers not beyond float rounding. On an H100
        (torch 2.11, default recipe, full-size network) one call of a table's 8 members took
        0.69-0.97x the time of a call per group (4 and 4), medians of interleaved pairs on ten
        small tables (the estimator suite's ``small`` and ``mixed`` kinds, full and quick, and six
        tasks of the many-tables population), before and after the background compiles; the
        probabilities moved by at most 2.4e-4 (fp16). On the 2-core CPU one call was slower:
        1.18x on the suite's quick ``mixed`` table, 1.06-1.13x on ``small`` (600 + 150 rows),
        0.97-0.99x on its quick 60-row shape."""
        if not all(device.type == "cuda" for device in self.devices_):
            return False
        train = next(iter(self.preprocessors_.values())).train_
        n_test = min(n_test, self.test_chunk_rows or n_test)  # the rows of one call
        return (train.shape[0] + n_test) * train.shape[1] <= JOINED_CALL_MAX_CELLS

    def _one_shot_chunks(self, X_test: Tensor):
        """A one-shot prediction's member tables per model call, in plan order: across the
        normalisation groups or one group at a time (:meth:`_joins_groups`)."""
        if not self._joins_groups(X_test.shape[0]):
            return itertools.chain.from_iterable(self._chunks(m, X_test) for m in self.plan_)
        prep = self.preprocessors_
        return self._member_chunks(
            self._entries(),
            lambda method: torch.cat([prep[method].train_, prep[method].transform(X_test)]),
            self._step(self._entries()),
        )

    def _cache_step(self) -> int:
        return getattr(self, "cache_step_", None) or self._step(self._entries())

    def _split(self, n_test: int) -> str:
        """``"members"`` or ``"rows"`` for a prediction of ``n_test`` rows
        (:func:`.devices.choose_split` over this estimator's chunks)."""
        if len(self.devices_) == 1:
            return "members"
        if self.cache_ is not None:  # the cached chunks span the normalisation groups
            groups = [(len(self._entries()), self._cache_step())]
        elif self._joins_groups(n_test):
            groups = [(len(self._entries()), self._step(self._entries()))]
        else:
            groups = [(len(members), self._step(members)) for members in self.plan_.values()]
        chunks = [min(step, size - i) for size, step in groups for i in range(0, size, step)]
        n_train = 0 if self.y_train_ is None else self.y_train_.shape[0]  # None: cached
        cached = self.cache_ is not None
        return choose_split(
            self.device_split, chunks, len(self.devices_), n_train, n_test, self.test_chunk_rows, cached
        )

    def _by_test_chunks(self, X_test: Tensor, predict_rows):
        """``predict_rows(rows, on)`` on ``test_chunk_rows`` test rows at a time, concatenated
        along the rows: a test row's answer depends on the train rows alone, so the numbers are
        one call's, and the memory a call holds is bounded by the chunk's. Split by rows over
        several devices, each device's block of rows runs there (``on = (engine, device)``)."""
        step = self.test_chunk_rows
        _check_count("test_chunk_rows", step)  # set_params may change it after fit
        _check_split(self.device_split)
        if self._split(X_test.shape[0]) == "rows":
            jobs = [
                lambda engine, device, rows=X_test[a:b]: _by_rows(
                    rows, step, lambda part: predict_rows(part, (engine, device))
                )
                for a, b in row_blocks(X_test.shape[0], len(self.devices_))
            ]
            return _joined(self._spread(jobs))
        return _by_rows(X_test, step, lambda part: predict_rows(part, None))

    @staticmethod
    def softmax(x: np.ndarray, axis: int = -1, temperature: float = 0.9) -> np.ndarray:
        """``softmax(x / temperature)`` along ``axis``, in NumPy: tabicl's public helper of the
        same name, for code written against it."""
        from scipy.special import softmax

        return softmax(np.asarray(x) / temperature, axis=axis)

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
    ``model_path=None``, ``allow_auto_download=True``, ``checkpoint_version`` (the released
    v2 checkpoint), ``device=None`` (CUDA if available), ``use_amp="auto"``, ``use_fa3="auto"``,
    ``offload_mode="auto"``, ``disk_offload_dir=None``, ``random_state=42``, ``n_jobs=None``,
    ``verbose=False``, ``inference_config=None`` (module docstring);
    tabserve's own: ``recipe=None`` (``"auto"`` on CUDA, ``exact`` on the CPU), ``allow_fp8=True``,
    ``bucket_grid=None`` (module docstring), ``test_chunk_rows=None``: predict that many test
    rows per model call at most (bounded memory for very many test rows, the same answers), and
    ``device_split="auto"``: with several devices, split a prediction by ensemble members
    (``"members"``) or by test rows (``"rows"``, the KV cache copied to each device);
    ``"auto"`` picks the split whose busiest device has less work (:mod:`.devices`).

    Fitted attributes as tabicl's: ``classes_``, ``n_classes_``, ``n_features_in_``,
    ``n_samples_in_``, ``feature_names_in_``, ``model_path_``, ``model_config_`` (the
    checkpoint's configuration), ``device_``, ``cache_mode_`` (``"kv"``, ``"repr"`` or None, from
    ``kv_cache``); ``model_`` is the served model. tabicl's preprocessing objects
    (``X_encoder_``, ``ensemble_generator_``, ``y_encoder_`` / ``y_scaler_``), its
    ``model_kv_cache_`` and ``inference_config_`` are its own classes and have no counterpart.
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
        allow_auto_download: bool = True,
        checkpoint_version: str = "tabicl-classifier-v2-20260212.ckpt",
        device: str | torch.device | None = None,
        use_amp: bool | str = "auto",
        use_fa3: bool | str = "auto",
        offload_mode: str | bool = "auto",
        disk_offload_dir: str | None = None,
        random_state: int | None = 42,
        n_jobs: int | None = None,
        verbose: bool = False,
        inference_config=None,
        recipe=None,
        allow_fp8: bool = True,
        bucket_grid=None,
        test_chunk_rows: int | None = None,
        device_split: str = "auto",
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
        self.allow_auto_download = allow_auto_download
        self.checkpoint_version = checkpoint_version
        self.device = device
        self.use_amp = use_amp
        self.use_fa3 = use_fa3
        self.offload_mode = offload_mode
        self.disk_offload_dir = disk_offload_dir
        self.random_state = random_state
        self.n_jobs = n_jobs
        self.verbose = verbose
        self.inference_config = inference_config
        self.recipe = recipe
        self.allow_fp8 = allow_fp8
        self.bucket_grid = bucket_grid
        self.test_chunk_rows = test_chunk_rows
        self.device_split = device_split

    @_atomic_fit
    @_estimator_call
    def fit(self, X, y) -> TabICLClassifier:
        """Fit preprocessing and the member plan (and the KV cache if ``kv_cache``).

        Raises:
            ValueError: zero rows, NaN labels, length mismatch, infinite features,
            too many classes for the requested mode, bad checkpoint.
        """
        self._check_params()
        X = self._validate_X(X, reset=True)
        y = self._target(X, y, type(self).__name__)
        if y.dtype.kind == "f" and np.isnan(y).any():
            raise ValueError("y contains NaN labels")
        if y.dtype == object and any(label is None for label in y):
            raise ValueError("y contains None among its labels")
        check_classification_targets(y)
        self.classes_, codes = np.unique(y, return_inverse=True)
        self.n_classes_ = len(self.classes_)
        self.devices_ = resolve_devices(self.device)
        self.device_ = self.devices_[0]
        # Loaded before the members' preprocessing, not beside it: a fresh process's first fit
        # that loaded on a thread of its own measured 742 against 783 ms (small table) and
        # 1,183 against 853 ms (DataFrame table) on an H100 host: both load and preprocess in
        # Python under one interpreter lock.
        self.model_ = self._load_model(X.shape[0], self.n_classes_)
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

    @_estimator_call
    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``(rows, n_classes)`` float32, columns in ``classes_`` order."""
        X_test = self._test_table(X)
        if self._certain():
            return np.ones((X_test.shape[0], 1), dtype=np.float32)
        kwargs = {
            "return_logits": bool(self.average_logits),
            "softmax_temperature": self.softmax_temperature,
        }

        def probabilities(rows: Tensor, on) -> Tensor:
            return self._probabilities(
                torch.cat(
                    self._member_outputs(
                        rows,
                        lambda engine, X_m, y_m: self._one_shot(engine, X_m, y_m, **kwargs),
                        lambda engine, X_m, cache: engine.forward_with_cache(X_m, cache, **kwargs),
                        on,
                    )
                )
            )

        return self._by_test_chunks(X_test, probabilities).cpu().numpy()

    def _probabilities(self, outputs: Tensor) -> Tensor:
        """The ensemble's probabilities ``(rows, n_classes)`` from the members' outputs
        ``(members, rows, n_classes)`` in plan order (logits with ``average_logits``, else
        probabilities)."""
        patterns = device_values(
            [p for members in self.plan_.values() for _, p in members], torch.int64, outputs.device
        )
        # Member i saw original class c as label pattern_i[c]: read its column back.
        aligned = outputs.gather(2, patterns[:, None, :].expand(-1, outputs.shape[1], -1))
        avg = aligned.mean(dim=0)
        if self.average_logits:
            avg = torch.softmax(avg / self.softmax_temperature, dim=-1)
        return avg / avg.sum(dim=1, keepdim=True)

    def _from_raw(self, raw: Tensor, method: str, params: dict):
        """``method``'s answer from the members' raw head outputs (the packed path)."""
        logits = raw[..., : self.n_classes_]
        if not self.average_logits:
            logits = torch.softmax(logits / self.softmax_temperature, dim=-1)
        proba = self._probabilities(logits).cpu().numpy()
        return proba if method == "predict_proba" else self.classes_[proba.argmax(axis=1)]

    def _certain(self) -> bool:
        # tabicl fits a single class and answers it with probability 1, as a softmax over one
        # class must: the members' outputs cannot change that answer, so none are computed.
        return self.n_classes_ == 1

    def _packable(self) -> bool:
        return not self._certain() and self.n_classes_ <= self.model_.config.max_classes

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
        allow_auto_download: bool = True,
        checkpoint_version: str = "tabicl-regressor-v2-20260212.ckpt",
        device: str | torch.device | None = None,
        use_amp: bool | str = "auto",
        use_fa3: bool | str = "auto",
        offload_mode: str | bool = "auto",
        disk_offload_dir: str | None = None,
        random_state: int | None = 42,
        n_jobs: int | None = None,
        verbose: bool = False,
        inference_config=None,
        recipe=None,
        allow_fp8: bool = True,
        bucket_grid=None,
        test_chunk_rows: int | None = None,
        device_split: str = "auto",
    ):
        self.n_estimators = n_estimators
        self.norm_methods = norm_methods
        self.feat_shuffle_method = feat_shuffle_method
        self.outlier_threshold = outlier_threshold
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        self.model_path = model_path
        self.allow_auto_download = allow_auto_download
        self.checkpoint_version = checkpoint_version
        self.device = device
        self.use_amp = use_amp
        self.use_fa3 = use_fa3
        self.offload_mode = offload_mode
        self.disk_offload_dir = disk_offload_dir
        self.random_state = random_state
        self.n_jobs = n_jobs
        self.verbose = verbose
        self.inference_config = inference_config
        self.recipe = recipe
        self.allow_fp8 = allow_fp8
        self.bucket_grid = bucket_grid
        self.test_chunk_rows = test_chunk_rows
        self.device_split = device_split

    @_atomic_fit
    @_estimator_call
    def fit(self, X, y) -> TabICLRegressor:
        """Standardise y, fit preprocessing / members (and the KV cache if ``kv_cache``)."""
        self._check_params()
        X = self._validate_X(X, reset=True)
        y = self._target(X, y, type(self).__name__)
        try:
            y = np.asarray(y, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"regression targets must be numeric: {e}") from None
        if not np.isfinite(y).all():
            raise ValueError("y contains NaN or infinite targets")
        self.y_mean_ = float(np.mean(y, dtype=np.float64))
        std = float(np.std(y, dtype=np.float64))
        self.y_scale_ = std if std >= 10 * np.finfo(np.float64).eps else 1.0
        self.devices_ = resolve_devices(self.device)
        self.device_ = self.devices_[0]
        self.model_ = self._load_model(X.shape[0])
        y_scaled = ((y - np.float32(self.y_mean_)) / np.float32(self.y_scale_)).astype(np.float32)
        self._fit_members(X, torch.as_tensor(y_scaled, dtype=torch.float64, device=self.device_), 0)
        return self

    @_estimator_call
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

        def statistics(rows: Tensor, on) -> dict:
            return self._statistics(
                self._member_outputs(
                    rows,
                    lambda engine, X_m, y_m: quantile_stats(self._one_shot(engine, X_m, y_m), kinds, alphas),
                    lambda engine, X_m, cache: engine.predict_stats_with_cache(X_m, cache, kinds, alphas),
                    on,
                ),
                kinds,
            )

        results = {k: v.cpu().numpy() for k, v in self._by_test_chunks(X_test, statistics).items()}
        return results[kinds[0]] if isinstance(output_type, str) else results

    def _statistics(self, outputs: list, kinds: list) -> dict:
        """``kind -> (rows, ...)`` in target units: the member average of each statistic, from
        the members' statistics in plan order (a tensor or a dict of them per call)."""
        outputs = [o if isinstance(o, dict) else {kinds[0]: o} for o in outputs]
        return {
            kind: (torch.cat([o[kind] for o in outputs]).double() * self.y_scale_ + self.y_mean_)
            .mean(dim=0)
            for kind in kinds
        }

    def _from_raw(self, raw: Tensor, method: str, params: dict):
        """``predict(**params)``'s answer from the members' raw quantiles (the packed path)."""
        output_type = params.get("output_type", "mean")
        kinds = [output_type] if isinstance(output_type, str) else list(output_type)
        stats = self._statistics([quantile_stats(raw, kinds, params.get("alphas"))], kinds)
        results = {kind: value.cpu().numpy() for kind, value in stats.items()}
        return results[kinds[0]] if isinstance(output_type, str) else results

    def _packable(self) -> bool:
        return True
