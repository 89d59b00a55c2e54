"""The estimator suite's child process: one (engine, kind) job in a fresh interpreter,
``python -m tabserve.bench.estimator_child SPEC.json``.

The parent (:mod:`.estimator_suite`) writes the spec through :func:`.runner.run_child`: the
engine and kind, ``mode`` (``"suite"``: cold, steady, warm and the model's share; or
``"predict_many"``: one fitted ``kv_cache=True`` estimator predicting each of ``sizes`` rows),
device, quick, seed, repeats, checkpoint, ``compile_timeout_s``, ``restart`` (only the cold
figures, over an earlier process's compile caches), the ``result`` and ``outputs`` paths and
``spawned_at``. The result JSON is rewritten after every stage, so a crash or a timeout keeps what
was measured before it; an error is the job's result (``failed`` or ``oom``, with its stage and
traceback), never an exception out of the process.

What a job's process imports: this module loads the tabserve package's base (torch and the
operator library that registers ``torch.ops.tabserve.*``) and the suite's kinds, engines and
timing modules, about 0.09 s over torch's own import on a 2-core Xeon CPU, inside every engine's
cold figures; never tabserve's model code (``tabserve.models``). A tabicl engine's process
therefore runs tabicl's estimators with none of tabserve's network, serving or preprocessing
loaded; only a tabserve engine imports ``tabserve.models``, in :func:`setup` (timed as its
``import_ms``) and for its served preset and background compiles. test_bench_estimators.py
checks both in a child process.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import timing
from .estimator_engines import estimator_spec
from .estimator_kinds import Kind, kind_by_name, make_table


class Job:
    """The spec and the incrementally written result of one child job."""

    def __init__(self, spec: dict, entered: float):
        self.spec = spec
        self.path = Path(spec["result"])
        self.result: dict = {**self.labels(spec), "status": "running", "pid": os.getpid()}
        self.spawned = spec.get("spawned_at")
        if self.spawned is not None:
            self.result["spawn_to_start_ms"] = (entered - self.spawned) * 1e3
        self.save()

    @staticmethod
    def labels(spec: dict) -> dict:
        """What names the job in its result (a suite's parent reads its results by these)."""
        return {"engine": spec["engine"], "kind": spec["kind"], "mode": spec.get("mode", "suite")}

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

    def finish(self) -> None:
        self.result["status"] = "ok"
        self.save()


@dataclass
class Engine:
    """A job's configured estimator (``proto``, cloned per fit) on its table."""

    kind: Kind
    table: dict
    proto: object
    clone: Callable  # sklearn.base.clone, imported with the engine
    device: torch.device
    family: str  # "tabicl" or "tabserve"

    def fresh(self):
        return self.clone(self.proto)

    def predict(self, estimator, X):
        """Probabilities (classification) or predictions (regression), float64."""
        out = estimator.predict(X) if self.kind.task == "reg" else estimator.predict_proba(X)
        return np.asarray(out, dtype=np.float64)

    def time_once(self, fn) -> tuple[float, object]:
        return timing.time_once(fn, self.device)


class TimedModel:
    """A served model whose calls are timed (synchronised): the model's share of a predict."""

    METHODS = ("forward_with_cache", "predict_stats", "predict_stats_with_cache", "build_cache")

    def __init__(self, inner, device: torch.device):
        self._inner, self._device = inner, device
        self.ms, self.calls = 0.0, 0

    def _timed(self, fn, *args, **kwargs):
        ms, out = timing.time_once(lambda: fn(*args, **kwargs), self._device)
        self.ms += ms
        self.calls += 1
        return out

    def __call__(self, *args, **kwargs):
        return self._timed(self._inner, *args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name in self.METHODS and callable(attr):
            return functools.partial(self._timed, attr)
        return attr


def main(argv=None) -> int:
    """Runs the job of the spec file ``argv[0]``; 0 unless the process itself breaks."""
    entered = time.time()
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    job = Job(spec, entered)
    try:
        if spec.get("mode") == "predict_many":
            predict_many_job(job)
        else:
            suite_job(job)
    except Exception as error:  # noqa: BLE001  (anything unforeseen is the job's result)
        job.fail("job", error)
    return 0


def setup(job: Job, kv_cache: bool, n_test: int | None = None) -> Engine:
    """Builds the table (timed apart: ``data_ms``), imports the engine's package and scikit-learn
    (``import_ms``) and configures the estimator of the job's engine."""
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
    from sklearn.base import clone

    job.result["import_ms"] = (time.perf_counter() - start) * 1e3
    job.result["estimator"] = est_spec
    torch.manual_seed(spec["seed"])
    proto = getattr(library, est_spec["class"])(**est_spec["params"])
    job.save()
    device = torch.device(spec["device"])
    return Engine(kind, table, proto, clone, device, est_spec["family"])


def served_preset(estimator) -> str | None:
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


def wait_for_compiles(job: Job) -> bool:
    """Waits for the compiles a tabserve estimator started in the background; True when they
    finished within the spec's ``compile_timeout_s``."""
    from tabserve.models.tabicl.serving.background import wait_for_compiles as wait

    return wait(timeout=job.spec.get("compile_timeout_s"))


# ---------------------------------------------------------------------------------------------
# mode "suite": cold, steady, warm, the model's share


def suite_job(job: Job) -> None:
    try:
        engine = setup(job, kv_cache=False)
    except Exception as error:  # noqa: BLE001
        job.fail("setup", error)
        return
    if engine.kind.task == "reg":
        y_train = np.asarray(engine.table["y_train"], dtype=np.float64)
        job.result["target_std"] = float(np.std(y_train))
    cold = cold_call(job, engine)
    if cold is None:
        return
    estimator, first = cold
    if engine.family == "tabserve":
        steady(job, engine, estimator)
    if job.spec.get("restart"):  # the restarted process: its cold figures are all it adds
        job.finish()
        return
    np.save(job.spec["outputs"], first)
    job.result["outputs"] = job.spec["outputs"]
    job.result["output_shape"] = list(first.shape)
    job.save()
    if not warm_calls(job, engine, first):
        return
    if engine.family == "tabserve":
        job.result["stages"] = model_share(engine)
    job.finish()


def cold_call(job: Job, engine: Engine) -> tuple | None:
    """The process's first fit + predict (``result["cold"]``): (the estimator, its output), or
    None when it failed (the job's result then says so)."""
    X_train, y_train, X_test = (engine.table[k] for k in ("X_train", "y_train", "X_test"))
    timing.reset_peak_memory(engine.device)
    stage = "fit"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            estimator = engine.fresh()
            fit_ms, _ = engine.time_once(lambda: estimator.fit(X_train, y_train))
            stage = "predict"
            predict_ms, first = engine.time_once(lambda: engine.predict(estimator, X_test))
    except Exception as error:  # noqa: BLE001  (an input kind an engine rejects is a result)
        job.fail(f"cold {stage}", error)
        return None
    done = time.time()
    cold = {"fit_ms": fit_ms, "predict_ms": predict_ms, "first_call_ms": fit_ms + predict_ms}
    if job.spawned is not None:
        cold["ready_ms"] = (done - job.spawned) * 1e3  # from spawn, table building included
        cold["cold_ms"] = cold["ready_ms"] - job.result["data_ms"]
    cold["memory"] = timing.peak_memory(engine.device)
    messages = {f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught}
    cold["warnings"] = sorted(messages)[:8]
    job.result["cold"] = cold
    return estimator, first


def steady(job: Job, engine: Engine, estimator) -> None:
    """A compiled preset compiles a call in the background once the call recurs, while the
    ready one answers: for such a preset a second fit + predict (untimed), then the steady state
    starts once the compiles have finished (``cold["steady_ms"]``, from the spawn)."""
    from tabserve.models.tabicl.serving.background import CompilingTabICL

    job.result["served_preset"] = served_preset(estimator)
    cold = job.result["cold"]
    start = time.perf_counter()
    if isinstance(getattr(estimator, "model_", None), CompilingTabICL):
        X_train, y_train, X_test = (engine.table[k] for k in ("X_train", "y_train", "X_test"))
        engine.predict(engine.fresh().fit(X_train, y_train), X_test)
    finished = wait_for_compiles(job)
    cold["compile_wait_ms"] = (time.perf_counter() - start) * 1e3
    cold["compiled"] = finished
    if job.spawned is not None:
        cold["steady_ms"] = (time.time() - job.spawned) * 1e3 - job.result["data_ms"]


def warm_calls(job: Job, engine: Engine, first) -> bool:
    """``repeats`` fits + predicts, each with a fresh estimator (a clone of the configured one),
    after the first (``result["warm"]``); False when one failed."""
    X_train, y_train, X_test = (engine.table[k] for k in ("X_train", "y_train", "X_test"))
    fits, predicts, totals = [], [], []
    timing.reset_peak_memory(engine.device)
    try:
        for _ in range(max(int(job.spec["repeats"]), 1)):
            estimator = engine.fresh()
            fit_ms, _ = engine.time_once(lambda e=estimator: e.fit(X_train, y_train))
            predict_ms, out = engine.time_once(lambda e=estimator: engine.predict(e, X_test))
            fits.append(fit_ms)
            predicts.append(predict_ms)
            totals.append(fit_ms + predict_ms)
    except Exception as error:  # noqa: BLE001
        job.result["warm"] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        job.fail("warm", error)
        return False
    warm = timing.Timing(totals).as_dict()
    warm.update(
        fit_ms=timing.Timing(fits).median_ms,
        predict_ms=timing.Timing(predicts).median_ms,
        fit_samples_ms=fits,
        predict_samples_ms=predicts,
        memory=timing.peak_memory(engine.device),
        # clone + the same random_state: the same answer as the cold call
        max_abs_diff_to_cold=(
            float(np.max(np.abs(out - first))) if out.shape == first.shape else None
        ),
    )
    job.result["warm"] = warm
    job.save()
    return True


def model_share(engine: Engine) -> dict:
    """One more warm predict of a tabserve estimator with its served model's calls timed: the
    model's share of the predict (an optional figure: an error is recorded, not fatal)."""
    X_train, y_train, X_test = (engine.table[k] for k in ("X_train", "y_train", "X_test"))
    try:
        estimator = engine.fresh().fit(X_train, y_train)
        timed = TimedModel(estimator.model_, engine.device)
        estimator.model_ = timed
        predict_ms, _ = engine.time_once(lambda: engine.predict(estimator, X_test))
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {
        "predict_ms": predict_ms,
        "model_ms": timed.ms,
        "model_calls": timed.calls,
        "host_ms": predict_ms - timed.ms,
        "model_share": timed.ms / predict_ms if predict_ms > 0 else None,
    }


# ---------------------------------------------------------------------------------------------
# mode "predict_many": fit once with kv_cache=True, predict each size


def predict_many_job(job: Job) -> None:
    sizes = [int(n) for n in job.spec["sizes"]]
    try:
        engine = setup(job, kv_cache=True, n_test=max(sizes))
    except Exception as error:  # noqa: BLE001
        job.fail("setup", error)
        return
    timing.reset_peak_memory(engine.device)
    try:
        estimator = engine.fresh()
        table = engine.table
        fit_ms, _ = engine.time_once(lambda: estimator.fit(table["X_train"], table["y_train"]))
    except Exception as error:  # noqa: BLE001
        job.fail("fit (kv_cache=True)", error)
        return
    job.result["fit_ms"] = fit_ms
    job.result["fit_memory"] = timing.peak_memory(engine.device)
    if engine.family == "tabserve":
        job.result["served_preset"] = served_preset(estimator)
    job.result["sizes"] = {}
    failed = None
    for n in sizes:
        try:
            figures = predict_rows(job, engine, estimator, table["X_test"][:n])
        except Exception as error:  # noqa: BLE001
            figures = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            failed = failed or (n, error)
        job.result["sizes"][str(n)] = figures
        job.save()
    if failed is not None:
        job.fail(f"predict {failed[0]} rows", failed[1])
        return
    job.finish()


def predict_rows(job: Job, engine: Engine, estimator, X) -> dict:
    """The fitted estimator's first predict of ``X`` (``first_ms``), then its warm median over
    ``repeats`` predicts, in the steady state for tabserve."""
    timing.reset_peak_memory(engine.device)
    first_ms, _ = engine.time_once(lambda: engine.predict(estimator, X))
    if engine.family == "tabserve":
        # steady state: the cache's compiled half, then the prediction's own compile
        for _ in range(2):
            wait_for_compiles(job)
            engine.predict(estimator, X)
    repeats = max(int(job.spec["repeats"]), 1)
    figures = timing.time_calls(
        lambda: engine.predict(estimator, X),
        engine.device,
        warmup=0,
        min_repeats=repeats,
        max_repeats=repeats,
        budget_s=0,
    ).as_dict()
    figures.update(first_ms=first_ms, memory=timing.peak_memory(engine.device))
    return figures


if __name__ == "__main__":
    sys.exit(main())
