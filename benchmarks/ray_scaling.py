"""tabserve on Ray, on this machine's CPU: the many-tables job's throughput by worker layout, and
the per-batch overhead of predict_dataset against calling the estimator directly.

Both run in this process against a local Ray instance (``ray.init(num_cpus=--cpus)``):

* many tables: the many-tables suite's seeded population (``tabserve.bench.many_tables_population``,
  ``--tables`` tables, classification and regression) answered by ``fit_predict_many_dataset``
  in each worker layout of :data:`LAYOUTS` (1 worker of 2 threads, 2 workers of 1 thread), the
  same chunks of ``--tasks-per-call`` tasks in each, so the same packs; and by the estimators'
  own ``fit_predict_many`` in this process (2 threads, no Ray) as the reference. Per layout:
  the jobs' wall time (worker start included), tables per second, the start alone (a job of
  one table) and the largest difference of its answers from the reference's.
* per-batch overhead: a classifier fitted with ``kv_cache=True`` predicts ``--batches`` batches
  of ``--batch-rows`` rows directly (``predict_proba`` per batch, 2 threads) and through
  ``predict_dataset`` (one worker of 2 threads). Ray's time per batch is the span of the
  worker's tasks in Ray Data's own record (first start to last end: the worker's start-up comes
  before) over the batches; the overhead is that less the direct calls' median (the first call
  warms up). *Ray's own* cost per batch is Ray's time per batch less the callable's (the
  estimator's call and the batch's conversions), from the same record: it holds no estimator
  time, so other processes on the machine disturb it far less than the overhead.

Checkpoints: random weights of ``--model-size`` (timings are real, answers are agreement only),
or ``--checkpoint`` / ``--regressor-checkpoint``. The JSON goes to ``--json`` (default
``tabserve-results/ray-scaling-cpu.json``). On a shared machine the figures are noisy: other
processes take the same cores.

    python benchmarks/ray_scaling.py                              # full-size model
    python benchmarks/ray_scaling.py --model-size tiny --tables 12 --batches 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import default_json, print_table, write_json

#: Worker layouts of the many-tables job: (name, fit_predict_many_dataset's placement).
LAYOUTS = (
    ("1 worker x 2 threads", {"num_workers": 1, "num_cpus_per_worker": 2}),
    ("2 workers x 1 thread", {"num_workers": 2, "num_cpus_per_worker": 1}),
)
#: Each kind of task: (estimator class name, the method answered).
KINDS = {"clf": ("TabICLClassifier", "predict_proba"), "reg": ("TabICLRegressor", "predict")}
#: Threads of the calls made in this process (the reference and the direct batches).
THREADS = 2
#: Train rows of the per-batch overhead's classifier.
TRAIN_ROWS = 512


def parse_args(argv=None):
    from tabserve.bench.workloads import add_checkpoint_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_arguments(parser)
    parser.add_argument("--tables", type=int, default=24, help="tables of the many-tables job")
    parser.add_argument("--tasks-per-call", type=int, default=4)
    parser.add_argument("--batches", type=int, default=5, help="batches of the overhead job")
    parser.add_argument("--batch-rows", type=int, default=10_000)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be at least 2 (the first direct call warms up)")
    return args


def _estimator(kind: str, checkpoint: Path, **params):
    import tabserve

    return getattr(tabserve, KINDS[kind][0])(model_path=checkpoint, device="cpu", **params)


def _max_difference(got: list, want: list) -> float:
    """The largest absolute difference of two lists of answers (inf where one is a refusal or
    a label differs)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
            return float("inf")
        if a.dtype.kind != "f":
            worst = max(worst, 0.0 if np.array_equal(a, b) else float("inf"))
        else:
            worst = max(worst, float(np.abs(a - b).max(initial=0.0)))
    return worst


def many_tables(args, checkpoints: dict) -> dict:
    """The many-tables figures (module docstring)."""
    from tabserve.bench.many_tables_population import make_task, population_for, task_specs
    from tabserve.ray import fit_predict_many_dataset

    specs = task_specs(population_for("cpu", quick=False, tables=args.tables), args.seed)
    tasks = {kind: [make_task(s) for s in specs if s.task == kind] for kind in KINDS}
    # The workers serve with their own threads; n_jobs is the reference's, in this process.
    templates = {
        kind: _estimator(kind, checkpoints[kind], n_jobs=THREADS) for kind in KINDS if tasks[kind]
    }
    for kind, template in templates.items():  # reads the checkpoint once, as the workers do
        template.fit_predict_many(tasks[kind][:1], KINDS[kind][1])
    start = time.perf_counter()
    want = {
        k: t.fit_predict_many(tasks[k], KINDS[k][1], errors="return") for k, t in templates.items()
    }
    reference_s = time.perf_counter() - start

    results = []
    for name, placement in LAYOUTS:
        start = time.perf_counter()
        list(fit_predict_many_dataset(templates["clf"], tasks["clf"][:1], **placement))
        start_s = time.perf_counter() - start
        start = time.perf_counter()
        got = {
            kind: list(
                fit_predict_many_dataset(
                    template,
                    tasks[kind],
                    KINDS[kind][1],
                    tasks_per_call=args.tasks_per_call,
                    **placement,
                )
            )
            for kind, template in templates.items()
        }
        wall_s = time.perf_counter() - start
        difference = max(_max_difference(got[k], want[k]) for k in templates)
        results.append(
            {
                "layout": name,
                **placement,
                "wall_s": wall_s,
                "tables_per_s": len(specs) / wall_s,
                "start_s": start_s,
                "max_difference": difference,
                "answers": got,
            }
        )
    first = results[0]["answers"]
    for result in results:
        answers = result.pop("answers")
        result["max_difference_from_first_layout"] = max(
            _max_difference(answers[k], first[k]) for k in templates
        )
    return {
        "tables": len(specs),
        "by_kind": {kind: len(tasks[kind]) for kind in KINDS},
        "tasks_per_call": args.tasks_per_call,
        "reference": {
            "threads": THREADS,
            "wall_s": reference_s,
            "tables_per_s": len(specs) / reference_s,
        },
        "layouts": results,
    }


