"""The compile-contention benchmark (benchmarks/compile_contention.py): it measures a call three
ways and records them, and leaves the warm-ups' pause as it found it. No timing is asserted."""

import json
import sys
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
