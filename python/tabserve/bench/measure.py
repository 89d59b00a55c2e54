"""One benchmark job, run inside its own subprocess: ``python -m tabserve.bench.measure SPEC.json``.

A job is one (cell, workload) pair, or an ABBA comparison of two cells on one workload. The spec
(written by :mod:`.runner`) names them and gives the checkpoints, device, timing budget and where
to write the result JSON and the outputs the gates compare. The result is rewritten after every
phase, so a crash or a timeout keeps what was measured before it.

Phases of a regular workload: ``cold`` (first call, JIT counters), ``one_shot`` (warm fit +
predict from device tensors, inputs rotated between two random sets), ``kv`` (cache build, then
cached predict), ``end_to_end`` (estimator fit, then predict from host numpy). Stream workloads
have one phase, ``stream``: every fresh table once, after warming (for a bucketed cell, each
bucket the stream visits, with a table of another shape; see :func:`stream_warm_shapes`).
A phase that raises is recorded with its error; the job status follows the one-shot (or stream)
phase: ``ok``, ``oom`` or ``failed``.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from . import timing
from .cells import Cell
from .engines import UnsupportedCell, make_engine
from .workloads import host_table, model_tables, stream_shapes, workload_by_name


class SkipPhase(Exception):
    """A phase that does not apply to this cell / workload."""


def jit_counters() -> dict:
    """Dynamo activity so far: frames compiled, graphs, graph breaks (with the top reasons)."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {
        "frames_compiled": int(counters["frames"]["ok"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(breaks.values())),
        "break_reasons": [reason.split("\n")[0][:160] for reason, _ in breaks.most_common(3)],
    }


def reset_jit_counters() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def gate_output(task: str, output: torch.Tensor) -> torch.Tensor:
    """What the gates compare: probabilities, or the mean of the quantiles (regression)."""
    output = output.float()
    return (output.mean(dim=-1) if task == "reg" else output).cpu()


