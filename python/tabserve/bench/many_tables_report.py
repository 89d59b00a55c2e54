"""The many-tables suite's text report: its tables as rows (shared with ``benchmarks/record.py``,
which prints them as Markdown in docs/results.md) and the printed report.

Numbers are formatted as the driver's tables format them (:func:`.timing.format_mib`,
:func:`.report.format_x`), laid out by :func:`.report.format_table`.
"""

from __future__ import annotations

from .estimator_engines import N_ESTIMATORS, TABICL
from .many_tables_child import TABSERVE_LOOP, TABSERVE_PACKED
from .report import format_table, format_x
from .timing import format_mib

THROUGHPUT_COLUMNS = (
    "engine", "status", "pass", ">s", ">tables/s", ">clf tables/s", ">reg tables/s",
    f">x {TABICL}", f">x {TABSERVE_LOOP}", ">peak MiB",
)  # fmt: skip

THROUGHPUT_LEGEND = (
    "Tables per second, pass by pass in one process (1 cold: the process's first answers, "
    "checkpoint loads and set-up included; 2 warm: the same tasks again; 3 compiled: again after "
    "tabserve's background compiles finished, the wait in brackets); x: the engine's tables per "
    "second over the baseline's in the same pass; peak MiB: the CUDA allocator's peak, or the "
    "process's peak resident set on the CPU"
)

ACCURACY_COLUMNS = (
    "engine", ">clf tasks", ">max dp (task)", ">argmax agree (min)", ">reg tasks",
    ">max err/std (task)", ">later passes vs 1",
)  # fmt: skip

PADDING_COLUMNS = (
    "kind", ">packs", ">member tables", ">real cells", ">padded cells", ">padded / real",
    ">largest pack cells", ">fits ms", ">packed calls ms", ">answers ms",
)  # fmt: skip
PADDING_TITLE = (
    f"Padding of {TABSERVE_PACKED}, and where its warm pass's time goes (fits: each task's fit and "
    "member tables; a member table: one ensemble member)"
)

ACCURACY_TITLE = "Accuracy against the reference, task by task (the worst task in brackets)"

SPEEDUP_TITLE = f"Speed-ups of {TABSERVE_PACKED} (tables per second over the baseline's)"


def _status(result: dict) -> str:
    return "ok" if result["status"] == "ok" else result["status"].upper()


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def _peak(memory: dict | None) -> str:
    memory = memory or {}
    return format_mib(memory.get("peak_allocated_bytes", memory.get("peak_rss_bytes")))


def _packs(tier: dict) -> str:
    """Where one served model's packed calls went (``CompilingTabICL.packs_tier``)."""
    state, ready, fused = tier.get("state"), tier.get("ready_ms"), tier.get("packs_ms")
    timed = f": {fused:.0f} against {ready:.0f} ms" if ready is not None and fused is not None else ""
    named = {
        "compiled": "fused kernels",
        "declined": "ready preset, fused slower",
        "failed": "ready preset, fused kernels failed",
        "queued": "ready preset, fused kernels compiling",
    }
    if state in named:
        children = tier.get("precompiled")
        built = f", {children} kernels compiled in children" if children else ""
        return named[state] + timed + built
    return f"ready preset (packed calls: {state})"  # too few yet to compile for


def _pass_label(result: dict, figures: dict) -> str:
    label = f"{figures['number']} {figures['name']}"
    wait = result.get("compile_wait") if figures["name"] == "compiled" else None
    notes = []
    if wait:
        unfinished = "" if wait.get("finished") else ", unfinished"
        notes.append(f"waited {wait['ms'] / 1e3:.1f} s{unfinished}")
    tiers = [t for t in figures.get("packs") or [] if t.get("state") not in (None, 0, "off")]
    if tiers:
        notes.append("packs on " + "; ".join(_packs(t) for t in tiers))
    return label + (f" ({'; '.join(notes)})" if notes else "")


def throughput_rows(document: dict) -> list:
    """One row of :data:`THROUGHPUT_COLUMNS` per (engine, pass); an engine without passes gets
    one row of its status."""
    rows = []
    for r in document["results"]:
        passes = r.get("passes") or []
        if not passes:
            rows.append([r["engine"], _status(r)] + ["-"] * (len(THROUGHPUT_COLUMNS) - 2))
        for figures in passes:
            kinds = figures.get("kinds") or {}
            speedup = (r.get("speedup") or {}).get(figures["name"], {})
            rows.append(
                [
                    r["engine"],
                    _status(r),
                    _pass_label(r, figures),
                    f"{figures['ms'] / 1e3:.1f}",
                    _rate(figures.get("tables_per_s")),
                    _rate((kinds.get("clf") or {}).get("tables_per_s")),
                    _rate((kinds.get("reg") or {}).get("tables_per_s")),
                    format_x((speedup.get(TABICL) or {}).get("total")),
                    format_x((speedup.get(TABSERVE_LOOP) or {}).get("total")),
                    _peak(figures.get("memory")),
                ]
            )
    return rows


def speedup_table(document: dict) -> tuple[list, list]:
    """(columns, rows) of the packed engine's speed-ups: a row per (baseline, kind), a column per
    pass."""
    summary = document.get("summary") or {}
    names = list(dict.fromkeys(n for passes in summary.values() for n in passes))
    rows = []
    for base, passes in summary.items():
        for kind in ("total", "clf", "reg"):
            values = [(passes.get(n) or {}).get(kind) for n in names]
            if any(v is not None for v in values):
                rows.append([base, "all" if kind == "total" else kind, *map(format_x, values)])
    return ["over", "kind"] + [f">{n}" for n in names], rows


