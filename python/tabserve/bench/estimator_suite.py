"""Estimator-level benchmark suite: what users do with the estimators, timed.

``python -m tabserve.bench estimators [--device cpu|cuda|auto] [--quick] [--kinds ...]
[--recipes exact auto ...] [--out DIR] [--checkpoint CLF --regressor-checkpoint REG]
[--model-size full|tiny] [--repeats N] [--timeout S]``, or
``python -m tabserve.bench estimators --merge A.json B.json [...] [--out DIR]``

Where the raw-model cells (``python -m tabserve.bench``) time the model on device tensors, this
suite times the scikit-learn estimators on host tables (NumPy arrays and pandas DataFrames) of a
few *kinds* (:data:`.estimator_kinds.KINDS`: numeric, mixed numeric / string with missing values
and unseen categories, many rows, many features, many classes, regression, pandas ``category`` /
boolean / integer-named columns). Engines (:mod:`.estimator_engines`): ``tabicl`` 2.2.0 with its
defaults (its own ``use_amp="auto"``), ``tabicl`` in fp32 (``use_amp=False, use_fa3=False``) and
tabserve's estimators with each ``--recipes`` value, all with ``n_estimators=8`` and the same
checkpoint (random-weight checkpoints from :func:`.workloads.make_checkpoint` when none is given).

Every (engine, kind) pair runs in a fresh process (:func:`.runner.run_child` running
:mod:`.estimator_child`, with its own empty compile caches and a timeout); a tabicl engine's
process never imports tabserve's model code (:mod:`.estimator_child` says what it imports).
Measured per pair:

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
kinds, results, predict_many, speed-ups) and the printed table (:mod:`.estimator_report`) as
``.txt``. Speed-ups are the tabicl engines' warm (or cold) time over the engine's, per kind, and
their geometric mean across kinds. ``--merge`` writes one such record from the records of several
runs of the same device, mode and torch (each run a subset of ``--kinds``: :func:`merge`). A pair
that fails (bad input, bad checkpoint, out of memory, timeout) is a result with its error, never
the end of the suite.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import report
from .estimator_engines import BASELINES, DEFAULT_RECIPES, N_ESTIMATORS, TABICL_FP32, engine_names
from .estimator_kinds import KINDS, PREDICT_MANY_KIND, PREDICT_SIZES, Kind, kind_by_name
from .estimator_report import render
from .runner import child_env, run_child
from .timing import geometric_mean
from .workloads import add_checkpoint_arguments, checkpoints_for

SCHEMA = "tabserve.bench.estimator_suite/1"
#: The suite's command, as records name it.
COMMAND = "python -m tabserve.bench estimators"
#: The child module of every job.
CHILD = "tabserve.bench.estimator_child"


# ---------------------------------------------------------------------------------------------
# Jobs


def run_job(spec: dict, job_dir: Path, timeout_s: float, name: str = "result") -> dict:
    """One child job in a fresh process (:func:`.runner.run_child` with :func:`.runner.child_env`:
    the job folder's compile caches, empty at its first job). ``name``: the job's files."""
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, result=str(job_dir / f"{name}.json"), outputs=str(job_dir / f"{name}.npy"))
    result = run_child(CHILD, spec, job_dir / f"{name}-spec.json", timeout_s, child_env(job_dir))
    result.setdefault("engine", spec["engine"])
    result.setdefault("kind", spec["kind"])
    result.setdefault("mode", spec.get("mode", "suite"))
    if result["status"] != "ok" and "reason" not in result:
        result["reason"] = result["status"]
    return result


@dataclass
class Run:
    """What the jobs of a run share: the common part of their specs, the checkpoint of each task,
    the folder of the job folders, the time limit per job and where progress goes."""

    spec: dict
    checkpoints: dict
    run_dir: Path
    timeout_s: float
    say: Callable
    after_job: Callable = lambda: None  # noqa: E731  (called once each job's result is in)

    def job(self, folder: str, spec: dict, name: str = "result") -> dict:
        """The job of ``spec`` (over the run's common part) in the job folder ``folder``."""
        job_dir = self.run_dir / "jobs" / folder
        return run_job(dict(self.spec, **spec), job_dir, self.timeout_s, name)

    def done(self, what: str, result: dict) -> None:
        self.say(f"  {what}: {result['status']} ({result.get('wall_s', 0):.1f} s)")
        self.after_job()


def run_kinds(run: Run, kinds: Sequence[Kind], engines: list, restart: bool, results: list) -> list:
    """Every (kind, engine) job, appended to ``results`` as it finishes; with ``restart`` each
    tabserve job that succeeded once more, in a fresh process over the first one's compile
    caches."""
    for kind in kinds:
        for engine in engines:
            spec = {"engine": engine, "kind": kind.name, "checkpoint": run.checkpoints[kind.task]}
            folder = f"{kind.name}__{engine}"
            result = run.job(folder, spec)
            if restart and engine not in BASELINES and result["status"] == "ok":
                again = run.job(folder, dict(spec, restart=True), "restarted")
                result["restarted"] = again.get("cold") or {"error": again.get("reason")}
            results.append(result)
            run.done(f"{kind.name} / {engine}", result)
    return results


#: The floor of a fresh process's first answer: the interpreter starts, imports torch and makes
#: one tensor on the device (a CUDA context on a GPU); it prints when it has.
FLOOR_SCRIPT = (
    "import sys, time; import torch; torch.ones(1, device=sys.argv[1]).sum().item(); "
    "print(time.time())"
)


def measure_floor(device: str, runs: int = 3) -> dict:
    """The floor's time from spawn (like the jobs' cold figures), ``runs`` fresh processes."""
    samples = []
    for _ in range(runs):
        spawned = time.time()
        done = subprocess.run(
            [sys.executable, "-c", FLOOR_SCRIPT, device],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        samples.append((float(done.stdout.split()[-1]) - spawned) * 1e3)
    return {"samples_ms": samples, "median_ms": statistics.median(samples)}


def run_predict_many(run: Run, engines: list, sizes: list, many: list) -> list:
    """Every engine's fit-once, predict-many job on :data:`.estimator_kinds.PREDICT_MANY_KIND`,
    appended to ``many`` as it finishes."""
    for engine in engines:
        spec = {
            "mode": "predict_many",
            "engine": engine,
            "kind": PREDICT_MANY_KIND,
            "checkpoint": run.checkpoints["clf"],
            "sizes": sizes,
        }
        many.append(run.job(f"predict-many__{engine}", spec))
        run.done(f"predict many / {engine}", many[-1])
    return many


# ---------------------------------------------------------------------------------------------
# Accuracy and speed-ups


def accuracy(task: str, output, reference, target_std: float | None = None) -> dict:
    """An engine's outputs against tabicl fp32's on the same table."""
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


def _accuracy_against(result: dict, reference: dict | None, task: str) -> dict | None:
    if result["engine"] == TABICL_FP32:
        return {"reference": True} if result["status"] == "ok" else None
    if result["status"] != "ok" or reference is None or reference.get("status") != "ok":
        return None
    try:
        outputs = np.load(result["outputs"]), np.load(reference["outputs"])
    except (OSError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return accuracy(task, *outputs, reference.get("target_std"))


def add_accuracy_and_speedups(results: list, kinds: Sequence[Kind]) -> None:
    """Per result: ``accuracy`` against tabicl fp32 of its kind, ``speedup`` against the tabicl
    engines (their time over this one's), warm and cold."""
    by = {(r["kind"], r["engine"]): r for r in results}
    tasks = {k.name: k.task for k in kinds}
    for r in results:
        r["accuracy"] = _accuracy_against(r, by.get((r["kind"], TABICL_FP32)), tasks[r["kind"]])
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
    """Per fit-once, predict-many result and size: the tabicl engines' warm median over this
    one's."""
    by = {r["engine"]: r for r in rows}

    def median(r, n):
        # A size measured before a job failed or timed out at a later size keeps its figure
        # (the child saves each size as it finishes); a size that failed has none.
        return ((r or {}).get("sizes", {}).get(n) or {}).get("median_ms")

    for r in rows:
        r["speedup"] = {}
        for n in r.get("sizes") or {}:
            mine = median(r, n)
            r["speedup"][n] = {
                base: (median(by.get(base), n) / mine if mine and median(by.get(base), n) else None)
                for base in BASELINES
            }


# ---------------------------------------------------------------------------------------------
# The record: merge and publish


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


def _load_agreeing(paths: list) -> list:
    """The records at ``paths``; ValueError names the first that differs from the first one."""
    documents = [_load_record(path) for path in paths]
    first = documents[0]
    for path, document in zip(paths[1:], documents[1:]):
        for what, read in MERGE_MUST_AGREE:
            if read(document) != read(first):
                raise ValueError(
                    f"{path}: {what} {read(document)!r} differs from {paths[0]}'s {read(first)!r}"
                )
    return documents


def merge(paths: list) -> dict:
    """One record from the records of several runs (``--merge``).

    ``results``: the union, a later file's (kind, engine) replacing an earlier one's, ordered
    like :data:`.estimator_kinds.KINDS`; ``kinds`` likewise; ``predict_many`` (and its
    ``predict_sizes``) from the last file that has it; ``command`` the runs' commands joined by
    ``" ; then "``, and their commits likewise (each once); ``settings`` (engines and recipes: the
    union) and ``environment`` from the first file; ``summary`` recomputed. Each result keeps its
    accuracy and speed-ups, measured against its own run's tabicl rows of the same kind (every run
    has them: :func:`.estimator_engines.engine_names`).

    Raises ValueError naming the file that is not an estimator-suite record or whose device,
    quick mode or torch version differs from the first file's.
    """
    documents = _load_agreeing(paths)
    first = documents[0]
    rank = {k.name: i for i, k in enumerate(KINDS)}.get
    results = {(r["kind"], r["engine"]): r for d in documents for r in d["results"]}
    kinds = {k["name"]: k for d in documents for k in d["kinds"]}
    engines = list(dict.fromkeys(e for d in documents for e in d["settings"]["engines"]))
    recipes = list(dict.fromkeys(r for d in documents for r in d["settings"]["recipes"]))
    many = next((d for d in reversed(documents) if d.get("predict_many")), None)
    floor = next((d["floor"] for d in reversed(documents) if d.get("floor")), None)
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
        "complete": all(d.get("complete", True) for d in documents),
        "floor": floor,
        "summary": summarize(merged, engines),
    }


def _publish(document: dict, out: Path, say) -> int:
    """Writes ``estimator_suite_<device>[-quick].json`` and its table (``.txt``) to ``out``."""
    report.write_record(out, "estimator_suite", document, render(document), say)
    return 0


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tables with ~1/10 of the rows (and fewer features on the wide kinds); "
        "the default without a GPU",
    )
    p.add_argument("--full", action="store_true", help="full-size tables even on the CPU")
    p.add_argument(
        "--kinds",
        nargs="+",
        metavar="KIND",
        choices=[k.name for k in KINDS],
        help="table kinds (default: all)",
    )
    p.add_argument(
        "--recipes", nargs="+", metavar="RECIPE", default=list(DEFAULT_RECIPES),
        help="tabserve recipes, one engine each (default: exact auto)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("tabserve-results"))
    add_checkpoint_arguments(p)
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


def _settings(args, kinds: Sequence[Kind], checkpoints: dict, note: str, run_dir: Path) -> dict:
    """The run's settings, as the record keeps them."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or (device == "cpu" and not args.full)
    predict_many = PREDICT_MANY_KIND in [k.name for k in kinds] and not args.no_predict_many
    return {
        "device": device,
        "quick": quick,
        "repeats": args.repeats if args.repeats is not None else (3 if quick else 5),
        "timeout_s": args.timeout,
        "seed": args.seed,
        "n_estimators": N_ESTIMATORS,
        "recipes": list(args.recipes),
        "engines": engine_names(args.recipes),
        "model_size": args.model_size,
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
        "checkpoint_note": note,
        "predict_sizes": list(PREDICT_SIZES["quick" if quick else "full"]) if predict_many else [],
        "work_dir": str(run_dir),
    }


def _measure(args, argv: list, say) -> dict:
    """Runs the suite's jobs; the record of the run. After each job the record of the jobs so
    far is written to ``--out`` with ``"complete": False``, so a run stopped from outside (the
    time limit of a lent machine) leaves the figures it measured."""
    kinds = [kind_by_name(n) for n in (args.kinds or [k.name for k in KINDS])]
    run_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tabserve-estimator-suite-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    given = {"clf": args.checkpoint, "reg": args.regressor_checkpoint}
    tasks = {k.task for k in kinds}
    checkpoints, note = checkpoints_for(tasks, given, run_dir, args.model_size, COMMAND)
    settings = _settings(args, kinds, checkpoints, note, run_dir)
    device, quick, engines = settings["device"], settings["quick"], settings["engines"]
    say(f"[estimator-suite] {device}{' (quick)' if quick else ''}; checkpoints: {note}")
    spec = {
        "device": device,
        "quick": quick,
        "seed": args.seed,
        "repeats": settings["repeats"],
        "compile_timeout_s": args.compile_timeout,
    }
    environment = report.environment(("pandas",))
    floor = measure_floor(device)
    say(f"  floor (import torch, one tensor on {device}): {floor['median_ms'] / 1e3:.2f} s")
    results: list = []
    many: list = []

    def record(complete: bool) -> dict:
        done = copy.deepcopy(results)
        for result in done:  # each result keeps its own run's floor through a merge
            result["floor_ms"] = floor["median_ms"]
        measured = copy.deepcopy(many)
        add_accuracy_and_speedups(done, kinds)
        add_predict_many_speedups(measured)
        return {
            **report.record_head(SCHEMA, environment, settings, COMMAND, argv),
            "complete": complete,
            "kinds": [k.as_dict(quick) for k in kinds],
            "results": done,
            "predict_many": measured,
            "floor": floor,
            "summary": summarize(done, engines),
        }

    def partial() -> None:
        document = record(False)
        report.write_record(args.out, "estimator_suite", document, render(document), lambda *a: None)

    run = Run(spec, settings["checkpoints"], run_dir, args.timeout, say, partial)
    run_kinds(run, kinds, engines, args.restart, results)
    sizes = settings["predict_sizes"]
    if sizes:
        run_predict_many(run, engines, sizes, many)
    return record(True)


def main(argv=None) -> int:
    """``python -m tabserve.bench estimators [options]`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    if not args.merge:
        return _publish(_measure(args, argv, say), args.out, say)
    try:
        document = merge(args.merge)
    except ValueError as error:
        raise SystemExit(f"{COMMAND} --merge: {error}") from None
    return _publish(document, args.out, say)
