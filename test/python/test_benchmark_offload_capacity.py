"""The offload-capacity benchmark (benchmarks/offload_capacity.py): every engine's ladder in
every mode runs on the CPU with the tiny model, tabserve agrees with tabicl on each table, a
ladder stops at its first failure, and the record renders. No timing is asserted."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tabicl")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import offload_capacity  # noqa: E402
import record  # noqa: E402


def test_every_ladder_runs_and_tabserve_answers_as_tabicl(tmp_path):
    out = tmp_path / "offload_capacity_cpu.json"
    assert offload_capacity.main(["--quick", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    results = document["results"]
    ladders = {(r["engine"], r["mode"]) for r in results}
    assert ladders == {(e, m) for e in offload_capacity.ENGINES for m in offload_capacity.MODES}
    assert all(r["status"] == "ok" for r in results) and len(results) == 2 * 3 * 2
    for r in results:
        assert r["fit_ms"] >= 0 and r["predict_ms"] > 0 and r["memory"]["peak_rss_bytes"] > 0
        if r["engine"] == "tabserve":
            assert r["max_abs_prob_diff_to_tabicl"] <= 1e-5
    assert document["widest"] == {
        e: dict.fromkeys(offload_capacity.MODES, 16) for e in ("tabicl", "tabserve")
    }
    text = record.render_results([out])
    assert "## Offload capacity:" in text and "| 16 |" in text and "tabserve disk" in text


def test_a_ladder_stops_at_its_first_failure(tmp_path, monkeypatch):
    calls = []

    def rung(spec, folder, timeout_s):
        calls.append((spec["mode"], spec["features"]))
        status = "oom" if spec["features"] >= 16 and spec["mode"] == "gpu" else "ok"
        labels = {k: spec[k] for k in ("engine", "mode", "features")}
        done = {"fit_ms": 1.0, "predict_ms": 1.0, "outputs": str(tmp_path / "none.npy")}
        return {**labels, "status": status, **done}

    monkeypatch.setattr(offload_capacity, "run_rung", rung)
    args = offload_capacity.parse_args(
        ["--quick", "--engines", "tabserve", "--features", "4", "16", "64"]
    )
    results = offload_capacity.climb(args, tmp_path / "clf.ckpt", tmp_path, float("inf"), print)
    assert [c for c in calls if c[0] == "gpu"] == [("gpu", 4), ("gpu", 16)]  # 64 never tried
    assert [c for c in calls if c[0] == "cpu"] == [("cpu", 4), ("cpu", 16), ("cpu", 64)]
    assert offload_capacity.widest(results) == {"tabserve": {"gpu": 4, "cpu": 64, "disk": 64}}


def test_engines_climb_side_by_side_and_the_deadline_stops_a_running_rung(tmp_path, monkeypatch):
    calls = []

    def rung(spec, folder, timeout_s):
        calls.append((spec["engine"], spec["mode"], spec["features"], timeout_s))
        labels = {k: spec[k] for k in ("engine", "mode", "features")}
        if spec["features"] == 16:  # the rung outlives the deadline: its timeout stops it
            return {**labels, "status": "timeout", "reason": f"timeout after {timeout_s:g} s"}
        done = {"fit_ms": 1.0, "predict_ms": 1.0, "outputs": str(tmp_path / "none.npy")}
        return {**labels, "status": "ok", **done}

    monkeypatch.setattr(offload_capacity, "run_rung", rung)
    args = offload_capacity.parse_args(["--quick", "--modes", "gpu", "--features", "4", "16", "64"])
    deadline = offload_capacity.time.monotonic() + 100.0
    results = offload_capacity.climb(args, tmp_path / "clf.ckpt", tmp_path, deadline, print)
    assert [c[:3] for c in calls] == [
        ("tabicl", "gpu", 4), ("tabserve", "gpu", 4), ("tabicl", "gpu", 16), ("tabserve", "gpu", 16)
    ]  # fmt: skip
    assert all(0 < c[3] <= 100.0 for c in calls)  # no rung runs past the deadline
    assert [r["status"] for r in results] == ["ok", "ok", "stopped", "stopped"]
    assert offload_capacity.widest(results) == {"tabicl": {"gpu": 4}, "tabserve": {"gpu": 4}}


def test_no_rung_starts_after_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(offload_capacity, "run_rung", lambda *a: pytest.fail("a rung ran"))
    args = offload_capacity.parse_args(["--quick", "--modes", "cpu"])
    results = offload_capacity.climb(args, tmp_path / "clf.ckpt", tmp_path, 0.0, print)
    assert [(r["engine"], r["status"]) for r in results] == [
        ("tabicl", "not run"), ("tabserve", "not run")
    ]


def test_a_rung_records_where_tabserves_calls_fell_back(monkeypatch, tmp_path):
    """The child's watch reads what the estimators log when a GPU call's column output does not
    fit where its mode asked (reference_args.offload_store), and the record shows it."""
    import logging

    import torch
    from tabserve.models.tabicl import TabICLClassifier
    from tabserve.models.tabicl.sklearn import reference_args

    logger = logging.getLogger("tabserve")  # the watch's handler and level end with the test
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "level", logger.level)
    kept_on = offload_capacity._watch_fallbacks()
    monkeypatch.setattr(reference_args, "device_free_bytes", lambda device: 1 << 20)
    estimator = TabICLClassifier(offload_mode=False, device="cuda:0")
    estimator.device_ = torch.device("cuda", 0)  # as a fit on the GPU sets it (no GPU needed)
    with reference_args.offload_store(estimator, 1 << 19) as store:
        assert store is None  # fits on the device: nothing said
    assert kept_on == set()
    with reference_args.offload_store(estimator, 1 << 21) as store:
        assert store is not None  # past the device's free memory: host memory
    assert kept_on == {"cpu"}
    rung = {"engine": "tabserve", "mode": "gpu", "features": 2000, "status": "ok", "fit_ms": 1.0,
            "predict_ms": 1.0, "memory": {"peak_allocated_bytes": 1 << 30}, "kept_on": ["cpu"]}  # fmt: skip
    assert "kept on cpu" in offload_capacity._line(rung)
    out = tmp_path / "offload_capacity_h100.json"
    out.write_text(json.dumps({"benchmark": "offload_capacity", "environment": {}, "results": [rung]}))
    assert "(kept on cpu)" in record.render_results([out])
