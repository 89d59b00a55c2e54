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

With ``--triton``, two more: the calls while the worker (pause on) compiles tabserve's fused
feed-forward kernel (the model's width, fp16; an empty Triton cache) the two ways a packs warm-up
could, the median and the longest call of each (a native compile pass keeps the interpreter lock,
which no pause takes back):

- ``triton_here``: in this process (its first Triton compile, as in a fresh serving process);
- ``triton_children``: listed by ``collect_compiles``, compiled by ``compile_elsewhere``'s child
  processes and read back from the cache, as the packs' warm-ups do.

On the CPU the kernel compiles for an H100 (sm_90) under a driver that names that target and
loads nothing (the CPU's served model launches no Triton kernel).

    python benchmarks/compile_contention.py                 # CPU, tiny model
    python benchmarks/compile_contention.py --device cuda   # the full-size model on the GPU
    python benchmarks/compile_contention.py --triton        # and beside a Triton compile

Results: a line per way, and JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
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


def _launch_feed_forward(device: torch.device, eps: float) -> None:
    """The fused feed-forward kernel at the model's width (128, hidden 256, fp16)."""
    from tabserve.kernels import feed_forward

    x = torch.randn(4096, 128, device=device)
    w1, w2 = torch.randn(256, 128, device=device), torch.randn(128, 256, device=device)
    ones, zeros = torch.ones(128, device=device), torch.zeros(256, device=device)
    try:
        feed_forward._launch(x, None, ones, ones, w1, zeros, w2, ones, eps, torch.float16, _same)
    except AttributeError:  # the stand-in driver loads nothing: compiled, not launched
        if device.type == "cuda":
            raise


def _same(kernel):
    return kernel


def _compile_feed_forward(where: str, device: torch.device, eps: float) -> None:
    from tabserve.kernels.precompile import collect_compiles, compile_elsewhere

    if where == "children":
        with collect_compiles() as found:
            _launch_feed_forward(device, eps)
        compile_elsewhere(found)
    _launch_feed_forward(device, eps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def beside_a_triton_compile(call, device: torch.device, where: str) -> dict:
    """The calls, each after a quiet moment, while the worker compiles the fused feed-forward
    kernel ``where`` (``here`` or ``children``) into an empty cache, with an epsilon of its own
    (a constant of the kernel): median and longest ms, and the compile's seconds."""
    eps = {"here": 1.0101e-5, "children": 1.0202e-5}[where]
    done, seconds, samples = threading.Event(), [], []

    def compile_job() -> None:
        start = time.perf_counter()
        try:
            _compile_feed_forward(where, device, eps)
        finally:
            seconds.append(time.perf_counter() - start)
            done.set()

    saved = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix=f"tabserve-contention-{where}-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            assert background._worker.submit(compile_job)
            # The job runs in the quiet moments between calls (as after the callers' own
            # Python) and pauses while one is in progress: a call waits only for a native pass.
            while not done.wait(background.QUIET_S * 1.5):
                samples.append(measure(call, 1, device))
            background.wait_for_compiles(600)
        finally:
            if saved is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = saved
    return {
        "median_ms": statistics.median(samples) if samples else None,
        "longest_ms": max(samples) if samples else None,
        "calls": len(samples),
        "compile_s": seconds[0] if seconds else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workload", default="small")
    parser.add_argument("--size", choices=("tiny", "full"), default=None,
                        help="model size (default: tiny on the CPU, full on CUDA)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--triton", action="store_true",
                        help="also beside a Triton compile, here and in children")  # fmt: skip
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
    if args.triton:
        if device.type == "cpu":
            from tabserve.kernels.precompile import SM90, TargetDriver
            from triton.runtime.driver import driver

            driver.set_active(TargetDriver(SM90))
        for where in ("here", "children"):  # here first: the process's first Triton compile
            figures[f"triton_{where}"] = found = beside_a_triton_compile(call, device, where)
            print(
                f"triton {where}: compile {found['compile_s']:.1f} s, {found['calls']} calls, "
                f"median {found['median_ms']:.1f} ms, longest {found['longest_ms']:.1f} ms"
            )
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
