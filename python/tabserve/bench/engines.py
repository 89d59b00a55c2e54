"""Turn a :class:`~tabserve.bench.cells.Cell` into callables: one-shot, KV cache, estimator.

An :class:`Engine` owns one loaded model and runs every call inside the cell's context (TF32
flags, autocast, ``sdpa_kernel``). The reference engine drives ``tabicl`` 2.2.0 the way its own
wrappers do (``InferenceConfig`` with ``use_amp`` for its fp16 path); the tabserve engine applies
the recipe fields to :class:`tabserve.models.tabicl.TabICLv2`; cells with buckets, regional
compile or CUDA graphs run through :class:`tabserve.models.tabicl.serving.ServedTabICL` with the
cell's recipe (``recipes.recipe_from_cell``). Outputs are what a user receives: class
probabilities (classification) or raw quantiles (regression).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from tabserve.models.tabicl.recipes import (
    autocast_dtype,
    freezing,
    precision_flags,
    sdpa_context,
    set_fused_operators,
    set_stage_kernels,
    specialized_floats,
)

from .cells import Cell
from .workloads import Workload

#: Methods of each stage module that run attention (wrapped for per-stage backends).
_STAGE_MODULES = {"col": "col_embedder", "row": "row_interactor", "icl": "icl_predictor"}
_STAGE_METHODS = ("forward", "build_cache", "forward_cached", "hierarchical_probs")


class UnsupportedRecipe(RuntimeError):
    """The cell asks for something this engine cannot do (reported as skipped)."""


def _sdpa_context(backend: str):
    return sdpa_context(backend)


class Engine:
    """A cell made runnable on one device (see the module docstring)."""

    def __init__(self, cell: Cell, workload: Workload, checkpoint: Path, device: torch.device):
        self.cell, self.workload, self.device = cell, workload, torch.device(device)
        self.checkpoint = Path(checkpoint)

    @property
    def captures(self) -> int | None:
        """CUDA graphs captured so far (engines that capture report them; None = not applicable)."""
        return None

    def _outer_autocast(self) -> bool:
        return True

    @property
    def _uses_serving(self) -> bool:
        """Whether the cell's model is served (:class:`ServedTabICL`), which then enters its
        recipe's context itself."""
        return False

    @contextlib.contextmanager
    def context(self):
        """Everything a call of this cell runs under."""
        cell = self.cell
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            # Served cells (buckets, regional, CUDA graphs) turn freezing on themselves, where
            # they may trace; a timed replay should not pay for the flag.
            if cell.freeze and not self._uses_serving:
                stack.enter_context(freezing())
            if cell.dynamic and not self._uses_serving:  # served calls enter their recipe's
                stack.enter_context(specialized_floats())
            stack.enter_context(precision_flags(cell.precision))
            dtype = autocast_dtype(cell.precision)
            if dtype is not None and self._outer_autocast():
                stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
            if cell.uniform_attention:
                stack.enter_context(_sdpa_context(cell.uniform_attention))
            yield

    def one_shot(self, X, y_train):
        raise NotImplementedError

    def padding_gate(self, X, y_train):
        """``(padded, unpadded)`` fp32 eager outputs for the padded-vs-unpadded gate, or None
        when the cell does not pad."""
        return

    def recipe_padding_gate(self, X, y_train):
        """``(padded, unpadded)`` outputs under the cell's own recipe for the padded-vs-unpadded
        gate, or None when the cell does not pad."""
        return

    def build_cache(self, X_train, y_train):
        raise NotImplementedError

    def predict_cached(self, X_test, cache):
        raise NotImplementedError

    def fit_estimator(self, X_train, y_train):
        raise NotImplementedError

    def estimator_predict(self, estimator, X_test):
        with self.context():
            if self.workload.task == "reg":
                return estimator.predict(X_test)
            return estimator.predict_proba(X_test)


