"""Compile contention: what a background compile costs the estimator calls beside it.

A compile is Python. Every model call lets go of the interpreter lock around each torch op and
takes it back after, so a Python-busy thread beside the call delays every one of those
take-backs by up to CPython's switch interval (5 ms). The background warm-ups therefore pause
at their next Python function call while an estimator call is in progress
(:func:`tabserve.models.tabicl.serving.background._pause_for_callers`).

This measures one served model's call (the medium preset on CUDA, exact on the CPU; the
small workload's shape by default) three ways, a median of ``--repeats`` each:

- ``alone``: nothing else runs;
- ``beside``: the background worker runs a Python-busy job (a stand-in for a compile) with its
  pause switched off;
- ``paused``: the same job with the pause on (as the warm-ups run).

    python benchmarks/compile_contention.py                 # CPU, tiny model
    python benchmarks/compile_contention.py --device cuda   # the full-size model on the GPU

Results: a line per way, and JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tabserve.bench import report
from tabserve.bench.workloads import make_checkpoint, model_tables, workload_by_name
from tabserve.models.tabicl import TabICLv2
from tabserve.models.tabicl.serving import background
from tabserve.models.tabicl.serving.served import ServedTabICL


def _busy(stop: threading.Event) -> None:
    """Python work in small function calls, as a compiler's, until ``stop``."""
    table: dict = {}

    def step(i: int) -> None:
        table[i] = str(i)

    while not stop.is_set():
        for i in range(1000):
            step(i)


def measure(call, repeats: int, device: torch.device) -> float:
    """Median ms of ``repeats`` calls, each inside ``foreground()`` as the estimators call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        with background.foreground():
            call()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def beside_a_busy_warm_up(call, repeats: int, device: torch.device, pause: bool) -> float:
    """``measure`` while the worker runs :func:`_busy`, its pause on or off."""
    stop = threading.Event()
    hook = background._pause_for_callers
    if not pause:
        background._pause_for_callers = lambda frame, event, arg: None
    try:
        assert background._worker.submit(lambda: _busy(stop))
        time.sleep(background.QUIET_S * 2)  # the worker starts the job in a pause between calls
        return measure(call, repeats, device)
    finally:
        stop.set()
        background.wait_for_compiles(60)
        background._pause_for_callers = hook


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workload", default="small")
    parser.add_argument("--size", choices=("tiny", "full"), default=None,
                        help="model size (default: tiny on the CPU, full on CUDA)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "tiny")
    with tempfile.TemporaryDirectory() as folder:
        path = make_checkpoint("clf", Path(folder) / "clf.ckpt", size=size)
        model = TabICLv2.from_checkpoint(path, device=device)
    served = ServedTabICL(model, "medium" if device.type == "cuda" else "exact")
    workload = workload_by_name(args.workload)
    X, y = model_tables(workload, 0, device)

    def call():
        with torch.no_grad():
            served(X, y)

    for _ in range(3):  # warm-up: kernels loaded, graphs captured
        measure(call, 1, device)
    figures = {
        "alone_ms": measure(call, args.repeats, device),
        "beside_ms": beside_a_busy_warm_up(call, args.repeats, device, pause=False),
        "paused_ms": beside_a_busy_warm_up(call, args.repeats, device, pause=True),
    }
    for name, ms in figures.items():
        print(f"{name[:-3]:>7}: {ms:9.1f} ms")
    if args.json:
        document = {
            "benchmark": "compile_contention",
            "environment": report.environment(),
            "command": " ".join(["python benchmarks/compile_contention.py", *(argv or sys.argv[1:])]),
            "device": args.device,
            "model_size": size,
            "workload": workload.as_dict(),
            "repeats": args.repeats,
            **figures,
        }
        report.write_json(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