def _worst(entry: dict | None, key: str) -> str:
    if not entry or key not in entry:
        return "-"
    return f"{entry[key]:.1e} ({entry['worst_task']})"


def _passes_agree(result: dict) -> str:
    diffs = [f.get("max_abs_diff_to_pass_1") for f in (result.get("passes") or [])[1:]]
    if not diffs:
        return "-"
    return "differ" if None in diffs else f"{max(diffs):.1e}"


def accuracy_rows(document: dict) -> list:
    """One row of :data:`ACCURACY_COLUMNS` per engine: its answers against the reference's."""
    rows = []
    for r in document["results"]:
        acc = r.get("accuracy")
        if acc and acc.get("reference"):
            rows.append([r["engine"], "reference", "-", "-", "-", "-", _passes_agree(r)])
            continue
        clf, reg = (acc or {}).get("clf"), (acc or {}).get("reg")
        agree = "-"
        if clf and "argmax_agreement" in clf:
            agree = f"{clf['argmax_agreement']:.1%} ({clf['min_argmax_agreement']:.1%})"
        rows.append(
            [
                r["engine"],
                (clf or {}).get("tasks", "-"),
                _worst(clf, "max_abs_prob_diff"),
                agree,
                (reg or {}).get("tasks", "-"),
                _worst(reg, "max_mean_diff_over_std"),
                _passes_agree(r),
            ]
        )
    return rows


def _padding_row(kind: str, p: dict) -> list:
    real, padded = p.get("real_cells", 0), p.get("padded_cells", 0)
    return [
        kind,
        p.get("packs", 0),
        p.get("tables", 0),
        f"{real:,}",
        f"{padded:,}",
        f"{padded / real:.3f}" if real else "-",
        f"{p.get('largest_pack_cells', 0):,}",
        *(_ms(p.get(key)) for key in STAGE_KEYS),
    ]


#: The packed engine's stage times (:class:`tabserve.models.tabicl.sklearn.many._Clock`).
STAGE_KEYS = ("fit_ms", "packs_ms", "answers_ms")


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def padding_rows(document: dict) -> list:
    """One row of :data:`PADDING_COLUMNS` per task kind of the packed engine's warm pass (the
    first where there is no other; every pass packs alike), and one for all (empty without a
    packed engine that ran)."""
    packed = next((r for r in document["results"] if r["engine"] == TABSERVE_PACKED), None)
    passes = (packed or {}).get("passes") or []
    padding = passes[min(1, len(passes) - 1)].get("padding") if passes else None
    if not padding:
        return []
    rows = [_padding_row(kind, p) for kind, p in padding.items() if p]
    total = {
        key: sum(p.get(key, 0) for p in padding.values())
        for key in ("packs", "tables", "real_cells", "padded_cells")
    }
    for key in STAGE_KEYS:  # records made before the stage times have none
        if all(key in p for p in padding.values() if p):
            total[key] = sum(p[key] for p in padding.values() if p)
    total["largest_pack_cells"] = max(p.get("largest_pack_cells", 0) for p in padding.values())
    return rows + [_padding_row("all", total)]


def population_lines(document: dict) -> list:
    """What the population was, in two sentences."""
    settings, pop = document["settings"], document["population"]
    shape = settings["population"]

    def span(key):
        low, median, high = pop[key]
        return f"{low}-{high} (median {median})"

    tasks = (
        f"population '{shape['name']}' ({shape['description']}), seed {settings['seed']}: "
        f"{pop['tables']} tables, {pop['clf']} classification ({pop['many_class']} of them past "
        f"10 classes), {pop['reg']} regression, {pop['frames']} DataFrames with string columns "
        "and NaN"
    )
    shapes = (
        f"train rows {span('train_rows_min_median_max')}, test rows "
        f"{span('test_rows_min_median_max')}, features {span('features_min_median_max')}"
    )
    return [tasks, shapes]


def reference_text(settings: dict) -> str:
    """The accuracy reference engine, and why when it is ``tabicl``."""
    reference = settings.get("reference") or "none"
    if reference == TABICL:
        reference += " (its defaults are fp32 on the CPU)"
    return reference


def header(document: dict) -> list:
    settings, env = document["settings"], document["environment"]
    return [
        (
            f"Many tables on {env.get('gpu') or env.get('cpu')} ({settings['device']}"
            f"{', quick' if settings['quick'] else ''}), torch {env['torch']}, tabicl "
            f"{env['tabicl']}, tabserve {env['tabserve']}; n_estimators={N_ESTIMATORS}"
        ),
        *population_lines(document),
        f"checkpoints: {settings['checkpoint_note']}",
        f"accuracy reference: {reference_text(settings)}",
        *([f"note: {settings['note']}"] if settings.get("note") else []),
    ]


def render(document: dict) -> str:
    """The printed report of a many-tables record (saved beside it as ``.txt``)."""
    parts = header(document) + [
        "",
        THROUGHPUT_LEGEND,
        format_table(THROUGHPUT_COLUMNS, throughput_rows(document)),
    ]
    columns, rows = speedup_table(document)
    if rows:
        parts += ["", SPEEDUP_TITLE, format_table(columns, rows)]
    parts += ["", ACCURACY_TITLE]
    parts.append(format_table(ACCURACY_COLUMNS, accuracy_rows(document)))
    padding = padding_rows(document)
    if padding:
        parts += ["", PADDING_TITLE, format_table(PADDING_COLUMNS, padding)]
    failed = [r for r in document["results"] if r["status"] != "ok"]
    if failed:
        parts += ["", "Errors (recorded as results, not fatal):"]
        parts += [f"  {r['engine']}: {r['status']}: {r.get('reason', '')}" for r in failed]
    return "\n".join(parts)
