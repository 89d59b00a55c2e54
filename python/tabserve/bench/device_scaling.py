"""Device-scaling suite: the estimators on 1, 2, 4 (and 8) devices of one host, timed.

``python -m tabserve.bench devices [--device cuda|cpu|auto] [--counts 1 2 4 8] [--quick]
[--repeat-device] [--model-size full|tiny] [--checkpoint CLF] [--tables N] [--repeats R]
[--compile-timeout S] [--out DIR] [--seed S]``

Three cells, each answered by estimators with their defaults (``n_estimators=8``) whose
``device`` lists ``n`` devices, for each ``n`` of ``--counts``:

- ``fit+predict``: the driver's ``large`` table (8,192 + 2,048 rows, 64 features, 4 classes;
  ``--quick``: 256 + 64 rows, 8 features), fit and ``predict_proba`` by one estimator;
- ``kv-predict``: ``predict_proba`` of 100,000 rows (``--quick``: 4,000) by a classifier fitted
  with ``kv_cache=True`` on 2,048 train rows of 20 features (``--quick``: 128), 25,000 test rows
  per model call;
- ``many-tables``: ``fit_predict_many`` over the many-tables population
  (:mod:`.many_tables_population`, ``--tables`` tasks, 60 by default; ``--quick``: 8).

Each cell runs once to warm up, waits for the background compiles (``--compile-timeout``), then
is timed ``--repeats`` times on the host clock (the estimators answer host arrays); the record
keeps every sample, the median, the speed-up over one device and the largest difference of the
answers from one device's. The split each prediction took (``"members"`` / ``"rows"``) is
recorded. Counts past the visible GPUs are skipped, unless ``--repeat-device`` names the first
device ``n`` times (on a host of one GPU this measures what spreading costs, not what it gains);
on the CPU every list repeats ``"cpu"``.

Output (``--out``): ``device_scaling_<device>[-quick].json``, rendered into docs/results.md by
``benchmarks/record.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from . import report
from .many_tables_population import make_population, population_for, task_specs
from .timing import time_cpu
from .workloads import Workload, add_checkpoint_arguments, checkpoints_for, host_table

SCHEMA = "tabserve.bench.device_scaling/1"
COMMAND = "python -m tabserve.bench devices"
CELLS = ("fit+predict", "kv-predict", "many-tables")
#: Speed-ups the suite is held to, by cell and device count.
TARGETS = {
    "many-tables": {2: 1.85, 4: 3.6, 8: 7.0},
    "kv-predict": {2: 1.85, 4: 3.6, 8: 7.0},
    "fit+predict": {2: 1.6},
}
TABLES = {
    False: {
        "fit+predict": Workload("large", 8, 8192, 2048, 64),
        "kv-predict": Workload("kv", 8, 2048, 100_000, 20),
    },
    True: {
        "fit+predict": Workload("large-quick", 8, 256, 64, 8),
        "kv-predict": Workload("kv-quick", 8, 128, 4000, 8),
    },
}
KV_CHUNK_ROWS = 25_000


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    parser.add_argument("--quick", action="store_true", help="small tables (tests)")
    parser.add_argument(
        "--repeat-device",
        action="store_true",
        help="name the first device n times where fewer GPUs are visible",
    )
    parser.add_argument("--tables", type=int, default=None, help="many-tables tasks (default 60)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.counts) or args.repeats < 1:
        parser.error("--counts and --repeats take integers >= 1")
    return args


def device_lists(device: str, counts: list, repeat: bool) -> dict:
    """``n -> [device names]`` for each count that this host can run."""
    if device == "cpu":
        return {n: ["cpu"] * n for n in counts}
    visible = torch.cuda.device_count()
    lists = {}
    for n in counts:
        if n <= visible:
            lists[n] = [f"cuda:{i}" for i in range(n)]
        elif repeat:
            lists[n] = ["cuda:0"] * n
    return lists


class Cell:
    """One cell: ``make(devices)`` an estimator (or a pair), ``run(estimator)`` its answers,
    ``rows`` the test rows a prediction splits (None for many tables)."""

    def __init__(self, name: str, make, run, rows: int | None, description: str):
        self.name, self.make, self.run, self.rows, self.description = name, make, run, rows, description


def make_cells(quick: bool, tables: int | None, seed: int, device: str, paths: dict) -> list:
    """The suite's cells (see the module docstring)."""
    from tabserve.models.tabicl import TabICLClassifier, TabICLRegressor

    def classifier(devices, **params):
        return TabICLClassifier(model_path=paths["clf"], device=devices, **params)

    large, kv = TABLES[quick]["fit+predict"], TABLES[quick]["kv-predict"]
    X, y, X_test = host_table(large, seed)
    X_kv, y_kv, X_kv_test = host_table(kv, seed + 1)
    count = tables if tables is not None else (None if quick else 60)
    specs = task_specs(population_for(device, quick, count), seed)
    tasks = {
        kind: [task for spec, task in zip(specs, make_population(specs)) if spec.task == kind]
        for kind in ("clf", "reg")
    }

    def many(devices):
        return classifier(devices), TabICLRegressor(model_path=paths["reg"], device=devices)

    def run_many(pair):
        answers = pair[0].fit_predict_many(tasks["clf"], "predict_proba") if tasks["clf"] else []
        return answers + (pair[1].fit_predict_many(tasks["reg"]) if tasks["reg"] else [])

    return [
        Cell(
            "fit+predict",
            classifier,
            lambda est: est.fit(X, y).predict_proba(X_test),
            large.n_test,
            f"fit + predict_proba, {large.n_train:,} + {large.n_test:,} rows, "
            f"{large.n_features} features, 4 classes",
        ),
        Cell(
            "kv-predict",
            lambda devices: classifier(devices, kv_cache=True, test_chunk_rows=KV_CHUNK_ROWS).fit(X_kv, y_kv),
            lambda est: est.predict_proba(X_kv_test),
            kv.n_test,
            f"predict_proba of {kv.n_test:,} rows, kv_cache=True on {kv.n_train:,} train rows, "
            f"{kv.n_features} features, {KV_CHUNK_ROWS:,} rows per call",
        ),
        Cell(
            "many-tables",
            many,
            run_many,
            None,
            f"fit_predict_many over {len(specs)} tables ({len(tasks['reg'])} regression), "
            f"population seed {seed}",
        ),
    ]


