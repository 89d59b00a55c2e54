"""Turn a :class:`~tabserve.bench.cells.Cell` into callables: one-shot, KV cache, estimator.

An :class:`Engine` owns one loaded model. The reference engine drives ``tabicl`` 2.2.0 the way its
own wrappers do (``InferenceConfig`` with ``use_amp`` for its fp16 path); the tabserve engine
serves :class:`tabserve.models.tabicl.TabICLv2` through
:class:`tabserve.models.tabicl.serving.served.ServedTabICL` with the cell's :class:`ServingOptions`,
exactly as the estimators do with ``recipe=<the same options>``. Outputs are what a user
receives: class probabilities (classification) or raw quantiles (regression).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tabserve.models.tabicl.serving.options import precision_flags

from .cells import Cell
from .workloads import Workload


class UnsupportedCell(RuntimeError):
    """The cell asks for something this engine cannot do here (reported as skipped)."""


class Engine:
    """A cell made runnable on one device (see the module docstring)."""

    def __init__(self, cell: Cell, workload: Workload, checkpoint: Path, device: torch.device):
        self.cell, self.workload, self.device = cell, workload, torch.device(device)
        self.checkpoint = Path(checkpoint)

    @property
    def captures(self) -> int | None:
        """CUDA graphs captured so far (engines that capture report them; None = not applicable)."""
        return None

    @contextlib.contextmanager
    def context(self):
        """What a call of this cell runs under (gradients off; the reference's precision
        flags: it applies its own autocast per stage; a served model enters its options')."""
        with torch.no_grad(), precision_flags(self.cell.precision):
            yield

    def one_shot(self, X, y_train):
        raise NotImplementedError

    def padding_gate(self, X, y_train):
        """``(padded, unpadded)`` fp32 eager outputs for the padded-vs-unpadded gate, or None
        when the cell does not pad."""
        return

    def recipe_padding_gate(self, X, y_train):
        """``(padded, unpadded)`` outputs under the cell's own options for the
        padded-vs-unpadded gate, or None when the cell does not pad."""
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
            kv_cache=False,
            random_state=0,
        )
        with self.context():
            return estimator.fit(X_train, y_train)