class ReferenceEngine(Engine):
    """``tabicl`` 2.2.0: fp32 (``use_amp=False``) or its own fp16 autocast (``use_amp=True``)."""

    def __init__(self, cell, workload, checkpoint, device):
        super().__init__(cell, workload, checkpoint, device)
        from tabicl import InferenceConfig
        from tabicl._model.tabicl import TabICL

        if cell.precision not in ("fp32", "fp16"):
            raise UnsupportedRecipe(f"the reference has no {cell.precision} path")
        payload = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
        self.model = TabICL(**payload["config"])
        self.model.load_state_dict(payload["state_dict"])
        self.model.eval().to(self.device)
        self.use_amp = cell.precision == "fp16"
        self.inference_config = InferenceConfig()
        stage = {"device": str(self.device), "use_amp": self.use_amp, "use_fa3": self.use_amp}
        self.inference_config.update_from_dict(
            {k: dict(stage) for k in ("COL_CONFIG", "ROW_CONFIG", "ICL_CONFIG")}
        )

    def _outer_autocast(self) -> bool:
        return False  # the reference applies its own autocast per stage

    def one_shot(self, X, y_train):
        with self.context():
            kwargs = {} if self.workload.task == "reg" else {"return_logits": False}
            return self.model(X, y_train, inference_config=self.inference_config, **kwargs)

    def build_cache(self, X_train, y_train):
        with self.context():
            self.model.forward_with_cache(
                X_train=X_train,
                y_train=y_train,
                store_cache=True,
                cache_mode="kv",
                inference_config=self.inference_config,
            )
            cache, self.model._cache = self.model._cache, None
            return cache

    def predict_cached(self, X_test, cache):
        with self.context():
            kwargs = {} if self.workload.task == "reg" else {"return_logits": False}
            return self.model.forward_with_cache(
                X_test=X_test, cache=cache, inference_config=self.inference_config, **kwargs
            )

    def fit_estimator(self, X_train, y_train):
        import tabicl

        kind = tabicl.TabICLRegressor if self.workload.task == "reg" else tabicl.TabICLClassifier
        estimator = kind(
            n_estimators=self.workload.members,
            model_path=str(self.checkpoint),
            allow_auto_download=False,
            device=str(self.device),
            use_amp=self.use_amp,
            use_fa3=self.use_amp,
            kv_cache=self.cell.kv_cache,
            random_state=0,
        )
        with self.context():
            return estimator.fit(X_train, y_train)