class Job:
    """State of one running job and its incrementally written result."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.cell = Cell.from_dict(spec["cell_spec"])
        self.workload = workload_by_name(spec["workload"])
        self.device = torch.device(spec["device"])
        self.result_path = Path(spec["result"])
        self.outputs: dict = {}
        self.result: dict = {
            "cell": self.cell.name,
            "workload": self.workload.name,
            "status": "running",
            "pid": os.getpid(),
        }
        self.save()

    def save(self) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.result_path)
        if self.outputs and self.spec.get("outputs"):
            torch.save(self.outputs, self.spec["outputs"])

    def phase(self, name: str, fn) -> None:
        """Runs one phase, records its figures or its error, saves."""
        if name in self.spec.get("skip_phases", ()):
            reason = self.spec.get("skip_reason", "not measured in this run (--skip-phases)")
            self.result[name] = {"skipped": reason}
            self.save()
            return
        try:
            self.result[name] = fn()
        except SkipPhase as skip:
            self.result[name] = {"skipped": str(skip)}
        except torch.OutOfMemoryError as error:
            self.result[name] = {"error": "oom", "message": str(error)[:500]}
            torch.cuda.empty_cache()
        except Exception as error:  # noqa: BLE001  (a failing phase is a result, not the end of the job)
            self.result[name] = {
                "error": type(error).__name__,
                "message": str(error)[:1000],
                "traceback": traceback.format_exc()[-3000:],
            }
        self.save()

    def timed(self, fn, *, host_clock: bool = False) -> dict:
        spec = self.spec
        return timing.time_calls(
            fn,
            "cpu" if host_clock else self.device,
            warmup=spec.get("warmup", 2),
            min_repeats=spec.get("min_repeats", 5),
            max_repeats=spec.get("max_repeats", 100),
            budget_s=spec.get("budget_s", 1.0),
        ).as_dict()


def run_job(spec: dict) -> dict:
    """Measures one (cell, workload) pair (see the module docstring)."""
    job = Job(spec)
    torch.manual_seed(spec.get("seed", 0))
    start = time.perf_counter()
    aot = job.cell.aot  # bucket packages instead of compile-cache artifacts (after the model)
    if spec.get("compile_cache_mode") == "load" and not aot:  # artifacts before compiling
        from tabserve import compile_cache

        header = compile_cache.load(spec["compile_cache"])
        job.result["compile_cache"] = {
            "load_ms": (time.perf_counter() - start) * 1e3,
            "artifacts": header["artifacts"],
        }
    try:
        engine = make_engine(job.cell, job.workload, spec["checkpoint"], job.device)
    except UnsupportedCell as error:
        job.result.update(status="skipped", reason=f"skipped: {error}")
        job.save()
        return job.result
    except Exception as error:  # noqa: BLE001  (a model that does not load is a result)
        oom = isinstance(error, torch.OutOfMemoryError)
        job.result.update(
            status="oom" if oom else "failed",
            reason=f"loading: {type(error).__name__}: {str(error)[:300]}",
            traceback=traceback.format_exc()[-3000:],
        )
        job.save()
        return job.result
    if spec.get("compile_cache_mode") == "load" and aot:  # a restart from bucket packages
        loading = time.perf_counter()
        loaded = engine.model.load_buckets(spec["compile_cache"])
        job.result["aot"] = {"load_ms": (time.perf_counter() - loading) * 1e3, "packages": loaded}
    job.result["load_ms"] = (time.perf_counter() - start) * 1e3
    if job.spec.get("compile_cache_mode") == "save":
        return _prime_aot(job, engine) if aot else _prime_compile_cache(job, engine)
    if job.spec.get("gate_only"):
        job.phase("cold", lambda: _gate_reference(job, engine))
        main = "cold"
    elif job.workload.is_stream:
        job.phase("stream", lambda: _stream(job, engine))
        main = "stream"
    else:
        X, y = model_tables(job.workload, spec.get("seed", 0), job.device)
        job.phase("cold", lambda: _cold(job, engine, X, y))
        _ready(job)
        job.phase("padding_gates", lambda: _padding_gates(job, engine, X, y))
        job.phase("one_shot", lambda: _one_shot(job, engine, X, y))
        job.phase("kv", lambda: _kv(job, engine, X, y))
        job.phase("end_to_end", lambda: _end_to_end(job, engine))
        main = "one_shot"
    error = job.result[main].get("error") or job.result.get("cold", {}).get("error")
    job.result["status"] = "ok" if not error else "oom" if error == "oom" else "failed"
    if error:
        job.result["reason"] = f"{main}: {error}: {job.result[main].get('message', '')[:200]}"
    job.result["captures"] = engine.captures
    job.save()
    return job.result


def _ready(job: Job) -> None:
    """``ready_ms``: from the parent's spawn of this process to the end of the first call
    (interpreter start, imports, model load, compile-cache load, compile / capture, the call):
    for a warm-cache cell, how long a restarted server takes to its first answer."""
    spawned = job.spec.get("spawned_at")
    if spawned is not None and job.result.get("cold", {}).get("error") is None:
        job.result["ready_ms"] = (time.time() - spawned) * 1e3
        job.save()


def _prime_compile_cache(job: Job, engine) -> dict:
    """The first process of a warm-cache cell: compile (and capture) everything the measured
    process will run (the one-shot call, the KV-cache build and cached predict, the estimator's
    end-to-end path) once, then save the compile-cache artifacts."""
    from tabserve import compile_cache

    X, y = model_tables(job.workload, job.spec.get("seed", 0), job.device)
    job.phase("cold", lambda: _cold(job, engine, X, y))
    error = job.result["cold"].get("error")
    if error is None:
        job.phase("prime_other_paths", lambda: _prime_other_paths(job, engine, X, y))
        error = job.result["prime_other_paths"].get("error")
    if error is None:
        try:
            saved = compile_cache.save(job.spec["compile_cache"], cell=job.cell.name)
            job.result["compile_cache"] = {"bytes": saved["bytes"], "artifacts": saved["artifacts"]}
        except compile_cache.CompileCacheError as failure:
            error = str(failure)
    job.result["status"] = "ok" if error is None else "failed"
    if error is not None:
        job.result["reason"] = f"priming: {error}"
    job.save()
    return job.result


def _prime_aot(job: Job, engine) -> dict:
    """The first process of an ahead-of-time cell: export the bucket packages of the workload's
    table (its buckets, its batch of members) into the directory the restart will load."""
    X, y = model_tables(job.workload, job.spec.get("seed", 0), job.device)
    n_train = y.shape[1]
    plan = engine.model.grid.plan(n_train, X.shape[1] - n_train, X.shape[2])

    def export() -> dict:
        buckets = list(dict.fromkeys(chunk.bucket for chunk in plan if chunk.bucket is not None))
        if not buckets:
            raise ValueError("the workload's table is past the bucket grid: nothing to export")
        start = time.perf_counter()
        manifest = engine.model.export_buckets(job.spec["compile_cache"], buckets, X.shape[0])
        return {
            "export_ms": (time.perf_counter() - start) * 1e3,
            "packages": [entry["file"] for entry in manifest["packages"]],
        }

    job.phase("cold", export)
    error = job.result["cold"].get("error")
    job.result["compile_cache"] = None if error else {"aot": job.result["cold"]["packages"]}
    job.result["status"] = "ok" if error is None else "failed"
    if error is not None:
        job.result["reason"] = f"priming: {error}: {job.result['cold'].get('message', '')[:200]}"
    job.save()
    return job.result


def _prime_other_paths(job: Job, engine, X, y) -> dict:
    figures = {}
    if job.workload.cacheable:
        n_train = job.workload.n_train
        figures["kv_build_ms"], cache = timing.time_once(
            lambda: engine.build_cache(X[:, :n_train], y), job.device
        )
        figures["kv_predict_ms"], _ = timing.time_once(
            lambda: engine.predict_cached(X[:, n_train:], cache), job.device
        )
    X_train, y_train, X_test = host_table(job.workload, job.spec.get("seed", 0))
    figures["end_to_end_ms"], _ = timing.time_once(
        lambda: engine.estimator_predict(engine.fit_estimator(X_train, y_train), X_test),
        job.device,
    )
    return figures


def _cold(job: Job, engine, X, y) -> dict:
    reset_jit_counters()
    timing.reset_peak_memory(job.device)
    first_ms, output = timing.time_once(lambda X=X, y=y: engine.one_shot(X, y), job.device)
    job.outputs["one_shot"] = gate_output(job.workload.task, output)
    memory = timing.peak_memory(job.device)
    return {"first_call_ms": first_ms, "jit": jit_counters(), "memory": memory}


def _padding_gates(job: Job, engine, X, y) -> dict:
    """The padded-vs-unpadded gates' outputs of a cell that pads (after the cold call and the
    ready time, which they would lengthen: a second model, eager calls, for graph-per-shape
    cells a second capture): fp32 eager, and the cell's own options. A failure here fails the
    cell's gate (:func:`tabserve.bench.gates.apply_gates`)."""
    if "error" in job.result.get("cold", {}):
        raise SkipPhase("the cold call failed")
    start = time.perf_counter()
    ran = []
    for route, gate in (("", engine.padding_gate), ("_recipe", engine.recipe_padding_gate)):
        padding = gate(X, y)  # fp32 eager / the cell's own kernels and graphs
        if padding is not None:
            job.outputs[f"padded{route}"], job.outputs[f"unpadded{route}"] = (
                gate_output(job.workload.task, out) for out in padding
            )
            ran.append(f"padded{route}")
    if not ran:
        raise SkipPhase("the cell pads nothing")
    return {"routes": ran, "ms": (time.perf_counter() - start) * 1e3}


