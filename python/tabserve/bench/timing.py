"""The timing harness and statistics of every tabserve benchmark: the driver's raw-model cells,
estimator suite and many-tables suite (``python -m tabserve.bench [estimators | many-tables]``)
and the kernel micro-benchmarks under ``benchmarks/``.

CUDA: every timed call is bracketed by its own pair of CUDA events on the current stream, and the
events are read after one final synchronisation, so calls queue back to back as in serving. CPU:
``time.perf_counter`` around each call. Repeats continue until ``max_repeats`` or until
``budget_s`` seconds are spent, but never fewer than ``min_repeats``.

A :class:`Timing` keeps every sample and reports the median, p20 / p80 and the interquartile
spread; ``noisy`` is set when IQR / median exceeds :data:`NOISE_THRESHOLD` (the threshold
``torch.utils.benchmark`` warns at). :func:`geometric_mean` summarises speed-ups across tables;
:func:`reset_peak_memory` / :func:`peak_memory` bracket a phase's peak GPU memory;
:func:`peak_memory_of` brackets a long stretch's peak memory on either device.

:func:`measure` (the micro-benchmarks' entry point) times a call the same way and adds its peak
extra memory, from one more call apart from the timed ones:

* CUDA: ``torch.cuda.max_memory_allocated()`` above ``memory_allocated()`` at the start, after
  ``reset_peak_memory_stats()`` (the call's output counts: it is memory the call allocates).
* CPU: the larger of two probes, both kept in ``memory_probes``. ``tracemalloc`` sees what goes
  through Python's allocator (Python objects, numpy) but not torch's or Arrow's; the resident set
  size, sampled every ~0.2 ms from /proc/self/statm after ``malloc_trim(0)`` hands freed heap back,
  sees everything but misses allocations shorter than the sampling period and pages that
  allocators other than glibc's keep from earlier calls. ``memory_method`` names the probe used.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

#: IQR / median above which a measurement is flagged noisy.
NOISE_THRESHOLD = 0.10
MiB = 1024 * 1024


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of a non-empty sequence, ``q`` in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty sequence")
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def geometric_mean(values: Sequence[float | None]) -> float | None:
    """Geometric mean of the positive values (None and non-positive ones left out), or None when
    there are none: the mean of speed-up ratios across tables."""
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass
class Timing:
    """Samples (ms) of one measurement and their summary."""

    samples_ms: list

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> float:
        """IQR / median (0 for a single sample)."""
        iqr = percentile(self.samples_ms, 75) - percentile(self.samples_ms, 25)
        return iqr / self.median_ms if self.median_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "median_ms": self.median_ms,
            "p20_ms": percentile(self.samples_ms, 20),
            "p80_ms": percentile(self.samples_ms, 80),
            "p90_ms": percentile(self.samples_ms, 90),
            "repeats": len(self.samples_ms),
            "iqr_over_median": self.spread,
            "noisy": self.spread > NOISE_THRESHOLD,
            "samples_ms": list(self.samples_ms),
        }


def synchronize(device: torch.device | str) -> None:
    """Waits for ``device`` (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Starts a phase's peak-memory window on a CUDA ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict | None:
    """``{"peak_allocated_bytes", "peak_reserved_bytes"}`` on a CUDA ``device`` since the last
    :func:`reset_peak_memory` (None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }


@contextmanager
def peak_memory_of(device: torch.device | str, period_s: float = 2e-3) -> Iterator[dict]:
    """Brackets a stretch of work: the dict it yields holds, once the stretch ended, the work's
    peak memory: on CUDA :func:`peak_memory`'s figures (the allocator's peak since the start); on
    the CPU ``peak_rss_bytes`` and ``rss_before_bytes``, the process's resident set size sampled
    every ``period_s`` by an :class:`RssSampler` after :func:`malloc_trim` (long stretches of
    work: a period of milliseconds keeps the sampler off the cores the work uses, and misses only
    allocations shorter than it). Empty on a CPU without /proc/self/statm."""
    device = torch.device(device)
    figures: dict = {}
    sampler, before = None, 0
    if device.type == "cuda":
        reset_peak_memory(device)
    elif os.path.exists("/proc/self/statm"):
        malloc_trim()
        before = rss_bytes()
        sampler = RssSampler(period_s)
        sampler.start()
    try:
        yield figures
    finally:
        if device.type == "cuda":
            figures.update(peak_memory(device))
        elif sampler is not None:
            figures.update(peak_rss_bytes=int(sampler.stop()), rss_before_bytes=int(before))


def time_cpu(fn: Callable[[], object], min_repeats: int, max_repeats: int, budget_s: float) -> list:
    """Host-timed samples (ms) of ``fn()``."""
    times: list = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_cuda(
    fn: Callable[[], object], min_repeats: int, max_repeats: int, budget_s: float
) -> list:
    """CUDA-event samples (ms) of ``fn()`` on the current stream."""
    pairs = []
    deadline = time.perf_counter() + budget_s
    while len(pairs) < max_repeats and (len(pairs) < min_repeats or time.perf_counter() < deadline):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        pairs.append((begin, end))
        if len(pairs) % 8 == 0:  # bound how far the host runs ahead of the device
            end.synchronize()
    torch.cuda.synchronize()
    return [begin.elapsed_time(end) for begin, end in pairs]


def time_calls(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    warmup: int = 2,
    min_repeats: int = 5,
    max_repeats: int = 100,
    budget_s: float = 1.0,
) -> Timing:
    """Warms ``fn`` up ``warmup`` times, then times it (see the module docstring)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    timer = time_cuda if device.type == "cuda" else time_cpu
    return Timing(timer(fn, min_repeats, max_repeats, budget_s))


