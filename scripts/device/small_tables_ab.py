"""A/Bs of the default CUDA path on small tables, in one process, each pair interleaved, answers
compared; and a profile of KV-cached predictions.

    python scripts/device/small_tables_ab.py --out DIR [--parts prep cached first]

``prep``: the members' preprocessing (encoder, constant filter, normalisations, member tables) on
the device (the default) against on the host with the member tables copied over: the
preprocessing alone, then the estimator's fit + predict. ``cached``: a ``kv_cache=True``
estimator on the suite's ``wide-rows`` table: 1, 100 and 10,000 rows, and a profile of 1 and
10,000 rows. ``first``: a fresh process's first fit + predict of a small table with the
preprocessing on the device and on the host.

The tables: the estimator suite's ``small`` and ``mixed`` kinds (full and quick) and the first
classification tasks of the many-tables population. Medians of interleaved pairs; prints one line
per table and writes ``DIR/small_tables_ab.json`` after each part (a run cut short keeps the
parts it finished).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tabserve import TabICLClassifier
from tabserve.bench.estimator_kinds import kind_by_name, make_table
from tabserve.bench.many_tables_population import POPULATIONS, make_task, task_specs
from tabserve.bench.workloads import make_checkpoint
from tabserve.models.tabicl.serving.options import describe
from tabserve.models.tabicl.sklearn import preprocessing as P

PAIRS = 9


def tables(population_tasks: int) -> list:
    out = []
    for name in ("small", "mixed"):
        for quick in (True, False):
            t = make_table(kind_by_name(name), quick=quick)
            out.append(
                (f"{name}{'-quick' if quick else ''}", t["X_train"], t["y_train"], t["X_test"])
            )
    specs = [s for s in task_specs(POPULATIONS["full"], 77) if s.task == "clf"][:population_tasks]
    for s in specs:
        X_train, y_train, X_test = make_task(s)
        label = f"task{s.index} {s.n_train}+{s.n_test}x{s.n_features}{' frame' if s.frame else ''}"
        out.append((label, X_train, y_train, X_test))
    return out


def timed(device: torch.device, call) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def paired(device, a, b, pairs: int = PAIRS) -> tuple:
    """Medians (ms) of ``a()`` and ``b()`` alternated ``pairs`` times, after one call of each."""
    a(), b()
    ta, tb = [], []
    for _ in range(pairs):
        ta.append(timed(device, a))
        tb.append(timed(device, b))
    return statistics.median(ta), statistics.median(tb)


@contextlib.contextmanager
def host_preprocessing(on: bool):
    """Every table encoder made inside runs on the host (the estimator copies the member tables
    to its device per call)."""
    if not on:
        yield
        return
    init = P.TableEncoder.__init__
    P.TableEncoder.__init__ = lambda self, device: init(self, "cpu")
    try:
        yield
    finally:
        P.TableEncoder.__init__ = init


def part_prep(args, data, device) -> list:
    print("== prep: members' preprocessing, device / host (ms, medians of pairs)")
    rows = []
    for label, X_train, y_train, X_test in data:
        est = TabICLClassifier(model_path=args.checkpoint, device=device).fit(X_train, y_train)

        def prep(where, X_train=X_train, X_test=X_test, est=est):
            encoder = P.TableEncoder(where).fit(X_train)
            table = encoder.transform(X_train)
            kept = P.ConstantFeatureFilter().fit(table)
            table, test = kept.transform(table), kept.transform(encoder.transform(X_test))
            for method, members in est.plan_.items():
                member = P.MemberPreprocessor(method, 4.0, 0).fit(table)
                joined = torch.cat([member.train_, member.transform(test)]).float()
                P.member_tables(joined, members).to(device)

        def fit_predict(host, X_train=X_train, y_train=y_train, X_test=X_test, est=est):
            def call():
                with host_preprocessing(host):
                    return est.fit(X_train, y_train).predict_proba(X_test)

            return call

        alone = paired(device, lambda: prep(device), lambda: prep("cpu"))
        whole = paired(device, fit_predict(False), fit_predict(True))
        diff = float(np.abs(fit_predict(False)() - fit_predict(True)()).max())
        rows.append({"table": label, "prep_ms": alone, "fit_predict_ms": whole, "max_diff": diff})
        print(f"{label:32s} prep {alone[0]:7.2f} / {alone[1]:7.2f}   fit+predict {whole[0]:8.2f} / "
              f"{whole[1]:8.2f} ({whole[1] / whole[0]:.2f}x)  max diff {diff:.1e}", flush=True)  # fmt: skip
    return rows


def part_cached(args, device, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    print("== cached: wide-rows, kv_cache=True")
    t = make_table(kind_by_name("wide-rows"), n_test=10_000)
    est = TabICLClassifier(model_path=args.checkpoint, device=device, kv_cache=True)
    fit_ms = timed(device, lambda: est.fit(t["X_train"], t["y_train"]))
    result = {"fit_ms": fit_ms, "preset": describe(est.served_options_), "rows": {}}
    print(f"fit {fit_ms:.0f} ms ({result['preset']})")
    for n in (1, 100, 10_000):
        X = t["X_test"][:n]
        est.predict_proba(X)
        times = [timed(device, lambda X=X: est.predict_proba(X)) for _ in range(5)]
        result["rows"][n] = statistics.median(times)
        print(f"{n:6d} rows {result['rows'][n]:8.2f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(out / "cached_profile.txt", "w") as f:
        for n in (1, 10_000):
            with profile(activities=activities) as prof:
                timed(device, lambda n=n: est.predict_proba(t["X_test"][:n]))
            averages = prof.key_averages()
            f.write(
                f"== {n} rows\n{averages.table(sort_by=sort, row_limit=25, max_name_column_width=70)}\n"
            )
            f.write(
                averages.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=70)
            )
    print(f"profiles in {out / 'cached_profile.txt'}")
    return result


FIRST = """
import sys, time
start = time.perf_counter()
import numpy as np, torch
torch.zeros(1, device="{device}")
sys.path.insert(0, "{scripts}")
from small_tables_ab import host_preprocessing
from tabserve import TabICLClassifier
from tabserve.bench.estimator_kinds import kind_by_name, make_table
t = make_table(kind_by_name("{kind}"), quick={quick})
ready = time.perf_counter()
with host_preprocessing({host}):
    est = TabICLClassifier(model_path="{checkpoint}", device="{device}").fit(t["X_train"], t["y_train"])
    est.predict_proba(t["X_test"])
