"""Offload capacity: the widest table each engine fits and predicts in each ``offload_mode``.

tabicl's ``offload_mode`` keeps the column stage's output, the largest tensor of a call
(members x rows x features x 128 values), on the device (``"gpu"``), in host memory (``"cpu"``)
or in a memory-mapped file (``"disk"``), and both engines fall back to the next of them, by
tabicl's rule, where the output does not fit where it was asked for. This climbs a ladder of
ever wider tables (``--rows`` train and ``--test-rows`` test rows, each of ``--features``) for
every engine (tabicl 2.2.0, tabserve) and mode: each rung is a fresh process that fits and
predicts once with the estimators' defaults (``n_estimators`` members), after one small fit +
predict that sets up the device. A ladder stops at its first rung that fails (out of memory, an
error, ``--timeout``), so its last rung that ran is the widest table that fits. Each rung keeps
its time (fit, predict), its peak memory (the CUDA allocator's, or the process's resident set on
the CPU) and, where both engines ran it, the largest difference between their probabilities.

    python benchmarks/offload_capacity.py --device cuda \
        --json benchmarks/results/offload_capacity_h100.json
    python benchmarks/offload_capacity.py --quick          # the CPU, the tiny model, small tables

Results: a line per rung, the widest table per engine and mode, and JSON (``--json``), which
``benchmarks/record.py`` renders into docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tabserve.bench import report
from tabserve.bench.runner import child_env, run_isolated

ENGINES = ("tabicl", "tabserve")
MODES = ("gpu", "cpu", "disk")
#: The ladder's widths on a GPU: the column stage's output of 8 members x 10,000 rows x 2,000
#: features is 82 GB in fp32, past one H100's memory.
FEATURES = (500, 1000, 2000, 4000, 8000)
QUICK = {"rows": 60, "test_rows": 20, "features": (4, 16), "n_estimators": 2, "size": "tiny"}


def _table(rows: int, test_rows: int, features: int, seed: int = 0):
    """A seeded classification table: (X_train, y_train, X_test), 3 classes."""
    rs = np.random.RandomState(seed)
    X = rs.randn(rows + test_rows, features).astype(np.float32)
    signal = X[:, : min(features, 5)].sum(axis=1) + 0.5 * rs.randn(rows + test_rows)
    y = np.digitize(signal, np.quantile(signal, [1 / 3, 2 / 3]))
    return X[:rows], y[:rows], X[rows:]


# ----------------------------------------------------------------------------- one rung
def child(spec_path: str) -> int:
    """Runs one rung (its spec a JSON file), writing its result as it goes."""
    import torch
    from tabserve.bench import timing

    spec = json.loads(Path(spec_path).read_text())
    result = {"status": "running"}
    out = Path(spec["result"])

    def save() -> None:
        out.write_text(json.dumps(result, indent=1, default=str))

    save()
    try:
        if spec["engine"] == "tabicl":
            from tabicl import TabICLClassifier

            extra = {"allow_auto_download": False}
        else:
            from tabserve.models.tabicl import TabICLClassifier

            extra = {}
        mode = {"gpu": False, "cpu": "cpu", "disk": "disk"}[spec["mode"]]
        params = dict(
            model_path=spec["checkpoint"], device=spec["device"], n_estimators=spec["n_estimators"],
            offload_mode=mode, disk_offload_dir=spec["disk_dir"], **extra,
        )  # fmt: skip
        device = torch.device(spec["device"])
        small = _table(64, 16, 8, seed=1)
        TabICLClassifier(**params).fit(small[0], small[1]).predict_proba(small[2])
        X_train, y_train, X_test = _table(spec["rows"], spec["test_rows"], spec["features"])
        kept_on = _watch_fallbacks() if spec["engine"] == "tabserve" else set()
        with timing.peak_memory_of(device) as memory:
            start = time.perf_counter()
            estimator = TabICLClassifier(**params).fit(X_train, y_train)
            timing.synchronize(device)
            fitted = time.perf_counter()
            proba = estimator.predict_proba(X_test)
            done = time.perf_counter()
        np.save(spec["outputs"], np.asarray(proba, dtype=np.float64))
        result.update(
            status="ok", fit_ms=(fitted - start) * 1e3, predict_ms=(done - fitted) * 1e3,
            memory=memory,
        )  # fmt: skip
        if kept_on:
            result["kept_on"] = sorted(kept_on)
    except Exception as error:  # noqa: BLE001  (the rung's result, not the process's failure)
        oom = "out of memory" in str(error).lower() or type(error).__name__ == "OutOfMemoryError"
        result.update(
            status="oom" if oom else "failed", reason=f"{type(error).__name__}: {error}"[:600]
        )
    save()
    return 0


def _watch_fallbacks() -> set:
    """The places tabserve's calls kept their column output where the mode asked for another
    (its ``tabserve`` logger says so: ``reference_args.offload_store``), filled as calls run."""
    import logging

    places: set = set()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("offload_mode=") and record.args:
                places.add(record.args[-1])

    logger = logging.getLogger("tabserve")
    logger.setLevel(logging.INFO)
    logger.addHandler(Watch())
    return places


# ----------------------------------------------------------------------------- the ladders
def run_rung(spec: dict, folder: Path, timeout_s: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, result=str(folder / "result.json"), outputs=str(folder / "proba.npy"),
                disk_dir=str(folder / "offload"))  # fmt: skip
    (folder / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(folder / "spec.json")]
    result = run_isolated(command, Path(spec["result"]), timeout_s, child_env(folder))
    shutil.rmtree(folder / "offload", ignore_errors=True)
    return {**{k: spec[k] for k in ("engine", "mode", "features", "outputs")}, **result}


def climb(args, checkpoint: Path, run_dir: Path, deadline: float, say) -> list:
    """Every engine's ladder in every mode: its rungs' results. The engines climb side by side
    (each width of a mode for every engine before the next width), so a run cut short by its
    deadline still holds both engines' rungs of the widths it reached, comparable. A rung still
    running at the deadline is stopped (``status`` ``"stopped"``) and no rung starts after it."""
    results = []
    for mode in args.modes:
        climbing = list(args.engines)
        for features in args.features:
            for engine in list(climbing):
                left = deadline - time.monotonic()
                if left <= 0:
                    results.append(_unrun(engine, mode, features, "the run's deadline passed"))
                    climbing.remove(engine)
                    continue
                spec = {
                    "engine": engine, "mode": mode, "features": features, "rows": args.rows,
                    "test_rows": args.test_rows, "n_estimators": args.n_estimators,
                    "device": args.device, "checkpoint": str(checkpoint),
                }  # fmt: skip
                folder = run_dir / f"{engine}-{mode}-{features}"
                result = run_rung(spec, folder, min(args.timeout, left))
                if result["status"] == "timeout" and left < args.timeout:
                    result.update(status="stopped", reason="still running at the run's deadline")
                results.append(result)
                say(_line(result))
                if result["status"] != "ok":
                    climbing.remove(engine)
    return results


def _unrun(engine: str, mode: str, features: int, reason: str) -> dict:
    return {"engine": engine, "mode": mode, "features": features, "status": "not run",
            "reason": reason}  # fmt: skip


def agreement(results: list) -> None:
    """Adds to each tabserve rung the largest difference from tabicl's probabilities on the same
    table (any mode of tabicl's that ran it), then drops the rungs' output files' paths (the
    files go with the run's folder)."""
    reference = {}
    for r in results:
        if r["engine"] == "tabicl" and r["status"] == "ok":
            reference.setdefault(r["features"], r["outputs"])
    for r in results:
        if r["engine"] == "tabserve" and r["status"] == "ok" and r["features"] in reference:
            ours, theirs = np.load(r["outputs"]), np.load(reference[r["features"]])
            r["max_abs_prob_diff_to_tabicl"] = float(np.max(np.abs(ours - theirs)))
    for r in results:
        r.pop("outputs", None)


def widest(results: list) -> dict:
    """``engine -> mode -> the most features of a rung that ran`` (None: not even the first)."""
    found: dict = {}
    for r in results:
        modes = found.setdefault(r["engine"], {})
        modes.setdefault(r["mode"], None)
        if r["status"] == "ok":
            modes[r["mode"]] = max(modes[r["mode"]] or 0, r["features"])
    return found


def peak_bytes(memory: dict | None) -> int | None:
    memory = memory or {}
    return memory.get("peak_allocated_bytes", memory.get("peak_rss_bytes"))


def _line(r: dict) -> str:
    head = f"{r['engine']:>8} {r['mode']:>4} {r['features']:>6} features: {r['status']}"
    if r["status"] != "ok":
        return f"{head} ({r.get('reason', '')[:120]})"
    peak = peak_bytes(r.get("memory"))
    peak_text = f", peak {peak / 2**30:.2f} GiB" if peak is not None else ""
    kept = f", kept on {'/'.join(r['kept_on'])}" if r.get("kept_on") else ""
    return (
        f"{head}, fit {r['fit_ms'] / 1e3:.2f} s, predict {r['predict_ms'] / 1e3:.2f} s"
        f"{peak_text}{kept}"
    )


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="small tables and the tiny model (tests)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--features", nargs="+", type=int, help=f"the ladder (default {FEATURES})")
    p.add_argument("--rows", type=int, help="train rows (default 8,000)")
    p.add_argument("--test-rows", type=int, help="test rows (default 2,000)")
    p.add_argument("--n-estimators", type=int, help="members (default 8, the estimators')")
    p.add_argument("--model-size", choices=("full", "tiny"), help="default: full (tiny --quick)")
    p.add_argument(
        "--checkpoint", type=Path, help="a classifier checkpoint (default: random weights)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per rung")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after which no rung runs (one still running is stopped)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = QUICK if args.quick else {}
    args.features = args.features or list(quick.get("features", FEATURES))
    args.rows = args.rows or quick.get("rows", 8000)
    args.test_rows = args.test_rows or quick.get("test_rows", 2000)
    args.n_estimators = args.n_estimators or quick.get("n_estimators", 8)
    args.model_size = args.model_size or quick.get("size", "full")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child(args.child)
    from tabserve.bench.workloads import make_checkpoint

    deadline = time.monotonic() + (args.deadline if args.deadline is not None else float("inf"))
    with tempfile.TemporaryDirectory(prefix="tabserve-offload-") as folder:
        run_dir = Path(folder)
        checkpoint = args.checkpoint or make_checkpoint(
            "clf", run_dir / "clf.ckpt", args.model_size
        )
        results = climb(args, checkpoint, run_dir, deadline, lambda line: print(line, flush=True))
        agreement(results)
    found = widest(results)
    for engine, modes in found.items():
        widths = ", ".join(f"{mode} {width or '-'}" for mode, width in modes.items())
        print(f"widest ({args.rows:,} + {args.test_rows:,} rows): {engine} {widths}")
    if args.json:
        report.write_json(args.json, {
            "benchmark": "offload_capacity",
            "environment": report.environment(),
            "command": " ".join(["python benchmarks/offload_capacity.py", *argv]),
            "device": args.device,
            "settings": {
                "rows": args.rows, "test_rows": args.test_rows, "n_estimators": args.n_estimators,
                "model_size": "checkpoint" if args.checkpoint else args.model_size,
                "features": args.features, "timeout_s": args.timeout,
            },
            "results": results,
            "widest": found,
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
