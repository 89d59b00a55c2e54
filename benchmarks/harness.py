"""What the kernel micro-benchmarks under ``benchmarks/`` share besides timing: their command
lines (``--device``, ``--quick``, ``--cases`` and the rest), case selection, the JSON result with
the environment, and the fixed-width table.

Timing and peak memory come from the one harness of the package, :mod:`tabserve.bench.timing`
(:func:`~tabserve.bench.timing.measure`), which the TabICLv2 driver times with too. A benchmark
builds a zero-argument callable per (case, method), measures it and hands the rows to
:func:`write_json` and :func:`print_table`. Results go to ``--json`` (or ``--out``), by default
under ``tabserve-results/`` in the current directory (git-ignored), never into tracked files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from tabserve.bench.report import environment as bench_environment
from tabserve.bench.timing import measure

#: Where a benchmark writes its JSON when no path is given (relative to the current directory).
RESULTS_DIR = Path("tabserve-results")


# ---------------------------------------------------------------------------------------------
# Environment and reporting


def environment() -> dict:
    """Versions and hardware of this run, recorded in every JSON result (the driver's record plus
    the data libraries the preprocessing benchmarks compare against)."""
    return bench_environment(extra_modules=("pyarrow", "pandas"))


def default_json(stem: str) -> Path:
    """The JSON path a benchmark writes to without ``--json``: :data:`RESULTS_DIR`/<stem>.json."""
    return RESULTS_DIR / f"{stem}.json"


def write_json(path: str | os.PathLike, payload: dict) -> None:
    """Writes ``payload`` (plus ``environment``) as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Prints a fixed-width table: with rich when it is installed, else plain text. Columns whose
    name starts with '>' are right-aligned (the '>' is dropped)."""
    names = [c.lstrip(">") for c in columns]
    right = [c.startswith(">") for c in columns]
    cells = [[str(v) for v in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        table = Table(title=title, box=None, pad_edge=False, header_style="bold")
        for name, is_right in zip(names, right):
            table.add_column(name, justify="right" if is_right else "left", no_wrap=True)
        for row in cells:
            table.add_row(*row)
        Console(width=max(100, _plain_width(names, cells))).print(table)
        return
    print(title)
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    for row in [names, ["-" * w for w in widths], *cells]:
        print("  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(row, widths, right)))


def _plain_width(names, cells) -> int:
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    return sum(widths) + 2 * len(widths)


def compare_and_time(
    case: dict,
    methods: dict[str, Callable],
    call: Sequence,
    want: torch.Tensor,
    scale: torch.Tensor,
    device: torch.device | str,
    budget_s: float,
) -> tuple[list, list]:
    """Each method of ``methods`` called on ``call``: its max |difference| from ``want`` in units
    of ``scale`` (broadcast against the output), then :func:`measure`. A method that raises (a
    tile configuration a compiler refuses) is reported as failed, not fatal. Returns (records
    for the JSON, each ``case`` plus the method's figures; table rows starting with the case's
    ``name``)."""
    records, rows = [], []
    for method, fn in methods.items():
        try:
            got = fn(*call)
        except Exception as e:  # noqa: BLE001  (reported in the table)
            rows.append([case["case"], method, f"failed: {type(e).__name__}", "", "", ""])
            continue
        error = ((got.float() - want.float()).abs() / scale).max().item()
        del got
        m = measure(lambda fn=fn: fn(*call), device, budget_s=budget_s)
        records.append({**case, "method": method, "max_error_roundings": error, **m.as_dict()})
        rows.append([case["case"], method, *m.table_cells(), f"{error:.1f}"])
    return records, rows


def attention_benchmark_parser(doc: str):
    """The options the attention benchmarks share (``--device``, ``--quick``, ``--dtype``,
    ``--budget``, ``--cases``: see :func:`selected_cases`, ``--flash-sweep``, ``--json``); each
    adds its own."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument(
        "--cases", nargs="+", metavar="TEXT", help="only the cases whose name contains one"
    )
    parser.add_argument(
        "--flash-sweep",
        action="store_true",
        help="tabserve's flash_attention on each tile of its sweep too",
    )
    parser.add_argument("--json", type=Path)
    return parser


