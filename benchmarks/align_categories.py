"""AlignCategories benchmark: 35 prediction batches of tables shaped like the seed's datasets.

Per workload (synthetic string-column tables with the seed's column counts and realistic
vocabulary sizes), side by side, each the total over 35 prediction batches:

    tabserve eager        AlignCategories(sort_by="value") on tables already on the device
    tabserve compiled     torch.compile(align, fullgraph=True) on batches marked with
                          tabserve.tables.mark_dynamic (one graph; compilation excluded, it
                          happens in the warm-up; graphs counted and reported)
    torch_peer eager      the pure-PyTorch lookup (benchmarks/torch_peer.py) per column plus the
                          same gather (compiled too with --peer-compiled: slow to compile)
    sklearn               OrdinalEncoder.transform on the pandas batches (CPU)
    from_pandas           Table.from_pandas(batch, device=...) for the 35 batches (the input
                          conversion, not part of the transform)

Peak extra memory is tabserve.bench.timing's (CUDA allocator; CPU: tracemalloc / RSS probes)
over the 35 calls with their outputs kept; on CUDA also ``max_call_peak_bytes``, the largest peak
of one call (its output freed before the next), the seed's "max peak" per transform. Every
method's codes are checked against scikit-learn before timing; a mismatch exits with status 1.

Usage:
    python benchmarks/align_categories.py --quick            # CPU, < 1 minute
    python benchmarks/align_categories.py --device cuda --out align_categories_h200.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.preprocessing import OrdinalEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import torch_peer  # noqa: E402
from tabserve.align import AlignCategories  # noqa: E402
from tabserve.strings import StringColumn  # noqa: E402
from tabserve.bench.timing import (  # noqa: E402
    cuda_peak_bytes,
    format_mib,
    format_ms,
    measure,
    synchronize,
)
from tabserve.tables import Table, mark_dynamic  # noqa: E402

BATCHES = 35


@dataclass(frozen=True)
class Workload:
    """A synthetic table: one vocabulary size per string column, label length, row counts."""

    name: str
    vocabularies: tuple  # fitted categories per string column
    label_bytes: int  # mean label length
    fit_rows: int
    batch_rows: int  # mean rows of a prediction batch (they range over 0.5x .. 1.5x)
    quick: bool = False


WORKLOADS = (
    Workload("credit-g", (4, 5, 10, 5, 5, 4, 3, 3, 4, 3, 4, 2, 2), 12, 800, 60, quick=True),
    Workload("Diabetes130US", (6, 3, 10, 9, 17, 26, 17, 700, 750, 780) + (4,) * 29, 10, 20_000, 1_000),
    Workload("kddcup09_appetency", (15_000, 4_000, 1_500, 500, 250) + (12,) * 33, 10, 20_000, 1_000),
    Workload("Amazon_employee_access", (7_500, 4_200, 130, 180, 450, 340, 2_350, 65, 340), 6, 20_000, 1_000),
    Workload("Food_Delivery_Time", (6, 4, 4), 8, 10_000, 500),
    Workload("synthetic-text", (2_000, 1_000, 500), 600, 5_000, 300, quick=True),
)


def make_labels(rng: np.random.Generator, count: int, mean_bytes: int, tag: str) -> list:
    words = ["alpha", "béta", "gamma", "delta", "日本", "omega", "x", "lorem", "ipsum", "dolor"]
    if mean_bytes <= 16:
        return [f"{tag}{i}" for i in range(count)]
    labels = []
    for i in range(count):
        n_words = max(1, int(rng.integers(mean_bytes // 12, mean_bytes // 4)))
        labels.append(f"{i} " + " ".join(rng.choice(words, n_words)))
    return labels


def make_frames(workload: Workload, scale: float, seed: int):
    """(fit frame, 35 batch frames): 'str' columns with ~5% missing and ~2% unseen labels."""
    rng = np.random.default_rng(seed)
    pools = [
        make_labels(rng, max(2, int(k * scale)) + max(1, int(k * scale) // 20), workload.label_bytes, f"c{j}_")
        for j, k in enumerate(workload.vocabularies)
    ]

    def frame(rows: int, unseen: bool) -> pd.DataFrame:
        columns = {}
        for j, pool in enumerate(pools):
            seen = len(pool) - max(1, len(pool) // 21)
            values = np.array(pool, dtype=object)[rng.zipf(1.3, rows) % (len(pool) if unseen else seen)]
            values[rng.random(rows) < 0.05] = None
            columns[f"c{j}"] = pd.Series(values, dtype="str")
        return pd.DataFrame(columns)

    fit_rows = max(50, int(workload.fit_rows * scale))
    mean = max(8, int(workload.batch_rows * scale))
    sizes = np.linspace(0.5 * mean, 1.5 * mean, BATCHES).astype(int) + np.arange(BATCHES)
    return frame(fit_rows, unseen=False), [frame(int(n), unseen=True) for n in sizes]


def peer_align(indexes, table: Table) -> torch.Tensor:
    """The pure-PyTorch peer: torch_peer lookups of every batch vocabulary, then the gather."""
    looked_up = torch_peer.lookup_columns(indexes, [c.categories for c in table.columns])
    lookup_table = torch.cat([looked_up, looked_up.new_full((1,), -1)])
    sizes = torch.tensor([len(c.categories) for c in table.columns], device=looked_up.device)
    starts = torch.cumsum(sizes, 0) - sizes
    codes = torch.stack([c.codes for c in table.columns], dim=1)
    index = torch.where((codes >= 0) & (codes < sizes), codes + starts, looked_up.shape[0])
    return lookup_table[index]


def run_workload(workload: Workload, args) -> dict:
    device = torch.device(args.device)
    scale = args.scale if args.scale is not None else (0.1 if args.quick else 1.0)
    fit_frame, frames = make_frames(workload, scale, args.seed)
    encoder = OrdinalEncoder(
        dtype=np.int64, handle_unknown="use_encoded_value", unknown_value=-1, encoded_missing_value=-1
    ).fit(fit_frame)
    expected = [encoder.transform(f) for f in frames]

    align = AlignCategories(sort_by="value").to(device).fit(Table.from_pandas(fit_frame, device=device))
    tables = [Table.from_pandas(f, device=device) for f in frames]
    marked = [mark_dynamic(Table.from_pandas(f, device=device)) for f in frames]
    compiled = torch.compile(align, fullgraph=True)
    vocabularies = [
        StringColumn.from_pylist(align.categories(name), device=device) for name in align.column_names
    ]
    peer = torch_peer.fit_columns(vocabularies)

    # the peer takes seconds on CPU on long labels; --no-peer when its figures are already known
    skip_peer = args.no_peer or (args.quick and workload.label_bytes > 100)
    methods = {
        "tabserve eager": (lambda: [align(t) for t in tables], device),
        "tabserve compiled": (lambda: [compiled(t) for t in marked], device),
        "torch_peer eager": None if skip_peer else (lambda: [peer_align(peer, t) for t in tables], device),
        "sklearn OrdinalEncoder (cpu)": (lambda: [encoder.transform(f) for f in frames], "cpu"),
        "Table.from_pandas": (lambda: [Table.from_pandas(f, device=device) for f in frames], device),
    }
    if args.peer_compiled:
        peer_compiled = torch.compile(peer_align, fullgraph=True)
        methods["torch_peer compiled"] = (lambda: [peer_compiled(peer, t) for t in marked], device)

    record = {"workload": workload.name, "columns": len(workload.vocabularies), "scale": scale,
              "batch_rows": [len(f) for f in frames], "methods": {}, "mismatches": []}
    checks = {"tabserve eager": align, "tabserve compiled": compiled}
    if not skip_peer:
        checks["torch_peer eager"] = lambda t: peer_align(peer, t)
    if args.peer_compiled:
        checks["torch_peer compiled"] = lambda t: peer_compiled(peer, t)
    from torch._dynamo.utils import counters

    counters.clear()
    for name, fn in checks.items():
        batches = marked if "compiled" in name else tables
        for b, (table, want) in enumerate(zip(batches, expected)):
            if not np.array_equal(fn(table).cpu().numpy(), want):
                record["mismatches"].append(f"{name} batch {b}")
    record["compiled_graphs"] = counters["stats"]["unique_graphs"]
    record["graph_breaks"] = sum(counters["graph_break"].values())
    # One batch at a time, for the per-call peak (the seed's "max peak" figure).
    single = {
        "tabserve eager": (align, tables),
        "tabserve compiled": (compiled, marked),
        "torch_peer eager": None if skip_peer else (lambda t: peer_align(peer, t), tables),
    }
    for name, method in methods.items():
        if method is None:
            record["methods"][name] = {"median_ms": None, "peak_extra_bytes": None, "skipped": True}
            continue
        m = measure(method[0], method[1], **args.timing)
        record["methods"][name] = m.as_dict()
        if single.get(name) is not None and device.type == "cuda":
            record["methods"][name]["max_call_peak_bytes"] = max_call_peak(*single[name], device)
    if args.profile:
        record["profile"] = profile_calls(compiled, marked, device)
    return record


def profile_calls(fn, batches, device: torch.device, top: int = 25) -> dict:
    """Where one pass over the batches spends its time: the host's Python functions (cProfile,
    by own time) and the operators and kernels (torch.profiler, by self CPU and device time)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    def fn_all():
        return [fn(b) for b in batches]

    fn_all()
    synchronize(device)
    host = cProfile.Profile()
    host.enable()
    fn_all()
    synchronize(device)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(top)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn_all()
        synchronize(device)
    averages = prof.key_averages()
    by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return {
        "calls": len(batches),
        "host_python": text.getvalue().splitlines()[:top + 12],
        "ops_by_host_time": averages.table(sort_by="self_cpu_time_total", row_limit=top).splitlines(),
        "ops_by_device_time": averages.table(sort_by=by, row_limit=top).splitlines(),
    }


