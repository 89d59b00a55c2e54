"""The estimator suite's text report: its tables as rows (shared with ``benchmarks/record.py``,
which prints them as Markdown in docs/results.md) and the printed report.

Numbers are formatted as the driver's tables format them (:func:`.timing.format_ms`,
:func:`.report.format_x`, :func:`.report.format_peak_mib`), laid out by
:func:`.report.format_table`.
"""

from __future__ import annotations

from .estimator_engines import N_ESTIMATORS, TABICL, TABICL_FP32
from .estimator_kinds import PREDICT_MANY_KIND
from .report import format_peak_mib, format_table, format_x
from .timing import format_ms

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

PREDICT_MANY_TITLE = (
    f"Fit once (kv_cache=True), predict many ({PREDICT_MANY_KIND}; warm median per size)"
)

SUMMARY_TITLE = "Speed-ups, geometric mean across kinds"
SUMMARY_COLUMNS = (
    "engine", ">warm x tabicl", ">warm x fp32", ">cold x tabicl", ">cold x fp32", ">kinds",
)  # fmt: skip


def _engine_label(result: dict) -> str:
    """The engine, with the preset it served when its name does not say it (``auto``)."""
    engine, preset = result["engine"], result.get("served_preset")
    return f"{engine} ({preset})" if preset and not engine.endswith(preset) else engine


def _status(result: dict) -> str:
    return "ok" if result["status"] == "ok" else result["status"].upper()


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1e3:.1f}"


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


def suite_rows(results: list) -> list:
    """One row of :data:`SUITE_COLUMNS` per (kind, engine) result."""
    rows = []
    for r in results:
        cold, warm = r.get("cold") or {}, r.get("warm") or {}
        share = (r.get("stages") or {}).get("model_share")
        spread = (
            f"{format_ms(warm['p20_ms'])}-{format_ms(warm['p80_ms'])}" if "p20_ms" in warm else "-"
        )
        speed = (r.get("speedup") or {}).get("warm", {})
        rows.append(
            [
                r["kind"],
                _engine_label(r),
                _status(r),
                _seconds(cold.get("cold_ms")),
                _seconds((r.get("restarted") or {}).get("cold_ms")),
                _seconds(cold.get("steady_ms")),
                format_ms(cold.get("first_call_ms")),
                format_ms(warm.get("median_ms")),
                spread,
                format_ms(warm.get("fit_ms")),
                format_ms(warm.get("predict_ms")),
                "-" if share is None else f"{share:.0%}",
                format_x(speed.get(TABICL)),
                format_x(speed.get(TABICL_FP32)),
                _accuracy_text(r.get("accuracy")),
                format_peak_mib(warm.get("memory") or cold.get("memory"), reserved=False),
            ]
        )
    return rows


def predict_many_table(document: dict) -> tuple[list, list]:
    """(columns, rows) of the record's fit-once, predict-many results."""
    sizes = [str(n) for n in document["settings"]["predict_sizes"]]
    columns = ["engine", "status", ">fit ms"] + [f">{n} rows ms" for n in sizes]
    columns += [f">x tabicl @{n}" for n in sizes]
    rows = []
    for r in document.get("predict_many") or []:
        figures, speedup = r.get("sizes") or {}, r.get("speedup") or {}
        rows.append(
            [_engine_label(r), _status(r), format_ms(r.get("fit_ms"))]
            + [format_ms((figures.get(n) or {}).get("median_ms")) for n in sizes]
            + [format_x(speedup.get(n, {}).get(TABICL)) for n in sizes]
        )
    return columns, rows


def summary_rows(summary: dict) -> list:
    """One row of :data:`SUMMARY_COLUMNS` per engine of the record's ``summary``."""
    return [
        [
            engine,
            format_x(s["warm_vs_tabicl"]),
            format_x(s["warm_vs_tabicl-fp32"]),
            format_x(s["cold_vs_tabicl"]),
            format_x(s["cold_vs_tabicl-fp32"]),
            s["warm_vs_tabicl_kinds"],
        ]
        for engine, s in summary.items()
    ]


