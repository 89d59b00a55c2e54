"""The estimator-level benchmark suite (``python -m tabserve.bench estimators``): its kinds,
engines, child process, report and record (``tabserve.bench.estimator_*``).

CPU only, a tiny random-weight model, ``--quick`` tables and one warm repeat: one end-to-end run
through the driver's command line on a numeric and a regression kind (shared by the tests that
read its document), one run whose checkpoint does not exist (every job an error row), the child
processes' imports, and unit tests of the tables and figures.
"""

import copy
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("tabicl")
pytest.importorskip("sklearn")

from tabicl_helpers import bench_child_imports
from tabserve.bench import cli, estimator_engines, estimator_report
from tabserve.bench import estimator_suite as suite
from tabserve.bench.estimator_kinds import (
    KINDS,
    MIXED_STRING_CATEGORIES,
    Kind,
    kind_by_name,
    make_table,
)
from tabserve.bench.timing import geometric_mean
from tabserve.bench.workloads import make_checkpoint

QUICK = ["--device", "cpu", "--quick", "--model-size", "tiny", "--repeats", "1", "--quiet"]


def _document(out) -> dict:
    (path,) = out.glob("estimator_suite_*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    argv = QUICK + ["--kinds", "small", "regression", "--recipes", "exact", "--out", str(out)]
    argv += ["--work-dir", str(out / "work")]
    assert cli.main(["estimators", *argv]) == 0
    return out, _document(out)


def _result(document, kind, engine):
    (found,) = [r for r in document["results"] if r["kind"] == kind and r["engine"] == engine]
    return found


def test_end_to_end_writes_a_result_per_engine_and_kind(run):
    _, document = run
    engines = ["tabicl", "tabicl-fp32", "tabserve-exact"]
    assert document["settings"]["engines"] == engines
    assert document["environment"]["tabicl"].startswith("2.2")
    assert document["command"].startswith("python -m tabserve.bench estimators --device cpu")
    assert sorted((r["kind"], r["engine"]) for r in document["results"]) == sorted(
        (k, e) for k in ("small", "regression") for e in engines
    )
    for r in document["results"]:
        assert r["status"] == "ok", r.get("reason")
        assert r["cold"]["cold_ms"] > r["cold"]["first_call_ms"] > 0  # imports included
        assert r["warm"]["median_ms"] > 0 and r["warm"]["repeats"] == 1
        warm = r["warm"]
        assert warm["fit_ms"] + warm["predict_ms"] == pytest.approx(warm["median_ms"])
        assert r["warm"]["max_abs_diff_to_cold"] == 0.0  # a clone gives the same answer
        assert r["speedup"]["warm"]["tabicl-fp32"] > 0
    exact = _result(document, "small", "tabserve-exact")
    assert 0 < exact["stages"]["model_share"] <= 1 and exact["stages"]["model_calls"] >= 1
    summary = document["summary"]["tabserve-exact"]
    assert summary["warm_vs_tabicl-fp32"] > 0 and summary["warm_vs_tabicl-fp32_kinds"] == 2
    assert document["predict_many"] == []  # wide-rows not selected


def test_exact_matches_tabicl_fp32_on_the_numeric_kind(run):
    _, document = run
    acc = _result(document, "small", "tabserve-exact")["accuracy"]
    assert acc["max_abs_prob_diff"] <= 1e-5
    assert acc["argmax_agreement"] == 1.0
    reg = _result(document, "regression", "tabserve-exact")["accuracy"]
    assert reg["max_mean_diff_over_std"] <= 1e-4
    assert _result(document, "small", "tabicl-fp32")["accuracy"] == {"reference": True}


def test_the_table_renders_and_is_saved(run):
    out, document = run
    text = estimator_report.render(document)
    (saved,) = out.glob("estimator_suite_*.txt")
    assert saved.read_text().strip() == text.strip()
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("kind"))
    for column in ("cold s", "warm ms", "x tabicl", "x fp32", "accuracy vs tabicl-fp32"):
        assert column in header
    rows = [line for line in lines if line.startswith("small") and "tabserve-exact" in line]
    assert len(rows) == 2 and "dp " in rows[0]  # the suite's row, then the floor table's
    assert "Speed-ups, geometric mean across kinds" in text
    assert "Errors" not in text


