"""Reporting: versions, speedups, the JSON result, the fixed-width table, the plot, promotions.

JSON schema (``SCHEMA``): ``environment`` (versions and hardware), ``settings`` (device, timing,
checkpoints and whether they are random), ``cells`` and ``workloads`` (the tables as run),
``results`` (one per cell x workload: ``status``, ``reason``, phases ``cold`` / ``one_shot`` /
``kv`` / ``end_to_end`` or ``stream`` with every sample, ``gate``, ``speedup``), ``promotion``,
``reference_medians`` (``{workload: {phase: {reference cell: [median ms of every run seen]}}}``:
this run's, and with ``--merge`` every merged run's), ``targets`` and, in ABBA mode, ``ab``.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tabserve.models.tabicl.serving.options import PROMOTIONS_SCHEMA

from . import targets
from .gates import promote
from .timing import MiB, format_ms

SCHEMA = "tabserve.bench.tabiclv2/1"
#: Baselines speedups are quoted against: (label, cell).
BASELINES = (("ref16", "ref-fp16"), ("ref32", "ref-fp32"))


# ---------------------------------------------------------------------------------------------
# Environment


def environment(extra_modules: tuple[str, ...] = ()) -> dict:
    """Library versions and hardware of this run (plus the versions of ``extra_modules``)."""
    cuda = torch.cuda.is_available()
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "driver": _nvidia_smi("driver_version") if cuda else None,
        "git_commit": git_commit(),
    }
    for module in (
        "tabserve",
        "tabicl",
        "numpy",
        "sklearn",
        "triton",
        "transformer_engine",
        "flash_attn_interface",
        *extra_modules,
    ):
        env[module] = _version(module)
    return env


def _version(module: str) -> str:
    try:
        found = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001  (a missing optional package is recorded, not fatal)
        return f"unavailable ({type(error).__name__})"
    try:
        return str(getattr(found, "__version__", None) or importlib.metadata.version(module))
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=20,
        ).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def cpu_name() -> str:
    """The CPU model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git_commit() -> str | None:
    """Short commit of the checkout this package runs from, with ``+dirty`` when tracked files
    differ from it; None outside git. ``TABSERVE_COMMIT`` names it instead: a copied working
    tree (on a lent GPU machine) carries a stale HEAD, so the command that copies it says which
    commit the tree is."""
    if os.environ.get("TABSERVE_COMMIT"):
        return os.environ["TABSERVE_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------------
# Speedups and payload


def _phase_ms(result: dict, phase: str) -> float | None:
    value = result.get(phase)
    return value.get("median_ms") if isinstance(value, dict) else None


def add_speedups(results: list, keep: bool = False) -> None:
    """``speedup[route][label]`` = baseline median / this cell's median, per workload, in place.
    ``keep``: a figure a result already has stays (a merge keeps each run's own figures, against
    the reference of the same run; only what a run could not compute, having no reference cell,
    comes from the merged results' reference)."""
    by_key = {(r["workload"], r["cell"]): r for r in results}
    for result in results:
        if result.get("status") != "ok":
            continue
        speedup = {}
        for phase in ("one_shot", "kv", "stream"):
            mine = _phase_ms(result, phase)
            for label, baseline in BASELINES:
                base = by_key.get((result["workload"], baseline))
                theirs = _phase_ms(base, phase) if base and base.get("status") == "ok" else None
                if mine and theirs:
                    speedup.setdefault(phase, {})[label] = theirs / mine
        if keep:
            for phase, figures in result.get("speedup", {}).items():
                speedup.setdefault(phase, {}).update(figures)
        result["speedup"] = speedup


def reference_medians(results: list, *histories: dict | None) -> dict:
    """``{workload: {phase: {reference cell: [medians]}}}``: the lists of ``histories`` joined,
    then the reference cells' medians in ``results``; a value already listed is not added again
    (a document merged with the runs it came from counts each run once); each list sorted."""
    merged: dict = {}

    def add(workload: str, phase: str, cell: str, median: float) -> None:
        values = merged.setdefault(workload, {}).setdefault(phase, {}).setdefault(cell, [])
        if not any(abs(v - median) <= 1e-9 * max(1.0, median) for v in values):
            values.append(median)

    for history in histories:
        for workload, phases in (history or {}).items():
            for phase, cells in phases.items():
                for cell, values in cells.items():
                    for median in values:
                        add(workload, phase, cell, median)
    references = {cell for _, cell in BASELINES}
    for result in results:
        if result.get("cell") in references and result.get("status") == "ok":
            for phase in ("one_shot", "kv", "stream"):
                median = _phase_ms(result, phase)
                if median is not None:
                    add(result["workload"], phase, result["cell"], median)
    for phases in merged.values():
        for cells in phases.values():
            for values in cells.values():
                values.sort()
    return merged


def payload(
    *,
    settings: dict,
    cells: Sequence,
    workloads: Sequence,
    results: list,
    ab: dict | None = None,
    env: dict | None = None,
    reference_history: dict | None = None,
) -> dict:
    """The JSON document of one run (see the module docstring); ``env`` defaults to this
    machine's :func:`environment` (merges pass the measuring machine's, and the merged runs'
    ``reference_history``)."""
    cells_by_name = {c.name: c for c in cells}
    document = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": env or environment(),
        "settings": settings,
        "cells": [c.to_dict() for c in cells],
        "workloads": [w.as_dict() for w in workloads],
        "results": results,
        "promotion": promote(results, cells_by_name),
        "reference_medians": reference_medians(results, reference_history),
        **({"ab": ab} if ab is not None else {}),
    }
    document["targets"] = targets.evaluate(document)
    return document