def batch_overhead(args, checkpoint: Path) -> dict:
    """The per-batch overhead figures (module docstring)."""
    from tabserve.ray import predict_dataset, to_pandas_in_order

    rs = np.random.RandomState(args.seed)
    rows = args.batch_rows
    X = rs.standard_normal((TRAIN_ROWS + args.batches * rows, 10)).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] + 0.3 * rs.standard_normal(len(X)) > 0).astype(np.int64)
    model = _estimator("clf", checkpoint, kv_cache=True, n_jobs=THREADS)
    model.fit(X[:TRAIN_ROWS], y[:TRAIN_ROWS])
    test = X[TRAIN_ROWS:]

    direct, want = [], []
    for b in range(args.batches):
        start = time.perf_counter()
        want.append(model.predict_proba(test[b * rows : (b + 1) * rows]))
        direct.append(time.perf_counter() - start)
    frame = pd.DataFrame(test, columns=[f"f{j}" for j in range(test.shape[1])])

    start = time.perf_counter()
    result = predict_dataset(
        model,
        frame,
        method="predict_proba",
        batch_size=rows,
        num_workers=1,
        num_cpus_per_worker=THREADS,
    ).materialize()
    job_s = time.perf_counter() - start
    got = to_pandas_in_order(result).to_numpy()
    # Ray Data's record of the worker's tasks: from the first one's start to the last one's
    # end (the worker's start-up comes before), and each task's time around the callable.
    (stats,) = [
        o
        for o in result.get_stats_summary().operators_stats
        if "_BatchPredictor" in o.operator_name
    ]
    ray_batch_s = stats.time_total_s / stats.wall_time.count
    direct_batch_s = statistics.median(direct[1:])  # the first call warms up
    return {
        "batch_rows": rows,
        "batches": args.batches,
        "train_rows": TRAIN_ROWS,
        "threads": THREADS,
        "direct_batch_s": direct,
        "direct_batch_median_s": direct_batch_s,
        "ray_job_s": job_s,
        "ray_tasks_span_s": stats.time_total_s,
        "ray_batch_s": ray_batch_s,
        "ray_task_mean_s": stats.wall_time.mean,
        "ray_callable_mean_s": stats.udf_time.mean,
        "ray_cost_per_batch_s": ray_batch_s - stats.udf_time.mean,
        "overhead_per_batch_s": ray_batch_s - direct_batch_s,
        "overhead_share": (ray_batch_s - direct_batch_s) / direct_batch_s,
        "max_difference": float(np.abs(got - np.concatenate(want)).max()),
    }


def report(many: dict, overhead: dict) -> None:
    reference = many["reference"]
    rows = [
        [
            "fit_predict_many (no Ray)",
            f"{reference['wall_s']:.1f}",
            f"{reference['tables_per_s']:.2f}",
            "",
            "",
        ]
    ]
    for r in many["layouts"]:
        rows.append(
            [
                r["layout"],
                f"{r['wall_s']:.1f}",
                f"{r['tables_per_s']:.2f}",
                f"{r['start_s']:.1f}",
                f"{r['max_difference']:.1e}",
            ]
        )
    print_table(
        f"Many tables: {many['tables']} tables, {many['tasks_per_call']} per call",
        ["layout", ">wall s", ">tables/s", ">start s", ">max |diff|"],
        rows,
    )
    o = overhead
    print_table(
        f"predict_dataset per batch of {o['batch_rows']:,} rows (1 worker, {o['threads']} threads)",
        [
            ">direct s",
            ">Ray s",
            ">overhead s",
            ">overhead",
            ">Ray's own s",
            ">job s",
            ">max |diff|",
        ],
        [
            [
                f"{o['direct_batch_median_s']:.3f}",
                f"{o['ray_batch_s']:.3f}",
                f"{o['overhead_per_batch_s']:.3f}",
                f"{100 * o['overhead_share']:.0f}%",
                f"{o['ray_cost_per_batch_s']:.4f}",
                f"{o['ray_job_s']:.1f}",
                f"{o['max_difference']:.1e}",
            ]
        ],
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray
    import tabserve
    from tabserve.bench.workloads import checkpoints_for

    with tempfile.TemporaryDirectory(prefix="tabserve-ray-scaling-") as run_dir:
        given = {"clf": args.checkpoint, "reg": args.regressor_checkpoint}
        checkpoints, note = checkpoints_for(
            KINDS, given, Path(run_dir), args.model_size, "ray_scaling"
        )
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            many = many_tables(args, checkpoints)
            overhead = batch_overhead(args, checkpoints["clf"])
        finally:
            ray.shutdown()
    report(many, overhead)
    out = args.json or default_json("ray-scaling-cpu")
    write_json(
        out,
        {
            "benchmark": "ray_scaling",
            "command": " ".join(sys.argv),
            "ray": ray.__version__,
            "tabserve": tabserve.__version__,
            "checkpoints": note,
            "ray_cpus": args.cpus,
            "many_tables": many,
            "batch_overhead": overhead,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
