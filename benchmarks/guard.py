"""Regression guard: re-runs the headline cases of every benchmark on this machine and compares
each figure with the committed record of the same device under ``benchmarks/results/``.

One command on the GPU machine (a few minutes; run it from the repository root)::

    python benchmarks/guard.py --out guard-out           # all four benchmarks
    python benchmarks/guard.py --only string_lookup      # some of them
    python benchmarks/guard.py --full                    # also the compiled presets (+6 min)
    python benchmarks/guard.py --compare guard-out       # judge a finished run again

The benchmarks and their headline cases are the table ``HEADLINES``: the string lookup's large
cases (``benchmarks/string_lookup.py``), AlignCategories on two workloads
(``benchmarks/align_categories.py``), the raw-model presets that compile nothing on the driver's
small and medium workloads (``python -m tabserve.bench``; ``--full`` adds the compiled ``small``
and ``large-fp8`` presets), and the estimator suite's ``mixed`` kind
(``python -m tabserve.bench estimators``). Each runs in its own process with a time limit
and writes its usual JSON under ``--out``.

A figure (a median time, ms) regresses when ``new / recorded > 1 + tolerance``. The tolerance
is the larger of the benchmark's floor (``Headline.floor``: 10 %, 15 % for AlignCategories) and
the two measurements' own spreads, ``(p80 - p20) / median`` of the record plus that of the new
run, so that a noisy figure needs a larger change to fail. The floors sit above the spreads of
the H200 records' headline figures (under 1 % for the string lookup's eager cases, 2-6 % for
AlignCategories and the presets) and above the 4.5 % between two harnesses timing one lookup
kernel there (0.720 and 0.752 ms). A figure the record lacks is
reported and not judged; a benchmark that fails, or a headline figure the new run lacks, fails
the guard. The exit status is 1 on any failure, and every failing figure is printed with ``!!!``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from record import DRIVER_SCHEMA, ROOT, SUITE_SCHEMA

#: (median, p20, p80) of one figure, ms.
Figure = tuple[float, Optional[float], Optional[float]]


def _figure(entry: dict) -> Optional[Figure]:
    median = entry.get("median_ms") if isinstance(entry, dict) else None
    if median is None:
        return None
    return float(median), entry.get("p20_ms"), entry.get("p80_ms")


def lookup_figures(record: dict) -> dict[str, Figure]:
    """``case / method`` -> lookup figure, from a string-lookup record."""
    out = {}
    for case in record.get("cases", []):
        for method, result in case.get("methods", {}).items():
            if not result.get("check", {}).get("ok", True):
                continue  # wrong codes are the benchmark's own failure
            figure = _figure(result.get("lookup"))
            if figure:
                out[f"{case['case']['name']} / {method}"] = figure
    return out


def align_figures(record: dict) -> dict[str, Figure]:
    """``workload / method`` -> total time over the prediction batches, from an align record."""
    out = {}
    for workload in record.get("workloads", []):
        for method, result in workload.get("methods", {}).items():
            figure = _figure(result)
            if figure:
                out[f"{workload['workload']} / {method}"] = figure
    return out


def driver_figures(record: dict) -> dict[str, Figure]:
    """``workload / cell one-shot|kv`` -> figure, from a driver record (the last result of each
    pair counts, as in a merged record)."""
    out = {}
    for result in record.get("results", []):
        if result.get("status") != "ok":
            continue
        for phase, label in (("one_shot", "one-shot"), ("kv", "kv")):
            figure = _figure(result.get(phase))
            if figure:
                out[f"{result['workload']} / {result['cell']} {label}"] = figure
    return out


def suite_figures(record: dict) -> dict[str, Figure]:
    """``kind / engine warm`` -> warm fit + predict figure, from an estimator-suite record."""
    out = {}
    for result in record.get("results", []):
        if result.get("status") != "ok" or result.get("mode", "suite") != "suite":
            continue
        figure = _figure(result.get("warm"))
        if figure:
            out[f"{result['kind']} / {result['engine']} warm"] = figure
    return out


@dataclass(frozen=True)
class Headline:
    """One benchmark's headline run: its command (``{out}`` is replaced by the JSON path, or the
    output folder), the committed record it is judged against, how figures are read
    from both, which of them are judged (glob patterns), the figures that must come back, and the
    tolerance floor."""

    name: str
    record: str  # file name under benchmarks/results/, {device} replaced
    command: tuple[str, ...]
    figures: Callable[[dict], dict[str, Figure]]
    judged: tuple[str, ...]
    required: tuple[str, ...]
    floor: float
    timeout_s: float
    full_only: bool = False
    #: Where the command writes a folder of JSON files (the driver, the estimator suite): the
    #: schema prefix of the records in it that hold the run's results. Empty: one JSON file.
    output_schema: str = ""

    @property
    def output_dir(self) -> bool:
        return bool(self.output_schema)


LOOKUP_CASES = (
    "random-L4096-V200k-Q100k",
    "unknown50-L4096-V200k-Q100k",
    "middle-L64-V200k-Q100k",
    "cols4-L64-V200k-Q100k",
    "random-L8-V200k-Q100k",
)
LOOKUP_METHODS = ("tabserve cuda", "tabserve cuda compiled")
ALIGN_WORKLOADS = ("credit-g", "Diabetes130US")
ALIGN_METHODS = ("tabserve eager", "tabserve compiled")
#: Driver runs: (workload, cells, compiled); the presets that compile run only with --full.
DRIVER_RUNS = (
    ("small", ("medium", "exact"), False),
    ("medium", ("medium",), False),
    ("small", ("small",), True),
    ("large", ("large-fp8",), True),
)
SUITE_KINDS = ("mixed",)


def _driver_command(workload: str, cells: Sequence[str], timeout_s: float) -> tuple[str, ...]:
    return (
        "-m", "tabserve.bench", "--device", "cuda", "--quiet", "--workloads", workload,
        "--cells", *cells, "--no-gate-reference", "--skip-phases", "end_to_end", "--no-plot",
        "--no-user-promotions", "--timeout", str(int(timeout_s)), "--out", "{out}",
    )


HEADLINES: tuple[Headline, ...] = (
    Headline(
        "string_lookup",
        "string_lookup_{device}.json",
        ("benchmarks/string_lookup.py", "--device", "cuda", "--quiet", "--cases", *LOOKUP_CASES,
         "--methods", *LOOKUP_METHODS, "--out", "{out}"),
        lookup_figures,
        tuple(f"* / {m}" for m in LOOKUP_METHODS),
        tuple(f"{c} / {m}" for c in LOOKUP_CASES for m in LOOKUP_METHODS),
        floor=0.10,
        timeout_s=240,
    ),
    Headline(
        "align_categories",
        "align_categories_{device}.json",
        ("benchmarks/align_categories.py", "--device", "cuda", "--no-peer", "--budget", "0.2",
         "--workloads", *ALIGN_WORKLOADS, "--out", "{out}"),
        align_figures,
        tuple(f"* / {m}" for m in ALIGN_METHODS),
        tuple(f"{w} / {m}" for w in ALIGN_WORKLOADS for m in ALIGN_METHODS),
        floor=0.15,
        timeout_s=180,
    ),
    *(
        Headline(
            f"presets_{workload}{'_compiled' if compiled else ''}",
            "{device}.json",
            _driver_command(workload, cells, 280 if compiled else 200),
            driver_figures,
            tuple(f"{workload} / {cell} *" for cell in cells),
            tuple(f"{workload} / {cell} one-shot" for cell in cells),
            floor=0.10,
            timeout_s=320 if compiled else 300,
            full_only=compiled,
            output_schema=DRIVER_SCHEMA,
        )
        for workload, cells, compiled in DRIVER_RUNS
    ),
    Headline(
        "estimator_suite",
        "estimator_suite_{device}.json",
        ("-m", "tabserve.bench", "estimators", "--device", "cuda", "--quiet", "--kinds",
         *SUITE_KINDS, "--recipes", "auto", "--repeats", "3", "--no-predict-many", "--out",
         "{out}"),
        suite_figures,
        ("* / tabserve-*",),
        tuple(f"{k} / tabserve-auto warm" for k in SUITE_KINDS),
        floor=0.10,
        timeout_s=240,
        output_schema=SUITE_SCHEMA,
    ),
)


def spread(figure: Figure) -> float:
    """(p80 - p20) / median, 0 when the percentiles are missing."""
    median, p20, p80 = figure
    if p20 is None or p80 is None or median <= 0:
        return 0.0
    return max(0.0, (p80 - p20) / median)


@dataclass
class Verdict:
    benchmark: str
    figure: str
    state: str  # ok, faster, REGRESSED, MISSING, no record
    new: Optional[float] = None
    recorded: Optional[float] = None
    ratio: Optional[float] = None
    tolerance: Optional[float] = None

    @property
    def failed(self) -> bool:
        return self.state in ("REGRESSED", "MISSING")


def judge(headline: Headline, new: dict[str, Figure], recorded: dict[str, Figure]) -> list[Verdict]:
    """One verdict per judged figure of the new run, plus MISSING for headline figures it lacks."""
    new = {k: v for k, v in new.items() if any(fnmatch.fnmatchcase(k, p) for p in headline.judged)}
    verdicts = []
    for name in headline.required:
        if name not in new:
            verdicts.append(Verdict(headline.name, name, "MISSING", recorded=(
                recorded[name][0] if name in recorded else None)))
    for name, figure in sorted(new.items()):
        if name not in recorded:
            verdicts.append(Verdict(headline.name, name, "no record", new=figure[0]))
            continue
        old = recorded[name]
        tolerance = max(headline.floor, spread(old) + spread(figure))
        ratio = figure[0] / old[0] if old[0] > 0 else float("inf")
        state = "REGRESSED" if ratio > 1 + tolerance else "faster" if ratio < 1 - tolerance else "ok"
        verdicts.append(Verdict(headline.name, name, state, figure[0], old[0], ratio, tolerance))
    return verdicts


def device_name() -> str:
    """The record suffix of this machine: ``h200`` for an H200, else the GPU's name in lower case
    without spaces, ``cpu`` without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return "h200" if "h200" in name else name.replace("nvidia", "").strip().replace(" ", "-")