def record_head(schema: str, environment: dict, settings: dict, command: str, argv: list) -> dict:
    """The keys every suite's record begins with: its schema, when it was made, the machine and
    versions, the settings and the command line (``command`` and its arguments ``argv``)."""
    return {
        "schema": schema,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment,
        "settings": settings,
        "command": " ".join([command, *argv]),
    }


def write_json(path: Path, document: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return path


def write_record(out: Path, suite: str, document: dict, text: str, say) -> Path:
    """Writes a suite's record ``out/<suite>_<device>[-quick].json`` (from the record's
    settings) and its printed table ``text`` beside it as ``.txt``, then says the table and where
    both went; the JSON's path."""
    settings = document["settings"]
    stem = f"{suite}_{settings['device']}{'-quick' if settings['quick'] else ''}"
    path = write_json(Path(out) / f"{stem}.json", document)
    path.with_suffix(".txt").write_text(text + "\n")
    say("")
    say(text)
    say(f"\nwritten: {path} and {path.with_suffix('.txt')}")
    return path


def write_promotions(path: Path, document: dict) -> Path:
    """Merges this run's promotion into a promotions file, keyed by device, then by workload.

    The file ``recipe="auto"`` reads (:func:`tabserve.models.tabicl.serving.options.auto_options`):
    ``{"schema", "devices": {<GPU name or "cpu">: {"updated", "torch", "tabserve",
    "capability", "command", "workloads":
    {<workload>: {<route>: {"preset", "median_ms"}, "shape": {...}}}}}}``. Workloads of other
    runs on the same device are kept.
    """
    path = Path(path)
    try:
        promotions = json.loads(path.read_text())
    except (OSError, ValueError):
        promotions = {}
    promotions.setdefault("schema", PROMOTIONS_SCHEMA)
    env = document["environment"]
    device = env["gpu"] if document["settings"]["device"] == "cuda" else "cpu"
    entry = promotions.setdefault("devices", {}).setdefault(device, {"workloads": {}})
    entry.update(
        updated=document["created"],
        torch=env["torch"],
        tabserve=env.get("tabserve"),
        capability=env.get("gpu_capability") if device != "cpu" else None,
        command=document["settings"].get("command"),
    )
    shapes = {w["name"]: w for w in document["workloads"]}
    for workload, routes in document["promotion"].items():
        entry["workloads"][workload] = {**routes, "shape": shapes.get(workload)}
    return write_json(path, promotions)


# ---------------------------------------------------------------------------------------------
# Table


def format_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Fixed-width text table; columns named with a leading '>' are right-aligned."""
    names = [c.lstrip(">") for c in columns]
    right = [c.startswith(">") for c in columns]
    cells = [[str(v) for v in row] for row in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    lines = []
    for row in [names, ["-" * w for w in widths], *cells]:
        line = "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(row, widths, right))
        lines.append(line.rstrip())
    return "\n".join(lines)


#: Milliseconds as the tables print them (one format for the driver and the benchmarks).
fmt_ms = format_ms


def format_x(value: float | None) -> str:
    """A speed-up as the tables print it: ``"2.35x"``, ``"-"`` for None."""
    return "-" if value is None else f"{value:.2f}x"


def format_peak_mib(memory: dict | None, reserved: bool = True) -> str:
    """Peak allocated MiB of a :func:`.timing.peak_memory` figure, ``"/<reserved MiB>"`` after it
    with ``reserved``; ``"-"`` without a figure (CPU)."""
    if not memory:
        return "-"
    allocated = f"{memory['peak_allocated_bytes'] / MiB:.0f}"
    return f"{allocated}/{memory['peak_reserved_bytes'] / MiB:.0f}" if reserved else allocated


def _gate_text(gate: dict | None) -> str:
    if not gate:
        return "-"
    if gate.get("passed") is None:
        return "unchecked"
    if gate.get("note") == "is the fp32 reference":
        return "ref"
    if gate["passed"]:
        one = gate.get("one_shot", {})
        worst = one.get("max_prob_diff", one.get("mean_rel_error"))
        text = "pass" if worst is None else f"pass {worst:.1e}"
        padded = gate.get("padded_recipe", {})
        padded = padded.get("max_prob_diff", padded.get("mean_rel_error"))
        return text if padded is None else f"{text} pad {padded:.0e}"
    failures = [
        f"{route}: {', '.join(gate[route]['failures'])}"
        for route in ("one_shot", "kv", "padded", "padded_recipe", "padding_gates")
        if gate.get(route, {}).get("failures")
    ]
    return "FAIL " + "; ".join(failures)


def _get(result: dict, phase: str, key: str):
    value = result.get(phase)
    return value.get(key) if isinstance(value, dict) else None


MAIN_COLUMNS = (
    "workload",
    "cell",
    "status",
    ">cold ms",
    ">one-shot ms",
    ">p20-p80",
    "noise",
    ">x ref16",
    ">x ref32",
    ">kv ms",
    ">e2e ms",
    ">MiB alloc/resv",
    ">recomp",
    ">breaks",
    "gate",
)
STREAM_COLUMNS = (
    "workload",
    "cell",
    "status",
    ">p50 ms",
    ">p90 ms",
    ">fresh/warm p50",
    ">x ref16",
    ">recomp",
    ">captures",
    ">MiB alloc/resv",
    "gate",
)


def _status_text(result: dict) -> str:
    if result["status"] != "ok":
        return result["status"].upper()
    return "gate-ref" if result.get("gate_only") else "ok"


def main_rows(results: list) -> list:
    rows = []
    for r in results:
        if r["status"] == "skipped" or "stream" in r:
            continue
        one = r.get("one_shot") if isinstance(r.get("one_shot"), dict) else {}
        jit = _get(r, "cold", "jit") or {}
        spread = "-" if "p20_ms" not in one else f"{fmt_ms(one['p20_ms'])}-{fmt_ms(one['p80_ms'])}"
        rows.append(
            [
                r["workload"],
                r["cell"],
                _status_text(r),
                fmt_ms(_get(r, "cold", "first_call_ms")),
                fmt_ms(one.get("median_ms")),
                spread,
                "NOISY" if one.get("noisy") else "",
                format_x(r.get("speedup", {}).get("one_shot", {}).get("ref16")),
                format_x(r.get("speedup", {}).get("one_shot", {}).get("ref32")),
                fmt_ms(_get(r, "kv", "median_ms")),
                fmt_ms(_get(r, "end_to_end", "median_ms")),
                format_peak_mib(one.get("memory")),
                one.get("recompiles", "-"),
                jit.get("graph_breaks", "-"),
                _gate_text(r.get("gate")),
            ]
        )
    return rows


def stream_rows(results: list) -> list:
    rows = []
    for r in results:
        if r["status"] == "skipped" or "stream" not in r:
            continue
        stream = r["stream"]
        rows.append(
            [
                r["workload"],
                r["cell"],
                r["status"] if r["status"] == "ok" else r["status"].upper(),
                fmt_ms(stream.get("median_ms")),
                fmt_ms(stream.get("p90_ms")),
                format_x(stream.get("fresh_over_warm_p50")),
                format_x(r.get("speedup", {}).get("stream", {}).get("ref16")),
                stream.get("recompiles", "-"),
                "-" if stream.get("captures") is None else stream["captures"],
                format_peak_mib(stream.get("memory")),
                _gate_text(r.get("gate")),
            ]
        )
    return rows


TARGET_COLUMNS = (
    "target", "workload", "cell", ">value", ">needed", "verdict", ">vs fastest reference seen",
)  # fmt: skip


def _runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def _target_row(verdict: dict) -> list:
    value, threshold = verdict["value"], verdict["threshold"]
    fastest = verdict.get("vs_fastest_reference")
    return [
        verdict["target"],
        verdict["workload"],
        verdict["cell"] or "-",
        "-" if value is None else f"{value:.2f}",
        ("<= " if verdict["at_most"] else ">= ") + f"{threshold:g}",
        verdict["verdict"],
        "-" if fastest is None else f"{fastest:.2f} ({_runs(verdict['reference_runs'])})",
    ]


#: The target for a restarted server loading compile-cache artifacts, seconds to its first answer.
READY_TARGET_S = 30.0
#: The stream target: a fresh table's p50 latency over the warm latency of its bucket.
STREAM_TARGET = 1.25


def render(document: dict) -> str:
    """Everything printed at the end of a run: tables, failures, skips, promotion."""
    settings, results = document["settings"], document["results"]
    env = document["environment"]
    parts = [
        (
            f"TabICLv2 benchmark on {env.get('gpu') or env.get('cpu')} ({settings['device']}), "
            f"torch {env['torch']}, tabicl {env['tabicl']}, tabserve {env['tabserve']}"
        ),
        f"checkpoints: {settings['checkpoint_note']}",
    ]
    if main_rows(results):
        parts += [
            "",
            "Latency (ms, median; p20-p80; cold = first call incl. compile)",
            format_table(MAIN_COLUMNS, main_rows(results)),
        ]
    if stream_rows(results):
        parts += [
            "",
            (
                "Fresh-table stream (each table once; fresh/warm: median over the tables of the"
                f" first call over the same table warm; target <= {STREAM_TARGET:g}x, 0 recompiles"
                " and 0 captures)"
            ),
            format_table(STREAM_COLUMNS, stream_rows(results)),
        ]
    restarts = [r for r in results if r.get("priming") and r.get("ready_ms") is not None]
    if restarts:
        parts += [
            "",
            f"Restart from compile-cache artifacts (target: ready in <= {READY_TARGET_S:g} s):",
        ]
        parts += [
            f"  {r['workload']} / {r['cell']}: first answer {r['ready_ms'] / 1e3:.1f} s after the "
            f"process was spawned (first call {fmt_ms(_get(r, 'cold', 'first_call_ms'))} ms; "
            f"priming {fmt_ms(r['priming'].get('cold_ms'))} ms)"
            for r in restarts
        ]
    verdicts = document.get("targets") or targets.evaluate(document)
    if any(v["verdict"] != targets.UNMEASURED for v in verdicts):
        parts += [
            "",
            (
                "Targets (the promoted cell's figure against the reference of its"
                " own run; last column: against the fastest reference run in the document)"
            ),
            format_table(TARGET_COLUMNS, [_target_row(v) for v in verdicts]),
        ]
    failed = [r for r in results if r["status"] not in ("ok", "skipped")]
    if failed:
        parts += ["", "Failed cells (reported, not fatal):"]
        parts += [
            f"  {r['workload']} / {r['cell']}: {r['status']}: {r.get('reason', '')}" for r in failed
        ]
    skipped: dict = {}
    for r in results:
        if r["status"] == "skipped":  # one line per (cell, reason), naming the workloads
            skipped.setdefault((r["cell"], r.get("reason", "")), []).append(r["workload"])
    if skipped:
        parts += ["", "Skipped cells:"] + [
            f"  {cell} ({', '.join(workloads)}): {why}"
            for (cell, why), workloads in skipped.items()
        ]
    if document["promotion"]:
        parts += ["", "Promoted (fastest cell that passed its gate):"]
        for workload, routes in document["promotion"].items():
            picks = ", ".join(
                f"{route} {p['preset']} ({fmt_ms(p['median_ms'])} ms)" for route, p in routes.items()
            )
            parts.append(f"  {workload}: {picks}")
    return "\n".join(parts)


def render_ab(ab: dict) -> str:
    if ab.get("status") != "ok":
        return f"ABBA {ab.get('cells')}: {ab.get('status')}: {ab.get('reason', '')}"
    s = ab["summary"]
    a, b = ab["cells"]
    # Older result files have no "outputs_stable".
    stable = "".join(
        f"{label}'s output unchanged after the windows: {same}; "
        for label, same in ab.get("outputs_stable", {}).items()
    )
    return "\n".join(
        [
            f"ABBA on {ab['workload']}: {a} (A) vs {b} (B), {s['windows']} windows",
            f"  A median {fmt_ms(s['a_median_ms'])} ms, B median {fmt_ms(s['b_median_ms'])} ms",
            (
                f"  B vs A: {s['change_median']:+.2%} median (p20 {s['change_p20']:+.2%}, p80 "
                f"{s['change_p80']:+.2%}); halves {s['first_half_mean']:+.2%} / {s['second_half_mean']:+.2%}"
                f" ({'consistent' if s['consistent'] else 'NOT consistent: treat as noise'})"
            ),
            (
                f"  outputs bitwise equal: {ab['bitwise_equal']} (max abs diff {ab['max_abs_diff']:.3g}); "
                + stable
                + f"recompiles during measurement: {ab['recompiles_during_measurement']}"
            ),
        ]
    )


# ---------------------------------------------------------------------------------------------
# Plot


def plot(document: dict, path: Path) -> Path | None:
    """PNG: per workload, one-shot (or stream p50) latency by cell with p20-p80 whiskers (log
    scale), and the speedup over the reference fp16 cell (fp32 when fp16 did not run); cells in
    the order of the document's cell table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Gate-only references (fp32 outputs, no timing) have nothing to draw.
    ok = [r for r in document["results"] if r["status"] == "ok" and not r.get("gate_only")]
    workloads = list(dict.fromkeys(r["workload"] for r in ok))
    if not workloads:
        return None
    order = {c["name"]: k for k, c in enumerate(document.get("cells", []))}
    per_workload = [
        sorted((r for r in ok if r["workload"] == w), key=lambda r: order.get(r["cell"], len(order)))
        for w in workloads
    ]
    fig, axes = plt.subplots(
        len(workloads),
        2,
        figsize=(12, 0.25 * sum(len(m) + 3 for m in per_workload) + 0.5),
        height_ratios=[len(m) + 3 for m in per_workload],
        squeeze=False,
    )
    references = {cell for _, cell in BASELINES}
    for (left, right), workload, mine in zip(axes, workloads, per_workload):
        phase = "stream" if "stream" in mine[0] else "one_shot"
        names = [r["cell"] for r in mine]
        y = list(range(len(mine)))
        med = [r[phase]["median_ms"] for r in mine]
        low = [m - r[phase]["p20_ms"] for m, r in zip(med, mine)]
        high = [r[phase]["p80_ms"] - m for m, r in zip(med, mine)]
        colors = ["tab:gray" if r["cell"] in references else "tab:blue" for r in mine]
        label = (
            "ref16"
            if any(r.get("speedup", {}).get(phase, {}).get("ref16") for r in mine)
            else "ref32"
        )
        speed = [r.get("speedup", {}).get(phase, {}).get(label, 0.0) for r in mine]
        left.barh(y, med, xerr=[low, high], color=colors)
        left.set_xscale("log")
        right.barh(y, speed, color=colors)
        right.axvline(1.0, color="black", linewidth=0.8)
        for axis, values, text in (
            (left, med, [fmt_ms(m) for m in med]),
            (right, speed, [f"{v:.2f}x" for v in speed]),
        ):
            axis.set_yticks(y, names, fontsize=7)
            axis.invert_yaxis()
            axis.tick_params(axis="x", which="both", labelsize=7)
            for row, (value, words) in enumerate(zip(values, text)):
                if value:
                    axis.annotate(
                        words, (value, row), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=6,
                    )
        right.set_xlim(0, max(speed + [1.0]) * 1.15)
        what = "stream p50" if phase == "stream" else "one-shot"
        left.set_title(f"{workload}: {what} ms", fontsize=9)
        right.set_title(f"{workload}: speedup over {label}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
