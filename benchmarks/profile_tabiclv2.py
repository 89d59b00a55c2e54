"""Where the time of one TabICLv2 call goes, per stage and per kernel, for driver cells.

For each cell (names as in ``python -m tabserve.bench --list``, with ``--cells-file`` the research
cells too) on one workload: the warm wall time
of a one-shot call (``--phase kv``: of a KV-cached prediction), the GPU time of each stage (column embedding, row interaction, in-context
learning; CUDA events around the stage modules' methods, so the reference and tabserve split the
same way), the share of the wall time the GPU is busy, the GPU time per kernel family
(attention kernels, GEMMs, Inductor's fused kernels, ...: the split that compiled and captured
cells still show), the call's timeline (device span, idle gaps and stalls, the host's lead
before the first kernel; ``--trace`` also writes the call as a Perfetto trace), and
``torch.profiler`` tables of the kernels by device time and of the
operators by host time. Not a benchmark: the driver measures; this explains.

    python benchmarks/profile_tabiclv2.py --device cuda --workload large \
        --cells ref-fp16 large --out profile-large.txt
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabserve.bench.cells import cell_by_name, cell_table, load_cells_file, skip_reason
from tabserve.bench.engines import make_engine
from tabserve.bench.timing import synchronize, time_once
from tabserve.bench.workloads import make_checkpoint, model_tables, workload_by_name
from torch.profiler import ProfilerActivity, profile

STAGES = {"col": "col_embedder", "row": "row_interactor", "icl": "icl_predictor"}
METHODS = ("forward", "build_cache", "forward_cached", "hierarchical_probs")


class StageTimer:
    """CUDA-event (or wall-clock on CPU) time of each stage module's methods, summed per call."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device, self.spans = device, []
        for stage, attribute in STAGES.items():
            module = getattr(model, attribute, None)
            for method in METHODS:
                if module is not None and hasattr(module, method):
                    setattr(module, method, self._wrap(stage, getattr(module, method)))

    def _wrap(self, stage, fn):
        def timed(*args, **kwargs):
            if self.device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.spans.append((stage, start, end))
            else:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                self.spans.append((stage, t0, time.perf_counter()))
            return out

        return timed

    def collect(self) -> dict:
        synchronize(self.device)
        totals = {stage: 0.0 for stage in STAGES}
        for stage, start, end in self.spans:
            ms = start.elapsed_time(end) if self.device.type == "cuda" else (end - start) * 1e3
            totals[stage] += ms
        self.spans.clear()
        return totals


#: Rows of the profiler's table kept in the JSON summary, heaviest self time first.
TOP_ROWS = 40

