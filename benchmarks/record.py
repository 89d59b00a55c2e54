"""docs/results.md, rendered from the measured records under ``benchmarks/results/``.

The records are JSON files of several kinds, told apart by their content:

* a driver record (``schema`` ``tabserve.bench.tabiclv2/...``): one per device, e.g. ``h200.json``
  and ``cpu.json`` (the driver's JSON, merged with ``python -m tabserve.bench --merge``), with its
  plot ``<name>.png`` beside it when there is one;
* an estimator-suite record (``schema`` ``tabserve.bench.estimator_suite/...``,
  ``python -m tabserve.bench estimators``): the estimators' fit + predict, the headline;
* a many-tables record (``schema`` ``tabserve.bench.many_tables/...``,
  ``python -m tabserve.bench many-tables``): a population of small tables answered by loops of
  estimators and by ``fit_predict_many``;
* a device-scaling record (``schema`` ``tabserve.bench.device_scaling/...``,
  ``python -m tabserve.bench devices``): the estimators on 1, 2, 4 and 8 devices of one host;
* the string-lookup sweep (``benchmarks/string_lookup.py``, ``"benchmark": "string_lookup"``);
* the category-alignment sweep (``benchmarks/align_categories.py``,
  ``"benchmark": "align_categories"``);
* a kernel micro-benchmark's JSON (``"benchmark"`` one of :data:`KERNEL_BENCHMARKS`, e.g.
  ``benchmarks/icl_attention.py --json``): a row per case and method.

Other JSON files are left out. For each driver record the page gives the device, the versions
(torch, CUDA, cuDNN, Triton, driver, tabicl), the commit and the command, then one table per
workload: per cell the one-shot median (p20-p80), the KV-cached median, the speed-up over the
reference cells of the same run (``ref-fp16`` / ``ref-fp32``; ``c1-ref-fp16`` / ``c0-ref-fp32``
in older records), the peak allocated memory and the accuracy gate's verdict. The sweeps get
their headline tables.

    python benchmarks/record.py benchmarks/results/*.json -o docs/results.md
    python benchmarks/record.py --check benchmarks/results/*.json -o docs/results.md

``--check`` writes nothing and exits with status 1 when the file differs from what it would
render (a record changed and the page was not rendered again).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tabserve.bench import device_scaling as scaling
from tabserve.bench import estimator_report as suite
from tabserve.bench import many_tables_report as many
from tabserve.bench.report import format_x
from tabserve.bench.timing import MiB, format_mib, format_ms

#: The repository root: paths inside it are printed relative to it.
ROOT = Path(__file__).resolve().parents[1]

DRIVER_SCHEMA = "tabserve.bench.tabiclv2/"
SUITE_SCHEMA = "tabserve.bench.estimator_suite/"
MANY_TABLES_SCHEMA = "tabserve.bench.many_tables/"
#: The reference cells speed-ups are quoted against: (column label, cell names, speed-up keys).
REFERENCES = (
    ("ref-fp16", ("ref-fp16", "c1-ref-fp16"), ("ref-fp16", "ref16")),
    ("ref-fp32", ("ref-fp32", "c0-ref-fp32"), ("ref-fp32", "ref32")),
)
#: String-lookup methods of the headline table: (column, method name, figure).
LOOKUP_COLUMNS = (
    ("tabserve cpu", "tabserve cpu", "lookup"),
    ("tabserve cuda", "tabserve cuda", "lookup"),
    ("tabserve cuda compiled", "tabserve cuda compiled", "lookup"),
    ("pyarrow", "pyarrow index_in", "lookup"),
    ("pandas", "pandas get_indexer", "lookup"),
    ("torch peer cuda", "torch_peer cuda", "lookup"),
    ("torch peer cpu", "torch_peer cpu", "lookup"),
    ("build cuda", "tabserve cuda", "build"),
)

HEADER = """\
# Measured results