def max_call_peak(fn, batches, device: torch.device) -> int:
    """The largest peak extra device memory of one call over the batches (output included, each
    output freed before the next call): comparable to the seed's per-transform "max peak"."""
    return max(cuda_peak_bytes(lambda batch=batch: fn(batch), device) for batch in batches)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small workloads on CPU (< 1 min)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--workloads", nargs="+", metavar="NAME", help="workload names")
    parser.add_argument("--scale", type=float, default=None, help="row and vocabulary scale (default 1, quick 0.1)")
    parser.add_argument("--peer-compiled", action="store_true", help="also compile the torch_peer")
    parser.add_argument("--no-peer", action="store_true", help="leave the torch_peer out (reported as skipped)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed repeats per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one pass of the compiled transform (host Python and ops)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (0: default)")
    parser.add_argument("--out", default=str(harness.default_json("align_categories")))
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = args.budget if args.budget is not None else (0.2 if args.quick else 1.0)
    args.timing = {"budget_s": budget, "min_repeats": 3, "max_repeats": 50}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch._dynamo.config.recompile_limit = 64
    if args.device == "cpu" and args.threads:
        # Inductor's CPU kernels are OpenMP loops; on a small shared box their spin-waits cost
        # seconds per pass when other processes load the cores.
        torch.set_num_threads(args.threads)
    workloads = [w for w in WORKLOADS if (w.quick or not args.quick)]
    if args.workloads:
        workloads = [w for w in WORKLOADS if w.name in args.workloads]
    start = time.perf_counter()
    records = []

    def write(records: list) -> None:  # after every workload: a killed run keeps what it measured
        harness.write_json(args.out, {"benchmark": "align_categories", "command": " ".join(sys.argv),
                                      "device": args.device, "total_s": round(time.perf_counter() - start, 1),
                                      "workloads": records,
                                      "failures": [m for r in records for m in r["mismatches"]]})

    for workload in workloads:
        record = run_workload(workload, args)
        records.append(record)
        write(records)
        print(f"{workload.name}: graphs {record['compiled_graphs']}, breaks {record['graph_breaks']}, "
              f"mismatches {len(record['mismatches'])}", flush=True)
    names = list(records[0]["methods"])
    rows = [
        [r["workload"], r["columns"]]
        + [f"{format_ms(r['methods'][n]['median_ms'])} / "
           f"{format_mib(r['methods'][n]['peak_extra_bytes'])}" for n in names]
        for r in records
    ]
    harness.print_table(
        f"total ms over {BATCHES} batches / peak extra MiB, device {args.device}",
        ["workload", ">cols"] + [">" + n for n in names],
        rows,
    )
    failures = [m for r in records for m in r["mismatches"]]
    write(records)
    print(f"{len(records)} workloads in {time.perf_counter() - start:.1f} s; JSON: {args.out}")
    if failures:
        print("MISMATCHES:", failures)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
