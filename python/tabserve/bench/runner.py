"""Subprocess isolation: every job runs in a fresh interpreter with a timeout.

A fresh process means a fresh CUDA context, allocator, cuDNN plan cache and Dynamo state; each job
also gets its own Inductor / Triton cache folder unless its cell is about warm caches. The child
(:mod:`.measure` for the raw-model cells, :mod:`.estimator_child` for the estimator suite) is a
module run as ``python -m <module> SPEC.json`` (:func:`run_child`); it writes its result JSON as
it goes, and :func:`run_isolated` turns whatever happened into a result: the child's own status,
or ``timeout`` (process group killed), ``oom`` or ``crashed`` (non-zero exit, e.g. a signal),
keeping the phases measured before the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import tabserve

from .cells import Cell, skip_reason
from .workloads import Workload

_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def run_isolated(
    command: Sequence[str],
    result_path: Path,
    timeout_s: float,
    env: dict | None = None,
) -> dict:
    """Runs ``command`` in its own process group, waits at most ``timeout_s``, reads ``result_path``.

    Returns the child's result dict (or ``{}`` when it wrote none) with ``status`` resolved,
    ``wall_s``, ``returncode`` and, for anything but success, ``log_tail`` (last 3,000 characters
    of its stdout + stderr) and ``reason``.
    """
    result_path = Path(result_path)
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,  # its own process group: a timeout kills compile workers too
    )
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    result = _read(result_path)
    result.update(wall_s=time.perf_counter() - start, returncode=proc.returncode)
    if timed_out:
        result.update(status="timeout", reason=f"timeout after {timeout_s:g} s")
    elif proc.returncode != 0:
        oom = any(marker in log for marker in _OOM_MARKERS)
        result.update(status="oom" if oom else "crashed", reason=_exit_reason(proc.returncode))
    elif result.get("status") in (None, "running"):
        result.update(status="crashed", reason="exited without a final result")
    if result["status"] not in ("ok", "skipped"):
        result["log_tail"] = log[-3000:]
    return result


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def child_env(job_dir: Path) -> dict:
    """The child's environment: this tabserve importable, and its own (empty) compile caches, so
    every job compiles cold; warm-cache cells carry compile-cache artifacts instead."""
    env = dict(os.environ)
    package_root = str(Path(tabserve.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(job_dir / "inductor")
    env["TRITON_CACHE_DIR"] = str(job_dir / "triton")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


#: The raw-model cells' child module.
MEASURE = "tabserve.bench.measure"


def run_child(module: str, spec: dict, spec_path: Path, timeout_s: float, env: dict) -> dict:
    """Writes ``spec`` to ``spec_path`` with ``spawned_at`` (the child's cold figures count from
    it), then runs ``python -m <module> <spec_path>`` through :func:`run_isolated`, reading the
    result the child writes to ``spec["result"]``."""
    spec_path = Path(spec_path)
    spec_path.write_text(json.dumps({**spec, "spawned_at": time.time()}, indent=1))
    command = [sys.executable, "-m", module, str(spec_path)]
    return run_isolated(command, Path(spec["result"]), timeout_s, env)


def skipped_result(cell: Cell, workload: Workload, reason: str) -> dict:
    """The result of a job that did not run, ``reason`` starting with "skipped: "."""
    return {"cell": cell.name, "workload": workload.name, "status": "skipped", "reason": reason}


def run_cell(
    cell: Cell,
    workload: Workload,
    *,
    run_dir: Path,
    device: str,
    checkpoint: Path,
    timeout_s: float,
    timing: dict,
    seed: int = 0,
    gate_only: bool = False,
) -> dict:
    """One (cell, workload) job: skipped here when the cell cannot run, else in a subprocess.

    ``gate_only``: the job only computes the fp32 outputs other cells are gated against (one
    call, no timing phases); its result says ``"gate_only": True`` and is never promoted."""
    reason = skip_reason(cell, device)
    if reason is not None:
        return skipped_result(cell, workload, reason)
    job_dir = Path(run_dir) / "jobs" / f"{workload.name}__{cell.name}"
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "cell": cell.name,
        "cell_spec": cell.to_dict(),
        "workload": workload.name,
        "device": device,
        "checkpoint": str(checkpoint),
        "seed": seed,
        "result": str(job_dir / "result.json"),
        "outputs": str(job_dir / "outputs.pt"),
        **timing,
        **({"gate_only": True} if gate_only else {}),
    }
    priming = None
    if cell.warm_cache:
        priming = _prime(cell, spec, job_dir, timeout_s)
        if priming.get("status") != "ok":
            reason = f"priming the compile cache: {priming.get('reason', priming.get('status'))}"
            return {
                **priming,
                "cell": cell.name,
                "workload": workload.name,
                "status": "failed",
                "reason": reason,
                "outputs": None,
            }
        spec.update(compile_cache=priming["spec"]["compile_cache"], compile_cache_mode="load")
        # A restart is about its first answer: the KV and estimator paths recompile in the
        # restarted process and are measured by the presets' own cells.
        spec["skip_phases"] = sorted({*spec.get("skip_phases", ()), "kv", "end_to_end"})
        spec["skip_reason"] = "a warm-cache cell measures the restart's first answer and one-shot"
    result = run_child(MEASURE, spec, job_dir / "spec.json", timeout_s, child_env(job_dir))
    result.setdefault("cell", cell.name)
    result.setdefault("workload", workload.name)
    result["outputs"] = spec["outputs"] if Path(spec["outputs"]).exists() else None
    if gate_only:
        result["gate_only"] = True
    if priming is not None:
        cold = priming.get("cold") or {}
        result["priming"] = {
            # compile-cache cells: the priming's cold call; bucket-package cells: the export
            "cold_ms": cold.get("first_call_ms", cold.get("export_ms")),
            "wall_s": priming.get("wall_s"),
            "compile_cache": priming.get("compile_cache"),
        }
    return result


def _prime(cell: Cell, spec: dict, job_dir: Path, timeout_s: float) -> dict:
    """A warm-cache cell's first process: compiles the workload's bucket in fresh caches and saves
    the compile-cache artifacts (:mod:`tabserve.compile_cache`), or for an ``aot`` cell exports
    its bucket packages (:mod:`tabserve.models.tabicl.serving.aot`); the measured process then starts
    from fresh caches too, with only those loaded: a server restart."""
    prime_dir = job_dir / "prime"
    prime_dir.mkdir(exist_ok=True)
    prime_spec = dict(
        spec,
        result=str(prime_dir / "result.json"),
        outputs=None,
        # bucket packages: a directory; compile-cache artifacts: one file
        compile_cache=str(job_dir / ("aot-buckets" if cell.aot else "compile-cache.bin")),
        compile_cache_mode="save",
    )
    spec_path = prime_dir / "spec.json"
    result = run_child(MEASURE, prime_spec, spec_path, timeout_s, child_env(prime_dir))
    return {**result, "spec": prime_spec}


def run_ab(
    cells: Sequence[Cell],
    workload: Workload,
    *,
    run_dir: Path,
    device: str,
    checkpoint: Path,
    timeout_s: float,
    windows: int = 12,
    calls: int = 5,
    seed: int = 0,
) -> dict:
    """ABBA comparison of two cells in one subprocess (see :func:`measure.run_ab`)."""
    for cell in cells:
        reason = skip_reason(cell, device)
        if reason is not None:
            return {
                "cells": [c.name for c in cells],
                "status": "skipped",
                "reason": f"{cell.name}: {reason}",
            }
    job_dir = Path(run_dir) / "jobs" / f"ab__{workload.name}__{cells[0].name}__{cells[1].name}"
    job_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "mode": "ab",
        "cells": [c.name for c in cells],
        "cell_specs": [c.to_dict() for c in cells],
        "workload": workload.name,
        "device": device,
        "checkpoint": str(checkpoint),
        "seed": seed,
        "windows": windows,
        "ab_calls": calls,
        "result": str(job_dir / "result.json"),
    }
    return run_child(MEASURE, spec, job_dir / "spec.json", timeout_s, child_env(job_dir))