class TabserveEngine(Engine):
    """:class:`TabICLv2` served by :class:`ServedTabICL` with the cell's options."""

    def __init__(self, cell, workload, checkpoint, device):
        super().__init__(cell, workload, checkpoint, device)
        from tabserve.models.tabicl import TabICLv2

        if cell.options.graphs and self.device.type != "cuda":
            raise UnsupportedCell("CUDA graphs need a CUDA device")
        self.model = self._served(TabICLv2.from_checkpoint(self.checkpoint, device=self.device))

    def _served(self, model, options=None):
        from tabserve.buckets import BucketGrid
        from tabserve.models.tabicl.serving.served import ServedTabICL

        return ServedTabICL(model, options or self.cell.options, BucketGrid())

    @contextlib.contextmanager
    def context(self):
        with torch.no_grad():  # the served model enters its options' precision itself
            yield

    @property
    def captures(self) -> int | None:
        return self.model.captures if self.cell.options.graphs else None

    def _padded_routes(self) -> tuple[bool, bool]:
        """(one-shot, KV-cached) routes on which the cell pads: bucketed and ``shape_graphs``
        cells' one-shot call, ``kv_graphs`` cells' KV-cached prediction (its test rows)."""
        options = self.cell.options
        return options.buckets or options.shape_graphs, (
            options.kv_graphs and self.workload.cacheable
        )

    def _kwargs(self) -> dict:
        return {} if self.workload.task == "reg" else {"return_logits": False}

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
        from tabserve.models.tabicl.serving.options import ServingOptions

        plain = TabICLv2.from_checkpoint(self.checkpoint, device=self.device)
        options = self.cell.options
        padded = self._served(
            plain,
            ServingOptions(
                buckets=options.buckets,
                kv_graphs=options.kv_graphs,
                shape_graphs=options.shape_graphs,
            ),
        )
        unpadded = self._served(plain, ServingOptions())
        kwargs = self._kwargs()
        n_train = y_train.shape[1]
        X = X[:, : max(n_train + 1, X.shape[1] - 1)]  # test rows off the test buckets
        pairs = []
        with torch.no_grad():
            if one_shot:
                pairs.append((padded(X, y_train, **kwargs), unpadded(X, y_train, **kwargs)))
            if kv_graphs:
                cache = unpadded.build_cache(X[:, :n_train], y_train)
                X_test = X[:, n_train:]
                pairs.append(
                    (
                        padded.forward_with_cache(X_test, cache, **kwargs),
                        unpadded.forward_with_cache(X_test, cache, **kwargs),
                    )
                )
        return _joined(pairs)

    def recipe_padding_gate(self, X, y_train):
        """(padded, unpadded) outputs under the cell's own options, or None when the cell pads
        nothing. :meth:`padding_gate` proves the padding logic exact in fp32 eager; this one
        runs the cell's own kernels (fused operators, head-dim-16 kernel, compiled and captured
        graphs) on padded inputs: the padded side is the cell's timed call itself, the
        unpadded side the same precision and kernels, eager and unpadded. The table has one
        train row and one test row fewer than the workload's, so both blocks sit off their
        buckets: the bucketed and ``shape_graphs`` cells' one-shot call, the ``kv_graphs``
        cells' KV-cached prediction (padded test rows), joined along the test rows for a cell
        with both."""
        one_shot, kv_graphs = self._padded_routes()
        if not (one_shot or kv_graphs):
            return None
        from tabserve.models.tabicl import TabICLv2

        n_train = y_train.shape[1]
        keep = max(n_train - 1, 1)
        X = torch.cat([X[:, :keep], X[:, n_train : max(n_train + 1, X.shape[1] - 1)]], dim=1)
        y_train = y_train[:, :keep]
        eager = self.cell.options.replace(
            compile="none",
            buckets=False,
            cuda_graphs=False,
            kv_graphs=False,
            shape_graphs=False,
            freeze=False,
        )
        plain = self._served(TabICLv2.from_checkpoint(self.checkpoint, device=self.device), eager)
        kwargs = self._kwargs()
        pairs = []
        # Replayed graphs' outputs live in a pool the next replay may write: copied at once.
        with torch.no_grad():
            if one_shot:
                padded = self.one_shot(X, y_train).float().clone()
                pairs.append((padded, plain(X, y_train, **kwargs).float()))
            if kv_graphs:
                X_test = X[:, keep:]
                cache = self.build_cache(X[:, :keep], y_train)
                padded = self.predict_cached(X_test, cache).float().clone()
                cache = plain.build_cache(X[:, :keep], y_train)
                pairs.append((padded, plain.forward_with_cache(X_test, cache, **kwargs).float()))
        return _joined(pairs)

    def one_shot(self, X, y_train):
        with self.context():
            return self.model(X, y_train, **self._kwargs())

    def build_cache(self, X_train, y_train):
        with self.context():
            return self.model.build_cache(X_train, y_train)

    def predict_cached(self, X_test, cache):
        with self.context():
            return self.model.forward_with_cache(X_test, cache, **self._kwargs())

    def fit_estimator(self, X_train, y_train):
        from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor

        kind = TabICLRegressor if self.workload.task == "reg" else TabICLClassifier
        estimator = kind(
            n_estimators=self.workload.members,
            model_path=self.checkpoint,
            device=self.device,
            random_state=0,
            recipe=self.cell.options,
        )
        with self.context():
            return estimator.fit(X_train, y_train)


def _joined(pairs: list) -> tuple:
    """One (padded, unpadded) pair from a gate's routes' pairs, joined along the test rows."""
    if len(pairs) == 1:
        return pairs[0]
    return tuple(torch.cat(outputs, dim=1) for outputs in zip(*pairs))


def make_engine(cell: Cell, workload: Workload, checkpoint: Path, device) -> Engine:
    """The engine of ``cell`` (raises :class:`UnsupportedCell` for what it cannot run here)."""
    kind = ReferenceEngine if cell.engine == "reference" else TabserveEngine
    return kind(cell, workload, checkpoint, torch.device(device))