This page is generated from the records under `benchmarks/results/`; do not edit it by hand.
After a record changes:

    python benchmarks/record.py benchmarks/results/*.json -o docs/results.md

Columns of the TabICLv2 tables: *one-shot* is one call that fits on the train rows and predicts
the test rows (median, then the 20th-80th percentile range, ms); *KV-cached* predicts the test
rows from a cache built once on the train rows; *x ref-fp16* / *x ref-fp32* is the reference
cell's median over this cell's, both measured in the same run (one-shot, then KV-cached; a record
merged from several runs shows each cell against its own run's reference, which can differ from
the reference row printed beside it); *peak MiB* is the
device memory allocated at the peak of a one-shot call; *gate* is the accuracy check against the
fp32 reference (the largest probability difference, or the mean relative error for a regressor).
The checkpoints are random weights of the full architecture: the timings are real, the accuracy
figures compare numerics only.
"""


# ---------------------------------------------------------------------------------------------
# Loading


def load(paths: Iterable[str | Path]) -> list[tuple[Path, dict]]:
    """The records among ``paths`` (driver records first, then the sweeps), each with its path."""
    records = []
    for path in paths:
        path = Path(path)
        document = json.loads(path.read_text())
        if kind(document) is not None:
            records.append((path, document))
    order = {
        "estimator_suite": 0,
        "many_tables": 1,
        "device_scaling": 2,
        "driver": 3,
        "string_lookup": 4,
        "align_categories": 5,
        "compile_contention": 6,
        "offload_capacity": 7,
        "kernel": 8,
    }
    return sorted(records, key=lambda item: (order[kind(item[1])], item[0].name))


#: The kernel micro-benchmarks whose JSON (``records`` of case, method and timing) is a record.
KERNEL_BENCHMARKS = ("icl_attention", "layer_norm_cast")


def kind(document: object) -> str | None:
    """``"estimator_suite"``, ``"many_tables"``, ``"device_scaling"``, ``"driver"``, ``"string_lookup"``,
    ``"align_categories"``, ``"compile_contention"``, ``"offload_capacity"``, ``"kernel"`` or None
    (not a record)."""
    if not isinstance(document, dict):
        return None
    if str(document.get("schema", "")).startswith(SUITE_SCHEMA):
        return "estimator_suite"
    if str(document.get("schema", "")).startswith(MANY_TABLES_SCHEMA):
        return "many_tables"
    if str(document.get("schema", "")).startswith(scaling.SCHEMA.split("/")[0] + "/"):
        return "device_scaling"
    if str(document.get("schema", "")).startswith(DRIVER_SCHEMA):
        return "driver"
    if document.get("benchmark") in (
        "string_lookup", "align_categories", "compile_contention", "offload_capacity"
    ):  # fmt: skip
        return document["benchmark"]
    if document.get("benchmark") in KERNEL_BENCHMARKS and isinstance(document.get("records"), list):
        return "kernel"
    return None


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it, else its name."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


# ---------------------------------------------------------------------------------------------
# Formatting


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; columns named with a leading '>' are right-aligned."""
    names = [c.lstrip(">") for c in columns]
    align = ["---:" if c.startswith(">") else "---" for c in columns]
    lines = ["| " + " | ".join(names) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def _cudnn(value: object) -> str:
    """cuDNN's version number (91900) as 9.19.0."""
    if isinstance(value, int) and value >= 10000:
        return f"{value // 10000}.{value // 100 % 100}.{value % 100}"
    return "-" if value is None else str(value)


def _phase(result: dict, phase: str) -> dict:
    value = result.get(phase)
    return value if isinstance(value, dict) and "median_ms" in value else {}


# ---------------------------------------------------------------------------------------------
# Driver records


def versions(env: dict) -> str:
    parts = [
        ("torch", env.get("torch")),
        ("CUDA", env.get("cuda")),
        ("cuDNN", _cudnn(env.get("cudnn"))),
        ("Triton", env.get("triton")),
        ("driver", env.get("driver")),
        ("tabicl", env.get("tabicl")),
    ]
    return ", ".join(f"{name} {value if value is not None else '-'}" for name, value in parts)


def device_name(document: dict) -> str:
    env = document.get("environment", {})
    if document.get("settings", {}).get("device") == "cuda" and env.get("gpu"):
        return env["gpu"]
    cpu = env.get("cpu") or "CPU"
    count = env.get("cpu_count")
    return f"{cpu} (CPU, {count} cores)" if count else f"{cpu} (CPU)"


def speedup(result: dict, phase: str, label: str, references: dict) -> float | None:
    """The reference median over this result's (same run: the figure the driver stored; a record
    without it: its own reference cell of the workload)."""
    _, _, keys = next(r for r in REFERENCES if r[0] == label)
    stored = result.get("speedup", {}).get(phase, {})
    for key in keys:
        if stored.get(key) is not None:
            return stored[key]
    if result.get("speedup"):
        return None  # the run measured no such reference: a merged one is not the same run
    mine = _phase(result, phase).get("median_ms")
    theirs = references.get(label, {}).get(phase)
    return theirs / mine if mine and theirs else None


def gate_text(result: dict) -> str:
    status = result.get("status", "?")
    if status != "ok":
        reason = result.get("reason") or ""
        if reason.lower().startswith(status):
            reason = reason[len(status) :].strip()
        return status.upper() + (f": {reason}" if reason else "")
    gate = result.get("gate")
    if not gate or gate.get("passed") is None:
        return "-"
    if gate.get("note") == "is the fp32 reference":
        return "reference"
    if not gate["passed"]:
        failures = [
            f"{route}: {', '.join(gate[route]['failures'])}"
            for route in ("one_shot", "kv", "padded", "padded_recipe", "padding_gates")
            if isinstance(gate.get(route), dict) and gate[route].get("failures")
        ]
        return "FAIL " + "; ".join(failures)
    one = gate.get("one_shot", {})
    if one.get("max_prob_diff") is not None:
        return f"pass (max dp {one['max_prob_diff']:.1e})"
    if one.get("mean_rel_error") is not None:
        return f"pass (rel {one['mean_rel_error']:.1e})"
    return "pass"


def _pair(result: dict, label: str, references: dict) -> str:
    one = speedup(result, "one_shot", label, references)
    kv = speedup(result, "kv", label, references)
    if one is None and kv is None:
        return "-"
    return f"{format_x(one)} / {format_x(kv)}"


def workload_rows(results: list, references: dict) -> list:
    rows = []
    for r in results:
        one, kv = _phase(r, "one_shot"), _phase(r, "kv")
        if r.get("gate_only"):
            timing = "gate reference only"
        elif one:
            timing = f"{format_ms(one['median_ms'])} ({format_ms(one.get('p20_ms'))}-"
            timing += f"{format_ms(one.get('p80_ms'))})"
        else:
            timing = "-"
        memory = one.get("memory") or {}
        rows.append(
            [
                r["cell"],
                timing,
                format_ms(kv.get("median_ms")),
                *(_pair(r, label, references) for label, _, _ in REFERENCES),
                _mib(memory.get("peak_allocated_bytes")),
                gate_text(r),
            ]
        )
    return rows


def stream_rows(results: list, references: dict) -> list:
    rows = []
    for r in results:
        stream = _phase(r, "stream")
        rows.append(
            [
                r["cell"],
                format_ms(stream.get("median_ms")),
                format_ms(stream.get("p90_ms")),
                format_x(stream.get("fresh_over_warm_p50")),
                *(format_x(speedup(r, "stream", label, references)) for label, _, _ in REFERENCES),
                stream.get("recompiles", "-"),
                gate_text(r),
            ]
        )
    return rows


WORKLOAD_COLUMNS = (
    "cell", ">one-shot ms (p20-p80)", ">KV-cached ms", ">x ref-fp16", ">x ref-fp32",
    ">peak MiB", "gate",
)  # fmt: skip
STREAM_COLUMNS = (
    "cell", ">p50 ms", ">p90 ms", ">fresh / warm p50", ">x ref-fp16", ">x ref-fp32",
    ">recompiles", "gate",
)  # fmt: skip


def _cell_order(document: dict) -> dict:
    return {c["name"]: i for i, c in enumerate(document.get("cells", [])) if "name" in c}


def _references(results: list) -> dict:
    """``{label: {phase: median}}`` of the workload's reference cells in ``results``."""
    found: dict = {}
    for label, names, _ in REFERENCES:
        for r in results:
            if r["cell"] in names and r.get("status") == "ok" and not r.get("gate_only"):
                for phase in ("one_shot", "kv", "stream"):
                    median = _phase(r, phase).get("median_ms")
                    if median:
                        found.setdefault(label, {})[phase] = median
    return found


def _record_header(title: str, path: Path, document: dict) -> list:
    """A record's title line and where, with what and from which commit it was measured."""
    env = document.get("environment", {})
    return [
        f"## {title}",
        "",
        f"- record: `{shown_path(path)}`",
        f"- versions: {versions(env)}",
        f"- commit: `{env.get('git_commit') or '-'}`",
    ]


def render_driver(path: Path, document: dict) -> str:
    settings = document.get("settings", {})
    lines = _record_header(device_name(document), path, document)
    command = settings.get("command")
    if command:
        merged = " (the last run merged into this record)" if settings.get("merged_from") else ""
        lines.append(f"- command{merged}: `{command}`")
    if settings.get("checkpoint_note"):
        lines.append(f"- checkpoints: {settings['checkpoint_note']}")
    plot = path.with_suffix(".png")
    if plot.exists():
        try:
            link = Path("..") / plot.resolve().relative_to(ROOT)
            lines += ["", f"![{path.stem}]({link.as_posix()})"]
        except ValueError:
            pass
    order = _cell_order(document)
    results = document.get("results", [])
    workloads = [w for w in document.get("workloads", []) if "name" in w]
    names = [w["name"] for w in workloads]
    names += sorted({r["workload"] for r in results} - set(names))
    descriptions = {w["name"]: w.get("description") for w in workloads}
    for workload in names:
        mine = [r for r in results if r.get("workload") == workload]
        ran = [r for r in mine if r.get("status") != "skipped"]
        if not ran:
            continue
        ran.sort(key=lambda r: (order.get(r["cell"], len(order)), r["cell"]))
        references = _references(ran)
        title = workload + (f": {descriptions[workload]}" if descriptions.get(workload) else "")
        lines += ["", f"### {title}", ""]
        if any("stream" in r for r in ran):
            lines.append(markdown_table(STREAM_COLUMNS, stream_rows(ran, references)))
        else:
            lines.append(markdown_table(WORKLOAD_COLUMNS, workload_rows(ran, references)))
        skipped = [r["cell"] for r in mine if r.get("status") == "skipped"]
        if skipped:
            skipped.sort(key=lambda c: (order.get(c, len(order)), c))
            lines += ["", "Not run on this device: " + ", ".join(skipped) + "."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Sweeps


def _sweep_header(title: str, path: Path, document: dict) -> list:
    env = document.get("environment", {})
    device = env.get("gpu") if document.get("device") == "cuda" else None
    device = device or f"{env.get('cpu') or 'CPU'} (CPU)"
    lines = [f"## {title}: {device}", ""]
    lines.append(f"- record: `{shown_path(path)}`")
    lines.append(f"- versions: {versions(env)}")
    lines.append(f"- commit: `{env.get('git_commit') or '-'}`")
    if document.get("command"):
        lines.append(f"- command: `{document['command']}`")
    return lines


def _lookup_cell(record: dict, method: str, what: str) -> str:
    result = record.get("methods", {}).get(method, {})
    if "error" in result:
        return "error"
    if "check" in result and not result["check"].get("ok"):
        return "wrong codes"
    return format_ms(result.get(what, {}).get("median_ms"))


def _target_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value / 1e6:.1f} MB" if value > 1000 else f"{value:.3f} ms"
    if isinstance(value, int):
        return f"{value / 1e6:.1f} MB"
    return "-" if value is None else str(value)


def render_string_lookup(path: Path, document: dict) -> str:
    lines = _sweep_header("String lookup", path, document)
    targets = document.get("targets", [])
    if targets:
        rows = []
        for t in targets:
            losses = t.get("losses") or []
            note = f" (slower in {len(losses)} cases)" if losses else ""
            rows.append([t["target"], _target_value(t.get("value")) + note, t["state"]])
        lines += ["", markdown_table(("target", "value", "verdict"), rows)]
    cases = document.get("cases", [])
    present = [
        column
        for column in LOOKUP_COLUMNS
        if any(column[2] in c.get("methods", {}).get(column[1], {}) for c in cases)
    ]
    # The headline cases: the largest vocabulary and query of the sweep (every label pattern).
    largest = [
        c
        for c in cases
        if c["case"].get("vocabulary") == max(x["case"].get("vocabulary", 0) for x in cases)
        and c["case"].get("query") == max(x["case"].get("query", 0) for x in cases)
    ]
    if largest and present:
        rows = [
            [c["case"]["name"], *(_lookup_cell(c, method, what) for _, method, what in present)]
            for c in largest
        ]
        lines += [
            "",
            f"Median ms per call on the cases with the largest vocabulary and query "
            f"({len(largest)} of the record's {len(cases)}; build: the index build):",
            "",
        ]
        lines.append(markdown_table(["case"] + [">" + p[0] for p in present], rows))
    return "\n".join(lines)


def render_align(path: Path, document: dict) -> str:
    lines = _sweep_header("Category alignment", path, document)
    workloads = document.get("workloads", [])
    if workloads:
        names = list(dict.fromkeys(n for w in workloads for n in w.get("methods", {})))
        rows = []
        for w in workloads:
            cells = []
            for name in names:
                m = w.get("methods", {}).get(name, {})
                if m.get("skipped") or m.get("median_ms") is None:
                    cells.append("-")
                else:
                    peak = format_mib(m.get("peak_extra_bytes"))
                    cells.append(f"{format_ms(m['median_ms'])} / {peak}")
            rows.append([w["workload"], w.get("columns", "-"), *cells])
        lines += ["", "Total ms over the prediction batches / peak extra MiB:", ""]
        lines.append(markdown_table(["workload", ">columns"] + [">" + n for n in names], rows))
    failures = document.get("failures") or []
    if failures:
        lines += ["", "Mismatches: " + ", ".join(failures) + "."]
    return "\n".join(lines)


def render_contention(path: Path, document: dict) -> str:
    """``benchmarks/compile_contention.py``: a served call alone, beside a Python-busy warm-up
    that does not pause, and beside one that does."""
    lines = _sweep_header("Compile contention", path, document)
    workload = document.get("workload", {})
    rows = [
        [
            workload.get("description", "-"),
            format_ms(document.get("alone_ms")),
            format_ms(document.get("beside_ms")),
            format_ms(document.get("paused_ms")),
        ]
    ]
    lines += [
        "",
        f"Median ms of a served call ({document.get('repeats', '-')} calls each; "
        f"{document.get('model_size', '-')} model):",
        "",
        markdown_table(
            ("workload", ">alone", ">beside a warm-up, pause off", ">beside a warm-up, pause on"),
            rows,
        ),
    ]
    compiles = [
        [name, f"{found['compile_s']:.1f}", str(found["calls"]),
         format_ms(found.get("median_ms")), format_ms(found.get("longest_ms"))]
        for name, found in (
            ("in this process", document.get("triton_here")),
            ("in child processes", document.get("triton_children")),
        )
        if found
    ]  # fmt: skip
    if compiles:
        lines += [
            "",
            "Served calls, each after a quiet moment, while the worker compiled tabserve's fused "
            "feed-forward kernel into an empty Triton cache:",
            "",
            markdown_table(
                ("compiled", ">compile s", ">calls", ">median ms", ">longest ms"), compiles
            ),
        ]
    return "\n".join(lines)


def _rung_cell(rung: dict | None) -> str:
    if rung is None:
        return "-"
    if rung["status"] != "ok":
        return rung["status"]
    memory = rung.get("memory") or {}
    peak = memory.get("peak_allocated_bytes", memory.get("peak_rss_bytes"))
    seconds = (rung["fit_ms"] + rung["predict_ms"]) / 1e3
    kept = f" (kept on {'/'.join(rung['kept_on'])})" if rung.get("kept_on") else ""
    return f"{seconds:,.1f} s / {format_mib(peak)}{kept}"


def render_offload(path: Path, document: dict) -> str:
    """``benchmarks/offload_capacity.py``: each engine's ladder in each mode, a row per width."""
    lines = _sweep_header("Offload capacity", path, document)
    settings = document.get("settings", {})
    results = document.get("results", [])
    ladders = list(dict.fromkeys((r["engine"], r["mode"]) for r in results))
    rows = []
    for features in sorted({r["features"] for r in results}):
        found = {(r["engine"], r["mode"]): r for r in results if r["features"] == features}
        diffs = [r.get("max_abs_prob_diff_to_tabicl") for r in found.values()]
        diffs = [d for d in diffs if d is not None]
        rows.append(
            [f"{features:,}", *(_rung_cell(found.get(ladder)) for ladder in ladders),
             f"{max(diffs):.1e}" if diffs else "-"]
        )  # fmt: skip
    lines += [
        "",
        (
            f"Fit + predict of {settings.get('rows', 0):,} train and "
            f"{settings.get('test_rows', 0):,} test rows, {settings.get('n_estimators', '-')} "
            "members, one fresh process per table (time / peak MiB; a ladder stops at its first "
            "failure; kept on: where tabserve's calls kept the column output when it did not fit "
            "where the mode asked, by tabicl's rule; max dp: tabserve against tabicl's "
            "probabilities):"
        ),
        "",
        markdown_table(
            ["features", *(f">{engine} {mode}" for engine, mode in ladders), ">max dp"], rows
        ),
    ]
    return "\n".join(lines)


def render_estimator_suite(path: Path, document: dict) -> str:
    """The suite's own tables (:mod:`tabserve.bench.estimator_report`), as Markdown."""
    settings = document.get("settings", {})
    lines = _record_header(f"Estimators, fit + predict: {device_name(document)}", path, document)
    if document.get("command"):
        lines.append(f"- command: `{document['command']}`")
    if settings.get("checkpoint_note"):
        lines.append(f"- checkpoints: {settings['checkpoint_note']}")
    lines += ["", suite.SUITE_LEGEND, ""]
    lines.append(markdown_table(suite.SUITE_COLUMNS, suite.suite_rows(document["results"])))
    if document.get("predict_many"):
        table = markdown_table(*suite.predict_many_table(document))
        lines += ["", suite.PREDICT_MANY_TITLE + ":", "", table]
    summary = document.get("summary") or {}
    if summary:
        rows = [
            [
                engine,
                format_x(s["warm_vs_tabicl"]),
                format_x(s["cold_vs_tabicl"]),
                s["warm_vs_tabicl_kinds"],
            ]
            for engine, s in summary.items()
        ]
        columns = ("engine", ">warm x tabicl", ">cold x tabicl", ">kinds")
        lines += ["", "Geometric means across kinds:", "", markdown_table(columns, rows)]
    floor = suite.floor_table(document)
    if floor:
        lines += ["", f"{suite.FLOOR_TITLE}; {floor[0]}:", "", markdown_table(suite.FLOOR_COLUMNS, floor[1])]
    return "\n".join(lines)


def render_many_tables(path: Path, document: dict) -> str:
    """The many-tables suite's tables (:mod:`tabserve.bench.many_tables_report`), as Markdown."""
    settings = document.get("settings", {})
    lines = _record_header(f"Many tables: {device_name(document)}", path, document)
    if document.get("command"):
        lines.append(f"- command: `{document['command']}`")
    lines += [f"- {line}" for line in many.population_lines(document)]
    if settings.get("checkpoint_note"):
        lines.append(f"- checkpoints: {settings['checkpoint_note']}")
    lines.append(f"- accuracy reference: {many.reference_text(settings)}")
    if settings.get("note"):
        lines.append(f"- note: {settings['note']}")
    lines += ["", many.THROUGHPUT_LEGEND + ":", ""]
    lines.append(markdown_table(many.THROUGHPUT_COLUMNS, many.throughput_rows(document)))
    columns, rows = many.speedup_table(document)
    if rows:
        lines += ["", many.SPEEDUP_TITLE + ":", "", markdown_table(columns, rows)]
    lines += ["", many.ACCURACY_TITLE + ":", ""]
    lines.append(markdown_table(many.ACCURACY_COLUMNS, many.accuracy_rows(document)))
    padding = many.padding_rows(document)
    if padding:
        lines += ["", many.PADDING_TITLE + ":", "", markdown_table(many.PADDING_COLUMNS, padding)]
    failed = [r for r in document.get("results", []) if r.get("status") != "ok"]
    if failed:
        lines += ["", "Errors: " + "; ".join(f"{r['engine']}: {r.get('reason')}" for r in failed)]
    return "\n".join(lines)


def render_device_scaling(path: Path, document: dict) -> str:
    """The device-scaling suite's table and targets (:mod:`tabserve.bench.device_scaling`)."""
    settings = document.get("settings", {})
    lines = _record_header(f"Device scaling: {device_name(document)}", path, document)
    if document.get("command"):
        lines.append(f"- command: `{document['command']}`")
    for cell, description in settings.get("cells", {}).items():
        lines.append(f"- {cell}: {description}")
    if settings.get("checkpoint_note"):
        lines.append(f"- checkpoints: {settings['checkpoint_note']}")
    lines += [
        "",
        f"Medians of {settings.get('repeats')} calls after a warm-up call and the background "
        "compiles; speed-up over one device, answers against one device's:",
        "",
        markdown_table(scaling.COLUMNS, scaling.rows(document)),
    ]
    targets = scaling.target_rows(document)
    if targets:
        lines += ["", "Targets:", "", markdown_table(scaling.TARGET_COLUMNS, targets)]
    return "\n".join(lines)


#: A kernel record's rate column, by the first of these keys its records have: (key, heading).
KERNEL_RATES = (
    ("kv_gb_per_s", "K+V GB/s"),
    ("gb_per_s", "GB/s"),
    ("tflop_per_s", "TFLOP/s"),
)
#: ... and its error column.
KERNEL_ERRORS = (
    ("max_error_roundings", "max err (roundings)"),
    ("max_abs_error_vs_fp32", "max abs err vs fp32"),
)


def _first_key(records: list, choices: tuple) -> tuple | None:
    for key, heading in choices:
        if any(key in r for r in records):
            return key, heading
    return None


def render_kernel(path: Path, document: dict) -> str:
    """A kernel micro-benchmark (``benchmarks/<name>.py --json``): a row per case and method,
    the median and 20th-80th percentile ms, the rate and the error its records carry."""
    name = document["benchmark"]
    modes = [flag for flag in ("cached", "prefix") if document.get(flag)]
    title = f"Kernel `{name}`" + "".join(f" --{flag}" for flag in modes)
    lines = _sweep_header(title, path, document)
    lines.append(f"- dtype: {document.get('dtype', '-')}")
    records = document["records"]
    rate, error = _first_key(records, KERNEL_RATES), _first_key(records, KERNEL_ERRORS)
    columns = ["case", "method", ">median ms", ">p20-p80"]
    columns += [f">{rate[1]}"] if rate else []
    columns += [f">{error[1]}"] if error else []
    rows = []
    for r in records:
        if "median_ms" not in r:
            cells = ["failed", "-"] + ["-"] * (bool(rate) + bool(error))
        else:
            spread = f"{format_ms(r.get('p20_ms'))}-{format_ms(r.get('p80_ms'))}"
            cells = [format_ms(r["median_ms"]), spread]
            cells += [f"{r[rate[0]]:,.0f}" if rate[0] in r else "-"] if rate else []
            cells += [f"{r[error[0]]:.1e}" if error[0] in r else "-"] if error else []
        rows.append([r.get("case", "-"), r.get("method", "-"), *cells])
    lines += ["", markdown_table(columns, rows)]
    return "\n".join(lines)


RENDERERS = {
    "estimator_suite": render_estimator_suite,
    "many_tables": render_many_tables,
    "device_scaling": render_device_scaling,
    "driver": render_driver,
    "string_lookup": render_string_lookup,
    "align_categories": render_align,
    "compile_contention": render_contention,
    "offload_capacity": render_offload,
    "kernel": render_kernel,
}


def render_results(paths: Iterable[str | Path]) -> str:
    """docs/results.md for the records among ``paths`` (others are left out)."""
    sections = [HEADER.rstrip("\n")]
    for path, document in load(paths):
        sections.append(RENDERERS[kind(document)](path, document))
    return "\n\n".join(sections) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/record.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("records", nargs="+", type=Path, help="record JSON files")
    parser.add_argument("-o", "--output", type=Path, help="the page to write (default: stdout)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when --output differs from what would be rendered",
    )
    args = parser.parse_args(argv)
    text = render_results(args.records)
    if args.check:
        if args.output is None:
            parser.error("--check needs --output")
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            print(
                f"{args.output} is out of date; render it again: python benchmarks/record.py "
                f"{' '.join(str(p) for p in args.records)} -o {args.output}",
                file=sys.stderr,
            )
            return 1
        print(f"{args.output} is up to date")
        return 0
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