def _gate_reference(job: Job, engine) -> dict:
    """Gate-only job: the outputs the gates compare against, on the same input the measured
    cells gate on (the workload's table, or a stream's gate table), and nothing else."""
    seed = job.spec.get("seed", 0)
    shape, table_seed = None, seed
    if job.workload.is_stream:
        k = stream_gate_table(stream_shapes(job.workload, seed))
        shape, table_seed = stream_shapes(job.workload, seed)[k], seed + k
    X, y = model_tables(job.workload, table_seed, job.device, shape)
    first_ms, output = timing.time_once(lambda: engine.one_shot(X, y), job.device)
    job.outputs["one_shot"] = gate_output(job.workload.task, output)
    return {"first_call_ms": first_ms}


def _one_shot(job: Job, engine, X, y) -> dict:
    if "error" in job.result.get("cold", {}):
        raise SkipPhase("the cold call failed")
    X2, y2 = model_tables(job.workload, job.spec.get("seed", 0) + 1, job.device)
    inputs = itertools.cycle([(X, y), (X2, y2)])
    frames = jit_counters()["frames_compiled"]
    timing.reset_peak_memory(job.device)
    figures = job.timed(lambda: engine.one_shot(*next(inputs)))
    figures["memory"] = timing.peak_memory(job.device)
    figures["recompiles"] = jit_counters()["frames_compiled"] - frames
    return figures