def _read_json(path: Path) -> dict:
    with open(path) as file:
        return json.load(file)


def read_run(headline: Headline, out: Path) -> Optional[dict]:
    """The JSON a headline's command wrote under ``out`` (None when it wrote none)."""
    if headline.output_dir:
        folder = out / headline.name
        paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
        records = [_read_json(p) for p in paths]
        schema = headline.output_schema
        records = [r for r in records if str(r.get("schema", "")).startswith(schema)]
        if not records:
            return None
        return {"results": [r for record in records for r in record.get("results", [])]}
    path = out / f"{headline.name}.json"
    return _read_json(path) if path.exists() else None


def run_headline(headline: Headline, out: Path, log) -> dict:
    """Runs one headline's command; returns {"returncode", "seconds", "log"}."""
    target = out / headline.name if headline.output_dir else out / f"{headline.name}.json"
    argv = [sys.executable, *(str(target) if a == "{out}" else a for a in headline.command)]
    log_path = out / f"{headline.name}.log"
    start = time.perf_counter()
    print(f"== {headline.name}: {' '.join(argv[1:])}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as file:
        try:
            returncode = subprocess.run(
                argv, cwd=ROOT, stdout=file, stderr=subprocess.STDOUT, env=env,
                timeout=headline.timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    seconds = round(time.perf_counter() - start, 1)
    log(f"   {headline.name}: exit {returncode} after {seconds} s (log: {log_path})")
    return {"returncode": returncode, "seconds": seconds, "log": str(log_path)}


def compare(headlines: Iterable[Headline], out: Path, device: str, results_dir: Path,
            runs: Optional[dict] = None) -> tuple[list[Verdict], list[str]]:
    """Verdicts of every figure of the runs under ``out``, and the failures that are not figures
    (a command that failed, a record that is missing)."""
    verdicts: list[Verdict] = []
    problems: list[str] = []
    for headline in headlines:
        run = (runs or {}).get(headline.name)
        if run is not None and run["returncode"] != 0:
            problems.append(f"{headline.name}: exit {run['returncode']} (log: {run['log']})")
        record_path = results_dir / headline.record.format(device=device)
        if not record_path.exists():
            problems.append(f"{headline.name}: no record {record_path}")
            continue
        new = read_run(headline, out)
        new_figures = headline.figures(new) if new is not None else {}
        verdicts.extend(judge(headline, new_figures, headline.figures(_read_json(record_path))))
    return verdicts, problems


def _format(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if value >= 100 else f"{value:.{digits}f}"


def report(verdicts: Sequence[Verdict], problems: Sequence[str]) -> str:
    """The verdict table, failures last and marked ``!!!``."""
    width = max([len(f"{v.benchmark}: {v.figure}") for v in verdicts] + [20])
    lines = [f"{'figure':{width}}  {'recorded':>9}  {'new':>9}  {'new/rec':>7}  {'tol':>5}  verdict"]
    for v in sorted(verdicts, key=lambda v: (v.failed, v.benchmark, v.figure)):
        ratio = "-" if v.ratio is None else f"{v.ratio:.3f}"
        tolerance = "-" if v.tolerance is None else f"{v.tolerance:.0%}"
        mark = "!!! " if v.failed else ""
        lines.append(
            f"{v.benchmark + ': ' + v.figure:{width}}  {_format(v.recorded):>9}  "
            f"{_format(v.new):>9}  {ratio:>7}  {tolerance:>5}  {mark}{v.state}"
        )
    for problem in problems:
        lines.append(f"!!! {problem}")
    failed = sum(v.failed for v in verdicts) + len(problems)
    judged = sum(v.ratio is not None for v in verdicts)
    lines.append(
        f"{'!!! GUARD FAILED' if failed else 'guard passed'}: {judged} figures judged, "
        f"{sum(v.state == 'REGRESSED' for v in verdicts)} regressed, "
        f"{sum(v.state == 'MISSING' for v in verdicts)} missing, {len(problems)} other failures, "
        f"{sum(v.state == 'faster' for v in verdicts)} faster than recorded"
    )
    return "\n".join(lines)


def select(names: Optional[Sequence[str]], full: bool) -> list[Headline]:
    """The headlines to run: all (the compiled presets with ``full`` only), or those whose name
    starts with one of ``names``."""
    pool = [h for h in HEADLINES if full or not h.full_only]
    if not names:
        return pool
    chosen = [h for h in pool if any(h.name.startswith(n) for n in names)]
    if not chosen:
        raise SystemExit(f"no benchmark matches {list(names)}; known: "
                         f"{', '.join(h.name for h in HEADLINES)}")
    return chosen


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="guard-out", help="folder of the runs' JSON and logs")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="benchmarks to run: names or their beginnings (string, align, "
                        "presets, estimator)")
    parser.add_argument("--full", action="store_true",
                        help="also the compiled presets (small, large-fp8: about 6 min more)")
    parser.add_argument("--compare", metavar="FOLDER",
                        help="run nothing: judge the runs already under FOLDER")
    parser.add_argument("--device", help="record suffix (default: this machine's, e.g. h200)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"),
                        help="folder of the committed records")
    parser.add_argument("--list", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    headlines = select(args.only, args.full)
    if args.list:
        for h in headlines:
            print(f"{h.name:28s} {h.record:30s} {' '.join(h.command)}")
        return 0
    device = args.device or device_name()
    results_dir = Path(args.results)
    runs = None
    if args.compare:
        out = Path(args.compare)
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        runs = {h.name: run_headline(h, out, print) for h in headlines}
    verdicts, problems = compare(headlines, out, device, results_dir, runs)
    text = report(verdicts, problems)
    print(text)
    if not args.compare:
        payload = {
            "benchmark": "guard",
            "device": device,
            "runs": runs,
            "verdicts": [v.__dict__ for v in verdicts],
            "problems": problems,
        }
        (out / "guard.json").write_text(json.dumps(payload, indent=1))
    return 1 if problems or any(v.failed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
