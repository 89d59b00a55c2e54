"""The many-tables suite's engines (as data) and its child process: one engine answering the
whole population in a fresh interpreter, ``python -m tabserve.bench.many_tables_child SPEC.json``.

The parent (:mod:`.many_tables_suite`) writes the spec through :func:`.runner.run_child`: the
engine, device, population (:class:`.many_tables_population.Population` as a dict) and seed, the
checkpoint of each task kind, ``compile_timeout_s``, the ``result`` and ``outputs``
paths and ``spawned_at``. The child builds the population (timed apart: ``data_ms``), imports its
engine's package (``import_ms``; a tabicl engine's process never imports ``tabserve.models``, as
in the estimator suite) and answers every task two or three times in the same process (the
passes), the classification tasks and then the regression tasks, each kind timed on its own:

* pass 1 is the process's first (``cold``: checkpoint loads, lazy set-up, first compiles);
  pass 2 the same work again (``warm``);
* a tabserve engine on CUDA then waits for the compiles its calls started in the background
  (:func:`tabserve.wait_for_compiles`, timed: ``compile_wait_ms``) and answers a third time
  (``compiled``): what a compile stall between passes costs shows as pass 2 against pass 3.

Each pass keeps its peak memory (:class:`.timing.PeakMemory`: the CUDA allocator's peak, or the
process's peak resident set on the CPU); the packed engine's passes keep their padding
(``packs``, member ``tables``, ``real_cells``, ``padded_cells``, ``largest_pack_cells`` of
:func:`tabserve.models.tabicl.sklearn.many.fit_predict_iter`). Pass 1's answers are saved to
``outputs`` (``.npz``, one array per task: probabilities or predictions, float64); later passes
are compared with it. A task an engine refuses is named in the pass (``task_errors``) and fails
the job after its passes; an error of the engine itself is the job's result, as in the
estimator suite's child.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import timing
from .estimator_child import Job
from .estimator_engines import N_ESTIMATORS, TABICL, TABICL_FP32
from .many_tables_population import Population, make_population, task_specs


@dataclass(frozen=True)
class ManyEngine:
    """One way of answering the population: ``family`` ``"tabicl"`` or ``"tabserve"``, a fresh
    estimator per task (a loop) or ``fit_predict_many`` (``packed``), with ``params`` over the
    defaults."""

    name: str
    family: str
    packed: bool
    params: dict = field(default_factory=dict)
    description: str = ""


TABSERVE_LOOP = "tabserve-loop"
TABSERVE_PACKED = "tabserve-packed"

ENGINES: tuple = (
    ManyEngine(TABICL, "tabicl", False, {}, "tabicl 2.2.0 with its defaults, one per task"),
    ManyEngine(
        TABICL_FP32,
        "tabicl",
        False,
        {"use_amp": False, "use_fa3": False},
        "tabicl 2.2.0 in fp32, one per task: the accuracy reference",
    ),
    ManyEngine(
        TABSERVE_LOOP, "tabserve", False, {}, "tabserve with its defaults, one estimator per task"
    ),
    ManyEngine(
        TABSERVE_PACKED,
        "tabserve",
        True,
        {},
        "tabserve with its defaults, fit_predict_many on all tasks of a kind",
    ),
)
#: What each task kind is answered with: (estimator class, method).
TASK_KINDS = {"clf": ("TabICLClassifier", "predict_proba"), "reg": ("TabICLRegressor", "predict")}
#: The pass names, in order.
PASSES = ("cold", "warm", "compiled")


def engine_by_name(name: str) -> ManyEngine:
    """The engine ``name``; raises KeyError listing the known ones."""
    for engine in ENGINES:
        if engine.name == name:
            return engine
    raise KeyError(f"unknown engine {name!r}; known: {', '.join(e.name for e in ENGINES)}")


def estimator_params(engine: ManyEngine, checkpoint, device: str) -> dict:
    """The constructor arguments of ``engine``'s estimators: ``N_ESTIMATORS`` members, the
    checkpoint, the device (and no download for tabicl), the engine's own ``params``."""
    params = {"n_estimators": N_ESTIMATORS, "model_path": str(checkpoint), "device": device}
    if engine.family == "tabicl":
        params["allow_auto_download"] = False
    return {**params, **engine.params}


