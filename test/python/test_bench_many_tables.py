"""The many-tables benchmark suite (``python -m tabserve.bench many-tables``): its population,
engines, child process, report and record (``tabserve.bench.many_tables_*``), and its section of
docs/results.md (``benchmarks/record.py``).

CPU only, a tiny random-weight model and the ``--quick`` population: one end-to-end run through
the driver's command line (shared by the tests that read its record), a tabicl child's imports,
and unit tests of the population and the figures. No timing is asserted.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("tabicl")
pytest.importorskip("sklearn")

from tabicl_helpers import bench_child_imports
from tabserve.bench import cli
from tabserve.bench import many_tables_report as many_report
from tabserve.bench import many_tables_suite as suite
from tabserve.bench.many_tables_child import ENGINES, TABSERVE_LOOP, TABSERVE_PACKED
from tabserve.bench.many_tables_population import (
    POPULATIONS,
    describe,
    make_task,
    population_for,
    task_specs,
)
from tabserve.bench.workloads import make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--device", "cpu", "--quick", "--model-size", "tiny", "--quiet"]
NOTE = "a test run"


def _record_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import record
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return record


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("many-tables")
    argv = QUICK + ["--out", str(out), "--work-dir", str(out / "work"), "--note", NOTE]
    assert cli.main(["many-tables", *argv]) == 0
    (path,) = out.glob("many_tables_*.json")
    assert path.name == "many_tables_cpu-quick.json"
    return path, json.loads(path.read_text())


def _result(document, engine):
    (found,) = [r for r in document["results"] if r["engine"] == engine]
    return found


# ---------------------------------------------------------------------------------------------
# The population


def test_the_population_is_seeded():
    population = POPULATIONS["cpu"]
    assert task_specs(population, 77) == task_specs(population, 77)
    assert task_specs(population, 77) != task_specs(population, 78)
    spec = task_specs(population, 77)[0]
    for left, right in zip(make_task(spec), make_task(spec)):
        if isinstance(left, pd.DataFrame):
            pd.testing.assert_frame_equal(left, right)
        else:
            np.testing.assert_array_equal(left, right)


def test_the_full_population_has_the_promised_mix():
    population = POPULATIONS["full"]
    specs = task_specs(population, 77)
    summary = describe(specs)
    assert summary["tables"] == 1000
    assert (summary["reg"], summary["many_class"], summary["frames"]) == (200, 50, 250)
    clf = [s for s in specs if s.task == "clf"]
    assert {s.n_classes for s in clf if s.n_classes > 10} <= set(range(11, 21))
    assert {s.n_classes for s in clf if s.n_classes <= 10} == set(range(2, 11))
    assert any(s.frame and s.task == "reg" for s in specs)
    for key, (low, high) in (
        ("n_train", (32, 2048)),
        ("n_test", (8, 512)),
        ("n_features", (3, 60)),
    ):
        values = [getattr(s, key) for s in specs]
        assert low <= min(values) and max(values) <= high
    # log-uniform: the median near the bounds' geometric mean (256 train rows, 64 test rows)
    assert 180 < np.median([s.n_train for s in specs]) < 360
    assert 45 < np.median([s.n_test for s in specs]) < 90


@pytest.mark.parametrize(("device", "quick", "name"), [("cuda", False, "full"),
                         ("cpu", False, "cpu"), ("cuda", True, "quick")])  # fmt: skip
def test_each_run_has_its_population_and_tables_sets_the_count(device, quick, name):
    assert population_for(device, quick).name == name
    assert population_for(device, quick, tables=5).tables == 5
    cpu = POPULATIONS["cpu"]
    assert cpu.train_rows == (32, 512) and cpu.test_rows == (8, 128)


def test_a_handful_of_tables_still_holds_every_kind():
    summary = describe(task_specs(population_for("cpu", True, tables=6), 77))
    assert summary["reg"] >= 1 and summary["many_class"] >= 1 and summary["frames"] >= 1


def test_tasks_are_shaped_as_their_specs_say():
    specs = task_specs(population_for("cuda", True, tables=40), 3)
    frame = next(s for s in specs if s.frame and s.task == "clf")
    X_train, y_train, X_test = make_task(frame)
    assert isinstance(X_train, pd.DataFrame) and X_train.shape == (frame.n_train, frame.n_features)
    assert X_test.shape == (frame.n_test, frame.n_features)
    strings = [c for c in X_train.columns if X_train[c].dtype == object]
    assert strings and X_train.drop(columns=strings).isna().to_numpy().any()
    assert len(set(y_train)) == frame.n_classes and isinstance(y_train[0], str)
    plain = next(s for s in specs if not s.frame and s.task == "reg")
    X_train, y_train, X_test = make_task(plain)
    assert isinstance(X_train, np.ndarray) and y_train.dtype == np.float64
    assert X_test.shape == (plain.n_test, plain.n_features)


# ---------------------------------------------------------------------------------------------
# A real quick run


def test_a_quick_run_answers_every_task_with_every_engine(run):
    _, document = run
    assert document["schema"] == suite.SCHEMA
    assert document["command"].startswith("python -m tabserve.bench many-tables --device cpu")
    assert document["settings"]["engines"] == ["tabicl", TABSERVE_LOOP, TABSERVE_PACKED]
    assert document["settings"]["reference"] == "tabicl"  # tabicl's defaults are fp32 on the CPU
    population = document["population"]
    assert population["tables"] == POPULATIONS["quick"].tables
    for r in document["results"]:
        assert r["status"] == "ok", r.get("reason")
        assert [p["name"] for p in r["passes"]] == ["cold", "warm"]  # no compiles on the CPU
        for figures in r["passes"]:
            assert figures["tables"] == population["tables"] and figures["task_errors"] == []
            assert set(figures["kinds"]) == {"clf", "reg"}
            assert figures["memory"]["peak_rss_bytes"] > 0
            assert figures.get("max_abs_diff_to_pass_1", 0.0) == 0.0
        assert r["speedup"]["warm"]["tabicl"]["total"] > 0


def test_packed_answers_match_tabicl_fp32_and_its_padding_is_counted(run):
    _, document = run
    population = document["population"]
    for engine in (TABSERVE_LOOP, TABSERVE_PACKED):
        acc = _result(document, engine)["accuracy"]
        assert acc["clf"]["tasks"] == population["clf"] and acc["clf"]["errors"] == 0
        assert acc["clf"]["max_abs_prob_diff"] <= 1e-5
        assert acc["clf"]["min_argmax_agreement"] == 1.0
        assert acc["reg"]["tasks"] == population["reg"]
        assert acc["reg"]["max_mean_diff_over_std"] <= 1e-5
    assert _result(document, "tabicl")["accuracy"] == {"reference": True}
    packed = _result(document, TABSERVE_PACKED)
    padding = packed["passes"][0]["padding"]
    for kind in ("clf", "reg"):
        p = padding[kind]
        assert p["packs"] >= 1 and p["tables"] >= 8  # members of at least one task
        assert p["padded_cells"] >= p["real_cells"] > 0
        assert p["largest_pack_cells"] <= p["padded_cells"]
        # The stages' times are parts of the kind's own time.
        stages = [p[key] for key in many_report.STAGE_KEYS]
        assert min(stages) >= 0 and sum(stages) <= packed["passes"][0]["kinds"][kind]["ms"]
    assert set(document["summary"]) == {"tabicl", TABSERVE_LOOP}


def test_the_table_is_saved_and_renders_every_section(run):
    path, document = run
    text = many_report.render(document)
    assert path.with_suffix(".txt").read_text().strip() == text.strip()
    for title in ("Tables per second", many_report.SPEEDUP_TITLE, many_report.ACCURACY_TITLE,
                  many_report.PADDING_TITLE):  # fmt: skip
        assert title in text
    assert "Errors" not in text and f"note: {NOTE}" in text
    rows = [line for line in text.splitlines() if line.startswith(TABSERVE_PACKED)]
    assert len(rows) == 3  # two passes and the accuracy row


def test_record_py_renders_a_many_tables_section(run, tmp_path):
    path, _ = run
    record = _record_module()
    page = record.render_results([path])
    assert "## Many tables: " in page
    assert "| tabserve-packed | ok | 2 warm |" in page
    assert "Padding of tabserve-packed" in page and f"- note: {NOTE}" in page
    output = tmp_path / "results.md"
    assert record.main([str(path), "-o", str(output)]) == 0
    assert record.main(["--check", str(path), "-o", str(output)]) == 0


#: Runs one child job (the spec file ``argv[1]``) as the child module's ``main`` does, then prints
#: the tabserve.models modules the process has loaded.
def test_a_tabicl_child_never_imports_tabserve_models(tmp_path):
    checkpoints = {t: str(make_checkpoint(t, tmp_path / f"{t}.ckpt", size="tiny"))
                   for t in ("clf", "reg")}  # fmt: skip
    population = population_for("cpu", True, tables=4).as_dict()
    spec = {"engine": "tabicl", "device": "cpu", "population": population, "seed": 1,
            "checkpoints": checkpoints, "result": str(tmp_path / "result.json"),
            "outputs": str(tmp_path / "outputs.npz")}  # fmt: skip
    result, loaded = bench_child_imports("many_tables_child", spec, tmp_path)
    assert result["status"] == "ok", result.get("reason")
    assert loaded == []


def test_a_failing_engine_is_a_result_with_its_error(tmp_path):
    spec = {"engine": "tabicl", "device": "cpu", "seed": 1,
            "population": population_for("cpu", True, tables=4).as_dict(),
            "checkpoints": {t: str(tmp_path / "missing.ckpt") for t in ("clf", "reg")}}  # fmt: skip
    result = suite.run_engine(spec, tmp_path, timeout_s=300)
    assert result["status"] == "failed" and result["returncode"] == 0
    assert result["passes"][0]["task_errors"]  # every task refused, named by index
    assert "task(s) refused" in result["reason"]
    document = {"results": [result], "summary": {}}
    assert many_report.throughput_rows(document)[0][1] == "FAILED"


# ---------------------------------------------------------------------------------------------
# Figures


def test_the_cpu_runs_tabicl_once_as_its_reference():
    every = [e.name for e in ENGINES]
    assert suite.default_engines("cuda") == every
    assert suite.default_engines("cpu") == [e for e in every if e != "tabicl-fp32"]
    assert suite.reference_engine("cuda", every) == "tabicl-fp32"
    assert suite.reference_engine("cpu", suite.default_engines("cpu")) == "tabicl"
    assert suite.reference_engine("cuda", [TABSERVE_PACKED]) is None


def test_accuracy_names_the_worst_task_per_kind():
    reference = {0: np.array([[0.6, 0.4], [0.2, 0.8]]), 1: np.array([[0.6, 0.4]]),
                 2: np.array([1.0, 2.0])}  # fmt: skip
    outputs = {0: np.array([[0.4, 0.6], [0.2, 0.8]]), 1: np.array([[0.55, 0.45]]),
               2: np.array([1.0, 2.5])}  # fmt: skip
    summary = suite.task_accuracy(outputs, reference, {0: "clf", 1: "clf", 2: "reg"}, {"2": 0.5})
    assert summary["clf"]["worst_task"] == 0
    assert summary["clf"]["max_abs_prob_diff"] == pytest.approx(0.2)
    assert summary["clf"]["min_argmax_agreement"] == 0.5
    assert summary["clf"]["argmax_agreement"] == pytest.approx(2 / 3)  # per test row
    assert summary["reg"] == {"tasks": 1, "errors": 0, "max_mean_diff_over_std": 1.0,
                              "worst_task": 2}  # fmt: skip


def _passes(*rates):
    names = ("cold", "warm", "compiled")
    return [{"number": i + 1, "name": names[i], "tables_per_s": r, "kinds": {"clf": {"tables_per_s": r}}}
            for i, r in enumerate(rates)]  # fmt: skip


def test_speedups_compare_pass_by_pass_and_a_missing_pass_with_the_last():
    results = [
        {"engine": "tabicl", "status": "ok", "passes": _passes(2.0, 4.0)},
        {"engine": TABSERVE_LOOP, "status": "ok", "passes": _passes(4.0, 8.0, 10.0)},
        {"engine": TABSERVE_PACKED, "status": "ok", "passes": _passes(8.0, 16.0, 40.0)},
    ]
    suite.add_speedups(results)
    packed = results[2]["speedup"]
    assert packed["cold"]["tabicl"] == {"total": 4.0, "clf": 4.0}
    assert packed["warm"][TABSERVE_LOOP]["total"] == 2.0
    assert packed["compiled"]["tabicl"]["total"] == 10.0  # tabicl's warm pass
    assert packed["compiled"][TABSERVE_LOOP]["total"] == 4.0
    assert suite.summarize(results)["tabicl"]["compiled"]["total"] == 10.0
    results[0]["status"] = "failed"
    suite.add_speedups(results)
    assert results[2]["speedup"]["warm"]["tabicl"]["total"] is None


def test_the_driver_offers_the_many_tables_suite(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "python -m tabserve.bench many-tables --help" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["many-tables", "--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: python -m tabserve.bench many-tables")
    assert "--tables" in usage and "--engines" in usage


def test_the_compiled_pass_says_where_the_packs_went():
    result = {"compile_wait": {"ms": 12345.0, "finished": True}}
    tiers = [
        {"state": "compiled", "ready_ms": 912.4, "packs_ms": 371.0, "precompiled": 6},
        {"state": "declined", "ready_ms": 50.0, "packs_ms": 61.0},
        {"state": 1, "ready_ms": None, "packs_ms": None},
        {"state": "off", "ready_ms": None, "packs_ms": None},
    ]
    label = many_report._pass_label(result, {"number": 3, "name": "compiled", "packs": tiers})
    assert label == (
        "3 compiled (waited 12.3 s; packs on fused kernels: 371 against 912 ms, 6 kernels "
        "compiled in children; "
        "ready preset, fused slower: 61 against 50 ms; ready preset (packed calls: 1))"
    )
    loop = many_report._pass_label(result, {"number": 3, "name": "compiled", "packs": tiers[3:]})
    assert loop == "3 compiled (waited 12.3 s)"
    assert many_report._pass_label(result, {"number": 2, "name": "warm"}) == "2 warm"