print((time.perf_counter() - ready) * 1e3)
"""


def part_first(args, device) -> list:
    print("== first: a fresh process's first fit + predict (ms, after imports), device / host")
    rows = []
    for kind, quick in (("small", True), ("small", False), ("mixed", True)):
        times = {False: [], True: []}
        for repeat in range(4):
            for host in (False, True) if repeat % 2 == 0 else (True, False):
                code = FIRST.format(device=device, scripts=Path(__file__).parent, kind=kind,
                                    quick=quick, host=host, checkpoint=args.checkpoint)  # fmt: skip
                done = subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, check=False
                )
                if done.returncode:
                    print(done.stderr[-2000:])
                    return rows
                times[host].append(float(done.stdout.split()[-1]))
        a, b = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"kind": kind, "quick": quick, "ms": (a, b), "all": times})
        print(
            f"{kind}{'-quick' if quick else '':6s} {a:8.1f} / {b:8.1f} ({b / a:.2f}x)", flush=True
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["prep", "cached", "first"],
        choices=("prep", "cached", "first"),
    )
    parser.add_argument("--checkpoint", help="classifier checkpoint (default: random weights)")
    parser.add_argument("--size", default="full", choices=("full", "tiny"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tasks", type=int, default=6, help="many-tables population tasks")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    data = tables(args.tasks)
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    parts = {
        "prep": lambda: part_prep(args, data, device),
        "cached": lambda: part_cached(args, device, args.out),
        "first": lambda: part_first(args, device),
    }
    with tempfile.TemporaryDirectory() as work:  # the checkpoint stays out of what comes back
        if args.checkpoint is None:
            args.checkpoint = str(make_checkpoint("clf", Path(work) / "clf.ckpt", size=args.size))
        for name in args.parts:
            record[name] = parts[name]()
            (args.out / "small_tables_ab.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