class ManyJob(Job):
    """A job of the many-tables suite: named by its engine."""

    @staticmethod
    def labels(spec: dict) -> dict:
        return {"engine": spec["engine"]}


@dataclass
class Answerer:
    """An engine's configured estimator of each task kind (``protos``, cloned per task by the
    loops) and how it answers a kind's tasks."""

    engine: ManyEngine
    protos: dict
    clone: object  # sklearn.base.clone, imported with the engine
    fit_predict_iter: object | None  # tabserve's many.fit_predict_iter, packed engine only

    def answer(self, kind: str, tasks: list, padding: dict) -> list:
        """Each task's answer (a float64 array, or the exception that refused it)."""
        proto, method = self.protos[kind], TASK_KINDS[kind][1]
        if self.engine.packed:
            answers = self.fit_predict_iter(proto, tasks, method, "return", {}, padding)
            return [a if isinstance(a, Exception) else np.asarray(a, np.float64) for a in answers]
        answers = []
        for X_train, y_train, X_test in tasks:
            try:
                estimator = self.clone(proto).fit(X_train, y_train)
                answers.append(np.asarray(getattr(estimator, method)(X_test), np.float64))
            except Exception as error:  # noqa: BLE001  (a refused task is named, not fatal)
                answers.append(error)
        return answers


def main(argv=None) -> int:
    """Runs the job of the spec file ``argv[0]``; 0 unless the process itself breaks."""
    entered = time.time()
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    job = ManyJob(spec, entered)
    try:
        run(job)
    except Exception as error:  # noqa: BLE001  (anything unforeseen is the job's result)
        job.fail("job", error)
    return 0


def setup(job: Job) -> tuple:
    """(the tasks, their indices by kind, the engine's :class:`Answerer`): the population built
    (``data_ms``) and the engine's package imported (``import_ms``)."""
    spec = job.spec
    start = time.perf_counter()
    specs = task_specs(Population(**spec["population"]), spec["seed"])
    tasks = make_population(specs)
    job.result["data_ms"] = (time.perf_counter() - start) * 1e3
    by_kind = {kind: [s.index for s in specs if s.task == kind] for kind in TASK_KINDS}
    job.result["target_std"] = {
        str(s.index): float(np.std(np.asarray(tasks[s.index][1], np.float64)))
        for s in specs
        if s.task == "reg"
    }
    engine = engine_by_name(spec["engine"])
    start = time.perf_counter()
    if engine.family == "tabicl":
        import tabicl as library
    else:
        import tabserve.models.tabicl as library
    from sklearn.base import clone

    iterate = None
    if engine.packed:
        from tabserve.models.tabicl.sklearn.many import fit_predict_iter as iterate
    job.result["import_ms"] = (time.perf_counter() - start) * 1e3
    protos, params = {}, {}
    for kind, indices in by_kind.items():
        if indices:
            params[kind] = estimator_params(engine, spec["checkpoints"][kind], spec["device"])
            protos[kind] = getattr(library, TASK_KINDS[kind][0])(**params[kind])
    job.result["estimator"] = {"family": engine.family, "packed": engine.packed, "params": params}
    job.save()
    return tasks, by_kind, Answerer(engine, protos, clone, iterate)


def pass_names(engine: ManyEngine, device: torch.device) -> list:
    """The passes a job times: cold, warm and, for tabserve on CUDA, compiled."""
    compiles = engine.family == "tabserve" and device.type == "cuda"
    return list(PASSES if compiles else PASSES[:2])


