"""Command line of the TabICLv2 benchmark driver (``python -m tabserve.bench``,
``benchmarks/benchmark_tabiclv2.py``). ``--help`` lists the options; docs/guide/serving.md
explains the cells and the output.

The driver has four suites: the raw-model cells (``python -m tabserve.bench [options]``), the
estimator suite (``python -m tabserve.bench estimators [options]``, :mod:`.estimator_suite`),
the many-tables suite (``python -m tabserve.bench many-tables [options]``,
:mod:`.many_tables_suite`) and the device-scaling suite (``python -m tabserve.bench devices
[options]``, :mod:`.device_scaling`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

import tabserve
from tabserve.models.tabicl.serving.options import user_promotions_path

from . import report
from .cells import FP32_CELLS, cell_by_name, cell_table, load_cells_file, select_cells, skip_reason
from .gates import apply_gates
from .runner import run_ab, run_cell, skipped_result
from .workloads import (
    BENCH_EXTRA,
    QUICK_WORKLOADS,
    WORKLOADS,
    add_checkpoint_arguments,
    checkpoints_for,
    workload_by_name,
)

#: Timing settings: full runs, and the reduced ``--quick`` run (CPU machines).
TIMING = {
    "full": {"warmup": 3, "min_repeats": 10, "max_repeats": 200, "budget_s": 1.0},
    # The cold / first calls already warm up; 3 repeats keep a 2-core CPU run near 2-3 minutes.
    "quick": {"warmup": 0, "min_repeats": 3, "max_repeats": 20, "budget_s": 0.2},
}


#: Phases a run may leave out; the cold call (gate outputs) and one-shot timing always run.
SKIPPABLE_PHASES = ("kv", "end_to_end")

#: Suites other than the raw-model cells: the first argument that names one, and its module
#: (its ``main(argv)`` takes the remaining arguments).
SUITES = {
    "estimators": "tabserve.bench.estimator_suite",
    "many-tables": "tabserve.bench.many_tables_suite",
    "devices": "tabserve.bench.device_scaling",
}
#: The console script's name, in error messages.
PROG = "tabserve-bench"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m tabserve.bench",
        description=__doc__.split("\n")[0],
        epilog="the other suites' options:\n  python -m tabserve.bench estimators --help\n"
        "  python -m tabserve.bench many-tables --help\n"
        "  python -m tabserve.bench devices --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tabserve {tabserve.__version__}")
    p.add_argument(
        "--cells", nargs="+", metavar="CELL", help="cell names or patterns (ref-*, large*)"
    )
    p.add_argument(
        "--cells-file",
        type=Path,
        help="more cells: a JSON file of presets with changed options "
        "(benchmarks/cells/research.json); they join the table for --cells and --list",
    )
    p.add_argument("--workloads", nargs="+", metavar="NAME", help="workload names")
    p.add_argument(
        "--quick",
        action="store_true",
        help="reduced workloads and timing (the default without a GPU)",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    add_checkpoint_arguments(p)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per (cell, workload) job")
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole run: jobs not started by then are reported as skipped "
        "(the report is still written; for machines lent by the minute)",
    )
    p.add_argument(
        "--no-gate-reference",
        action="store_true",
        help="do not add a gate-only fp32 job when the selected cells have no fp32 cell (their "
        "gates are then unchecked and they are never promoted)",
    )
    p.add_argument(
        "--skip-phases",
        nargs="+",
        choices=SKIPPABLE_PHASES,
        default=[],
        help="phases not to measure (each compiles anew in compiled cells: on a lent machine "
        "they can cost more than the one-shot measurement)",
    )
    p.add_argument("--budget", type=float, help="timing budget per measurement, seconds")
    p.add_argument("--min-repeats", type=int, help="timed repeats per measurement, at least")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--ab", nargs=2, metavar=("CELL_A", "CELL_B"), help="ABBA-compare two cells")
    p.add_argument("--windows", type=int, default=12, help="ABBA windows")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("tabserve-results"),
        help="directory of the run's JSON, plot and promotions (default ./tabserve-results)",
    )
    p.add_argument(
        "--promotions",
        type=Path,
        help="promotions file to merge this run's promotion into (default OUT/promotions.json; "
        "the one recipe='auto' ships with: python/tabserve/models/tabicl/serving/promotions.json)",
    )
    p.add_argument(
        "--no-user-promotions",
        action="store_true",
        help="do not merge the promotion into this machine's own promotions file, which "
        "recipe='auto' prefers to the shipped one (its path: $TABSERVE_CACHE_DIR or the "
        "platform's user cache directory)",
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--work-dir", type=Path, help="keep job folders here (default: temporary)")
    p.add_argument("--list", action="store_true", help="print the cell and workload tables")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="combine result files of several runs (one report, plot, promotion)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def list_tables(device: str, table) -> str:
    cells = report.format_table(
        ("cell", "runs here", "what"),
        [(c.name, skip_reason(c, device) or "yes", c.description) for c in table],
    )
    workloads = report.format_table(
        ("workload", ">members", ">train", ">test", ">features", "task", "what"),
        [
            (w.name, w.members, w.n_train, w.n_test, w.n_features, w.task, w.description)
            for w in WORKLOADS + QUICK_WORKLOADS
        ],
    )
    return f"{cells}\n\n{workloads}"


def _out_path(device: str, quick: bool, args) -> Path:
    if device == "cuda":
        tag = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip().replace(" ", "-")
    else:
        tag = "cpu"
    tag += "-quick" if quick else ""
    if args.workloads:
        tag += "_" + "-".join(args.workloads)
    if args.ab:
        tag += "_ab_" + "_".join(args.ab)
    return args.out / f"tabiclv2_{tag}.json"


def _progress(quiet: bool, total: int):
    if quiet:
        return nullcontext(None)
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return nullcontext(None)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=False,
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUITES:
        return importlib.import_module(SUITES[argv[0]]).main(argv[1:])
    args = parse_args(argv)
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    table = cell_table(load_cells_file(args.cells_file) if args.cells_file else ())
    if args.list:
        print(list_tables(device, table))
        return 0
    if args.merge:
        return _merge(args, table)
    quick = args.quick or device == "cpu"
    workloads = (
        [workload_by_name(n) for n in args.workloads]
        if args.workloads
        else list(QUICK_WORKLOADS if quick else WORKLOADS)
    )
    cells = (
        [cell_by_name(n, table) for n in args.ab] if args.ab else select_cells(args.cells, table)
    )
    timing = dict(TIMING["quick" if quick else "full"])
    if args.budget is not None:
        timing["budget_s"] = args.budget
    if args.min_repeats is not None:
        timing["min_repeats"] = args.min_repeats
    if args.skip_phases:
        timing["skip_phases"] = sorted(args.skip_phases)
    run_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tabserve-bench-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        given = {"clf": args.checkpoint, "reg": args.regressor_checkpoint}
        tasks = {w.task for w in workloads}
        checkpoints, note = checkpoints_for(tasks, given, run_dir, args.model_size, PROG)
        settings = {
            "device": device,
            "quick": quick,
            "timing": timing,
            "timeout_s": args.timeout,
            "seed": args.seed,
            "checkpoints": {k: str(v) for k, v in checkpoints.items()},
            "checkpoint_note": note,
            "command": " ".join(["python -m tabserve.bench", *argv]),
        }
        if not args.quiet:
            print(
                f"[tabserve.bench] {device}{' (quick)' if quick else ''}; checkpoints: {note}",
                flush=True,
            )
        if args.ab:
            return _run_ab(args, cells, workloads[0], device, checkpoints, run_dir, settings)
        results = _run_cells(args, cells, workloads, device, checkpoints, run_dir, timing)
        apply_gates(
            results, {c.name: c for c in table}, {w.name: w for w in workloads}, _load_outputs
        )
        report.add_speedups(results)
        extra = {r["cell"] for r in results} - {c.name for c in cells}  # a gate-only reference
        document = report.payload(
            settings=settings,
            cells=cells + [cell_by_name(name, table) for name in sorted(extra)],
            workloads=workloads,
            results=results,
        )
        _publish(document, _out_path(device, quick, args), args)
        return 0
    finally:
        if args.work_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


def gate_reference_cell(cells, device: str):
    """The fp32 cell to run gate-only when ``cells`` need gating but hold no fp32 cell (the
    reference ``ref-fp32`` when it can run here, else ``exact``), or None."""
    names = {c.name for c in cells}
    if not cells or names & set(FP32_CELLS):
        return None
    for name in FP32_CELLS:
        cell = cell_by_name(name)
        if skip_reason(cell, device) is None:
            return cell
    return None


def _run_cells(args, cells, workloads, device, checkpoints, run_dir, timing) -> list:
    reference = None if args.no_gate_reference else gate_reference_cell(cells, device)
    # (workload, cell, gate_only): a gate-only fp32 job first, so every cell of the run is gated.
    jobs = [
        job
        for w in workloads
        for job in ([(w, reference, True)] if reference else []) + [(w, c, False) for c in cells]
    ]
    results = []
    started = time.monotonic()
    with _progress(args.quiet, len(jobs)) as progress:
        task = progress.add_task("cells", total=len(jobs)) if progress else None
        for workload, cell, gate_only in jobs:
            if progress:
                progress.update(task, description=f"{workload.name} / {cell.name}")
            if args.deadline is not None and time.monotonic() - started > args.deadline:
                reason = f"skipped: the run's --deadline of {args.deadline:g} s had passed"
                result = skipped_result(cell, workload, reason)
            else:
                result = run_cell(
                    cell,
                    workload,
                    run_dir=run_dir,
                    device=device,
                    checkpoint=checkpoints[workload.task],
                    timeout_s=args.timeout,
                    timing=timing,
                    seed=args.seed,
                    gate_only=gate_only,
                )
            results.append(result)
            if progress:
                progress.advance(task)
                if result["status"] not in ("ok", "skipped"):
                    progress.console.print(
                        f"  {workload.name} / {cell.name}: {result['status']}: "
                        f"{result.get('reason', '')}"
                    )
    return results


def _run_ab(args, cells, workload, device, checkpoints, run_dir, settings) -> int:
    ab = run_ab(
        cells,
        workload,
        run_dir=run_dir,
        device=device,
        checkpoint=checkpoints[workload.task],
        timeout_s=args.timeout,
        windows=args.windows,
        seed=args.seed,
    )
    document = report.payload(
        settings=settings, cells=cells, workloads=[workload], results=[], ab=ab
    )
    out = _out_path(device, settings["quick"], args)
    report.write_json(out, document)
    print(report.render_ab(ab))
    print(f"\nresults: {out}")
    return 0 if ab.get("status") == "ok" else 1


def _merge(args, table) -> int:
    """One document from several runs' JSON (gates and speedups were computed in each run: a
    cell's speedup stays the one against its own run's reference, whatever reference a later
    run measured; a later file's result for the same cell and workload replaces an earlier one,
    unless it is gate-only)."""
    documents = [json.loads(path.read_text()) for path in args.merge]
    # Every merged run's reference medians (a merged document brings those of its own runs).
    history: dict = {}
    for document in documents:
        history = report.reference_medians(
            document["results"], history, document.get("reference_medians")
        )
    results = {}
    for document in documents:
        for result in document["results"]:
            key = (result["workload"], result["cell"])
            if result.get("gate_only") and key in results:
                continue  # a gate-only job never replaces a measured result
            results[key] = result
    merged = list(results.values())
    report.add_speedups(merged, keep=True)
    names = {r["cell"] for r in merged}
    workloads = {w["name"]: workload_by_name(w["name"]) for d in documents for w in d["workloads"]}
    settings = dict(documents[-1]["settings"], merged_from=[str(p) for p in args.merge])
    document = report.payload(
        settings=settings,
        cells=[c for c in table if c.name in names],
        workloads=list(workloads.values()),
        results=merged,
        env=documents[-1]["environment"],
        reference_history=history,
    )
    _publish(document, args.out / "tabiclv2_merged.json", args)
    return 0


def _publish(document: dict, out: Path, args) -> None:
    """Writes the JSON, prints the report, merges the promotion, draws the plot."""
    report.write_json(out, document)
    print(report.render(document))
    promotions = args.promotions or out.parent / "promotions.json"
    report.write_promotions(promotions, document)
    if not args.no_user_promotions:  # what recipe="auto" on this machine reads first
        report.write_promotions(user_promotions_path(), document)
    png, plotted = None, "no plot (--no-plot)"
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        plotted = f"no plot: matplotlib is not installed ({BENCH_EXTRA})"
    elif not args.no_plot:
        png = report.plot(document, out.with_suffix(".png"))
        plotted = f"plot: {png}" if png else "no plot: nothing ran"
    print(f"\nresults: {out}; {plotted}; promotions: {promotions}")


def _load_outputs(result: dict):
    path = result.get("outputs")
    if not path or not Path(path).exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
