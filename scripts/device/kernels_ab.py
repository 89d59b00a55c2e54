"""A/B of the blocks' built-in CUDA kernels on the uncompiled path: every LayerNorm before a
matmul on ``tabserve::layer_norm_cast`` and the column and row stages' feed-forward halves on
``tabserve::feed_forward_resident`` ("kernels"), against the modules under autocast ("modules"),
in one process, each pair interleaved, answers compared.

    python scripts/device/kernels_ab.py --out DIR [--parts tables packed loop cached profile]

Every estimator serves the default recipe's ready preset, ``medium`` (nothing compiled, so no
background compile runs beside the timings). ``tables``: fit + predict of the estimator
suite's kinds. ``packed``: ``fit_predict_many`` over the first
``--tasks`` tasks of the many-tables population. ``loop``: a fresh estimator per task over the
same tasks. ``cached``: a ``kv_cache=True`` estimator on the ``wide-rows`` table, 1, 100 and
10,000 rows. ``profile``: the packed call with the kernels, its top CUDA kernels.

Each side serves its own copy of the checkpoint (a served model per path), so that the CUDA
graphs each captures hold its own kernels. Medians of interleaved pairs; one line per case;
``DIR/kernels_ab.json`` after each part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tabserve import TabICLClassifier, TabICLRegressor
from tabserve.bench.estimator_kinds import kind_by_name, make_table
from tabserve.bench.many_tables_population import POPULATIONS, make_task, task_specs
from tabserve.bench.workloads import make_checkpoint
from tabserve.models.tabicl.network import layers
from tabserve.models.tabicl.serving.model_cache import clear_model_cache

PAIRS = 5
KINDS = ("small", "mixed", "wide-rows", "many-class", "regression")


@contextlib.contextmanager
def modules(on: bool):
    """The blocks run the modules under autocast (the kernels' routes closed)."""
    if not on:
        yield
        return
    saved = layers._eager_cuda_autocast
    layers._eager_cuda_autocast = lambda x: None
    try:
        yield
    finally:
        layers._eager_cuda_autocast = saved


def timed(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def paired(kernels, plain, pairs: int = PAIRS) -> tuple:
    """Medians (ms) of ``kernels()`` and ``plain()`` (the latter with the modules), alternated
    ``pairs`` times after one call of each; and the two answers of the first calls."""
    a = kernels()
    with modules(True):
        b = plain()
    ta, tb = [], []
    for _ in range(pairs):
        ta.append(timed(kernels))
        with modules(True):
            tb.append(timed(plain))
    return statistics.median(ta), statistics.median(tb), a, b


def difference(a, b) -> float:
    if isinstance(a, list):
        return max((difference(x, y) for x, y in zip(a, b)), default=0.0)
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind not in "fc":
        return float((a != b).mean())  # labels: the share that differ
    return float(np.abs(a - b).max())


def line(label: str, a: float, b: float, diff: float) -> str:
    return f"{label:34s} kernels {a:9.2f}  modules {b:9.2f} ms  ({b / a:.2f}x)  max diff {diff:.1e}"


def part_tables(args) -> list:
    print("== tables: fit + predict, recipe medium")
    rows = []
    for name in KINDS:
        kind = kind_by_name(name)
        t = make_table(kind)
        cls = TabICLRegressor if kind.n_classes == 0 else TabICLClassifier
        method = "predict" if kind.n_classes == 0 else "predict_proba"

        def call(path, t=t, cls=cls, method=method):
            est = cls(model_path=path, device="cuda", recipe="medium")
            return lambda: getattr(est.fit(t["X_train"], t["y_train"]), method)(t["X_test"])

        a, b, ya, yb = paired(call(args.ckpt[cls][0]), call(args.ckpt[cls][1]))
        rows.append({"kind": name, "ms": (a, b), "max_diff": difference(ya, yb)})
        print(line(name, a, b, rows[-1]["max_diff"]), flush=True)
    return rows


def tasks(args) -> list:
    specs = [s for s in task_specs(POPULATIONS["full"], 77) if s.task == "clf"][: args.tasks]
    return [make_task(s) for s in specs]


def tables_per_second(label: str, args, data, call) -> dict:
    """``call(path)`` (a callable answering every task of ``data`` on the served model of that
    checkpoint) for the kernels' and the modules' checkpoints, paired."""
    kernels, modules_side = (call(path) for path in args.ckpt[TabICLClassifier])
    a, b, ya, yb = paired(kernels, modules_side, 3)
    result = {"ms": (a, b), "tables_per_s": (len(data) / a * 1e3, len(data) / b * 1e3),
              "max_diff": difference(ya, yb)}  # fmt: skip
    print(line(label, a, b, result["max_diff"]), flush=True)
    return result


def part_packed(args, data) -> dict:
    print(f"== packed: fit_predict_many over {len(data)} classification tasks")

    def call(path):
        est = TabICLClassifier(model_path=path, device="cuda", recipe="medium")
        return lambda: est.fit_predict_many(data, "predict_proba")

    return tables_per_second("packed", args, data, call)


def part_loop(args, data) -> dict:
    print(f"== loop: a fresh estimator per task over {len(data)} classification tasks")

    def call(path):
        return lambda: [
            TabICLClassifier(model_path=path, device="cuda", recipe="medium")
            .fit(X, y)
            .predict_proba(T)
            for X, y, T in data
        ]

    return tables_per_second("loop", args, data, call)


def part_cached(args) -> dict:
    """1 and 100 rows interleaved; 10,000 rows one side after the other (the graphs of both
    served models at once do not fit an H100), each side's estimator fitted under its own
    kernels and dropped before the other's."""
    print("== cached: wide-rows, kv_cache=True, recipe medium")
    t = make_table(kind_by_name("wide-rows"), n_test=10_000)

    def fitted(side: int):
        est = TabICLClassifier(model_path=args.ckpt[TabICLClassifier][side], device="cuda",
                               kv_cache=True, recipe="medium")  # fmt: skip
        with modules(side == 1):
            return est.fit(t["X_train"], t["y_train"])

    result = {}
    few_rows(fitted(0), fitted(1), t["X_test"], result)
    answers, times = [], []
    for side in (0, 1):
        clear_model_cache()
        torch.cuda.empty_cache()
        est = fitted(side)
        with modules(side == 1):
            answers.append(est.predict_proba(t["X_test"]))
            times.append(statistics.median(
                timed(lambda est=est: est.predict_proba(t["X_test"])) for _ in range(PAIRS)
            ))  # fmt: skip
        del est
    result[10_000] = {"ms": tuple(times), "max_diff": difference(*answers)}
    print(line("10000 rows (one side, then the other)", *times, result[10_000]["max_diff"]))
    return result


def few_rows(kernels, plain, X_test, result: dict) -> None:
    """1 and 100 rows of ``X_test`` from the two fitted estimators, interleaved."""
    for n in (1, 100):
        X = X_test[:n]
        a, b, ya, yb = paired(lambda X=X: kernels.predict_proba(X),
                              lambda X=X: plain.predict_proba(X))  # fmt: skip
        result[n] = {"ms": (a, b), "max_diff": difference(ya, yb)}
        print(line(f"{n} rows", a, b, result[n]["max_diff"]), flush=True)


def part_profile(args, data, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    est = TabICLClassifier(model_path=args.ckpt[TabICLClassifier][0], device="cuda")
    est.fit_predict_many(data, "predict_proba")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(lambda: est.fit_predict_many(data, "predict_proba"))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                      max_name_column_width=80)  # fmt: skip
    (out / "packed_profile.txt").write_text(table)
    print(table[:6000])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parts = ("tables", "packed", "loop", "cached", "profile")
    parser.add_argument("--parts", nargs="+", default=list(parts), choices=parts)
    parser.add_argument("--tasks", type=int, default=48, help="many-tables population tasks")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as work:  # the checkpoints stay out of what comes back
        args.ckpt = {}
        for cls, task in ((TabICLClassifier, "clf"), (TabICLRegressor, "reg")):
            first = make_checkpoint(task, Path(work) / f"{task}.ckpt")
            second = Path(work) / f"{task}-modules.ckpt"
            shutil.copy(first, second)
            args.ckpt[cls] = (str(first), str(second))
        data = tasks(args) if {"packed", "loop", "profile"} & set(args.parts) else []
        run = {
            "tables": lambda: part_tables(args),
            "packed": lambda: part_packed(args, data),
            "loop": lambda: part_loop(args, data),
            "cached": lambda: part_cached(args),
            "profile": lambda: part_profile(args, data, args.out),
        }
        for name in args.parts:
            record[name] = run[name]()
            (args.out / "kernels_ab.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