def run(job: Job) -> None:
    try:
        tasks, by_kind, answerer = setup(job)
    except Exception as error:  # noqa: BLE001
        job.fail("setup", error)
        return
    device = torch.device(job.spec["device"])
    job.result["passes"] = []
    first = None
    for number, name in enumerate(pass_names(answerer.engine, device), 1):
        if name == "compiled":
            job.result["compile_wait"] = wait_for_compiles(job)
        answers, figures = timed_pass(answerer, tasks, by_kind, device)
        figures.update(number=number, name=name)
        if name == "compiled":
            figures["packs"] = packs_tiers()
        if first is None:
            first = answers
            save_outputs(job, answers)
        else:
            figures["max_abs_diff_to_pass_1"] = _max_diff(answers, first)
        job.result["passes"].append(figures)
        job.save()
    errors = job.result["passes"][0]["task_errors"]
    if errors:
        job.result.update(
            status="failed",
            reason=f"{len(errors)} task(s) refused; task {errors[0][0]}: {errors[0][1]}",
        )
        job.save()
        return
    job.finish()


def packs_tiers() -> list:
    """Where each cached compiling served model sent packed calls by now
    (:meth:`~tabserve.models.tabicl.serving.background.CompilingTabICL.packs_tier`)."""
    from tabserve.models.tabicl.serving.background import CompilingTabICL
    from tabserve.models.tabicl.serving.model_cache import served_models

    return [m.packs_tier() for m in served_models() if isinstance(m, CompilingTabICL)]


def wait_for_compiles(job: Job) -> dict:
    """Waits for the compiles a tabserve engine started in the background: how long, and whether
    they finished within the spec's ``compile_timeout_s``."""
    import tabserve

    start = time.perf_counter()
    finished = tabserve.wait_for_compiles(timeout=job.spec.get("compile_timeout_s"))
    return {"ms": (time.perf_counter() - start) * 1e3, "finished": bool(finished)}


def timed_pass(answerer: Answerer, tasks: list, by_kind: dict, device: torch.device) -> tuple:
    """(every task's answer by index, the pass's figures): its time in all and per kind, tables
    per second, peak memory, refused tasks and, for the packed engine, its padding per kind."""
    answers: dict = {}
    kinds, padding = {}, {}
    with timing.peak_memory_of(device) as memory:
        start = time.perf_counter()
        for kind, indices in by_kind.items():
            if indices:
                padding[kind] = {}
                mine = [tasks[i] for i in indices]
                kinds[kind], out = time_kind(answerer, kind, mine, padding[kind], device)
                answers.update(zip(indices, out))
        total_ms = (time.perf_counter() - start) * 1e3
    figures = {
        "ms": total_ms,
        "tables": len(answers),
        "tables_per_s": len(answers) / total_ms * 1e3 if total_ms > 0 else None,
        "kinds": kinds,
        "memory": memory or None,
        "task_errors": [
            [i, f"{type(a).__name__}: {str(a)[:300]}"]
            for i, a in sorted(answers.items())
            if isinstance(a, Exception)
        ],
    }
    if answerer.engine.packed:
        figures["padding"] = padding
    return answers, figures


def time_kind(answerer: Answerer, kind: str, tasks: list, padding: dict, device) -> tuple:
    """(the time and rate of answering ``tasks`` of ``kind``, their answers)."""
    ms, out = timing.time_once(lambda: answerer.answer(kind, tasks, padding), device)
    return {"tables": len(tasks), "ms": ms, "tables_per_s": len(tasks) / ms * 1e3}, out


def save_outputs(job: Job, answers: dict) -> None:
    arrays = {f"t{i}": a for i, a in answers.items() if not isinstance(a, Exception)}
    np.savez(job.spec["outputs"], **arrays)
    job.result["outputs"] = job.spec["outputs"]


def _max_diff(answers: dict, first: dict) -> float | None:
    """The largest difference between two passes' answers (None when a task's shapes differ or
    it was refused in one of them)."""
    worst = 0.0
    for i, a in answers.items():
        b = first.get(i)
        if isinstance(a, Exception) or isinstance(b, Exception) or a.shape != b.shape:
            return None
        if a.size:
            worst = max(worst, float(np.max(np.abs(a - b))))
    return worst


if __name__ == "__main__":
    sys.exit(main())