def test_the_floor_is_measured_in_the_run_and_each_cold_answer_set_against_it(run):
    _, document = run
    floor = document["floor"]
    assert len(floor["samples_ms"]) == 3 and floor["median_ms"] == sorted(floor["samples_ms"])[1]
    sentence, rows = estimator_report.floor_table(document)
    assert sentence.startswith(f"floor {floor['median_ms'] / 1e3:.2f} s")
    for row, r in zip(rows, document["results"]):
        over = (r["cold"]["cold_ms"] - floor["median_ms"]) / 1e3
        assert row[0] == r["kind"] and float(row[3]) == pytest.approx(over, abs=0.006)
    assert estimator_report.floor_table(dict(document, floor=None)) is None


def test_a_merged_record_names_each_runs_floor_beside_its_kinds(run):
    _, document = run
    later = document["floor"]["median_ms"] + 360.0  # a second run's floor, on other kinds
    results = [dict(r, floor_ms=later) if r["kind"] != "small" else r for r in document["results"]]
    sentence, rows = estimator_report.floor_table(dict(document, results=results))
    assert sentence.startswith("floor per merged run")
    assert f"{document['floor']['median_ms'] / 1e3:.2f} s (small)" in sentence
    assert f"{later / 1e3:.2f} s (" in sentence and "small" not in sentence.split(";")[1]
    for row, r in zip(rows, results):
        over = (r["cold"]["cold_ms"] - r["floor_ms"]) / 1e3
        assert float(row[3]) == pytest.approx(over, abs=0.006)


def test_a_failing_engine_is_an_error_row(tmp_path):
    missing = tmp_path / "no-such.ckpt"
    argv = QUICK + ["--kinds", "small", "--recipes", "exact", "--out", str(tmp_path)]
    argv += ["--work-dir", str(tmp_path / "work")]
    assert suite.main(argv + ["--checkpoint", str(missing)]) == 0
    document = _document(tmp_path)
    assert [r["engine"] for r in document["results"]] == ["tabicl", "tabicl-fp32", "tabserve-exact"]
    for r in document["results"]:
        assert r["status"] == "failed"
        assert r["error"]["stage"].startswith("cold")
        assert r["speedup"]["warm"]["tabicl"] is None and r["accuracy"] is None
    text = estimator_report.render(document)
    assert "FAILED" in text and "Errors (recorded as results, not fatal):" in text
    assert "small / tabserve-exact: failed:" in text


@pytest.mark.parametrize(
    ("engine", "imports_models"),
    [("tabicl", False), ("tabicl-fp32", False), ("tabserve-exact", True)],
)
def test_a_tabicl_child_never_imports_tabserve_models(tmp_path, engine, imports_models):
    """A tabicl engine's process loads tabserve's base and the suite's modules, never its model
    code; a tabserve engine's process does (the probe sees model imports)."""
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    spec = {"engine": engine, "kind": "small", "mode": "suite", "device": "cpu", "quick": True,
            "seed": 0, "repeats": 1, "checkpoint": str(checkpoint),
            "result": str(tmp_path / "result.json"),
            "outputs": str(tmp_path / "result.npy")}  # fmt: skip
    result, loaded = bench_child_imports("estimator_child", spec, tmp_path)
    assert result["status"] == "ok", result.get("reason")
    assert result["estimator"]["family"] == engine.split("-")[0]
    assert bool(loaded) == imports_models, loaded


def test_the_child_is_a_module_the_runner_starts(tmp_path):
    """``python -m tabserve.bench.estimator_child SPEC.json`` through the driver's harness: a spec
    the child cannot run is a failed result with its stage, not a crash."""
    spec = {"engine": "tabicl", "kind": "small", "device": "cpu", "quick": True, "seed": 0,
            "repeats": 1, "checkpoint": str(tmp_path / "missing.ckpt")}  # fmt: skip
    result = suite.run_job(spec, tmp_path / "job", timeout_s=300)
    assert result["status"] == "failed" and result["returncode"] == 0
    assert result["error"]["stage"].startswith("cold")
    assert json.loads((tmp_path / "job" / "result-spec.json").read_text())["spawned_at"] > 0