#: Kernel families by name (first match wins): where a compiled or captured cell's GPU time goes,
#: since its stage modules no longer run as such. Patterns are lower-case substrings.
KERNEL_FAMILIES = (
    # First: Inductor names a kernel after the ops it fuses, custom ones included (the row
    # stage's RoPE-and-head-split kernels say "small_head_attention": they feed it).
    ("Triton (Inductor-fused)", ("triton_",)),
    ("tabserve head-dim-16 attention", ("small_head_attention",)),
    ("memory-efficient attention", ("fmha_cutlass", "memeffattention", "attentionkernel")),
    ("cuDNN attention", ("cudnn",)),  # before flash: cuDNN's names say "flash" too
    ("flash attention", ("flash",)),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("other tabserve", ("tabserve",)),
    ("copies and casts", ("copy", "cast", "memcpy", "memset")),
    ("normalisation", ("layer_norm", "layernorm", "norm_kernel")),
    ("softmax", ("softmax",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reductions", ("reduce",)),
)


def kernel_family(name: str) -> str:
    """The family of :data:`KERNEL_FAMILIES` a kernel name falls in, else ``"other"``."""
    lowered = name.lower()
    for family, patterns in KERNEL_FAMILIES:
        if any(pattern in lowered for pattern in patterns):
            return family
    return "other"


def kernel_families(events) -> dict:
    """Device ms of the GPU kernels among profiler ``events`` (key averages), per family,
    heaviest first. Only kernel rows count (operators would count their kernels twice)."""
    totals = {}
    for event in events:
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        family = kernel_family(event.key)
        totals[family] = totals.get(family, 0.0) + event.self_device_time_total / 1e3
    return {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


#: A gap between two consecutive kernels this long (us) counts as a stall (the device waits on
#: the host: a launch, a synchronisation, a copy to read on the host).
STALL_US = 20.0


def timeline(events) -> dict:
    """When the device worked during one profiled call, from the profiler's ``events()``.

    ``gpu_span_ms``: first kernel start to last kernel end; ``gpu_busy_ms``: the union of the
    kernels' intervals in it; ``gaps_ms``: the idle rest; ``stalls`` / ``stall_ms``: the idle
    intervals of at least :data:`STALL_US`; ``host_lead_ms``: from the first host operator to
    the first kernel; ``host_tail_ms``: from the last kernel's end to the last host operator's.
    """
    cuda = torch.autograd.DeviceType.CUDA
    kernels, host = [], []
    for event in events:
        span = (event.time_range.start, event.time_range.end)
        (kernels if getattr(event, "device_type", None) == cuda else host).append(span)
    if not kernels:
        return {}
    kernels.sort()
    busy, gaps, end = 0.0, [], kernels[0][0]
    for start, stop in kernels:
        if start > end:
            gaps.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    stalls = [g for g in gaps if g >= STALL_US]
    first = min(start for start, _ in host) if host else kernels[0][0]
    last = max(stop for _, stop in host) if host else end
    return {
        "kernels": len(kernels),
        "gpu_span_ms": round((end - kernels[0][0]) / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gaps_ms": round(sum(gaps) / 1e3, 3),
        "stalls": len(stalls),
        "stall_ms": round(sum(stalls) / 1e3, 3),
        "host_lead_ms": round((kernels[0][0] - first) / 1e3, 3),
        "host_tail_ms": round(max(0.0, last - end) / 1e3, 3),
    }


def profiled_call(engine, workload, X, y, phase: str):
    """The call a profile times: the one-shot call (fit + predict), or with ``phase="kv"`` the
    KV-cached prediction of the test rows from a cache built once on the train rows."""
    if phase == "one_shot":
        return functools.partial(engine.one_shot, X, y)
    if not workload.cacheable:
        raise ValueError(f"--phase kv: the KV cache does not serve workload {workload.name}")
    cache = engine.build_cache(X[:, : workload.n_train], y)
    return functools.partial(engine.predict_cached, X[:, workload.n_train :].contiguous(), cache)


def profile_cell(
    name: str,
    workload,
    checkpoint: Path,
    device: torch.device,
    repeats: int,
    trace=None,
    phase: str = "one_shot",
    table=None,
):
    cell = cell_by_name(name, table or cell_table())
    reason = skip_reason(cell, device.type)
    if reason is not None:
        return {"cell": name, "workload": workload.name, "skipped": reason}, ""
    engine = make_engine(cell, workload, checkpoint, device)
    X, y = model_tables(workload, seed=1, device=device)
    call = profiled_call(engine, workload, X, y, phase)
    for _ in range(3):  # warm-up: compile, capture, cuDNN plans
        call()
    walls = [time_once(call, device)[0] for _ in range(repeats)]
    # Stage split (only where the stage modules run eagerly: compiled or captured cells hide it).
    model = getattr(engine, "model", None)
    inner = getattr(model, "model", model)
    eager = cell.options is None or not (cell.options.compiled or cell.options.graphs)
    timer = StageTimer(inner, device) if eager and isinstance(inner, torch.nn.Module) else None
    stages, stage_walls = [], []  # the stage-timed calls' own wall times, to read them against
    if timer is not None:
        for _ in range(repeats):
            stage_walls.append(time_once(call, device)[0])
            stages.append(timer.collect())
    stage_ms = (
        {s: round(statistics.median(t[s] for t in stages), 3) for s in STAGES} if stages else {}
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        synchronize(device)
    events = prof.key_averages()
    if trace is not None:  # the whole call as a Chrome / Perfetto trace
        trace.mkdir(parents=True, exist_ok=True)
        raw = trace / f"trace_{workload.name}_{name}{'_kv' if phase == 'kv' else ''}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    sort_device = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    wall = statistics.median(walls)
    result = {
        "cell": name,
        "workload": workload.name,
        "phase": phase,
        "wall_ms_median": round(wall, 3),
        "wall_ms_all": [round(w, 3) for w in walls],
        "stage_gpu_ms": stage_ms,
        "stage_call_wall_ms": [round(w, 3) for w in stage_walls],
    }
    if device.type == "cuda":  # operator and kernel rows both count: read it as an upper bound
        result["device_busy_ms"] = round(kernel_us / 1e3, 3)
        result["device_busy_share"] = round(kernel_us / 1e3 / wall, 3)
        result["kernel_family_ms"] = kernel_families(events)
        result["timeline"] = timeline(prof.events())
    # The heaviest rows as data (the printed tables are lost with the call's log otherwise).
    self_time = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    heaviest = sorted(events, key=lambda e: getattr(e, self_time, 0.0), reverse=True)[:TOP_ROWS]
    result["top_rows"] = [
        {
            "name": e.key[:160],
            "calls": e.count,
            "self_ms": round(getattr(e, self_time, 0.0) / 1e3, 3),
        }
        for e in heaviest
    ]
    tables = (
        f"-- {name} on {workload.name}: kernels by device time\n"
        + events.table(sort_by=sort_device, row_limit=30, max_name_column_width=90)
        + f"\n-- {name} on {workload.name}: operators by host time\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=90)
    )
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, tables


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", default="large")
    parser.add_argument("--cells", nargs="+", default=["ref-fp16", "large"])
    parser.add_argument(
        "--cells-file", type=Path, help="more cells (benchmarks/cells/research.json)"
    )
    parser.add_argument(
        "--phase",
        choices=("one_shot", "kv"),
        default="one_shot",
        help="the call profiled: one-shot (fit + predict) or the KV-cached prediction",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, help="default: random v2 weights (seed 0)")
    parser.add_argument("--model-size", choices=("full", "tiny"), default="full")
    parser.add_argument("--out", type=Path, help="write the profiler tables here")
    parser.add_argument("--json", type=Path, help="write the per-cell summaries here")
    parser.add_argument(
        "--trace", type=Path, help="write each cell's profiled call here (trace_*.json.gz)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    workload = workload_by_name(args.workload)
    table = cell_table(load_cells_file(args.cells_file) if args.cells_file else ())
    summaries, texts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or make_checkpoint(
            workload.task, Path(tmp) / "v2.ckpt", size=args.model_size
        )
        for name in args.cells:
            try:
                summary, text = profile_cell(
                    name, workload, checkpoint, device, args.repeats, args.trace, args.phase, table
                )
            except Exception as error:  # noqa: BLE001  (one failing cell must not hide the others)
                summary, text = {"cell": name, "error": f"{type(error).__name__}: {error}"}, ""
            print(json.dumps(summary), flush=True)
            summaries.append(summary)
            texts.append(text)
    if args.out:
        args.out.write_text("\n".join(texts))
    else:
        print("\n".join(texts))
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
