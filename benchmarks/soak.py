"""Soak benchmark: many predictions from one loaded TabICLv2, watching latency and memory drift.

Serves ``--predictions`` predictions (default 10,000; ``--quick``: 300), each on a fresh random
table (fresh values, labels and a shape drawn from a few serving sizes), from one model loaded
once. Every window of predictions reports its median / p90 latency, the process's resident set
size and, on CUDA, allocated / reserved memory. After the warm-up windows nothing should grow:
the verdict compares the last window with the first one after warm-up.

Then a concurrency check: two host threads predicting the same tables (on CUDA each on its own
stream) must give exactly the single-threaded results.

``--estimators``: each prediction is a fresh ``TabICLClassifier`` fitted and predicting on the
table's host arrays instead, through the process-wide model cache (the way cross-validation and
one-estimator-per-request servers use it), its bucket grid cycling through more grids than the
cache keeps, so models are evicted and rebuilt all along; the cache's bound is checked after
every call.

    python benchmarks/soak.py --quick                    # CPU: about a minute on 2 cores
    python benchmarks/soak.py --device cuda --size full  # H200: 10,000 full-size predictions
    python benchmarks/soak.py --device cuda --size full --preset medium
    python benchmarks/soak.py --estimators --quick       # the estimator path, CPU

Without ``--checkpoint`` a safetensors checkpoint of a classifier with seeded random weights is written
to a temporary folder (``--size tiny`` by default on CPU, the released architecture with ``full``):
latency and memory do not depend on the weights' values. Results: a table per window, a verdict,
and JSON (``--json``, default tabserve-results/soak-<device>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import default_json, print_table, write_json
from tabserve.bench.timing import MiB, malloc_trim, percentile, rss_bytes, time_once
from tabserve.models.tabicl import TabICLv2, TabICLv2Config

#: Architecture overrides of the small model (tabicl's constructor names); {} = released v2.
SIZES = {
    "tiny": {
        "embed_dim": 32,
        "col_num_inds": 16,
        "col_num_blocks": 2,
        "row_num_blocks": 2,
        "icl_num_blocks": 2,
    },
    "full": {},
}
#: Table shapes a server sees (train rows, test rows, features); each prediction draws one.
SHAPES = {
    "tiny": [(32, 8, 4), (64, 16, 8), (128, 32, 6), (200, 50, 10)],
    "full": [(256, 64, 16), (1024, 256, 32), (2048, 512, 64), (4096, 1024, 100)],
}
#: Growth after warm-up that still counts as "none": allocator noise, not a leak.
RSS_TOLERANCE = 32 * MiB
#: The same for allocated device memory: cuBLAS / cuDNN workspaces and autocast's weight-cast
#: cache move it by a few MiB in both directions with the table shape (seen on the H200:
#: 174.9 to 176.8 MiB over 3,706 predictions); a leak grows past this and keeps growing.
ALLOCATED_TOLERANCE = 8 * MiB
LATENCY_DRIFT_TOLERANCE = 0.25


def write_checkpoint(size: str, folder: Path) -> Path:
    """A tabserve safetensors checkpoint of a classifier with seeded random weights."""
    torch.manual_seed(0)
    model = TabICLv2(TabICLv2Config(**SIZES[size]))  # weights start uninitialised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("rope.freqs"):  # the RoPE frequencies are set by the constructor
                p.normal_(0, 0.05)
    return model.save_safetensors(folder / f"tabiclv2-clf-{size}.safetensors")


def random_table(generator: torch.Generator, shape, device) -> tuple:
    """A fresh table ``X (1, N + M, H)`` and labels ``y (1, N)`` of 2 to 5 classes."""
    n_train, n_test, features = shape
    classes = int(torch.randint(2, 6, (1,), generator=generator))
    X = torch.randn(1, n_train + n_test, features, generator=generator)
    y = (torch.randperm(n_train, generator=generator) % classes).float()[None]
    return X.to(device), y.to(device)


class EstimatorCalls:
    """``model(X, y)`` as a fresh classifier's fit + predict_proba on host arrays. Its bucket
    grid moves to the next of :data:`ESTIMATOR_GRIDS` every :data:`CALLS_PER_GRID` calls: more
    grids than the model cache keeps, so served models are built and evicted all along, while
    most calls find theirs cached. Records the most served models held."""

    def __init__(self, path: Path, device: torch.device, recipe: str | None):
        self.path, self.device, self.recipe = path, device, recipe
        self.calls, self.most_served = 0, 0

    def __call__(self, X, y):
        from tabserve.buckets import BucketGrid
        from tabserve.models.tabicl import TabICLClassifier
        from tabserve.models.tabicl.serving.model_cache import cache_info

        n_train = y.shape[1]
        grids = ESTIMATOR_GRIDS
        grid = BucketGrid(train_rows=grids[self.calls // CALLS_PER_GRID % len(grids)])
        self.calls += 1
        clf = TabICLClassifier(
            model_path=self.path, device=self.device, n_estimators=2, recipe=self.recipe,
            bucket_grid=grid,
        )  # fmt: skip
        table = X[0].cpu().numpy()
        clf.fit(table[:n_train], y[0].cpu().numpy().astype(int))
        proba = torch.from_numpy(clf.predict_proba(table[n_train:]))[None]
        self.most_served = max(self.most_served, cache_info()["served_models"])
        return proba


#: Bucket grids the estimator stream cycles through (train-row grids; the other axes default).
ESTIMATOR_GRIDS = [tuple(64 * 2**i * k for i in range(8)) for k in (1, 3, 5, 7, 9, 11)]
CALLS_PER_GRID = 25


def memory_now(device: torch.device) -> dict:
    malloc_trim()
    row = {"rss_mib": rss_bytes() / MiB}
    if device.type == "cuda":
        row["allocated_mib"] = torch.cuda.memory_allocated(device) / MiB
        row["reserved_mib"] = torch.cuda.memory_reserved(device) / MiB
    return row


def soak(
    model, device, size: str, predictions: int, window: int, seed: int, deadline: float = math.inf
) -> list:
    """Per-window latency and memory rows over ``predictions`` fresh tables (fewer when the
    ``time.monotonic()`` deadline passes first: the last row then closes a partial window)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = SHAPES[size]
    rows, latencies = [], []
    for i in range(predictions):
        stop = time.monotonic() > deadline
        shape = shapes[int(torch.randint(len(shapes), (1,), generator=generator))]
        X, y = random_table(generator, shape, device)
        ms, out = time_once(lambda X=X, y=y: model(X, y), device)
        assert out.shape[:2] == (1, shape[1]) and bool(torch.isfinite(out).all())
        latencies.append(ms)
        if (i + 1) % window == 0 or i + 1 == predictions or stop:
            rows.append(
                {
                    "predictions": i + 1,
                    "median_ms": statistics.median(latencies),
                    "p90_ms": percentile(latencies, 90),
                    **memory_now(device),
                }
            )
            print("  ".join(f"{k} {v:.1f}" for k, v in rows[-1].items()), flush=True)
            latencies = []
        if stop:
            break
    return rows