class TabserveEngine(Engine):
    """:class:`TabICLv2` with the cell's precision, attention choices and compile mode; served
    through :class:`ServedTabICL` when the cell pads (buckets), compiles regionally or captures
    CUDA graphs."""

    def __init__(self, cell, workload, checkpoint, device):
        super().__init__(cell, workload, checkpoint, device)
        from tabserve.models.tabicl import TabICLv2

        if cell.precision == "fp8":
            raise UnsupportedRecipe("not implemented: fp8")
        if (cell.cuda_graphs or cell.kv_graphs or cell.shape_graphs) and self.device.type != "cuda":
            raise UnsupportedRecipe("CUDA graphs need a CUDA device")
        self._set_kernel_knobs()
        self.model = TabICLv2.from_checkpoint(self.checkpoint, device=self.device)
        if cell.checks_first:
            self.model.defer_checks = False
        self.served = self._serve(self.model) if self._uses_serving else None
        if self.served is not None:
            self.model = self.served
            self._forward_cached = self.served.forward_with_cache
        else:
            self._forward_cached = self._prepare(self.model)

    @property
    def _uses_serving(self) -> bool:
        cell = self.cell
        return bool(
            cell.buckets or cell.regional or cell.cuda_graphs or cell.kv_graphs or cell.shape_graphs
        )

    def _set_kernel_knobs(self) -> None:
        """The cell's kernel knobs (:meth:`Cell.kernel_knobs`), module settings of the kernels:
        this process is the cell's own. Served cells and prepared models alike (c50's tile,
        set only where a model was prepared, never reached its served kv_graphs model)."""
        from tabserve.kernels import feed_forward

        knobs = self.cell.kernel_knobs()
        if "ffn_projecting_tile" in knobs:
            feed_forward.PROJECTING_LONG_CONFIG = tuple(knobs["ffn_projecting_tile"])
        if "ffn_gelu" in knobs:
            feed_forward.GELU = knobs["ffn_gelu"]

    def _recipe(self):
        from tabserve.models.tabicl.recipes import recipe_from_cell

        return recipe_from_cell(self.cell.recipe(), name=self.cell.name)

    def _serve(self, model):
        from tabserve.models.tabicl.serving import ServedTabICL

        return ServedTabICL(model, self._recipe(), _bucket_grid(self.cell.buckets))

    @property
    def captures(self) -> int | None:
        graphs = self.cell.cuda_graphs or self.cell.kv_graphs or self.cell.shape_graphs
        return self.served.captures if graphs else None

    def _padded_routes(self) -> tuple[bool, bool]:
        """(one-shot, KV-cached) routes on which the cell pads: bucketed and ``shape_graphs``
        cells' one-shot call, ``kv_graphs`` cells' KV-cached prediction (its test rows)."""
        cell = self.cell
        return bool(cell.buckets or cell.shape_graphs), cell.kv_graphs and self.workload.cacheable

    def padding_gate(self, X, y_train):
        """(padded, unpadded) outputs of the cell's padding in fp32 eager, or None when the cell
        pads nothing: bucketed cells' one-shot call; ``shape_graphs`` cells' one-shot call and
        ``kv_graphs`` cells' KV-cached prediction, whose test rows are padded (one test row
        fewer than the workload's, so that they do not sit on a test bucket), the graphs
        replayed as served; both of a cell with both, joined along the test rows."""
        one_shot, kv_graphs = self._padded_routes()
        if not (one_shot or kv_graphs):
            return None
        from tabserve.models.tabicl import TabICLv2
        from tabserve.models.tabicl.serving import ServedTabICL

        plain = TabICLv2.from_checkpoint(self.checkpoint, device=self.device)
        exact = self._recipe().replace(
            precision="fp32",
            compile="none",
            cuda_graphs=False,
            attention={},
            fused_ffn=False,
            fused_norm_linear=False,
            rope_in_projection=False,
            fused_out_projection=False,
            fused_row_tokens=False,
            icl_one_pass=False,
            freeze=False,
        )
        padded = ServedTabICL(plain, exact, _bucket_grid(self.cell.buckets))
        kwargs = {} if self.workload.task == "reg" else {"return_logits": False}
        n_train = y_train.shape[1]
        X = X[:, : max(n_train + 1, X.shape[1] - 1)]  # test rows off the test buckets
        pairs = []
        with torch.no_grad(), precision_flags("fp32"):
            if one_shot:
                pairs.append((padded(X, y_train, **kwargs), plain(X, y_train, **kwargs)))
            if kv_graphs:
                cache = plain.build_cache(X[:, :n_train], y_train)
                X_test = X[:, n_train:]
                pairs.append(
                    (
                        padded.forward_with_cache(X_test, cache, **kwargs),
                        plain.forward_with_cache(X_test, cache, **kwargs),
                    )
                )
        return _joined(pairs)

    def recipe_padding_gate(self, X, y_train):
        """(padded, unpadded) outputs under the cell's own recipe, or None when the cell pads
        nothing. :meth:`padding_gate` proves the padding logic exact in fp32 eager; this one
        runs the cell's own kernels (fused operators, head-dim-16 kernel, compiled and captured
        graphs) on padded inputs: the padded side is the cell's timed call itself, the
        unpadded side the same model, precision, fused operators and attention kernels, eager
        and unpadded. The table has one train row and one test row fewer than the workload's,
        so both blocks sit off their buckets (the train count a graph captured for the
        workload then reaches it through the device tensor): the bucketed and ``shape_graphs``
        cells' one-shot call, the ``kv_graphs`` cells' KV-cached prediction (padded test rows),
        both joined along the test rows for a cell with both."""
        one_shot, kv_graphs = self._padded_routes()
        if not (one_shot or kv_graphs):
            return None
        from tabserve.models.tabicl import TabICLv2

        n_train = y_train.shape[1]
        keep = max(n_train - 1, 1)
        X = torch.cat([X[:, :keep], X[:, n_train : max(n_train + 1, X.shape[1] - 1)]], dim=1)
        y_train = y_train[:, :keep]
        plain = TabICLv2.from_checkpoint(self.checkpoint, device=self.device)
        self._apply_recipe_kernels(plain)
        if self.cell.checks_first:
            plain.defer_checks = False
        kwargs = {} if self.workload.task == "reg" else {"return_logits": False}
        pairs = []
        # Replayed graphs' outputs live in a pool the next replay may write: copied at once.
        if one_shot:
            padded = self.one_shot(X, y_train).float().clone()
            with self.context():
                pairs.append((padded, plain(X, y_train, **kwargs).float()))
        if kv_graphs:
            X_test = X[:, keep:]
            cache = self.build_cache(X[:, :keep], y_train)
            padded = self.predict_cached(X_test, cache).float().clone()
            with self.context():
                cache = plain.build_cache(X[:, :keep], y_train)
                pairs.append((padded, plain.forward_with_cache(X_test, cache, **kwargs).float()))
        return _joined(pairs)

    def _apply_recipe_kernels(self, model) -> None:
        """The cell's fused operators and per-stage attention kernels on ``model``, in place."""
        set_fused_operators(model, self.cell)
        for stage, backend in self.cell.attention.items():
            set_stage_kernels(getattr(model, _STAGE_MODULES[stage]), backend)
            if not self.cell.uniform_attention:
                _pin_stage_attention(getattr(model, _STAGE_MODULES[stage]), backend)

    def _prepare(self, model):
        """Applies per-stage attention and compilation to ``model`` in place; returns the cached
        predict callable (compiled the same way)."""
        self._apply_recipe_kernels(model)
        if self.cell.compile is None:
            return model.forward_with_cache
        options = {
            "mode": None if self.cell.compile == "default" else self.cell.compile,
            "dynamic": True if self.cell.dynamic else None,
            "fullgraph": self.cell.fullgraph,
        }
        model.compile(**options)
        return torch.compile(model.forward_with_cache, **options)

    def one_shot(self, X, y_train):
        with self.context():
            if self.workload.task == "reg":
                return self.model(X, y_train)
            return self.model(X, y_train, return_logits=False)

    def build_cache(self, X_train, y_train):
        with self.context():
            return self.model.build_cache(X_train, y_train)

    def predict_cached(self, X_test, cache):
        with self.context():
            if self.workload.task == "reg":
                return self._forward_cached(X_test, cache)
            return self._forward_cached(X_test, cache, return_logits=False)

    def fit_estimator(self, X_train, y_train):
        from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor

        kind = TabICLRegressor if self.workload.task == "reg" else TabICLClassifier
        estimator = kind(
            n_estimators=self.workload.members,
            model_path=self.checkpoint,
            device=self.device,
            kv_cache=self.cell.kv_cache,
            random_state=0,
            recipe=self._recipe() if self._uses_serving else None,
            bucket_grid=_bucket_grid(self.cell.buckets),
        )
        with self.context():
            estimator.fit(X_train, y_train)
        if self._uses_serving:
            forward_cached = estimator.model_.forward_with_cache
        else:
            forward_cached = self._prepare(estimator.model_)
        estimator.model_ = _ModelInContext(estimator.model_, self.context, forward_cached)
        return estimator

    def estimator_predict(self, estimator, X_test):
        # The model calls enter the cell's context (see _ModelInContext); the estimator's own
        # pre- and post-processing stay in fp32, as they would in serving.
        if self.workload.task == "reg":
            return estimator.predict(X_test)
        return estimator.predict_proba(X_test)


