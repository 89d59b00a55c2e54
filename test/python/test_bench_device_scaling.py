"""The device-scaling suite (``python -m tabserve.bench devices``): one CPU run of every cell on
one and two CPU devices with a tiny random-weight model, its record, its targets and its section
of docs/results.md (``benchmarks/record.py``). No timing is asserted."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tabicl")

from tabserve.bench import cli
from tabserve.bench import device_scaling as scaling

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("devices")
    argv = ["--device", "cpu", "--quick", "--model-size", "tiny", "--counts", "1", "2",
            "--repeats", "1", "--tables", "4", "--out", str(out)]  # fmt: skip
    assert cli.main(["devices", *argv]) == 0
    (path,) = out.glob("device_scaling_*.json")
    assert path.name == "device_scaling_cpu-quick.json"
    return path, json.loads(path.read_text())


def test_every_cell_runs_on_each_count_with_one_devices_answers(run):
    _, document = run
    assert document["schema"] == scaling.SCHEMA
    seen = {(r["cell"], r["devices"]) for r in document["results"]}
    assert seen == {(cell, n) for cell in scaling.CELLS for n in (1, 2)}
    for r in document["results"]:
        assert r["status"] == "ok", r
        assert r["device_list"] == ["cpu"] * r["devices"]
        assert len(r["samples_ms"]) == 1 and r["median_ms"] == r["samples_ms"][0] > 0
        assert r["max_difference"] <= 1e-6  # the answers of one device
        assert (r["split"] == "tables") == (r["cell"] == "many-tables")
        assert r["split"] in ("members", "rows", "tables")
        if r["devices"] == 1:
            assert r["speedup"] == 1.0 and r["max_difference"] == 0.0
            assert r["split"] in ("members", "tables")  # one device never splits by rows
    # A list of one CPU named twice is not a multi-GPU run: its targets are not judged.
    assert {t["state"] for t in document["targets"]} == {"not a multi-GPU run"}
    assert {(t["cell"], t["devices"]) for t in document["targets"]} == {
        (cell, 2) for cell in scaling.TARGETS
    }


def test_the_record_renders_into_the_results_page(run):
    path, document = run
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import record
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert record.kind(document) == "device_scaling"
    page = record.render_results([path])
    assert "## Device scaling:" in page
    rows = [line for line in page.splitlines() if line.startswith("| fit+predict |")]
    assert rows[0].startswith("| fit+predict | 1 | members |") and "| 2 x cpu |" in rows[1]
    assert "| 2 | >= 1.6x |" in rows[2] and rows[2].endswith("| not a multi-GPU run |")
    txt = path.with_suffix(".txt").read_text()
    assert "many-tables" in txt and "not a multi-GPU run" in txt


def test_counts_past_the_visible_gpus_are_left_out_unless_repeated(monkeypatch):
    monkeypatch.setattr(scaling.torch.cuda, "device_count", lambda: 2)
    assert scaling.device_lists("cuda", [1, 2, 4], repeat=False) == {
        1: ["cuda:0"],
        2: ["cuda:0", "cuda:1"],
    }
    assert scaling.device_lists("cuda", [4], repeat=True) == {4: ["cuda:0"] * 4}
    assert scaling.device_lists("cpu", [3], repeat=False) == {3: ["cpu"] * 3}


def test_targets_are_judged_on_distinct_devices_only():
    ok = {"status": "ok", "speedup": 1.7}
    results = [
        dict(ok, cell="fit+predict", devices=2, device_list=["cuda:0", "cuda:1"]),
        dict(ok, cell="many-tables", devices=2, device_list=["cuda:0", "cuda:1"]),
        dict(ok, cell="many-tables", devices=4, device_list=["cuda:0"] * 4),
        dict(ok, cell="kv-predict", devices=1, device_list=["cuda:0"]),
    ]
    states = {(t["cell"], t["devices"]): t["state"] for t in scaling.targets(results)}
    assert states == {
        ("fit+predict", 2): "met",  # 1.7 >= 1.6
        ("many-tables", 2): "MISSED",  # 1.7 < 1.85
        ("many-tables", 4): "not a multi-GPU run",
    }
    assert np.isclose(scaling.TARGETS["many-tables"][8], 7.0)