def verdict(rows: list, warmup_windows: int) -> dict:
    """Growth of the last window over the first one after warm-up."""
    after = rows[min(warmup_windows, len(rows) - 1) :]  # a short run keeps its last window
    first, last = after[0], rows[-1]
    result = {
        "after_warmup_predictions": first["predictions"],
        "latency_drift": last["median_ms"] / first["median_ms"] - 1,
        "rss_growth_mib": last["rss_mib"] - first["rss_mib"],
        "rss_peak_growth_mib": max(r["rss_mib"] for r in after) - first["rss_mib"],
    }
    for key in ("allocated_mib", "reserved_mib"):
        if key in last:
            result[key.replace("_mib", "_growth_mib")] = last[key] - first[key]
    grows = (
        result["rss_growth_mib"] * MiB > RSS_TOLERANCE
        or result.get("allocated_growth_mib", 0) * MiB > ALLOCATED_TOLERANCE
    )
    slows = result["latency_drift"] > LATENCY_DRIFT_TOLERANCE
    result["ok"] = not grows and not slows
    result["summary"] = (
        "memory grows after warm-up" if grows else "no memory growth after warm-up"
    ) + ("; latency drifts up" if slows else "; latency steady")
    return result


def concurrency_check(
    model, device, size: str, tables: int, seed: int, precision=contextlib.nullcontext
) -> dict:
    """Two host threads (CUDA: one stream each) against one thread on the same tables.

    ``precision()`` gives the context every thread predicts under (autocast state is per
    thread)."""
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = [random_table(generator, SHAPES[size][i % 2], device) for i in range(tables)]
    with precision():
        expected = [model(X, y) for X, y in inputs]
    results: dict = {}

    def serve(worker: int) -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context, precision():
            results[worker] = [model(X, y) for X, y in inputs[worker::2]]
        if stream is not None:
            stream.synchronize()

    threads = [threading.Thread(target=serve, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [None] * tables
    for worker in (0, 1):
        got[worker::2] = results[worker]
    diffs = [float((a - b).abs().max()) for a, b in zip(got, expected)]
    return {
        "tables": tables,
        "mode": "2 threads, one CUDA stream each" if device.type == "cuda" else "2 threads (CPU)",
        "identical": all(torch.equal(a, b) for a, b in zip(got, expected)),
        "max_abs_diff": max(diffs),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predictions", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="300 predictions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="tiny on CPU, full on CUDA"
    )
    parser.add_argument("--checkpoint", type=Path, help="a TabICLv2 classifier .ckpt/.safetensors")
    parser.add_argument("--windows", type=int, default=20, help="report rows over the run")
    parser.add_argument("--warmup-windows", type=int, default=2)
    parser.add_argument("--concurrency-tables", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16"),
        default="fp32",
        help="fp16 / bf16: autocast, as the reduced-precision serving presets run",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=math.inf, help="stop the stream early after this"
    )
    parser.add_argument(
        "--preset",
        help="serve through ServedTabICL with this serving preset (e.g. medium: one CUDA graph "
        "per bucket; its own precision applies, leave --precision at fp32)",
    )
    parser.add_argument(
        "--estimators", action="store_true",
        help="fresh TabICLClassifier fit + predict per table through the model cache (--preset: "
        "its recipe)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.preset and args.precision != "fp32":
        parser.error("--preset brings its own precision: leave --precision at fp32")
    device = torch.device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "tiny")
    predictions = 300 if args.quick else args.predictions
    window = max(1, predictions // args.windows)

    folder = tempfile.TemporaryDirectory()
    path = args.checkpoint or write_checkpoint(size, Path(folder.name))
    model = TabICLv2.from_checkpoint(path, device=device)
    if args.estimators:
        model = EstimatorCalls(path, device, args.preset)
    elif args.preset:
        from tabserve.models.tabicl.serving.served import ServedTabICL

        model = ServedTabICL(model, args.preset)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.precision)

    def precision():
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    start = memory_now(device)
    deadline = time.monotonic() + args.max_seconds
    with precision():
        rows = soak(model, device, size, predictions, window, args.seed, deadline)
    served = rows[-1]["predictions"]
    result = verdict(rows, args.warmup_windows)
    concurrency = concurrency_check(
        model, device, size, args.concurrency_tables, args.seed, precision
    )

    print_table(
        f"soak: {served} of {predictions} predictions, TabICLv2 {size} "
        f"{args.preset or args.precision} on {device} "
        f"(torch threads {torch.get_num_threads()})",
        list(rows[0]),
        [[f"{v:.2f}" if isinstance(v, float) else v for v in r.values()] for r in rows],
    )
    print(f"memory before the first prediction: {start}")
    print(
        f"after warm-up ({result['after_warmup_predictions']} predictions): latency drift "
        f"{result['latency_drift']:+.1%}, RSS growth {result['rss_growth_mib']:+.1f} MiB "
        f"(peak {result['rss_peak_growth_mib']:+.1f})"
        + "".join(
            f", {k.split('_')[0]} {result[k]:+.1f} MiB"
            for k in ("allocated_growth_mib", "reserved_growth_mib")
            if k in result
        )
    )
    print(f"verdict: {result['summary']}")
    bounded = True
    if args.estimators:
        from tabserve.models.tabicl.serving.model_cache import MAX_SERVED_MODELS

        bounded = model.most_served <= MAX_SERVED_MODELS
        result["estimator_calls"] = model.calls
        result["most_served_models"] = model.most_served
        print(
            f"model cache: at most {model.most_served} served models held over {model.calls} "
            f"fresh estimators (bound {MAX_SERVED_MODELS})"
        )
    print(
        f"concurrency ({concurrency['mode']}, {concurrency['tables']} tables): "
        + ("identical to one thread" if concurrency["identical"] else "DIFFERS")
        + f" (max |diff| {concurrency['max_abs_diff']:.3g})"
    )
    out = args.json or default_json(f"soak-{device.type}")
    write_json(
        out,
        {
            "benchmark": "soak",
            "size": size,
            "device": str(device),
            "precision": args.precision,
            "preset": args.preset,
            "estimators": args.estimators,
            "predictions": predictions,
            "served": served,
            "stopped_early": served < predictions,
            "window": window,
            "windows": rows,
            "memory_at_start": start,
            "verdict": result,
            "concurrency": concurrency,
        },
    )
    print(f"wrote {out}")
    folder.cleanup()
    ok = result["ok"] and concurrency["identical"] and served == predictions and bounded
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
