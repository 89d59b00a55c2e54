"""Several devices of one host: ``device`` as a list, or ``"auto"``.

An estimator given several devices preprocesses on the first (``device_``) and spreads its
model calls over all of them (``devices_``), each device's calls on its own thread and CUDA
stream against that device's served model from the process-wide cache, the outputs gathered on
the first device in order. A prediction splits one of two ways (:func:`choose_split`):

- ``"members"``: each chunk of ensemble members goes to the next device in turn (a KV cache
  chunk lives on the device that built it);
- ``"rows"``: each device answers a block of the test rows with every member (the KV cache
  copied to each device once, and kept).

A many-tables call spreads its packs of tables the same way. No communication between devices
is needed: members, test rows and tables are independent, so the answers are one device's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
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


#: How a prediction on several devices splits (the estimators' ``device_split``).
SPLITS = ("auto", "members", "rows")


def choose_split(
    forced: str,
    chunk_members: Sequence[int],
    n_devices: int,
    n_train: int,
    n_test: int,
    chunk_rows: int | None,
    cached: bool,
) -> str:
    """``"members"`` or ``"rows"``: ``forced`` unless it is ``"auto"``, which picks the split
    whose busiest device processes fewer member-rows. Members: chunk ``i`` (of
    ``chunk_members[i]`` members) runs on device ``i % n_devices`` over every test row; rows: each
    device runs every member over its block of ``ceil(n_test / n_devices)`` test rows. Each call
    of ``chunk_rows`` test rows runs the ``n_train`` train rows again unless they are ``cached``.
    Rows need a test row per device."""
    if n_devices == 1 or n_test < n_devices:
        return "members"
    if forced != "auto":
        return forced

    def member_rows(rows: int) -> int:
        calls = 1 if chunk_rows is None else math.ceil(rows / chunk_rows)
        return rows + (0 if cached else calls * n_train)

    loads = [0] * n_devices
    for i, members in enumerate(chunk_members):
        loads[i % n_devices] += members
    by_members = max(loads) * member_rows(n_test)
    by_rows = sum(chunk_members) * member_rows(math.ceil(n_test / n_devices))
    return "rows" if by_rows < by_members else "members"


def row_blocks(n_rows: int, n_devices: int) -> list:
    """``n_devices`` contiguous ``(start, stop)`` blocks of ``n_rows`` rows, sizes differing by
    at most one."""
    base, extra = divmod(n_rows, n_devices)
    blocks, start = [], 0
    for d in range(n_devices):
        stop = start + base + (d < extra)
        blocks.append((start, stop))
        start = stop
    return blocks


def moved_to(value, device: torch.device):
    """``value`` (a tensor, or a cache: dataclasses, lists and tuples of them) with every tensor
    on ``device``; tensors already there are shared, not copied."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        items = [moved_to(v, device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: moved_to(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


def first_tensor(value) -> torch.Tensor | None:
    """The first tensor in ``value`` (as :func:`moved_to` walks it), None if it holds none."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        parts = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return None
    for part in parts:
        found = first_tensor(part)
        if found is not None:
            return found
    return None


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


__all__ = ["SPLITS", "choose_split", "moved_to", "resolve_devices", "row_blocks", "spread"]