class _ModelInContext:
    """Stands in for an estimator's ``model_``: every network call runs in the cell's context and
    returns fp32, so the estimator's numpy post-processing sees the dtype it expects."""

    def __init__(self, model, context, forward_cached):
        self._model, self._context, self._forward_cached = model, context, forward_cached

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _run(self, fn, *args, **kwargs):
        with self._context():
            out = fn(*args, **kwargs)
        if isinstance(out, dict):
            return {k: v.float() for k, v in out.items()}
        return out.float()

    def __call__(self, *args, **kwargs):
        return self._run(self._model, *args, **kwargs)

    def forward_with_cache(self, *args, **kwargs):
        return self._run(self._forward_cached, *args, **kwargs)

    def predict_stats(self, *args, **kwargs):
        return self._run(self._model.predict_stats, *args, **kwargs)

    def predict_stats_with_cache(self, X_test, cache, *args, **kwargs):
        from tabserve.models.tabicl.quantiles import quantile_stats

        raw = self.forward_with_cache(X_test, cache)
        return quantile_stats(raw, *args, **kwargs)


def _pin_stage_attention(module, backend: str) -> None:
    """Runs every attention-bearing method of one stage module under ``sdpa_kernel(backend)``."""
    for name in _STAGE_METHODS:
        method = getattr(module, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def pinned(*args, __method=method, **kwargs):
            with _sdpa_context(backend):
                return __method(*args, **kwargs)

        setattr(module, name, pinned)


def _joined(pairs: list) -> tuple:
    """One (padded, unpadded) pair from a gate's routes' pairs, joined along the test rows."""
    if len(pairs) == 1:
        return pairs[0]
    return tuple(torch.cat(outputs, dim=1) for outputs in zip(*pairs))


def _bucket_grid(name: str | None):
    """The bucket grid a cell names (``"default"``: ``BucketGrid()``), None without buckets."""
    if name is None:
        return None
    from tabserve.buckets import BucketGrid

    if name != "default":
        raise UnsupportedRecipe(f"unknown bucket grid {name!r}")
    return BucketGrid()


def make_engine(cell: Cell, workload: Workload, checkpoint: Path, device) -> Engine:
    """The engine of ``cell`` (raises :class:`UnsupportedRecipe` for recipes it cannot run)."""
    kind = ReferenceEngine if cell.engine == "reference" else TabserveEngine
    return kind(cell, workload, checkpoint, torch.device(device))
