"""The raw-model performance targets, checked against one driver document.

Each target reads one figure of the preset cell the document promotes for a workload and route
(what ``recipe="auto"`` would serve), or, for the restart target, of the warm-cache cells, and
compares it with a threshold. Speedups are the document's (``result["speedup"]``: against the
reference cells of the same run, or of the merged runs). A target whose cell or baseline did not
run is "not measured", never "met". Speedup targets also carry the figure against the fastest
run of the same reference cell in the document's ``reference_medians`` (every merged run's): the
reference's own latency moves between runs (the H200's small fp16 reference: 30-51 ms), so the
verdict of one run can rest on a slow reference; that column shows how much.
"""

from __future__ import annotations

from dataclasses import dataclass

MET, MISSED, UNMEASURED = "met", "missed", "not measured"


@dataclass(frozen=True)
class Target:
    """``figure`` >= ``threshold`` (``at_most``: <=) for the promoted cell of ``workload`` and
    ``route``.

    figure: ``ref16`` / ``ref32`` (speedup over the reference's fp16 / fp32 cell on the route's
    phase), ``memory`` (peak allocated over the reference fp16 cell's, one-shot: for a cell
    that captures CUDA graphs the larger of its timed calls' and its cold call's, since the
    replays allocate nothing outside the graphs' pool and their peak misses it),
    ``fresh_over_warm`` (stream p50; the cell must also neither recompile nor capture), ``ready_s`` (fastest
    warm-cache restart to its first answer, any workload).
    """

    name: str
    workload: str
    route: str
    figure: str
    threshold: float
    at_most: bool = False


TARGETS = (
    Target("large one-shot vs reference fp16", "large", "one_shot", "ref16", 4.0),
    Target("large one-shot vs reference fp32", "large", "one_shot", "ref32", 10.0),
    Target("large KV-cached predict vs reference cached fp16", "large", "kv_predict", "ref16", 4.0),
    Target("small one-shot vs reference fp16", "small", "one_shot", "ref16", 10.0),
    Target("xlarge one-shot vs reference fp16", "xlarge", "one_shot", "ref16", 3.0),
    Target("xlarge peak memory over reference fp16", "xlarge", "one_shot", "memory", 1.0, True),
    Target(
        "stream fresh p50 over warm, 0 recompiles / captures",
        "stream",
        "stream",
        "fresh_over_warm",
        1.25,
        True,
    ),
    Target("restart from compile-cache artifacts, s", "*", "one_shot", "ready_s", 30.0, True),
)

#: Route of the promotion -> phase of a result (where speedups and figures live).
PHASES = {"one_shot": "one_shot", "kv_predict": "kv", "stream": "stream"}
REFERENCE_FP16 = "ref-fp16"
#: Speedup figure -> its reference cell.
REFERENCE_CELLS = {"ref16": REFERENCE_FP16, "ref32": "ref-fp32"}


def _against_fastest(target: Target, result: dict, document: dict) -> tuple[float, int] | None:
    """(fastest reference median / the cell's median, runs of that reference), or None."""
    if target.figure not in REFERENCE_CELLS:
        return None
    phase = PHASES[target.route]
    medians = (
        document.get("reference_medians", {})
        .get(result["workload"], {})
        .get(phase, {})
        .get(REFERENCE_CELLS[target.figure])
    )
    mine = result.get(phase, {}).get("median_ms") if isinstance(result.get(phase), dict) else None
    if not medians or not mine:
        return None
    return min(medians) / mine, len(medians)


def peak_allocated(result: dict, phase: str) -> int | None:
    """Peak allocated bytes of a result's ``phase``; where the cell captured CUDA graphs, the
    larger of that and its cold call's (the capture allocates the graphs' working memory, which
    their replays reuse without allocating: timed one-shot replays on the large workload peaked
    at 0.4 GB against 7.4 GB in the capturing cold call on the H200)."""
    peaks = [(result.get(phase) or {}).get("memory") or {}]
    if result.get("captures"):
        peaks.append((result.get("cold") or {}).get("memory") or {})
    values = [p["peak_allocated_bytes"] for p in peaks if p.get("peak_allocated_bytes")]
    return max(values) if values else None


def _figure(target: Target, result: dict, by_key: dict) -> float | None:
    phase = PHASES[target.route]
    if target.figure in ("ref16", "ref32"):
        return result.get("speedup", {}).get(phase, {}).get(target.figure)
    if target.figure == "memory":
        reference = by_key.get((result["workload"], REFERENCE_FP16))
        mine = peak_allocated(result, phase)
        theirs = peak_allocated(reference or {}, phase)
        return mine / theirs if mine and theirs else None
    if target.figure == "fresh_over_warm":
        stream = result.get("stream", {})
        ratio = stream.get("fresh_over_warm_p50")
        if ratio is None:
            return None
        quiet = stream.get("recompiles", 0) == 0 and not stream.get("captures")
        return ratio if quiet else float("inf")
    raise ValueError(f"unknown target figure {target.figure!r}")


def _row(target: Target, cell: str | None, value: float | None) -> dict:
    if value is None:
        verdict = UNMEASURED
    elif target.at_most:
        verdict = MET if value <= target.threshold else MISSED
    else:
        verdict = MET if value >= target.threshold else MISSED
    return {
        "target": target.name,
        "workload": target.workload,
        "cell": cell,
        "value": value,
        "threshold": target.threshold,
        "at_most": target.at_most,
        "verdict": verdict,
    }


def evaluate(document: dict, targets=TARGETS) -> list[dict]:
    """One row per target: the promoted cell, its figure and the verdict."""
    results = document.get("results", [])
    by_key = {(r["workload"], r["cell"]): r for r in results}
    rows = []
    for target in targets:
        if target.figure == "ready_s":
            ready = [
                (r["ready_ms"] / 1e3, r["cell"], r["workload"])
                for r in results
                if r.get("priming") and r.get("ready_ms") is not None and r.get("status") == "ok"
            ]
            value, cell, workload = min(ready) if ready else (None, None, target.workload)
            rows.append({**_row(target, cell, value), "workload": workload})
            continue
        promoted = document.get("promotion", {}).get(target.workload, {}).get(target.route)
        cell = promoted["preset"] if promoted else None
        result = by_key.get((target.workload, cell)) if promoted else None
        value = _figure(target, result, by_key) if result else None
        row = _row(target, cell, value)
        fastest = _against_fastest(target, result, document) if value is not None else None
        if fastest is not None:
            row["vs_fastest_reference"], row["reference_runs"] = fastest
        rows.append(row)
    return rows
