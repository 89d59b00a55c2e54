"""Estimator-level benchmark suite: what users do with the estimators, timed.

``python -m tabserve.bench.estimator_suite [--device cpu|cuda|auto] [--quick] [--kinds ...]
[--recipes exact auto ...] [--out DIR] [--checkpoint CLF --regressor-checkpoint REG]
[--model-size full|tiny] [--repeats N] [--timeout S]``, or
``python -m tabserve.bench.estimator_suite --merge A.json B.json [...] [--out DIR]``

Where the driver (``python -m tabserve.bench``) times the raw model on device tensors, this suite
times the scikit-learn estimators on host tables (NumPy arrays and pandas DataFrames) of a few
*kinds* (:data:`KINDS`: numeric, mixed numeric / string with missing values and unseen
categories, many rows, many features, many classes, regression, pandas ``category`` / boolean /
integer-named columns). Engines: ``tabicl`` 2.2.0 with its defaults (its own ``use_amp="auto"``),
``tabicl`` in fp32 (``use_amp=False, use_fa3=False``) and tabserve's estimators with each
``--recipes`` value, all with ``n_estimators=8`` and the same checkpoint (random-weight
checkpoints from :func:`tabserve.bench.workloads.make_checkpoint` when none is given).

Every (engine, kind) pair runs in a fresh process (:func:`tabserve.bench.runner.run_isolated`,
its own empty compile caches, a timeout). A tabicl process never imports tabserve: the child
loads this file by path. Measured per pair:

* ``cold``: the fresh process's first fit + predict, from the parent's spawn of the process
  (interpreter start and imports included, building the seeded table excluded), as the driver's
  ``ready_ms``; and the first fit and predict on their own.
* ``restarted`` (``--restart``, tabserve): the cold figures of a second fresh process over the
  first one's on-disk compile caches (Inductor's, Triton's);
* ``steady``: for tabserve, from the spawn until the compiles the first call started in the
  background have finished (:func:`tabserve.wait_for_compiles`);
* ``warm``: the median over ``--repeats`` of fit + predict with a fresh estimator per call
  (``sklearn.base.clone`` of the configured one) in the same process, split into fit and
  predict; for tabserve, one more warm call with the model's calls timed (its share of predict).
* peak GPU memory (``torch.cuda.max_memory_allocated``) on CUDA.
* accuracy against tabicl fp32 on the same kind: classification max |dp| and argmax agreement,
  regression max |mean difference| / std(train target).

"Fit once, predict many" (the ``wide-rows`` kind): an estimator fitted once with
``kv_cache=True`` predicting 1, 100 and 10,000 rows (``--quick``: 1, 100, 1,000), warm median
per size, for every engine.

Output (``--out``): ``estimator_suite_<device>[-quick].json`` (environment, settings, command,
kinds, results, predict_many, speed-ups) and the printed table as ``.txt``. Speed-ups are the
tabicl engines' warm (or cold) time over the engine's, per kind, and their geometric mean across
kinds. ``--merge`` writes one such record from the records of several runs of the same device,
mode and torch (each run a subset of ``--kinds``: :func:`merge`). A pair that fails (bad input,
bad checkpoint, out of memory, timeout) is a result with its error, never the end of the suite.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = "tabserve.bench.estimator_suite/1"
#: Members per estimator, every engine.
N_ESTIMATORS = 8
#: The tabicl engines (their names are also the speed-up baselines).
TABICL = "tabicl"
TABICL_FP32 = "tabicl-fp32"
BASELINES = (TABICL, TABICL_FP32)
DEFAULT_RECIPES = ("exact", "auto")
#: Rows predicted by the fitted, KV-cached estimator ("fit once, predict many").
PREDICT_SIZES = {"full": (1, 100, 10_000), "quick": (1, 100, 1_000)}
PREDICT_MANY_KIND = "wide-rows"


# ---------------------------------------------------------------------------------------------
# Table kinds


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
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise KeyError(f"unknown kind {name!r}; known: {', '.join(k.name for k in KINDS)}")


def _rng(kind: Kind, seed: int):
    import numpy as np

    return np.random.default_rng([seed, zlib.crc32(kind.name.encode())])


def _labels(signal, n_train: int, n_classes: int):
    """Balanced classes: the train signal's quantile bins (every class present in train)."""
    import numpy as np

    edges = np.quantile(signal[:n_train], np.linspace(0, 1, n_classes + 1)[1:-1])
    return np.searchsorted(edges, signal)