FLOOR_TITLE = (
    "First answer over the floor (floor: a fresh process that imports torch and makes one "
    "tensor on the device, timed from its spawn like cold s; over: an engine's cold s, and "
    "restart s, less the floor)"
)
FLOOR_COLUMNS = ("kind", "engine", ">cold s", ">over floor s", ">restart s", ">restart over s")


def floor_table(document: dict) -> tuple[str, list] | None:
    """(the floor's sentence, rows of :data:`FLOOR_COLUMNS` per (kind, engine), each result
    against its own run's floor; "-" for a result of a run without one), or None for a record
    whose runs measured none."""
    floor = document.get("floor")
    if not floor:
        return None
    rows = []
    for r in document["results"]:
        base = r.get("floor_ms")
        cold = (r.get("cold") or {}).get("cold_ms")
        again = (r.get("restarted") or {}).get("cold_ms")
        over = lambda ms: "-" if ms is None or base is None else f"{(ms - base) / 1e3:+.2f}"  # noqa: E731
        rows.append([r["kind"], _engine_label(r), _seconds(cold), over(cold), _seconds(again), over(again)])
    samples = ", ".join(f"{ms / 1e3:.2f}" for ms in floor["samples_ms"])
    sentence = f"floor {floor['median_ms'] / 1e3:.2f} s (median of {samples} s)"
    per_run: dict = {}  # a merged record's runs each measured their own floor
    for r in document["results"]:
        if r.get("floor_ms") is not None:
            per_run.setdefault(r["floor_ms"], {})[r["kind"]] = None  # kinds in order, once
    if len(per_run) > 1:
        sentence = "floor per merged run, each row against its own run's: " + "; ".join(
            f"{ms / 1e3:.2f} s ({', '.join(kinds)})" for ms, kinds in per_run.items()
        )
    if any(r.get("floor_ms") is None for r in document["results"]):
        sentence += ", measured by the last merged run; '-': a run that measured none"
    return sentence, rows


def _header(document: dict) -> list:
    settings, env = document["settings"], document["environment"]
    repeats = settings["repeats"]
    return [
        (
            f"Estimator suite on {env.get('gpu') or env.get('cpu')} ({settings['device']}"
            f"{', quick' if settings['quick'] else ''}), torch {env['torch']}, tabicl "
            f"{env['tabicl']}, tabserve {env['tabserve']}; n_estimators={N_ESTIMATORS}, "
            f"{repeats} warm repeat{'' if repeats == 1 else 's'}"
        ),
        f"checkpoints: {settings['checkpoint_note']}",
    ] + (["INCOMPLETE: the run stopped before its last job; these are the jobs it finished"]
         if document.get("complete") is False else [])  # fmt: skip


def _errors(failed: list) -> list:
    lines = ["", "Errors (recorded as results, not fatal):"]
    for r in failed:
        many = " (predict many)" if r.get("mode") == "predict_many" else ""
        lines.append(f"  {r['kind']} / {r['engine']}{many}: {r['status']}: {r.get('reason', '')}")
    return lines


def render(document: dict) -> str:
    """The printed report of an estimator-suite record (saved beside it as ``.txt``)."""
    parts = _header(document) + [
        "",
        SUITE_LEGEND,
        format_table(SUITE_COLUMNS, suite_rows(document["results"])),
    ]
    many = document.get("predict_many") or []
    if many:
        parts += ["", PREDICT_MANY_TITLE, format_table(*predict_many_table(document))]
    summary = document.get("summary") or {}
    if summary:
        parts += ["", SUMMARY_TITLE, format_table(SUMMARY_COLUMNS, summary_rows(summary))]
    floor = floor_table(document)
    if floor:
        parts += ["", f"{FLOOR_TITLE}; {floor[0]}", format_table(FLOOR_COLUMNS, floor[1])]
    failed = [r for r in document["results"] + many if r["status"] != "ok"]
    if failed:
        parts += _errors(failed)
    return "\n".join(parts)