def _difference(a, b) -> float:
    """Largest absolute difference between two answers (arrays, or lists of them)."""
    if isinstance(a, list):
        return max((_difference(x, z) for x, z in zip(a, b)), default=0.0)
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def run_cell(cell: Cell, lists: dict, repeats: int, compile_timeout: float, say) -> list:
    """``cell`` on every device list: one result per count, speed-ups over the first count."""
    from tabserve.models.tabicl.serving.background import wait_for_compiles

    results, baseline = [], None
    for n, devices in lists.items():
        result = {"cell": cell.name, "devices": n, "device_list": devices}
        try:
            est = cell.make(devices)
            start = time.perf_counter()
            answers = cell.run(est)
            result["first_ms"] = (time.perf_counter() - start) * 1e3
            result["compiles_settled"] = wait_for_compiles(compile_timeout)
            samples = time_cpu(lambda: cell.run(est), repeats, repeats, 0.0)
            result.update(status="ok", samples_ms=samples, median_ms=statistics.median(samples))
            result["split"] = "tables" if cell.rows is None else est._split(cell.rows)
            if baseline is None:
                baseline = (result["median_ms"], answers)
            result["speedup"] = baseline[0] / result["median_ms"]
            result["max_difference"] = _difference(answers, baseline[1])
        except Exception as error:  # a count's failure is its result, not the suite's end
            result.update(status="error", reason=f"{type(error).__name__}: {error}")
        shown = f"{result['median_ms']:.1f} ms, {result['speedup']:.2f}x" if result["status"] == "ok" else result["reason"]
        say(f"  {cell.name} on {n} device(s): {shown}")
        results.append(result)
    return results


def targets(results: list) -> list:
    """Each target of :data:`TARGETS` the run measured: met or missed."""
    rows = []
    for r in results:
        goal = TARGETS.get(r["cell"], {}).get(r["devices"])
        if goal is None or r.get("status") != "ok":
            continue
        distinct = len(set(r["device_list"])) == r["devices"]
        state = ("met" if r["speedup"] >= goal else "MISSED") if distinct else "not a multi-GPU run"
        rows.append({"cell": r["cell"], "devices": r["devices"], "target": goal,
                     "speedup": r["speedup"], "state": state})  # fmt: skip
    return rows


#: Columns of the record's table (a leading '>' right-aligns).
COLUMNS = ("cell", ">devices", "split", ">first call", ">median", ">speed-up", ">max diff")
TARGET_COLUMNS = ("cell", ">devices", ">target", ">speed-up", "state")


def rows(document: dict) -> list:
    """The record's table: one row per cell and device count."""
    table = []
    for r in document["results"]:
        distinct = len(set(r["device_list"])) == r["devices"]
        shown = r["devices"] if distinct else f"{r['devices']} x {r['device_list'][0]}"
        if r["status"] != "ok":
            table.append([r["cell"], shown, "-", "-", r["reason"][:80], "-", "-"])
            continue
        table.append([
            r["cell"], shown, r["split"], f"{r['first_ms']:,.0f} ms", f"{r['median_ms']:,.1f} ms",
            f"{r['speedup']:.2f}x", f"{r['max_difference']:.1e}",
        ])  # fmt: skip
    return table


def target_rows(document: dict) -> list:
    return [
        [t["cell"], t["devices"], f">= {t['target']}x", f"{t['speedup']:.2f}x", t["state"]]
        for t in document.get("targets", [])
    ]


def render(document: dict) -> str:
    """The printed table of a record."""
    text = report.format_table(COLUMNS, rows(document))
    if document.get("targets"):
        text += "\n\n" + report.format_table(TARGET_COLUMNS, target_rows(document))
    return text


def main(argv=None) -> int:
    """``python -m tabserve.bench devices [options]`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{COMMAND}: --device cuda, and this machine has no CUDA GPU")
    lists = device_lists(device, args.counts, args.repeat_device)
    if not lists:
        raise SystemExit(f"{COMMAND}: none of --counts {args.counts} fits the visible GPUs")
    run_dir = Path(tempfile.mkdtemp(prefix="tabserve-device-scaling-"))
    given = {"clf": args.checkpoint, "reg": args.regressor_checkpoint}
    paths, note = checkpoints_for({"clf", "reg"}, given, run_dir, args.model_size, COMMAND)
    say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"[devices] {device}; counts {list(lists)}; checkpoints: {note}")
    results, described = [], {}
    for cell in make_cells(args.quick, args.tables, args.seed, device, paths):
        if cell.name in args.cells:
            described[cell.name] = cell.description
            results += run_cell(cell, lists, args.repeats, args.compile_timeout, say)
    settings = {
        "device": device,
        "quick": args.quick,
        "counts": list(lists),
        "repeat_device": args.repeat_device,
        "repeats": args.repeats,
        "seed": args.seed,
        "model_size": args.model_size,
        "checkpoint_note": note,
        "cells": described,
    }
    document = {
        **report.record_head(SCHEMA, report.environment(("pandas",)), settings, COMMAND, argv),
        "results": results,
        "targets": targets(results),
    }
    report.write_record(args.out, "device_scaling", document, render(document), say)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
