"""Triton kernels compiled in child processes.

A Triton compile in this process shares the interpreter with the callers: its Python pauses for
them (a background warm-up's does, ``serving.background``) but its native passes (MLIR, LLVM,
ptxas) keep the lock until they end. Compiled in a child, a kernel lands in Triton's on-disk
cache, and the launch here that would have compiled it reads it back instead::

    with collect_compiles() as found:   # launches that would compile are skipped and listed
        call()
    compile_elsewhere(found)            # children compile them into Triton's cache
    call()                              # reads them back: nothing compiles here

Beside the tiny model's calls on a 2-core AMD EPYC (``benchmarks/compile_contention.py
--triton``, torch on both cores), the fused feed-forward kernel compiled here in 17.3-19.5 s
(pausing for the calls; 6 runs) and in children in 9.3-9.7 s (3 runs), the calls' median
23-28 ms against 20-27 ms, the longest 154-486 ms against 189-195 ms. A child needs no GPU:
it compiles for the target each specialization names (Triton's own ``JITFunction.preload``),
creates no CUDA context and loads nothing, and it runs only on cores nothing else wants
(:func:`_yield_the_cpu`).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ._common import Specialization, collect_compiles, triton

#: Seconds the children may take in all before they are stopped.
TIMEOUT_S = 900.0

#: The target of an H100 or H200 (sm_90), for :class:`TargetDriver`.
SM90 = {"backend": "cuda", "arch": 90, "warp_size": 32}

__all__ = ["SM90", "TIMEOUT_S", "TargetDriver", "collect_compiles", "compile_elsewhere"]


def compile_elsewhere(
    found: Sequence[Specialization], *, workers: int | None = None, timeout: float = TIMEOUT_S
) -> None:
    """Compiles each specialization of ``found`` (from :func:`collect_compiles`) into Triton's
    on-disk cache (this process's, ``triton.knobs.cache.dir``) in idle-scheduled child
    processes, at most ``workers`` at once (default: half of the cores this process may use, at
    least one), and returns once they have all finished. A specialization already in the cache
    costs its child a read.

    Raises RuntimeError naming the kernel a child failed on, with the child's last words (what
    it compiled before stays in the cache), and TimeoutError past ``timeout`` seconds, the
    children stopped.
    """
    if triton is None:
        raise RuntimeError("compile_elsewhere needs Triton")
    if not sys.executable:  # an embedding host: no interpreter to start
        raise RuntimeError("compile_elsewhere needs sys.executable to start its children")
    found = list(dict.fromkeys(found))
    if not found:
        return
    if workers is None:
        workers = max(1, _cores() // 2)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    shares = [found[i :: min(workers, len(found))] for i in range(min(workers, len(found)))]
    env = dict(os.environ)
    cache = getattr(getattr(triton.knobs, "cache", None), "dir", None)
    if cache:  # this process's cache, wherever it was set
        env["TRITON_CACHE_DIR"] = str(cache)
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="tabserve-precompile-") as folder:
        children: list = []
        try:
            for i, share in enumerate(shares):
                request, log = Path(folder, f"{i}.json"), Path(folder, f"{i}.log")
                request.write_text(json.dumps([[s.module, s.qualname, s.data] for s in share]))
                with request.open() as stdin, log.open("w") as stderr:
                    child = subprocess.Popen(
                        [sys.executable, "-m", __name__],
                        stdin=stdin,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                        env=env,
                    )
                children.append((child, log))
            for child, _ in children:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"compiling {len(found)} Triton kernel specializations in child processes took "
                f"over {timeout} s; stopped"
            ) from None
        finally:
            for child, _ in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        failed = [(child, log) for child, log in children if child.returncode != 0]
        if failed:
            child, log = failed[0]
            words = log.read_text(errors="replace").strip().splitlines()[-12:]
            raise RuntimeError(
                f"a child compiling Triton kernels exited with {child.returncode}:\n"
                + "\n".join(words)
            )


def _cores() -> int:
    """The cores this process may run on (its affinity where the system says, as a container's
    CPU set does), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class TargetDriver:
    """A Triton driver that names a target and has no device: active in a child, which only
    compiles (Triton loads a kernel at its first launch), and where a compile for a GPU is
    wanted on a machine without one (a launch then fails at the load, after the compile)."""

    def __init__(self, target: dict):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(**target)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _kernel(module: str, qualname: str):
    kernel = importlib.import_module(module)
    for name in qualname.split("."):
        kernel = getattr(kernel, name)
    return kernel


def _yield_the_cpu() -> None:
    """This process runs only on cores nothing else wants (Linux's ``SCHED_IDLE``), else at
    the lowest priority. At ``nice 10`` a child slowed the callers' calls whose torch threads
    filled the cores (the tiny model, 2-core CPU: median 120-127 ms beside a child against
    23-26 ms beside a compile in the process; idle-scheduled, 20-27 ms)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        if hasattr(os, "nice"):
            os.nice(19)


def _child() -> int:
    """A child's work: compiles the ``[module, qualname, specialization]`` list on stdin."""
    _yield_the_cpu()
    from triton.runtime.driver import driver

    for module, qualname, data in json.load(sys.stdin):
        try:
            driver.set_active(TargetDriver(json.loads(data)["target"]))
            _kernel(module, qualname).preload(data)
        except Exception as error:  # noqa: BLE001  (reported to the parent, which raises)
            print(f"{module}.{qualname}: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child())