def time_once(fn: Callable[[], object], device: torch.device | str) -> tuple[float, object]:
    """Wall time (ms) of one synchronised call and its result (cold calls, stream tables)."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3, out


def abba_summary(a_ms: Sequence[float], b_ms: Sequence[float]) -> dict:
    """Paired latency change of B against A from A B B A windows.

    ``a_ms`` / ``b_ms`` hold two slot medians per window, in window order. Per window the change is
    ``(mean B - mean A) / mean A``; linear drift inside a window cancels. Reported: the median,
    mean, p20 / p80 of the per-window changes, the mean of each half of the run, and ``consistent``
    (both halves agree in sign, the only changes worth believing).
    """
    if len(a_ms) != len(b_ms) or not a_ms or len(a_ms) % 2:
        raise ValueError("need two A and two B slots per window")
    changes = []
    for w in range(len(a_ms) // 2):
        a = (a_ms[2 * w] + a_ms[2 * w + 1]) / 2
        b = (b_ms[2 * w] + b_ms[2 * w + 1]) / 2
        changes.append((b - a) / a)
    half = max(len(changes) // 2, 1)
    first, second = changes[:half], changes[half:] or changes[:half]
    first_mean, second_mean = statistics.mean(first), statistics.mean(second)
    return {
        "windows": len(changes),
        "change_median": statistics.median(changes),
        "change_mean": statistics.mean(changes),
        "change_p20": percentile(changes, 20),
        "change_p80": percentile(changes, 80),
        "first_half_mean": first_mean,
        "second_half_mean": second_mean,
        "consistent": (first_mean > 0) == (second_mean > 0),
        "a_median_ms": statistics.median(a_ms),
        "b_median_ms": statistics.median(b_ms),
    }


# ---------------------------------------------------------------------------------------------
# One measurement with its peak memory (the kernel micro-benchmarks)


@dataclass
class Measurement:
    """Time (ms) and peak extra memory (bytes) of one benchmarked call."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    peak_extra_bytes: int | None
    memory_method: str
    first_call_ms: float
    memory_probes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def table_cells(self) -> list:
        """The median, the p20-p80 spread and the peak extra MiB, as table cells."""
        spread = f"{format_ms(self.p20_ms)}-{format_ms(self.p80_ms)}"
        return [format_ms(self.median_ms), spread, format_mib(self.peak_extra_bytes)]


def format_ms(value: float | None) -> str:
    """Milliseconds with three decimals below 10, one below 1,000, none above."""
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def format_mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


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
    """Times ``fn()`` on ``device`` and measures its peak extra memory (module docstring).

    The first warm-up call is timed on its own (``first_call_ms``: compilation, lazy set-up).
    When it took longer than ``slow_s`` and a second call still does, the remaining warm-up is
    skipped and at most 3 repeats are taken, so slow baselines do not dominate a sweep.
    Raises whatever ``fn`` raises.
    """
    device = torch.device(device)
    first_call_ms, _ = time_once(fn, device)
    for _ in range(max(warmup - 1, 0)):
        if time_once(fn, device)[0] > slow_s * 1e3:
            min_repeats = max_repeats = min(min_repeats, 3)
            break
    timer = time_cuda if device.type == "cuda" else time_cpu
    times = timer(fn, min_repeats, max_repeats, budget_s)
    if not memory:
        peak, method, probes = None, "not measured", {}
    elif device.type == "cuda":
        peak, method, probes = cuda_peak_bytes(fn, device), "cuda allocator", {}
    else:
        peak, method, probes = cpu_peak_bytes(fn)
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


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Bytes ``fn()`` allocates on ``device`` at its peak, above what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def rss_bytes() -> int:
    """This process's resident set size (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    """Samples the resident set size until stopped; ``peak`` is the largest sample."""

    def __init__(self, period_s: float = 2e-4):
        super().__init__(daemon=True)
        self.period_s = period_s
        self.peak = rss_bytes()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def malloc_trim() -> None:
    """Hands glibc's freed heap memory back to the system (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then also counts retained free memory
        pass


def cpu_peak_bytes(fn: Callable[[], object]) -> tuple[int | None, str, dict]:
    """(peak extra bytes, the probe that saw it, every probe's figure) of one ``fn()`` call."""
    probes: dict = {}
    if os.path.exists("/proc/self/statm"):
        malloc_trim()
        base = rss_bytes()
        sampler = RssSampler()
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
