"""Many-tables benchmark suite: a population of small tables, answered one by one and at once.

A loop of fresh estimators and ``fit_predict_many`` answer the same tasks, timed.

``python -m tabserve.bench many-tables [--device cpu|cuda|auto] [--tables N] [--quick]
[--engines ...] [--model-size full|tiny] [--out DIR] [--seed S] [--checkpoint CLF
--regressor-checkpoint REG] [--timeout S] [--compile-timeout S] [--note TEXT]``

The population (:mod:`.many_tables_population`, seeded with ``numpy.random.RandomState(seed)``):
1,000 tasks with a GPU, train rows 32-2,048 and test rows 8-512 drawn log-uniformly, 3-60
features, 2-10 classes, 5% of the tasks with 11-20 classes, 20% regression, 25% pandas DataFrames
with string columns and missing values; on the CPU 40 tasks of at most 512 train and 128 test
rows; ``--quick`` 8 tasks of at most 128 train rows; ``--tables`` sets the count. Classification
tasks are answered by a ``TabICLClassifier`` (``predict_proba``), regression tasks by a
``TabICLRegressor`` (``predict``).

Engines (:data:`.many_tables_child.ENGINES`), every one in a fresh process
(:func:`.runner.run_child` running :mod:`.many_tables_child`, with its own empty compile caches
and a timeout), all with ``n_estimators=8`` and the same checkpoints (random-weight checkpoints
from :func:`.workloads.make_checkpoint` when none is given): ``tabicl`` 2.2.0 with its defaults in
a loop (a fresh estimator per task), ``tabicl-fp32`` (``use_amp=False, use_fa3=False``, the
accuracy reference), ``tabserve-loop`` (tabserve's estimators with their defaults, a fresh one per
task) and ``tabserve-packed`` (``fit_predict_many`` on each kind's tasks). On the CPU tabicl's
``use_amp="auto"`` is off, so its defaults are fp32: ``tabicl`` runs once there and is the
reference.

Measured per engine: each pass's wall time and tables per second, in all and per kind (pass 1
cold, pass 2 warm, for tabserve on CUDA pass 3 after the background compiles finished, with the
wait), its peak memory (CUDA allocator's peak, or the process's peak resident set on the CPU),
the packed engine's padding (packs, member tables, real and padded cells, the largest pack),
accuracy per task against the reference (classification: max |dp| and argmax agreement;
regression: max |mean difference| / std(train target); the worst task is named) and the speed-ups
(tables per second over ``tabicl``'s and ``tabserve-loop``'s, pass by pass; a pass a baseline did
not run compares with its last).

Output (``--out``): ``many_tables_<device>[-quick].json`` (environment, settings, command,
population, results, speed-ups) and the printed table (:mod:`.many_tables_report`) as ``.txt``.
An engine that fails (a refused task, bad checkpoint, out of memory, timeout) is a result with its
error, never the end of the suite.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from . import report
from .estimator_engines import N_ESTIMATORS, TABICL, TABICL_FP32
from .estimator_suite import accuracy
from .many_tables_child import ENGINES, PASSES, TABSERVE_LOOP, TABSERVE_PACKED
from .many_tables_population import describe, population_for, task_specs
from .many_tables_report import render
from .runner import child_env, run_child
from .workloads import add_checkpoint_arguments, checkpoints_for

SCHEMA = "tabserve.bench.many_tables/1"
#: The suite's command, as records name it.
COMMAND = "python -m tabserve.bench many-tables"
#: The child module of every job.
CHILD = "tabserve.bench.many_tables_child"
#: The engines speed-ups are quoted against.
BASELINES = (TABICL, TABSERVE_LOOP)
#: The population's seed unless ``--seed`` gives one.
DEFAULT_SEED = 77
#: The settings every engine's job gets in its spec.
JOB_SETTINGS = ("device", "population", "seed", "checkpoints", "compile_timeout_s")


def default_engines(device: str) -> list:
    """Every engine; on the CPU without ``tabicl-fp32`` (tabicl's defaults are fp32 there)."""
    return [e.name for e in ENGINES if not (device == "cpu" and e.name == TABICL_FP32)]


def reference_engine(device: str, engines: list) -> str | None:
    """The accuracy reference among ``engines``: ``tabicl-fp32``, or ``tabicl`` on the CPU."""
    if TABICL_FP32 in engines:
        return TABICL_FP32
    return TABICL if device == "cpu" and TABICL in engines else None


# ---------------------------------------------------------------------------------------------
# Jobs


def run_engine(spec: dict, run_dir: Path, timeout_s: float) -> dict:
    """One engine's job in a fresh process, in the job folder ``run_dir/jobs/<engine>``."""
    job_dir = Path(run_dir) / "jobs" / spec["engine"]
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, result=str(job_dir / "result.json"), outputs=str(job_dir / "outputs.npz"))
    result = run_child(CHILD, spec, job_dir / "spec.json", timeout_s, child_env(job_dir))
    result.setdefault("engine", spec["engine"])
    if result["status"] != "ok" and "reason" not in result:
        result["reason"] = result["status"]
    return result


