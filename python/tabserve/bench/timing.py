"""Timing primitives shared by every tabserve benchmark (the package driver and ``benchmarks/``).

CUDA: every timed call is bracketed by its own pair of CUDA events on the current stream, and the
events are read after one final synchronisation, so calls queue back to back as in serving. CPU:
``time.perf_counter`` around each call. Repeats continue until ``max_repeats`` or until
``budget_s`` seconds are spent, but never fewer than ``min_repeats``.

A :class:`Timing` keeps every sample and reports the median, p20 / p80 and the interquartile
spread; ``noisy`` is set when IQR / median exceeds :data:`NOISE_THRESHOLD` (the threshold
``torch.utils.benchmark`` warns at).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: IQR / median above which a measurement is flagged noisy.
NOISE_THRESHOLD = 0.10


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