def test_the_driver_offers_the_estimator_suite(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "python -m tabserve.bench estimators --help" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["estimators", "--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: python -m tabserve.bench estimators")
    assert "--kinds" in usage and "--merge" in usage


def test_tables_are_seeded_and_shaped():
    for kind in KINDS:
        a, b = make_table(kind, quick=True), make_table(kind, quick=True)
        n_train, n_test, n_features = kind.shape(quick=True)
        if kind.name == "mixed":  # its numeric columns, then the string ones
            n_features += len(MIXED_STRING_CATEGORIES)
        assert a["X_train"].shape == (n_train, n_features)
        assert a["X_test"].shape == (n_test, n_features)
        assert len(a["y_train"]) == n_train
        for key in a:
            left, right = a[key], b[key]
            if isinstance(left, pd.DataFrame):
                pd.testing.assert_frame_equal(left, right)
            else:
                np.testing.assert_array_equal(left, right)
        if kind.task == "clf":
            assert len(set(a["y_train"])) == kind.n_classes
    assert kind_by_name("wide").shape(quick=False) == (4000, 1000, 150)
    pool = make_table(kind_by_name("wide-rows"), quick=True, n_test=1000)
    base = make_table(kind_by_name("wide-rows"), quick=True)
    assert pool["X_test"].shape[0] == 1000
    np.testing.assert_array_equal(pool["X_train"], base["X_train"])


def test_mixed_and_categories_columns():
    mixed = make_table(kind_by_name("mixed"))
    X_train, X_test = mixed["X_train"], mixed["X_test"]
    assert set(mixed["y_train"]) == {"alpha", "beta", "gamma"}
    assert 0.08 < X_train.filter(like="num_").isna().to_numpy().mean() < 0.12
    strings = [f"str_{j}" for j in range(4)]
    assert [str(X_train[c].dtype) for c in strings] == ["object", "object", "string", "string"]
    unseen = np.mean([X_test[c].astype(str).str.contains("unseen").mean() for c in strings])
    assert 0.01 < unseen < 0.03
    assert not X_train["str_0"].astype(str).str.contains("unseen").any()
    cats = make_table(kind_by_name("categories"))["X_train"]
    assert list(cats.columns) == list(range(11))
    assert [str(cats[c].dtype) for c in range(6, 11)] == ["category"] * 3 + ["bool"] * 2
    assert cats[6].isna().any()


def test_accuracy_and_speedup_figures():
    ref = np.array([[0.2, 0.8], [0.6, 0.4]])
    acc = suite.accuracy("clf", ref + [[0.01, -0.01], [-0.2, 0.2]], ref)
    assert acc == {"max_abs_prob_diff": pytest.approx(0.2), "argmax_agreement": 0.5}
    reg = suite.accuracy("reg", np.array([1.0, 2.5]), np.array([1.0, 2.0]), target_std=2.0)
    assert reg["max_mean_diff_over_std"] == pytest.approx(0.25)
    assert "error" in suite.accuracy("clf", ref[:1], ref)
    assert geometric_mean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert geometric_mean([]) is None


def test_speedups_and_geometric_means(tmp_path):
    ref = np.array([[0.2, 0.8], [0.6, 0.4]])

    def row(kind, engine, warm, cold, output=ref):
        path = tmp_path / f"{kind}-{engine}.npy"
        np.save(path, output)
        return {
            "kind": kind,
            "engine": engine,
            "status": "ok",
            "warm": {"median_ms": warm},
            "cold": {"cold_ms": cold},
            "outputs": str(path),
        }

    results = [
        row("a", "tabicl", 40.0, 4000.0),
        row("a", "tabicl-fp32", 80.0, 4000.0),
        row("a", "tabserve-exact", 20.0, 2000.0, ref + 1e-3),
        row("b", "tabicl", 10.0, 1000.0),
        {"kind": "b", "engine": "tabicl-fp32", "status": "failed", "reason": "x"},
        row("b", "tabserve-exact", 10.0, 500.0),
    ]
    kinds = [Kind(name, 1, 1, 1, 2, (1, 1, 1), "") for name in "ab"]
    suite.add_accuracy_and_speedups(results, kinds)
    mine = results[2]
    assert mine["speedup"]["warm"] == {"tabicl": 2.0, "tabicl-fp32": 4.0}
    assert mine["accuracy"]["max_abs_prob_diff"] == pytest.approx(1e-3)
    assert results[5]["accuracy"] is None and results[5]["speedup"]["warm"]["tabicl-fp32"] is None
    summary = suite.summarize(results, ["tabserve-exact"])["tabserve-exact"]
    assert summary["warm_vs_tabicl"] == pytest.approx(2.0**0.5)  # kinds a (2x) and b (1x)
    assert summary["warm_vs_tabicl-fp32"] == pytest.approx(4.0)
    assert summary["warm_vs_tabicl-fp32_kinds"] == 1  # kind b's fp32 failed
    assert summary["cold_vs_tabicl"] == pytest.approx(2.0)
    rows = estimator_report.suite_rows(results)
    x_tabicl = estimator_report.SUITE_COLUMNS.index(">x tabicl")
    assert rows[2][x_tabicl : x_tabicl + 2] == ["2.00x", "4.00x"] and rows[4][2] == "FAILED"


def test_engine_specs():
    fp32 = estimator_engines.estimator_spec("tabicl-fp32", "clf", "m.ckpt", "cpu")
    assert fp32["family"] == "tabicl" and fp32["class"] == "TabICLClassifier"
    assert fp32["params"]["use_amp"] is False and fp32["params"]["use_fa3"] is False
    assert fp32["params"]["allow_auto_download"] is False and fp32["params"]["n_estimators"] == 8
    default = estimator_engines.estimator_spec("tabicl", "reg", "m.ckpt", "cuda")["params"]
    assert "use_amp" not in default and "use_fa3" not in default
    mine = estimator_engines.estimator_spec("tabserve-auto", "reg", "m.ckpt", "cpu", kv_cache=True)
    assert mine["class"] == "TabICLRegressor" and mine["params"]["recipe"] == "auto"
    assert mine["params"]["kv_cache"] is True
    with pytest.raises(ValueError):
        estimator_engines.estimator_spec("other", "clf", "m.ckpt", "cpu")


RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "estimator_suite_cpu.json"


def _write(path, document) -> Path:
    path.write_text(json.dumps(document))
    return path


def _split(document, kinds, predict_many: bool, command: str) -> dict:
    """The part of a record about ``kinds``, as a run with ``--kinds`` would have written it."""
    part = copy.deepcopy(document)
    part["kinds"] = [k for k in part["kinds"] if k["name"] in kinds]
    part["results"] = [r for r in part["results"] if r["kind"] in kinds]
    part["command"] = command
    if not predict_many:
        part["predict_many"], part["settings"]["predict_sizes"] = [], []
    part["summary"] = suite.summarize(part["results"], part["settings"]["engines"])
    return part


def test_merging_a_record_split_by_kind_gives_back_its_results_and_summary(tmp_path):
    original = json.loads(RECORD.read_text())
    first = ["small", "wide-rows", "many-class", "categories"]  # interleaved with the second
    a = _write(tmp_path / "a.json", _split(original, first, True, "run a"))
    rest = [k["name"] for k in original["kinds"] if k["name"] not in first]
    b = _write(tmp_path / "b.json", _split(original, rest, False, "run b"))
    out = tmp_path / "merged"
    # the file without the predict-many part first: it comes from whichever file has it
    assert suite.main(["--merge", str(b), str(a), "--out", str(out), "--quiet"]) == 0
    merged = _document(out)
    assert merged["schema"] == suite.SCHEMA
    assert merged["results"] == original["results"]  # in the order of KINDS
    assert merged["kinds"] == original["kinds"]
    assert merged["summary"] == original["summary"]
    assert merged["predict_many"] == original["predict_many"]
    assert merged["settings"]["predict_sizes"] == original["settings"]["predict_sizes"]
    assert merged["command"] == "run b ; then run a"
    assert merged["environment"] == original["environment"]
    assert merged["settings"]["merged_from"] == [str(b), str(a)]
    text = estimator_report.render(merged)
    assert (out / "estimator_suite_cpu-quick.txt").read_text().strip() == text
    assert "Fit once (kv_cache=True), predict many" in text


def test_merge_names_each_runs_commit_once(tmp_path):
    original = json.loads(RECORD.read_text())
    parts = []
    for name, commit in (("a", "abc1234"), ("b", "def5678+dirty"), ("c", "abc1234")):
        part = _split(original, ["small"], False, f"run {name}")
        part["environment"]["git_commit"] = commit
        parts.append(str(_write(tmp_path / f"{name}.json", part)))
    out = tmp_path / "merged"
    assert suite.main(["--merge", *parts, "--out", str(out), "--quiet"]) == 0
    assert _document(out)["environment"]["git_commit"] == "abc1234 ; then def5678+dirty"


def test_a_predict_many_job_that_timed_out_keeps_the_sizes_it_measured():
    def job(engine, status, sizes):
        return {"engine": engine, "status": status, "sizes": {n: {"median_ms": ms} for n, ms in sizes.items()}}

    rows = [
        job("tabicl", "ok", {"1": 80.0, "100": 40.0, "10000": 400.0}),
        job("tabicl-fp32", "ok", {"1": 120.0, "100": 50.0, "10000": 1200.0}),
        job("tabserve-auto", "timeout", {"1": 8.0, "100": 10.0}),  # killed during 10,000 rows
    ]
    suite.add_predict_many_speedups(rows)
    mine = rows[2]["speedup"]
    assert mine["1"]["tabicl"] == pytest.approx(10.0) and mine["100"]["tabicl-fp32"] == pytest.approx(5.0)
    assert "10000" not in mine
    document = {"settings": {"predict_sizes": [1, 100, 10000]}, "predict_many": rows}
    columns, table = estimator_report.predict_many_table(document)
    assert columns[3:6] == [">1 rows ms", ">100 rows ms", ">10000 rows ms"]
    assert table[2][1] == "TIMEOUT" and table[2][-3:] == ["10.00x", "4.00x", "-"]


def test_merge_a_later_file_replaces_a_kind_and_engine_and_the_summary_follows(tmp_path):
    original = json.loads(RECORD.read_text())
    later = _split(original, ["small"], True, "run again")
    (mine,) = [r for r in later["results"] if r["engine"] == "tabserve-exact"]
    old = mine["speedup"]["warm"]["tabicl"]
    mine["speedup"]["warm"]["tabicl"] = 100.0
    mine["warm"]["median_ms"] = 0.5
    for row in later["predict_many"]:
        row["fit_ms"] = 1.0
    later["settings"]["recipes"], later["settings"]["engines"] = ["auto"], ["tabserve-auto"]
    a = _write(tmp_path / "a.json", original)
    b = _write(tmp_path / "b.json", later)
    merged = suite.merge([a, b])
    assert [(r["kind"], r["engine"]) for r in merged["results"]] == [
        (r["kind"], r["engine"]) for r in original["results"]
    ]
    assert _result(merged, "small", "tabserve-exact")["warm"]["median_ms"] == 0.5
    assert _result(merged, "small", "tabicl") == _result(original, "small", "tabicl")
    assert _result(merged, "wide", "tabserve-exact") == _result(original, "wide", "tabserve-exact")
    assert [r["fit_ms"] for r in merged["predict_many"]] == [1.0] * 3
    before = original["summary"]["tabserve-exact"]
    # one kind's factor of the geometric mean replaced
    expected = before["warm_vs_tabicl"] * (100.0 / old) ** (1 / before["warm_vs_tabicl_kinds"])
    assert merged["summary"]["tabserve-exact"]["warm_vs_tabicl"] == pytest.approx(expected)
    assert merged["settings"]["recipes"] == ["exact", "auto"]
    assert list(merged["summary"]) == ["tabicl", "tabicl-fp32", "tabserve-exact", "tabserve-auto"]
    assert merged["summary"]["tabserve-auto"]["warm_vs_tabicl_kinds"] == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["settings"].update(device="cuda"), "device 'cuda' differs"),
        (lambda d: d["settings"].update(quick=False), "quick mode False differs"),
        (lambda d: d["environment"].update(torch="2.11.0+cu130"), "torch version '2.11.0"),
        (lambda d: d.update(schema="tabserve.bench/1"), "not an estimator-suite record"),
    ],
)
def test_merge_refuses_records_of_another_device_mode_torch_or_schema(tmp_path, change, message):
    original = json.loads(RECORD.read_text())
    other = copy.deepcopy(original)
    change(other)
    a = _write(tmp_path / "a.json", original)
    b = _write(tmp_path / "b.json", other)
    with pytest.raises(SystemExit, match=re.escape(f"{b}: {message}")):
        suite.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out"), "--quiet"])
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_file_that_is_not_a_record(tmp_path):
    a = _write(tmp_path / "a.json", json.loads(RECORD.read_text()))
    driver = RECORD.with_name("cpu.json")  # the raw-model driver's record
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path in (driver, broken):
        with pytest.raises(ValueError, match=re.escape(f"{path}: not an estimator-suite record")):
            suite.merge([a, path])


def test_a_run_stopped_from_outside_leaves_the_jobs_it_finished(tmp_path, monkeypatch):
    finished = []
    real = suite.run_job

    def stopped_after_one(*args, **kwargs):
        if finished:
            raise KeyboardInterrupt  # the lent machine's time limit, say
        finished.append(real(*args, **kwargs))
        return finished[-1]

    monkeypatch.setattr(suite, "run_job", stopped_after_one)
    argv = QUICK + ["--kinds", "small", "--recipes", "exact", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        cli.main(["estimators", *argv, "--work-dir", str(tmp_path / "work")])
    document = _document(tmp_path)
    assert document["complete"] is False and document["floor"]["median_ms"] > 0
    (only,) = document["results"]
    assert (only["kind"], only["engine"], only["status"]) == ("small", "tabicl", "ok")
    assert only["cold"] == finished[0]["cold"]
    (saved,) = tmp_path.glob("estimator_suite_*.txt")
    assert saved.read_text().splitlines()[2].startswith("INCOMPLETE")
    assert suite.merge([next(tmp_path.glob("estimator_suite_*.json"))])["complete"] is False

