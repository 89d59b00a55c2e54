"""Several devices of one host: ``device`` as a list, or ``"auto"``.

An estimator given several devices preprocesses once, on the first (``device_``), and spreads
its model calls over all of them (``devices_``): each call of a chunk of ensemble members (or of
a pack of tables) goes to the next device in turn, runs there on its own thread and CUDA stream
against that device's served model from the process-wide cache, and its output comes back to the
first device, in plan order. No communication between devices is needed: members, and tables,
are independent, so the answers are one device's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_map


def resolve_devices(device) -> tuple:
    """The devices ``device`` names: None is CUDA's current GPU where there is one, else the
    CPU; ``"auto"`` every visible GPU (the CPU without one); a device; or a list of devices.
    Raises ValueError naming the entry that is none."""
    if device is None:
        return (torch.device("cuda" if torch.cuda.is_available() else "cpu"),)
    if isinstance(device, str) and device == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return tuple(torch.device("cuda", i) for i in range(count)) or (torch.device("cpu"),)
    if isinstance(device, (list, tuple)):
        if not device:
            raise ValueError("device: an empty list names no device")
        devices = []
        for entry in device:
            nested = isinstance(entry, (list, tuple))
            if entry is None or nested or (isinstance(entry, str) and entry == "auto"):
                raise ValueError(f"device: a list holds devices, got {entry!r} in it")
            devices.append(_one(entry))
        return tuple(devices)
    return (_one(device),)


def _one(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device must name a torch device, got {device!r}: {error}") from None
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def spread(jobs: Sequence[Callable], devices: Sequence[torch.device], engines: Sequence) -> list:
    """``job(engine, device)`` of every job, job ``i`` on ``devices[i % n]`` with that device's
    engine, each device's jobs in order on a thread of its own; results on ``devices[0]``, in
    job order. One device: in this thread. A job that raises re-raises here with a note naming
    its device (the first failure in job order)."""
    if len(devices) == 1:
        return [job(engines[0], devices[0]) for job in jobs]
    home = devices[0]
    ready = None
    if home.type == "cuda":  # the inputs were made on the caller's stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(home))
    per_device = [list(range(d, len(jobs), len(devices))) for d in range(len(devices))]

    def run(d: int) -> dict:
        device, engine = devices[d], engines[d]
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        results = {}
        on_cuda = stream is not None
        with torch.cuda.device(device) if on_cuda else contextlib.nullcontext(), (
            torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext()
        ):
            if stream is not None and ready is not None:
                stream.wait_event(ready)
            for i in per_device[d]:
                try:
                    out = jobs[i](engine, device)
                    results[i] = tree_map(lambda t: t.to(home) if isinstance(t, torch.Tensor) else t, out)
                except Exception as error:
                    error.add_note(f"(on device {device}, one of the estimator's devices)")
                    results[i] = error
                    break
            if stream is not None:
                stream.synchronize()
        return results

    with concurrent.futures.ThreadPoolExecutor(len(devices), thread_name_prefix="tabserve-device") as pool:
        gathered = {}
        for part in pool.map(run, range(len(devices))):
            gathered.update(part)
    failures = [gathered[i] for i in sorted(gathered) if isinstance(gathered[i], Exception)]
    if failures:
        raise failures[0]
    return [gathered[i] for i in range(len(jobs))]


__all__ = ["resolve_devices", "spread"]
