"""The compile-contention benchmark (benchmarks/compile_contention.py): it measures a call three
ways and records them, and leaves the warm-ups' pause as it found it. No timing is asserted."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("tabicl")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compile_contention  # noqa: E402
from tabserve.models.tabicl.serving import background  # noqa: E402


def test_the_three_ways_are_measured_and_recorded(tmp_path):
    hook = background._pause_for_callers
    out = tmp_path / "contention.json"
    argv = ["--device", "cpu", "--workload", "small-quick", "--repeats", "1", "--json", str(out)]
    assert compile_contention.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["benchmark"] == "compile_contention" and document["model_size"] == "tiny"
    assert all(document[k] > 0 for k in ("alone_ms", "beside_ms", "paused_ms"))
    assert background._pause_for_callers is hook  # the pause is switched back on
    assert background.background_compiles() == 0


def test_the_triton_ways_measure_calls_beside_each_compile_and_record_them(tmp_path, monkeypatch):
    """With --triton: the calls beside a compile on the worker, here then in children (the
    compile itself stood in for: a real one is test_precompile's), and the stand-in driver of
    the CPU left to the benchmark's process."""
    driver = pytest.importorskip("triton.runtime.driver").driver
    monkeypatch.setattr(driver, "_active", None)
    compiled = []

    def compile_feed_forward(where, device, eps):
        compiled.append((where, threading.current_thread().name, eps))
        time.sleep(1.0)

    monkeypatch.setattr(compile_contention, "_compile_feed_forward", compile_feed_forward)
    out = tmp_path / "contention.json"
    argv = ["--device", "cpu", "--workload", "small-quick", "--repeats", "1", "--triton"]
    assert compile_contention.main([*argv, "--json", str(out)]) == 0
    worker = "tabserve-compile"
    assert [(w, t) for w, t, _ in compiled] == [("here", worker), ("children", worker)]
    assert compiled[0][2] != compiled[1][2]  # a specialization of its own each
    document = json.loads(out.read_text())
    for where in ("here", "children"):
        found = document[f"triton_{where}"]
        assert found["compile_s"] >= 1.0 and found["calls"] >= 1
        assert 0 < found["median_ms"] <= found["longest_ms"]
    assert background.background_compiles() == 0