def make_table(kind: Kind, quick: bool = False, seed: int = 0, n_test: int | None = None) -> dict:
    """The seeded host table of ``kind``: ``X_train``, ``y_train``, ``X_test``, ``y_test``.

    NumPy float64 arrays, or DataFrames for ``mixed`` and ``categories``; labels are integers
    (strings for ``mixed``), targets float64. ``n_test`` overrides the kind's test rows (the
    fit-once, predict-many pool); the train rows do not depend on it.
    """
    import numpy as np

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
    return {
        "X_train": X[:n_train],
        "y_train": y[:n_train],
        "X_test": X[n_train:],
        "y_test": y[n_train:],
    }


def _mixed_table(kind: Kind, rng, X, signal, n_train: int) -> dict:
    import numpy as np
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
    y = names[_labels(signal, n_train, kind.n_classes)]
    return {
        "X_train": frame.iloc[:n_train].reset_index(drop=True),
        "y_train": y[:n_train],
        "X_test": frame.iloc[n_train:].reset_index(drop=True),
        "y_test": y[n_train:],
    }


def _categories_table(kind: Kind, rng, n_train: int, rows: int) -> dict:
    import numpy as np
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
    y = _labels(signal, n_train, kind.n_classes)
    return {
        "X_train": frame.iloc[:n_train].reset_index(drop=True),
        "y_train": y[:n_train],
        "X_test": frame.iloc[n_train:].reset_index(drop=True),
        "y_test": y[n_train:],
    }


# ---------------------------------------------------------------------------------------------
# Engines


def engine_names(recipes) -> list:
    """The engines of a run: the two tabicl ones, then tabserve with each recipe."""
    return [TABICL, TABICL_FP32, *(f"tabserve-{r}" for r in recipes)]


def estimator_spec(engine: str, task: str, checkpoint, device: str, kv_cache: bool = False) -> dict:
    """``{"family", "class", "params"}`` of ``engine``'s estimator (JSON-friendly)."""
    name = "TabICLRegressor" if task == "reg" else "TabICLClassifier"
    params = {
        "n_estimators": N_ESTIMATORS,
        "model_path": str(checkpoint),
        "device": device,
        "kv_cache": bool(kv_cache),
    }
    if engine in BASELINES:
        params["allow_auto_download"] = False
        if engine == TABICL_FP32:
            params.update(use_amp=False, use_fa3=False)
        return {"family": "tabicl", "class": name, "params": params}
    if not engine.startswith("tabserve-"):
        raise ValueError(f"unknown engine {engine!r}")
    params["recipe"] = engine[len("tabserve-") :]
    return {"family": "tabserve", "class": name, "params": params}


# ---------------------------------------------------------------------------------------------
# The child process (loaded by path: a tabicl process never imports tabserve)

_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_tabserve_estimator_suite', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "sys.exit(module.child_main(sys.argv[2]))\n"
)


def child_command(spec_path: Path) -> list:
    return [sys.executable, "-c", _BOOTSTRAP, str(Path(__file__).resolve()), str(spec_path)]


def _load_timing():
    """The shared timing harness (``timing.py``, next to this file), without the package."""
    name = "_tabserve_bench_timing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("timing.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class _Child:
    """State and incrementally written result of one child job."""

    def __init__(self, spec: dict, entered: float):
        self.spec = spec
        self.path = Path(spec["result"])
        self.result: dict = {
            "engine": spec["engine"],
            "kind": spec["kind"],
            "mode": spec.get("mode", "suite"),
            "status": "running",
            "pid": os.getpid(),
        }
        spawned = spec.get("spawned_at")
        if spawned is not None:
            self.result["spawn_to_start_ms"] = (entered - spawned) * 1e3
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.path)

    def fail(self, where: str, error: BaseException) -> None:
        oom = type(error).__name__ == "OutOfMemoryError"
        self.result.update(
            status="oom" if oom else "failed",
            reason=f"{where}: {type(error).__name__}: {str(error)[:400]}",
            error={
                "stage": where,
                "type": type(error).__name__,
                "message": str(error)[:1000],
                "traceback": traceback.format_exc()[-3000:],
            },
        )
        self.save()