def kernel_benchmark_args(doc: str, argv=None):
    """The command line the fused-operator benchmarks share (``--device``, ``--quick``,
    ``--sweep``, ``--dtype``, ``--stream``, ``--budget``, ``--cases``, ``--max-registers``,
    ``--json``); returns
    (args, device, matmul dtype). ``args.stream_dtype``: the token stream's dtype
    (``--stream``); ``args.cases``: see :func:`selected_cases`."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time tile configurations too")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument(
        "--stream",
        choices=("float32", "matmul"),
        default="float32",
        help="the token stream's dtype: float32, or the matmul dtype (TabICLv2's column and row "
        "streams under fp16 / bf16 autocast: the embeddings come out of autocast's linears)",
    )
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="TEXT",
        help="only the cases whose name contains one of these (e.g. out-proj)",
    )
    parser.add_argument(
        "--max-registers",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also time the operator's kernel limited to N registers per thread (Triton's "
        "maxnreg: more programs per SM, maybe spills), each N",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    args.stream_dtype = dtype if args.stream == "matmul" else torch.float32
    return args, torch.device(args.device), dtype


def selected_cases(cases: list, args) -> list:
    """The cases (tuples led by their name) that ``--cases`` picks: all without it. Raises
    SystemExit naming the known cases when it picks none."""
    if not args.cases:
        return cases
    chosen = [case for case in cases if any(text in case[0] for text in args.cases)]
    if not chosen:
        names = ", ".join(case[0] for case in cases)
        raise SystemExit(f"--cases {args.cases} matches no case; the cases: {names}")
    return chosen


def overridden(op, override, choices, default, label: str) -> dict:
    """``op`` run under ``override(choice)`` for each of ``choices`` but ``default`` (a kernel
    setting's alternatives, timed beside the default): ``{"op <choice> <label>": callable}``."""

    def under(choice):
        def run(*call):
            with override(choice):
                return op(*call)

        return run

    return {f"op {choice} {label}": under(choice) for choice in choices if choice != default}


def kernel_methods(composite, op, device, sweep: dict | None = None) -> dict:
    """The methods a fused-operator benchmark times: the composite, the operator, on CUDA the
    composite under torch.compile and, with ``sweep``, the operator per tile configuration."""
    methods = {"composite": composite, "tabserve op": op}
    if torch.device(device).type == "cuda":
        methods["composite compiled"] = torch.compile(composite, fullgraph=True)
        methods |= sweep or {}
    return methods


def register_limited(run_kernel, limits) -> dict:
    """``run_kernel`` (a Triton operator's direct launcher) with each register limit of
    ``limits`` for every launch (``--max-registers``): ``{"op <= N regs": callable}``."""
    from tabserve.kernels._common import register_limit_override

    def limited(limit):
        def run(*args):
            with register_limit_override(limit):
                return run_kernel(*args)

        return run

    return {f"op <= {limit} regs": limited(limit) for limit in limits}


def tile_configured(run_kernel, config):
    """``run_kernel`` (a Triton operator's direct launcher) with tile ``config`` (tokens, warps,
    stages) for every launch: the benchmarks' sweeps."""
    from tabserve.kernels._common import tile_override

    def run(*args):
        with tile_override(config):
            return run_kernel(*args)

    return run


def report_kernel_benchmark(
    benchmark: str, title: str, args, device, dtype, records: list, rows: list
) -> Path:
    """The fused-operator benchmarks' output: the table on stdout, then the JSON (``--json`` or
    :data:`RESULTS_DIR`/<benchmark with dashes>-<device type>.json) with the environment; returns
    its path."""
    print_table(
        title,
        ["case", "method", "median ms", "p20-p80", "peak extra MiB", "max err (roundings)"],
        rows,
    )
    name = benchmark.replace("_", "-")
    out = args.json or default_json(f"{name}-{torch.device(device).type}")
    write_json(
        out,
        {"benchmark": benchmark, "device": str(device), "dtype": str(dtype),
         "stream_dtype": str(getattr(args, "stream_dtype", torch.float32)),
         "environment": environment(), "records": records},
    )  # fmt: skip
    print(f"wrote {out}")
    return out
