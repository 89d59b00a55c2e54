"""Triton kernels compiled in child processes (python/tabserve/kernels/precompile.py).

A real kernel goes the whole way on any machine: its launch is listed instead of compiled, a
child compiles it for an H100 (sm_90) into Triton's cache, and the same launch here then reads
it back, with compiling made impossible in this process. No GPU is needed: the launches here
run under a driver that names the H100 as its target and is never asked to load or launch
anything (a launch that would compile is skipped, and a warm-up only compiles).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("triton.knobs")
pytest.importorskip("triton.backends.nvidia.compiler")

PROBE = '''
import triton
import triton.language as tl


@triton.jit
def add_kernel(x, y, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    tl.store(out + i, tl.load(x + i, mask=keep) + tl.load(y + i, mask=keep), mask=keep)
'''


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A fresh kernel module (importable by the children too), an empty Triton cache, and
    the H100 driver active."""
    from tabserve.kernels.precompile import SM90, TargetDriver
    from triton.runtime.driver import driver

    name = f"tabserve_probe_{os.getpid()}_{len(os.listdir(tmp_path))}"
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{name}.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(driver, "_active", TargetDriver(SM90))
    return importlib.import_module(name), tmp_path / "cache"


def _launch(module, block: int = 128):
    import torch

    x = torch.zeros(1000)
    return module.add_kernel.warmup(x, x, x, 1000, BLOCK=block, grid=(8,))


def _cached(cache) -> set:
    if not cache.exists():
        return set()
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def test_a_kernel_compiled_in_a_child_is_read_back_here_without_compiling(probe, monkeypatch):
    from tabserve.kernels.precompile import collect_compiles, compile_elsewhere
    from triton.backends.nvidia.compiler import CUDABackend

    module, cache = probe
    with collect_compiles() as found:
        assert _launch(module) is None and _launch(module) is None  # skipped, listed once
        assert _launch(module, block=256) is None
    assert [(s.module, s.qualname) for s in found] == [(module.__name__, "add_kernel")] * 2
    assert found[0] != found[1] and _cached(cache) == set()  # nothing compiled here

    compile_elsewhere(found, workers=2)
    written = _cached(cache)
    assert len([n for n in written if n.endswith(".cubin")]) == 2

    def no_compiling_here(*args, **kwargs):
        raise AssertionError("compiled in this process")

    monkeypatch.setattr(CUDABackend, "add_stages", no_compiling_here)
    kernels = [_launch(module), _launch(module, block=256)]
    assert all(k is not None and k.asm["cubin"] for k in kernels)
    assert _cached(cache) == written
    with pytest.raises(AssertionError, match="compiled in this process"):
        _launch(module, block=512)  # the check bites: a specialization no child compiled


def test_collect_compiles_guards_its_own_thread_and_innermost_guard_decides(monkeypatch):
    """The hook alone: inside collect_compiles a compile is listed (once) and skipped (True),
    a nested no_triton_compiles refuses, another thread and the code after are untouched, and
    a hook call without Triton's serialized specialization compiles as usual."""
    knobs = pytest.importorskip("triton.knobs")
    from types import SimpleNamespace

    from tabserve.kernels import _common

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["repr"]))
    monkeypatch.setattr(_common, "_chained_hook", [None])

    def call(repr, data="{}"):
        fn = SimpleNamespace(module="kernels", name=repr)
        compile = {"specialization_data": data} if data is not None else {}
        return knobs.runtime.jit_cache_hook(repr=repr, fn=fn, compile=compile)

    with _common.collect_compiles() as found:
        assert call("k1") is True and call("k1") is True and call("k2", '{"a": 1}') is True
        assert call("k3", data=None) is None  # nothing to hand a child: compiles here
        with _common.no_triton_compiles(), pytest.raises(_common.WouldCompile):
            call("k4")
        assert call("k5") is True
        other = threading.Thread(target=lambda: call("k6"))
        other.start()
        other.join()
    assert call("k7") is None
    assert found == [
        _common.Specialization("kernels", "k1", "{}"),
        _common.Specialization("kernels", "k2", '{"a": 1}'),
        _common.Specialization("kernels", "k5", "{}"),
    ]
    assert seen == ["k6", "k7"]


def test_a_child_that_fails_names_the_kernel_and_one_past_the_deadline_is_stopped(
    tmp_path, monkeypatch
):
    from tabserve.kernels._common import Specialization
    from tabserve.kernels.precompile import compile_elsewhere

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    target = '"target": {"backend": "cuda", "arch": 90, "warp_size": 32}'
    wrong = Specialization(
        "tabserve.kernels.feed_forward", "_feed_forward_kernel", f'{{"name": "other", {target}}}'
    )
    with pytest.raises(RuntimeError, match=r"_feed_forward_kernel: RuntimeError: .*for other"):
        compile_elsewhere([wrong])
    missing = Specialization("tabserve.kernels.feed_forward", "no_such_kernel", f"{{{target}}}")
    with pytest.raises(RuntimeError, match="no_such_kernel: AttributeError"):
        compile_elsewhere([missing])
    started = []
    popen = subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recorded)
    # a kernel module whose import never ends: the children are stopped at the deadline
    (tmp_path / "tabserve_probe_stuck.py").write_text("import time\ntime.sleep(3600)\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    stuck = [Specialization("tabserve_probe_stuck", f"k{i}", f"{{{target}}}") for i in range(2)]
    with pytest.raises(TimeoutError, match="took over 0.5 s; stopped"):
        compile_elsewhere(stuck, workers=2, timeout=0.5)
    assert len(started) == 2 and all(c.returncode == -signal.SIGKILL for c in started)
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        compile_elsewhere([wrong], workers=0)
    compile_elsewhere([])  # nothing to do: no child
    monkeypatch.setattr(sys, "executable", "")
    with pytest.raises(RuntimeError, match="needs sys.executable"):
        compile_elsewhere([wrong])