# ---------------------------------------------------------------------------------------------
# Accuracy and speed-ups


def _load(result: dict) -> dict | None:
    path = result.get("outputs")
    if not path or not Path(path).exists():
        return None
    with np.load(path) as arrays:
        return {int(k[1:]): arrays[k] for k in arrays.files}


def task_accuracy(outputs: dict, reference: dict, tasks: dict, target_std: dict) -> dict:
    """An engine's answers against the reference's, task by task (``tasks``: index to kind),
    summarised per kind (:func:`_worst`); tasks either engine did not answer are left out."""
    found: dict = {}
    for index, task in sorted(tasks.items()):
        if index in outputs and index in reference:
            figures = accuracy(task, outputs[index], reference[index], target_std.get(str(index)))
            found.setdefault(task, []).append((index, figures, len(outputs[index])))
    return {task: _worst(task, rows) for task, rows in found.items()}


def _worst(task: str, found: list) -> dict:
    """The tasks compared, those whose shapes differ, the worst figure and its task and
    (classification) the lowest and the overall (per test row) argmax agreement."""
    ok = [(i, figures, rows) for i, figures, rows in found if "error" not in figures]
    summary = {"tasks": len(ok), "errors": len(found) - len(ok)}
    if not ok:
        return summary
    key = "max_mean_diff_over_std" if task == "reg" else "max_abs_prob_diff"
    index, worst, _ = max(ok, key=lambda f: f[1][key])
    summary.update({key: worst[key], "worst_task": index})
    if task == "clf":
        agree = [(figures["argmax_agreement"], rows) for _, figures, rows in ok]
        summary["min_argmax_agreement"] = min(a for a, _ in agree)
        summary["argmax_agreement"] = sum(a * n for a, n in agree) / max(
            sum(n for _, n in agree), 1
        )
    return summary


def add_accuracy(results: list, reference: str | None, tasks: dict) -> None:
    """Per result: ``accuracy`` against the reference engine's answers (None without one)."""
    by = {r["engine"]: r for r in results}
    ref = by.get(reference)
    ref_outputs = _load(ref) if ref is not None else None
    for r in results:
        if r["engine"] == reference:
            r["accuracy"] = {"reference": True} if ref_outputs is not None else None
            continue
        outputs = _load(r) if ref_outputs is not None else None
        r["accuracy"] = (
            None
            if outputs is None
            else task_accuracy(outputs, ref_outputs, tasks, ref.get("target_std") or {})
        )


def _rates(result: dict, number: int) -> dict | None:
    """Tables per second of pass ``number`` (or the engine's last pass before it), in all and
    per kind; None when the engine failed or ran no pass."""
    passes = result.get("passes") or []
    if result.get("status") != "ok" or not passes:
        return None
    figures = passes[min(number, len(passes)) - 1]
    rates = {"total": figures.get("tables_per_s")}
    rates.update({k: v.get("tables_per_s") for k, v in (figures.get("kinds") or {}).items()})
    return rates


