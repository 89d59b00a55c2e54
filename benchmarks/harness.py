"""The timing, memory and reporting helper shared by every tabserve benchmark CLI.

A benchmark builds a zero-argument callable per (workload, method) cell and hands it to
:func:`measure`, which returns a :class:`Measurement`; rows of measurements go to
:func:`write_json` and :func:`print_table`.

Timing:
    CUDA: after warm-up, every repeat is bracketed by CUDA events on the current stream; one
    synchronisation at the end reads them all. CPU: ``time.perf_counter`` around each call.
    Repeats continue until ``max_repeats`` or until ``budget_s`` seconds are spent, but never
    fewer than ``min_repeats``. Reported: median and the 20th / 80th percentiles, in ms. The
    timing loops themselves live in :mod:`tabserve.bench.timing` (shared with the TabICLv2 driver).

Peak extra memory (one extra call, separate from the timed ones):
    CUDA: ``torch.cuda.max_memory_allocated()`` above ``memory_allocated()`` at the start, after
    ``reset_peak_memory_stats()`` (the call's output counts: it is memory the call allocates).
    CPU: the peak of two probes, both reported. ``tracemalloc`` sees allocations made through
    Python's allocator (Python objects, numpy) but not torch's or Arrow's; resident set size
    sampled every ~0.2 ms from /proc/self/statm, after ``malloc_trim(0)`` hands freed heap
    memory back, sees everything but misses allocations shorter than the sampling period and
    pages that allocators other than glibc's keep from earlier calls. The table shows the larger
    one and says which it was (``memory_method``).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tabserve.bench.report import environment as bench_environment
from tabserve.bench.timing import percentile
from tabserve.bench.timing import synchronize as _sync
from tabserve.bench.timing import time_cpu as _time_cpu
from tabserve.bench.timing import time_cuda as _time_cuda

MiB = 1024 * 1024


@dataclass
class Measurement:
    """Time (ms) and peak extra memory (bytes) of one benchmark cell."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    peak_extra_bytes: Optional[int]
    memory_method: str
    first_call_ms: float
    memory_probes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def table_cells(self) -> list:
        """The median, the p20-p80 spread and the peak extra MiB, as table cells."""
        spread = f"{format_ms(self.p20_ms)}-{format_ms(self.p80_ms)}"
        return [format_ms(self.median_ms), spread, format_mib(self.peak_extra_bytes)]


def measure(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    warmup: int = 2,
    min_repeats: int = 5,
    max_repeats: int = 50,
    budget_s: float = 0.5,
    memory: bool = True,
    slow_s: float = 1.0,
) -> Measurement:
    """Times ``fn()`` on ``device`` (see the module docstring) and measures its peak extra memory.

    The first warm-up call is timed on its own (``first_call_ms``: compilation, lazy set-up).
    When it took longer than ``slow_s`` and a second call still does, the remaining warm-up is
    skipped and at most 3 repeats are taken, so slow baselines do not dominate a sweep.
    Raises whatever ``fn`` raises.
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    start = time.perf_counter()
    fn()
    _sync(device)
    first_call_ms = (time.perf_counter() - start) * 1e3
    for _ in range(max(warmup - 1, 0)):
        start = time.perf_counter()
        fn()
        _sync(device)
        if time.perf_counter() - start > slow_s:
            min_repeats = max_repeats = min(min_repeats, 3)
            break
    times = (
        _time_cuda(fn, min_repeats, max_repeats, budget_s)
        if on_cuda
        else _time_cpu(fn, min_repeats, max_repeats, budget_s)
    )
    if not memory:
        peak, method, probes = None, "not measured", {}
    elif on_cuda:
        peak, method, probes = _cuda_peak(fn, device), "cuda allocator", {}
    else:
        peak, method, probes = _cpu_peak(fn)
    return Measurement(
        median_ms=statistics.median(times),
        p20_ms=percentile(times, 20),
        p80_ms=percentile(times, 80),
        repeats=len(times),
        peak_extra_bytes=peak,
        memory_method=method,
        first_call_ms=first_call_ms,
        memory_probes=probes,
    )


def _cuda_peak(fn, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler(threading.Thread):
    """Samples the resident set size until stopped; ``peak`` is the largest sample."""

    def __init__(self, period_s: float = 2e-4):
        super().__init__(daemon=True)
        self.period_s = period_s
        self.peak = _rss_bytes()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.period_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, _rss_bytes())
        return self.peak


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then also counts retained free memory
        pass


def _cpu_peak(fn) -> tuple[Optional[int], str, dict]:
    probes: dict = {}
    if os.path.exists("/proc/self/statm"):
        _malloc_trim()
        base = _rss_bytes()
        sampler = _RssSampler()
        sampler.start()
        out = fn()
        probes["rss"] = max(sampler.stop() - base, 0)
        del out
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = fn()
    probes["tracemalloc"] = max(tracemalloc.get_traced_memory()[1] - base, 0)
    del out
    if not tracing:
        tracemalloc.stop()
    method = max(probes, key=probes.get)
    return probes[method], method, probes


# ---------------------------------------------------------------------------------------------
# Environment and reporting


def environment() -> dict:
    """Versions and hardware of this run, recorded in every JSON result (the driver's record plus
    the data libraries the preprocessing benchmarks compare against)."""
    return bench_environment(extra_modules=("pyarrow", "pandas"))


def write_json(path: str | os.PathLike, payload: dict) -> None:
    """Writes ``payload`` (plus ``environment``) as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def format_ms(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def format_mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


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
    results/<benchmark with dashes>-<device type>.json) with the environment; returns its path."""
    print_table(
        title,
        ["case", "method", "median ms", "p20-p80", "peak extra MiB", "max err (roundings)"],
        rows,
    )
    name = benchmark.replace("_", "-")
    out = (
        args.json or Path(__file__).parent / "results" / f"{name}-{torch.device(device).type}.json"
    )
    write_json(
        out,
        {"benchmark": benchmark, "device": str(device), "dtype": str(dtype),
         "stream_dtype": str(getattr(args, "stream_dtype", torch.float32)),
         "environment": environment(), "records": records},
    )  # fmt: skip
    print(f"wrote {out}")
    return out