def _kv(job: Job, engine, X, y) -> dict:
    if not job.workload.cacheable:
        raise SkipPhase("the KV cache does not serve more than max_classes classes")
    n_train = job.workload.n_train
    timing.reset_peak_memory(job.device)
    build_ms, cache = timing.time_once(lambda: engine.build_cache(X[:, :n_train], y), job.device)
    # Both test blocks contiguous, as a server's fresh tables are: a slice of X and a new tensor
    # differ in strides, and whole-model compile guards on strides (a whole-model compile on
    # the H200 compiled its frames a second time inside the timed loop otherwise).
    tests = [X[:, n_train:].contiguous(), torch.randn_like(X[:, n_train:]).contiguous()]
    first_ms, output = timing.time_once(lambda: engine.predict_cached(tests[0], cache), job.device)
    job.outputs["kv"] = gate_output(job.workload.task, output)
    frames = jit_counters()["frames_compiled"]
    rotation = itertools.cycle(tests)
    figures = job.timed(lambda: engine.predict_cached(next(rotation), cache))
    figures.update(
        build_ms=build_ms,
        first_predict_ms=first_ms,
        recompiles=jit_counters()["frames_compiled"] - frames,
        memory=timing.peak_memory(job.device),
    )
    return figures


def _end_to_end(job: Job, engine) -> dict:
    X_train, y_train, X_test = host_table(job.workload, job.spec.get("seed", 0))
    fit_ms, estimator = timing.time_once(lambda: engine.fit_estimator(X_train, y_train), job.device)
    first_ms, _ = timing.time_once(lambda: engine.estimator_predict(estimator, X_test), job.device)
    figures = job.timed(lambda: engine.estimator_predict(estimator, X_test), host_clock=True)
    figures.update(fit_ms=fit_ms, first_predict_ms=first_ms)
    return figures


def stream_gate_table(shapes: list) -> int:
    """The stream table the accuracy gates compare (the first with the most test rows): the
    argmax agreement gate (>= 99.5%) cannot be read from a handful of predictions (a table of 8
    test rows x 8 members fails it with one flipped near-tie)."""
    return max(range(len(shapes)), key=lambda k: (shapes[k][1], -k))


def stream_warm_shapes(cell, workload, shapes: list, seed: int) -> list:
    """The warm-up tables of a stream: after warming the bucket grid. For a bucketed
    cell, one table per bucket the stream visits, shaped as the bucket itself (other sizes and
    contents than the stream's tables, so a stream table that recompiles or captures anew is
    caught); for an unbucketed cell two tables of other shapes (it has no grid to warm)."""
    from tabserve.buckets import BucketGrid

    if not cell.buckets:
        return stream_shapes(workload, seed + 1000)[:2]
    grid = BucketGrid()
    warm, seen = [], set()
    for n_train, n_test, n_features, n_classes in shapes:
        bucket = grid.bucket_for(n_train, n_test, n_features)
        if bucket is None or bucket in seen:
            continue
        seen.add(bucket)
        warm.append((bucket.train_rows, max(bucket.test_rows, 1), bucket.features, n_classes))
    return warm