class _TimedModel:
    """A served model whose calls are timed (synchronised): the model's share of a predict."""

    METHODS = ("forward_with_cache", "predict_stats", "predict_stats_with_cache", "build_cache")

    def __init__(self, inner, sync):
        self._inner, self._sync = inner, sync
        self.ms, self.calls = 0.0, 0

    def _timed(self, fn, *args, **kwargs):
        self._sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self._sync()
        self.ms += (time.perf_counter() - start) * 1e3
        self.calls += 1
        return out

    def __call__(self, *args, **kwargs):
        return self._timed(self._inner, *args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name in self.METHODS and callable(attr):
            return functools.partial(self._timed, attr)
        return attr


def child_main(spec_path) -> int:
    entered = time.time()
    spec = json.loads(Path(spec_path).read_text())
    job = _Child(spec, entered)
    try:
        if spec.get("mode") == "predict_many":
            _child_predict_many(job)
        else:
            _child_suite(job)
    except Exception as error:  # noqa: BLE001  (anything unforeseen is the job's result)
        job.fail("job", error)
    return 0


def _setup(job: _Child, kv_cache: bool, n_test: int | None = None):
    """Builds the table (timed apart), imports the engine (timed), configures the estimator."""
    spec = job.spec
    kind = kind_by_name(spec["kind"])
    start = time.perf_counter()
    table = make_table(kind, spec["quick"], spec["seed"], n_test=n_test)
    job.result["data_ms"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    est_spec = estimator_spec(
        spec["engine"], kind.task, spec["checkpoint"], spec["device"], kv_cache
    )
    if est_spec["family"] == "tabicl":
        import tabicl as library
    else:
        import tabserve.models.tabicl as library
    import torch
    from sklearn.base import clone

    job.result["import_ms"] = (time.perf_counter() - start) * 1e3
    job.result["estimator"] = est_spec
    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    proto = getattr(library, est_spec["class"])(**est_spec["params"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    job.save()
    return kind, table, proto, clone, device, sync


def _predict(estimator, kind: Kind, X):
    import numpy as np

    out = estimator.predict(X) if kind.task == "reg" else estimator.predict_proba(X)
    return np.asarray(out, dtype=np.float64)


def _peak(device) -> dict | None:
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _served_preset(estimator) -> str | None:
    """The preset a tabserve estimator serves (what ``recipe="auto"`` resolved to)."""
    model = getattr(estimator, "model_", None)
    options = getattr(model, "options", None)
    if options is None:
        return None
    try:
        from tabserve.models.tabicl.serving.options import preset_name

        return preset_name(options) or "custom options"
    except Exception:  # noqa: BLE001
        return None


def _child_suite(job: _Child) -> None:
    import numpy as np

    timing = _load_timing()
    try:
        kind, table, proto, clone, device, sync = _setup(job, kv_cache=False)
    except Exception as error:  # noqa: BLE001
        job.fail("setup", error)
        return
    X_train, y_train, X_test = table["X_train"], table["y_train"], table["X_test"]
    if kind.task == "reg":
        job.result["target_std"] = float(np.std(np.asarray(y_train, dtype=np.float64)))
    family = job.result["estimator"]["family"]

    # cold: the process's first fit + predict
    _reset_peak(device)
    stage = "fit"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            estimator = clone(proto)
            fit_ms, _ = timing.time_once(lambda: estimator.fit(X_train, y_train), device)
            stage = "predict"
            predict_ms, first = timing.time_once(lambda: _predict(estimator, kind, X_test), device)
    except Exception as error:  # noqa: BLE001  (an input kind an engine rejects is a result)
        job.fail(f"cold {stage}", error)
        return
    done = time.time()
    cold = {"fit_ms": fit_ms, "predict_ms": predict_ms, "first_call_ms": fit_ms + predict_ms}
    spawned = job.spec.get("spawned_at")
    if spawned is not None:
        cold["ready_ms"] = (done - spawned) * 1e3  # from spawn, table building included
        cold["cold_ms"] = cold["ready_ms"] - job.result["data_ms"]
    cold["memory"] = _peak(device)
    messages = {f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught}
    cold["warnings"] = sorted(messages)[:8]
    job.result["cold"] = cold
    if family == "tabserve":
        job.result["served_preset"] = _served_preset(estimator)
        # A compiled preset compiles in the background while the ready one answers: the steady
        # state starts once it has finished.
        from tabserve.models.tabicl.serving.background import wait_for_compiles

        start = time.perf_counter()
        finished = wait_for_compiles(timeout=job.spec.get("compile_timeout_s"))
        cold["compile_wait_ms"] = (time.perf_counter() - start) * 1e3
        cold["compiled"] = finished
        if spawned is not None:
            cold["steady_ms"] = (time.time() - spawned) * 1e3 - job.result["data_ms"]
    if job.spec.get("restart"):  # the restarted process: its cold figures are all it adds
        job.result["status"] = "ok"
        job.save()
        return
    np.save(job.spec["outputs"], first)
    job.result["outputs"] = job.spec["outputs"]
    job.result["output_shape"] = list(first.shape)
    job.save()

    # warm: a fresh estimator (clone) per call, in this process after the first
    repeats = max(int(job.spec["repeats"]), 1)
    fits, predicts, totals = [], [], []
    _reset_peak(device)
    try:
        for _ in range(repeats):
            estimator = clone(proto)
            fit_ms, _ = timing.time_once(lambda: estimator.fit(X_train, y_train), device)
            predict_ms, out = timing.time_once(lambda: _predict(estimator, kind, X_test), device)
            fits.append(fit_ms)
            predicts.append(predict_ms)
            totals.append(fit_ms + predict_ms)
    except Exception as error:  # noqa: BLE001
        job.result["warm"] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        job.fail("warm", error)
        return
    warm = timing.Timing(totals).as_dict()
    warm.update(
        fit_ms=statistics.median(fits),
        predict_ms=statistics.median(predicts),
        fit_samples_ms=fits,
        predict_samples_ms=predicts,
        memory=_peak(device),
        # clone + the same random_state: the same answer as the cold call
        max_abs_diff_to_cold=(
            float(np.max(np.abs(out - first))) if out.shape == first.shape else None
        ),
    )
    job.result["warm"] = warm
    job.save()

    # the model's share of one more warm predict (tabserve: its served model's calls timed)
    if family == "tabserve":
        try:
            estimator = clone(proto).fit(X_train, y_train)
            timed = _TimedModel(estimator.model_, sync)
            estimator.model_ = timed
            predict_ms, _ = timing.time_once(lambda: _predict(estimator, kind, X_test), device)
            job.result["stages"] = {
                "predict_ms": predict_ms,
                "model_ms": timed.ms,
                "model_calls": timed.calls,
                "host_ms": predict_ms - timed.ms,
                "model_share": timed.ms / predict_ms if predict_ms > 0 else None,
            }
        except Exception as error:  # noqa: BLE001  (optional figure)
            job.result["stages"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    job.result["status"] = "ok"
    job.save()


def _child_predict_many(job: _Child) -> None:
    timing = _load_timing()
    sizes = [int(n) for n in job.spec["sizes"]]
    try:
        kind, table, proto, clone, device, sync = _setup(job, kv_cache=True, n_test=max(sizes))
    except Exception as error:  # noqa: BLE001
        job.fail("setup", error)
        return
    X_train, y_train, X_pool = table["X_train"], table["y_train"], table["X_test"]
    _reset_peak(device)
    try:
        estimator = clone(proto)
        fit_ms, _ = timing.time_once(lambda: estimator.fit(X_train, y_train), device)
    except Exception as error:  # noqa: BLE001
        job.fail("fit (kv_cache=True)", error)
        return
    job.result["fit_ms"] = fit_ms
    job.result["fit_memory"] = _peak(device)
    if job.result["estimator"]["family"] == "tabserve":
        job.result["served_preset"] = _served_preset(estimator)
    job.result["sizes"] = {}
    repeats = max(int(job.spec["repeats"]), 1)
    failed = None
    for n in sizes:
        X = X_pool[:n]
        try:
            _reset_peak(device)
            first_ms, _ = timing.time_once(lambda X=X: _predict(estimator, kind, X), device)
            if job.result["estimator"]["family"] == "tabserve":
                # steady state: the cache's compiled half, then the prediction's own compile
                from tabserve.models.tabicl.serving.background import wait_for_compiles

                for _ in range(2):
                    wait_for_compiles(timeout=job.spec.get("compile_timeout_s"))
                    _predict(estimator, kind, X)
            figures = timing.time_calls(
                lambda X=X: _predict(estimator, kind, X),
                device,
                warmup=0,
                min_repeats=repeats,
                max_repeats=repeats,
                budget_s=0,
            ).as_dict()
            figures.update(first_ms=first_ms, memory=_peak(device))
        except Exception as error:  # noqa: BLE001
            figures = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            failed = failed or (n, error)
        job.result["sizes"][str(n)] = figures
        job.save()
    if failed is not None:
        job.fail(f"predict {failed[0]} rows", failed[1])
        return
    job.result["status"] = "ok"
    job.save()


# ---------------------------------------------------------------------------------------------
# The parent: jobs, accuracy, speed-ups, report


def run_job(spec: dict, job_dir: Path, timeout_s: float, name: str = "result") -> dict:
    """One child job in a fresh process (:func:`runner.run_isolated`, :func:`runner.child_env`:
    the job folder's compile caches, empty at its first job). ``name``: the job's files."""
    from .runner import child_env, run_isolated

    job_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, result=str(job_dir / f"{name}.json"), outputs=str(job_dir / f"{name}.npy"))
    spec_path = job_dir / f"{name}-spec.json"
    spec_path.write_text(json.dumps({**spec, "spawned_at": time.time()}, indent=1))
    command = child_command(spec_path)
    result = run_isolated(command, Path(spec["result"]), timeout_s, child_env(job_dir))
    result.setdefault("engine", spec["engine"])
    result.setdefault("kind", spec["kind"])
    result.setdefault("mode", spec.get("mode", "suite"))
    if result["status"] != "ok" and "reason" not in result:
        result["reason"] = result["status"]
    return result


def accuracy(task: str, output, reference, target_std: float | None = None) -> dict:
    """An engine's outputs against tabicl fp32's on the same table."""
    import numpy as np

    output, reference = np.asarray(output), np.asarray(reference)
    if output.shape != reference.shape:
        return {"error": f"shape {list(output.shape)} vs the reference's {list(reference.shape)}"}
    if task == "reg":
        worst = float(np.max(np.abs(output - reference))) if output.size else 0.0
        scale = target_std if target_std and target_std > 0 else 1.0
        return {
            "max_abs_mean_diff": worst,
            "target_std": target_std,
            "max_mean_diff_over_std": worst / scale,
        }
    return {
        "max_abs_prob_diff": float(np.max(np.abs(output - reference))) if output.size else 0.0,
        "argmax_agreement": float(np.mean(output.argmax(axis=1) == reference.argmax(axis=1))),
    }


def _median(result: dict, phase: str) -> float | None:
    if result.get("status") != "ok":
        return None
    if phase == "warm":
        return (result.get("warm") or {}).get("median_ms")
    return (result.get("cold") or {}).get("cold_ms")


def geometric_mean(values) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def add_accuracy_and_speedups(results: list, kinds: list) -> None:
    """Per result: ``accuracy`` against tabicl fp32 of its kind, ``speedup`` against the tabicl
    engines (their time over this one's), warm and cold."""
    import numpy as np

    by = {(r["kind"], r["engine"]): r for r in results}
    tasks = {k.name: k.task for k in kinds}
    for r in results:
        ref = by.get((r["kind"], TABICL_FP32))
        if r["engine"] == TABICL_FP32:
            r["accuracy"] = {"reference": True} if r["status"] == "ok" else None
        elif r["status"] == "ok" and ref is not None and ref.get("status") == "ok":
            try:
                r["accuracy"] = accuracy(
                    tasks[r["kind"]],
                    np.load(r["outputs"]),
                    np.load(ref["outputs"]),
                    ref.get("target_std"),
                )
            except (OSError, ValueError) as error:
                r["accuracy"] = {"error": f"{type(error).__name__}: {error}"}
        else:
            r["accuracy"] = None
        r["speedup"] = {}
        for phase in ("warm", "cold"):
            mine = _median(r, phase)
            for base in BASELINES:
                theirs = _median(by.get((r["kind"], base), {}), phase)
                value = theirs / mine if mine and theirs else None
                r["speedup"].setdefault(phase, {})[base] = value


def summarize(results: list, engines: list) -> dict:
    """Per engine: the geometric mean across kinds of each speed-up, and over how many kinds."""
    summary = {}
    for engine in engines:
        mine = [r for r in results if r["engine"] == engine]
        entry = {}
        for phase in ("warm", "cold"):
            for base in BASELINES:
                values = [r.get("speedup", {}).get(phase, {}).get(base) for r in mine]
                values = [v for v in values if v]
                entry[f"{phase}_vs_{base}"] = geometric_mean(values)
                entry[f"{phase}_vs_{base}_kinds"] = len(values)
        summary[engine] = entry
    return summary


def add_predict_many_speedups(rows: list) -> None:
    by = {r["engine"]: r for r in rows}

    def median(r, n):
        # A size measured before a job failed or timed out at a later size keeps its figure
        # (the child saves each size as it finishes); a size that failed has none.
        return ((r or {}).get("sizes", {}).get(n) or {}).get("median_ms")

    for r in rows:
        r["speedup"] = {}
        for n in (r.get("sizes") or {}):
            mine = median(r, n)
            r["speedup"][n] = {
                base: (median(by.get(base), n) / mine if mine and median(by.get(base), n) else None)
                for base in BASELINES
            }


PREDICT_MANY_TITLE = (
    f"Fit once (kv_cache=True), predict many ({PREDICT_MANY_KIND}; warm median per size)"
)


def predict_many_table(document: dict) -> tuple[list, list]:
    """(columns, rows) of the record's fit-once, predict-many results."""
    sizes = [str(n) for n in document["settings"]["predict_sizes"]]
    columns = ["engine", "status", ">fit ms"] + [f">{n} rows ms" for n in sizes]
    columns += [f">x tabicl @{n}" for n in sizes]
    rows = []
    for r in document.get("predict_many") or []:
        figures = r.get("sizes") or {}
        engine = r["engine"]
        if r.get("served_preset") and not engine.endswith(r["served_preset"]):
            engine = f"{engine} ({r['served_preset']})"
        rows.append(
            [engine, "ok" if r["status"] == "ok" else r["status"].upper(), _ms(r.get("fit_ms"))]
            + [_ms((figures.get(n) or {}).get("median_ms")) for n in sizes]
            + [_x((r.get("speedup") or {}).get(n, {}).get(TABICL)) for n in sizes]
        )
    return columns, rows


# ---------------------------------------------------------------------------------------------
# Text report


def _ms(value) -> str:
    from .timing import format_ms

    return format_ms(value)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _accuracy_text(acc: dict | None) -> str:
    if not acc:
        return "-"
    if acc.get("reference"):
        return "reference"
    if "error" in acc:
        return f"n/a ({acc['error'][:40]})"
    if "max_abs_prob_diff" in acc:
        return f"dp {acc['max_abs_prob_diff']:.1e} agree {acc['argmax_agreement']:.1%}"
    return f"err/std {acc['max_mean_diff_over_std']:.1e}"


def _mib(memory: dict | None) -> str:
    if not memory:
        return "-"
    return f"{memory['peak_allocated_bytes'] / 2**20:.0f}"


SUITE_COLUMNS = (
    "kind", "engine", "status", ">cold s", ">restart s", ">steady s", ">first ms", ">warm ms",
    ">p20-p80", ">fit ms",
    ">predict ms", ">model %", ">x tabicl", ">x fp32", "accuracy vs tabicl-fp32", ">peak MiB",
)  # fmt: skip


SUITE_LEGEND = (
    "Fit + predict (cold s: a fresh process's first fit + predict from its spawn, imports "
    "included; restart s: the same in a second process over the first one's compile caches; "
    "steady s: from the spawn until the background compiles finished; first ms: the first fit "
    "+ predict alone; warm: median over fresh clones after that; model %: the model's share of "
    "one warm predict; x: tabicl's warm time over this one's)"
)


def suite_rows(results: list) -> list:
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        cold, warm = r.get("cold") or {}, r.get("warm") or {}
        stages = r.get("stages") or {}
        share = stages.get("model_share")
        spread = f"{_ms(warm['p20_ms'])}-{_ms(warm['p80_ms'])}" if "p20_ms" in warm else "-"
        cold_s = cold.get("cold_ms")
        restart_s = (r.get("restarted") or {}).get("cold_ms")
        steady_s = cold.get("steady_ms")
        speed = (r.get("speedup") or {}).get("warm", {})
        engine = r["engine"]
        if r.get("served_preset") and not engine.endswith(r["served_preset"]):
            engine = f"{engine} ({r['served_preset']})"
        rows.append(
            [
                r["kind"],
                engine,
                "ok" if ok else r["status"].upper(),
                "-" if cold_s is None else f"{cold_s / 1e3:.1f}",
                "-" if restart_s is None else f"{restart_s / 1e3:.1f}",
                "-" if steady_s is None else f"{steady_s / 1e3:.1f}",
                _ms(cold.get("first_call_ms")),
                _ms(warm.get("median_ms")),
                spread,
                _ms(warm.get("fit_ms")),
                _ms(warm.get("predict_ms")),
                "-" if share is None else f"{share:.0%}",
                _x(speed.get(TABICL)),
                _x(speed.get(TABICL_FP32)),
                _accuracy_text(r.get("accuracy")),
                _mib(warm.get("memory") or cold.get("memory")),
            ]
        )
    return rows


def render(document: dict) -> str:
    from .report import format_table

    settings, env = document["settings"], document["environment"]
    parts = [
        (
            f"Estimator suite on {env.get('gpu') or env.get('cpu')} ({settings['device']}"
            f"{', quick' if settings['quick'] else ''}), torch {env['torch']}, tabicl "
            f"{env['tabicl']}, tabserve {env['tabserve']}; n_estimators={N_ESTIMATORS}, "
            f"{settings['repeats']} warm repeat{'' if settings['repeats'] == 1 else 's'}"
        ),
        f"checkpoints: {settings['checkpoint_note']}",
        "",
        SUITE_LEGEND,
        format_table(SUITE_COLUMNS, suite_rows(document["results"])),
    ]
    many = document.get("predict_many") or []
    if many:
        parts += ["", PREDICT_MANY_TITLE, format_table(*predict_many_table(document))]
    summary = document.get("summary") or {}
    if summary:
        columns = (
            "engine", ">warm x tabicl", ">warm x fp32", ">cold x tabicl", ">cold x fp32", ">kinds",
        )  # fmt: skip
        rows = [
            [
                engine,
                _x(s["warm_vs_tabicl"]),
                _x(s["warm_vs_tabicl-fp32"]),
                _x(s["cold_vs_tabicl"]),
                _x(s["cold_vs_tabicl-fp32"]),
                s["warm_vs_tabicl_kinds"],
            ]
            for engine, s in summary.items()
        ]
        parts += ["", "Speed-ups, geometric mean across kinds", format_table(columns, rows)]
    failed = [r for r in document["results"] + many if r["status"] != "ok"]
    if failed:
        parts += ["", "Errors (recorded as results, not fatal):"]
        parts += [
            f"  {r['kind']} / {r['engine']}"
            f"{' (predict many)' if r.get('mode') == 'predict_many' else ''}: "
            f"{r['status']}: {r.get('reason', '')}"
            for r in failed
        ]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m tabserve.bench.estimator_suite", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tables with ~1/10 of the rows (and fewer features on the wide kinds); "
        "the default without a GPU",
    )
    p.add_argument("--full", action="store_true", help="full-size tables even on the CPU")
    p.add_argument(
        "--kinds", nargs="+", metavar="KIND", choices=[k.name for k in KINDS],
        help="table kinds (default: all)",
    )
    p.add_argument(
        "--recipes", nargs="+", metavar="RECIPE", default=list(DEFAULT_RECIPES),
        help="tabserve recipes, one engine each (default: exact auto)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("tabserve-results"))
    p.add_argument("--checkpoint", type=Path, help="classifier checkpoint")
    p.add_argument("--regressor-checkpoint", type=Path, help="regressor checkpoint")
    p.add_argument(
        "--model-size", choices=("full", "tiny"), default="full",
        help="size of the random-weight checkpoints made without --checkpoint",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, help="warm repeats (default 5; --quick: 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per (engine, kind) job")
    p.add_argument("--seed", type=int, default=0, help="table seed")
    p.add_argument(
        "--no-predict-many", action="store_true", help="leave out fit once, predict many"
    )
    p.add_argument(
        "--restart", action="store_true",
        help="run each tabserve job a second time over the first one's on-disk compile caches",
    )  # fmt: skip
    p.add_argument("--compile-timeout", type=float, help="seconds a job waits for compiles")
    p.add_argument("--work-dir", type=Path, help="keep job folders here (default: temporary)")
    p.add_argument(
        "--merge", nargs="+", type=Path, metavar="JSON",
        help="write one record from several runs' records (later files win) instead of running",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def _checkpoints(args, tasks, run_dir: Path) -> tuple:
    from .workloads import CHECKPOINT_SEED, make_checkpoint

    given = {"clf": args.checkpoint, "reg": args.regressor_checkpoint}
    paths, notes = {}, []
    for task in sorted(tasks):
        if given[task] is not None:
            paths[task] = Path(given[task])
            notes.append(f"{task}: {given[task]}")
        else:
            paths[task] = make_checkpoint(task, run_dir / f"random-{task}.ckpt", args.model_size)
            notes.append(
                f"{task}: RANDOM weights ({args.model_size} v2 architecture, "
                f"seed {CHECKPOINT_SEED}; "
                "timings are real, accuracy is agreement only)"
            )
    return paths, "; ".join(notes)


def _load_record(path: Path) -> dict:
    try:
        document = json.loads(Path(path).read_text())
    except ValueError:
        document = None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an estimator-suite record (schema {SCHEMA!r})")
    return document


#: What the records of one ``--merge`` must share: (what, how to read it from a record).
MERGE_MUST_AGREE = (
    ("device", lambda d: d["settings"]["device"]),
    ("quick mode", lambda d: d["settings"]["quick"]),
    ("torch version", lambda d: d["environment"]["torch"]),
)


def merge(paths: list) -> dict:
    """One record from the records of several runs (``--merge``).

    ``results``: the union, a later file's (kind, engine) replacing an earlier one's, ordered
    like :data:`KINDS`; ``kinds`` likewise; ``predict_many`` (and its ``predict_sizes``) from the
    last file that has it; ``command`` the runs' commands joined by ``" ; then "``, and their commits likewise
    (each once); ``settings`` (engines and recipes: the union) and ``environment`` from the
    first file; ``summary``
    recomputed. Each result keeps its accuracy and speed-ups, measured against its own run's
    tabicl rows of the same kind (every run has them: :func:`engine_names`).

    Raises ValueError naming the file that is not an estimator-suite record or whose device,
    quick mode or torch version differs from the first file's.
    """
    documents = [_load_record(path) for path in paths]
    first = documents[0]
    for path, document in zip(paths[1:], documents[1:]):
        for what, read in MERGE_MUST_AGREE:
            if read(document) != read(first):
                raise ValueError(
                    f"{path}: {what} {read(document)!r} differs from {paths[0]}'s {read(first)!r}"
                )
    rank = {k.name: i for i, k in enumerate(KINDS)}.get
    results = {(r["kind"], r["engine"]): r for d in documents for r in d["results"]}
    kinds = {k["name"]: k for d in documents for k in d["kinds"]}
    engines = list(dict.fromkeys(e for d in documents for e in d["settings"]["engines"]))
    recipes = list(dict.fromkeys(r for d in documents for r in d["settings"]["recipes"]))
    many = next((d for d in reversed(documents) if d.get("predict_many")), None)
    commits = dict.fromkeys(
        c.strip()
        for d in documents
        for c in str(d["environment"].get("git_commit") or "-").split(" ; then ")
    )
    merged = sorted(results.values(), key=lambda r: rank(r["kind"], len(KINDS)))
    predict_many = many["predict_many"] if many else []
    add_predict_many_speedups(predict_many)  # by this version's rules, like the summary
    settings = dict(
        first["settings"],
        engines=engines,
        recipes=recipes,
        predict_sizes=many["settings"]["predict_sizes"] if many else [],
        merged_from=[str(path) for path in paths],
    )
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": dict(first["environment"], git_commit=" ; then ".join(commits)),
        "settings": settings,
        "command": " ; then ".join(d["command"] for d in documents),
        "kinds": sorted(kinds.values(), key=lambda k: rank(k["name"], len(KINDS))),
        "results": merged,
        "predict_many": predict_many,
        "summary": summarize(merged, engines),
    }


def _publish(document: dict, out: Path, say) -> int:
    """Writes ``estimator_suite_<device>[-quick].json`` and its table (``.txt``) to ``out``."""
    from . import report

    settings = document["settings"]
    stem = f"estimator_suite_{settings['device']}{'-quick' if settings['quick'] else ''}"
    text = render(document)
    path = report.write_json(out / f"{stem}.json", document)
    (out / f"{stem}.txt").write_text(text + "\n")
    say("")
    say(text)
    say(f"\nwritten: {path} and {path.with_suffix('.txt')}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    if args.merge:
        try:
            document = merge(args.merge)
        except ValueError as error:
            raise SystemExit(f"estimator_suite --merge: {error}") from None
        return _publish(document, args.out, say)
    import torch

    from . import report

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or (device == "cpu" and not args.full)
    kinds = [kind_by_name(n) for n in (args.kinds or [k.name for k in KINDS])]
    engines = engine_names(args.recipes)
    repeats = args.repeats if args.repeats is not None else (3 if quick else 5)
    sizes = list(PREDICT_SIZES["quick" if quick else "full"])
    predict_many = PREDICT_MANY_KIND in [k.name for k in kinds] and not args.no_predict_many
    run_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tabserve-estimator-suite-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints, note = _checkpoints(args, {k.task for k in kinds}, run_dir)
    settings = {
        "device": device,
        "quick": quick,
        "repeats": repeats,
        "timeout_s": args.timeout,
        "seed": args.seed,
        "n_estimators": N_ESTIMATORS,
        "recipes": list(args.recipes),
        "engines": engines,
        "model_size": args.model_size,
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
        "checkpoint_note": note,
        "predict_sizes": sizes if predict_many else [],
        "work_dir": str(run_dir),
    }
    say(f"[estimator-suite] {device}{' (quick)' if quick else ''}; checkpoints: {note}")
    base = {
        "device": device,
        "quick": quick,
        "seed": args.seed,
        "repeats": repeats,
        "compile_timeout_s": args.compile_timeout,
    }
    results = []
    for kind in kinds:
        for engine in engines:
            spec = dict(base, engine=engine, kind=kind.name, checkpoint=str(checkpoints[kind.task]))
            job_dir = run_dir / "jobs" / f"{kind.name}__{engine}"
            result = run_job(spec, job_dir, args.timeout)
            if args.restart and engine not in BASELINES and result["status"] == "ok":
                # the same job again in a fresh process, over the first one's compile caches
                again = run_job(dict(spec, restart=True), job_dir, args.timeout, "restarted")
                result["restarted"] = again.get("cold") or {"error": again.get("reason")}
            results.append(result)
            say(f"  {kind.name} / {engine}: {result['status']} ({result.get('wall_s', 0):.1f} s)")
    many = []
    if predict_many:
        for engine in engines:
            spec = dict(
                base,
                mode="predict_many",
                engine=engine,
                kind=PREDICT_MANY_KIND,
                checkpoint=str(checkpoints["clf"]),
                sizes=sizes,
            )
            result = run_job(spec, run_dir / "jobs" / f"predict-many__{engine}", args.timeout)
            many.append(result)
            say(f"  predict many / {engine}: {result['status']} ({result.get('wall_s', 0):.1f} s)")
    add_accuracy_and_speedups(results, kinds)
    add_predict_many_speedups(many)
    document = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": report.environment(("pandas",)),
        "settings": settings,
        "command": " ".join(["python -m tabserve.bench.estimator_suite", *argv]),
        "kinds": [k.as_dict(quick) for k in kinds],
        "results": results,
        "predict_many": many,
        "summary": summarize(results, engines),
    }
    return _publish(document, args.out, say)


if __name__ == "__main__":
    sys.exit(main())