def add_speedups(results: list) -> None:
    """Per result and pass: its tables per second over each baseline's (:data:`BASELINES`), in
    all and per kind."""
    by = {r["engine"]: r for r in results}
    for r in results:
        r["speedup"] = {}
        for figures in r.get("passes") or []:
            mine = _rates(r, figures["number"]) or {}
            entry = r["speedup"].setdefault(figures["name"], {})
            for base in BASELINES:
                theirs = _rates(by.get(base, {}), figures["number"]) or {}
                entry[base] = {
                    k: (v / theirs[k] if v and theirs.get(k) else None) for k, v in mine.items()
                }


def summarize(results: list) -> dict:
    """The packed engine's speed-ups over each baseline, pass by pass (in all and per kind)."""
    packed = next((r for r in results if r["engine"] == TABSERVE_PACKED), None)
    if packed is None:
        return {}
    return {
        base: {name: figures.get(base) for name, figures in packed.get("speedup", {}).items()}
        for base in BASELINES
    }


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--tables", type=int,
        help="tasks in the population (default 1,000 with a GPU, 40 on the CPU, 8 with --quick)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a handful of small tables (tests)")
    p.add_argument(
        "--engines", nargs="+", metavar="ENGINE", choices=[e.name for e in ENGINES],
        help="engines (default: all; on the CPU without tabicl-fp32, which tabicl is there)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("tabserve-results"))
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="population seed")
    add_checkpoint_arguments(p)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine job")
    p.add_argument("--compile-timeout", type=float, help="seconds a job waits for compiles")
    p.add_argument(
        "--note", help="a sentence the record keeps and shows (what else ran on the machine, say)"
    )
    p.add_argument("--work-dir", type=Path, help="keep job folders here (default: temporary)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.tables is not None and args.tables < 1:
        p.error("--tables must be at least 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def _settings(args, run_dir: Path, tasks: set) -> dict:
    """The run's settings, as the record keeps them (the checkpoints made here when not given)."""
    device = args.device
    engines = list(args.engines or default_engines(device))
    given = {"clf": args.checkpoint, "reg": args.regressor_checkpoint}
    checkpoints, note = checkpoints_for(tasks, given, run_dir, args.model_size, COMMAND)
    return {
        "device": device,
        "quick": args.quick,
        "seed": args.seed,
        "population": population_for(device, args.quick, args.tables).as_dict(),
        "n_estimators": N_ESTIMATORS,
        "engines": engines,
        "reference": reference_engine(device, engines),
        "passes": list(PASSES),
        "model_size": args.model_size,
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
        "checkpoint_note": note,
        "timeout_s": args.timeout,
        "compile_timeout_s": args.compile_timeout,
        "work_dir": str(run_dir) if args.work_dir else None,
        "note": args.note,
    }


def _measure(args, argv: list, say: Callable) -> dict:
    """Runs every engine's job; the record of the run."""
    specs = task_specs(population_for(args.device, args.quick, args.tables), args.seed)
    run_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tabserve-many-tables-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, argv, say, run_dir, specs)
    finally:
        if args.work_dir is None:  # checkpoints and answers: needed only until the record
            shutil.rmtree(run_dir, ignore_errors=True)


def _run(args, argv: list, say: Callable, run_dir: Path, specs: list) -> dict:
    tasks = {s.index: s.task for s in specs}
    settings = _settings(args, run_dir, set(tasks.values()))
    # the commit and versions the engines start from: the tree may change while they run
    environment = report.environment(("pandas",))
    say(
        f"[many-tables] {settings['device']}{' (quick)' if args.quick else ''}: {len(specs)} "
        f"tables ({settings['population']['name']} population); checkpoints: "
        f"{settings['checkpoint_note']}"
    )
    common = {key: settings[key] for key in JOB_SETTINGS}
    results = []
    for engine in settings["engines"]:
        results.append(run_engine(dict(common, engine=engine), run_dir, args.timeout))
        say(f"  {engine}: {results[-1]['status']} ({results[-1].get('wall_s', 0):.1f} s)")
    add_accuracy(results, settings["reference"], tasks)
    add_speedups(results)
    return {
        **report.record_head(SCHEMA, environment, settings, COMMAND, argv),
        "population": describe(specs),
        "results": results,
        "summary": summarize(results),
    }


def main(argv=None) -> int:
    """``python -m tabserve.bench many-tables [options]`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    document = _measure(args, argv, say)
    report.write_record(args.out, "many_tables", document, render(document), say)
    return 0