def _stream(job: Job, engine) -> dict:
    seed = job.spec.get("seed", 0)
    shapes = stream_shapes(job.workload, seed)
    for k, shape in enumerate(stream_warm_shapes(job.cell, job.workload, shapes, seed)):
        engine.one_shot(*model_tables(job.workload, seed + 1000 + k, job.device, shape))
    reset_jit_counters()
    timing.reset_peak_memory(job.device)
    captures_before = engine.captures
    times, gate_table = [], stream_gate_table(shapes)
    for k, shape in enumerate(shapes):
        X, y = model_tables(job.workload, seed + k, job.device, shape)
        ms, output = timing.time_once(lambda X=X, y=y: engine.one_shot(X, y), job.device)
        times.append(ms)
        if k == gate_table:
            job.outputs["one_shot"] = gate_output(job.workload.task, output)
    summary = timing.Timing(times).as_dict()
    summary.update(
        shapes=[list(s) for s in shapes],
        gate_table=gate_table,
        jit=jit_counters(),
        recompiles=jit_counters()["frames_compiled"],
        # CUDA graphs captured by the fresh tables (None: the cell captures none).
        captures=None if captures_before is None else engine.captures - captures_before,
        memory=timing.peak_memory(job.device),
    )
    # The same tables again, now warm: a fresh table's latency against the warm latency of its
    # own bucket (or shape), the stream target (p50 of fresh / warm <= 1.25).
    warm = []
    for k, shape in enumerate(shapes):
        X, y = model_tables(job.workload, seed + k, job.device, shape)
        call = functools.partial(engine.one_shot, X, y)
        samples = [timing.time_once(call, job.device)[0] for _ in range(3)]
        warm.append(statistics.median(samples))
    ratios = [fresh / max(w, 1e-9) for fresh, w in zip(times, warm)]
    summary.update(
        warm_samples_ms=warm,
        warm_median_ms=statistics.median(warm),
        fresh_over_warm_p50=statistics.median(ratios),
        fresh_over_warm_p90=timing.percentile(ratios, 90),
    )
    return summary


# ---------------------------------------------------------------------------------------------
# ABBA


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def run_ab(spec: dict) -> dict:
    """Alternates two cells in A B B A windows on one workload (see :func:`timing.abba_summary`).

    Both engines load the same checkpoint and are warmed first; each slot is ``ab_calls`` timed
    calls on the same input, summarised by its median.
    """
    workload = workload_by_name(spec["workload"])
    device = torch.device(spec["device"])
    cells = [Cell.from_dict(fields) for fields in spec["cell_specs"]]
    engines = [make_engine(c, workload, spec["checkpoint"], device) for c in cells]
    X, y = model_tables(workload, spec.get("seed", 0), device)
    # Clones: a graph-replaying engine returns its graph's output buffer, which the next replay
    # overwrites.
    outputs = [engine.one_shot(X, y).clone() for engine in engines]
    for engine in engines:
        timing.time_calls(
            lambda engine=engine: engine.one_shot(X, y),
            device,
            warmup=2,
            min_repeats=1,
            max_repeats=1,
        )
    reset_jit_counters()
    slots = {"A": [], "B": []}
    for _ in range(spec.get("windows", 12)):
        for label in "ABBA":
            engine = engines[0 if label == "A" else 1]
            t = timing.time_calls(
                lambda engine=engine: engine.one_shot(X, y),
                device,
                warmup=0,
                min_repeats=spec.get("ab_calls", 5),
                max_repeats=spec.get("ab_calls", 5),
                budget_s=0,
            )
            slots[label].append(t.median_ms)
    # "Stayed equal": each cell's output after the windows against its own first one, and the
    # two cells' outputs against each other both before and after.
    after = [engine.one_shot(X, y).clone() for engine in engines]
    a, b = outputs
    result = {
        "cells": spec["cells"],
        "workload": workload.name,
        "slots_ms": slots,
        "summary": timing.abba_summary(slots["A"], slots["B"]),
        "bitwise_equal": _bitwise_equal(a, b) and _bitwise_equal(*after),
        "outputs_stable": {
            label: _bitwise_equal(first, last)
            for label, first, last in zip("AB", outputs, after)
        },
        "max_abs_diff": float((a.float() - b.float()).abs().max()) if a.shape == b.shape else None,
        "recompiles_during_measurement": jit_counters()["frames_compiled"],
        "status": "ok",
    }
    Path(spec["result"]).write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    (run_ab if spec.get("mode") == "ab" else run_job)(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
