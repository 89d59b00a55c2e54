"""The TabICLv2 benchmark driver (``tabserve.bench``): tables, isolation, gates, promotion, report.

CPU only. End-to-end runs of the CLI use a tiny random-weight model, ``--quick`` and the smallest
quick workload with few cells; everything else is unit-level (subprocess failures are provoked
with ``python -c``).
"""

import dataclasses
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tabicl")
pytest.importorskip("sklearn")

from tabserve.bench import cells as cells_mod
from tabserve.bench import gates, measure, report, runner, timing
from tabserve.bench.cells import (
    CELLS,
    Cell,
    cell_by_name,
    cell_from_entry,
    cell_table,
    load_cells_file,
    select_cells,
    skip_reason,
)
from tabserve.bench.cli import main, parse_args
from tabserve.bench.workloads import (
    WORKLOADS,
    host_table,
    make_checkpoint,
    model_tables,
    stream_shapes,
    workload_by_name,
)
from tabserve.models.tabicl.serving.options import (
    PRESETS,
    PROMOTIONS_SCHEMA,
    WITHOUT_FP8,
    ServingOptions,
    auto_options,
)

REPO = Path(__file__).resolve().parents[2]
RESEARCH_FILE = REPO / cells_mod.RESEARCH_CELLS_FILE
RESEARCH = load_cells_file(RESEARCH_FILE)
#: The default cells and the research cells shipped with the repository.
TABLE = {c.name: c for c in cell_table(RESEARCH)}
#: The CLI arguments of a small end-to-end run on the CPU.
QUICK = ["--device", "cpu", "--quick", "--model-size", "tiny", "--workloads", "small-quick"]


def research(name: str) -> Cell:
    return cell_by_name(name, RESEARCH)


def _cells_file(tmp_path, entries) -> Path:
    path = tmp_path / "cells.json"
    path.write_text(json.dumps({"cells": entries}))
    return path


# -- cell and workload tables -------------------------------------------------------------------


def test_default_table_is_the_two_references_and_one_cell_per_preset():
    names = [c.name for c in CELLS]
    assert names == ["ref-fp32", "ref-fp16", "exact", "medium", "small", "large", "large-fp8"]
    assert names[2:] == list(PRESETS)
    assert {c.name for c in CELLS if c.baseline} == {"ref-fp32", "ref-fp16"}
    for reference, precision in (("ref-fp32", "fp32"), ("ref-fp16", "fp16")):
        cell = cell_by_name(reference)
        assert (cell.engine, cell.options, cell.precision) == ("reference", None, precision)
        assert cell.promotable_preset is None
    for name, preset in PRESETS.items():
        cell = cell_by_name(name)
        assert cell.engine == "tabserve" and cell.preset == name
        assert cell.options == preset.options and cell.description == preset.description
        assert cell.promotable_preset == name and not cell.warm_cache and not cell.baseline
    # Only the fp32 cells run on the CPU; the fp8 one is the only one computing in fp8.
    assert {c.name for c in CELLS if "cpu" in c.devices} == {"ref-fp32", "exact"}
    assert [c.name for c in CELLS if c.uses_fp8] == ["large-fp8"]
    assert [c.name for c in CELLS if c.precision == "fp32"] == list(cells_mod.FP32_CELLS)
    assert not {c.name for c in RESEARCH} & set(names)  # research cells are not in the table


def test_research_cells_are_presets_with_their_changes():
    entries = json.loads(RESEARCH_FILE.read_text())["cells"]
    assert [c.name for c in RESEARCH] == [e["name"] for e in entries] and len(entries) >= 5
    for entry, cell in zip(entries, RESEARCH):
        assert cell.preset == entry["preset"] and cell.engine == "tabserve"
        assert cell.options == PRESETS[entry["preset"]].options.replace(**entry["changes"])
        assert cell.options != PRESETS[entry["preset"]].options, cell.name  # a real variant
        assert cell.devices == tuple(entry.get("devices", ("cuda",)))
        assert cell.warm_cache is entry.get("warm_cache", False)
        assert cell.aot is entry.get("aot", False)
        assert cell.description == entry.get("description", cell.description)
        assert cell.promotable_preset is None
    without = research("large-without-freeze")
    assert without.description.startswith("large with ServingOptions(") and not without.options.freeze
    assert research("exact-aot-restart").options.buckets and research("exact-aot-restart").aot


def test_cell_round_trips_through_its_dict():
    for cell in TABLE.values():
        data = json.loads(json.dumps(cell.to_dict()))
        assert Cell.from_dict(data) == cell, cell.name
        if cell.options is not None:
            assert data["options"] == dataclasses.asdict(cell.options)
    assert cell_by_name("large-fp8").to_dict()["options"]["attention"]["icl"] == "flash-fp8"
    assert cell_by_name("ref-fp16").to_dict()["options"] is None


def test_cells_file_errors_name_the_entry(tmp_path):
    base = {"name": "mine", "preset": "large"}
    bad = [
        ({**base, "preset": "lage"}, "mine: unknown preset 'lage'"),
        ({**base, "changes": {"fused_fn": True}}, "mine: ServingOptions has no field 'fused_fn'"),
        (
            {"name": "fp32-fused", "preset": "exact", "changes": {"fused_ffn": True}},
            "fp32-fused: ServingOptions: fused_ffn runs under bf16 / fp16 autocast only",
        ),
        ({**base, "changes": {"precision": "fp12"}}, "mine: ServingOptions: precision must be"),
        (
            {**base, "changes": {"buckets": True}},
            "mine: ServingOptions: kv_graphs are the unpadded cache's graphs",
        ),
        ({**base, "speed": "fast"}, r"mine: unknown keys \['speed'\]"),
        ({"name": "orphan"}, "an entry needs 'name' and 'preset'"),
    ]
    for entry, message in bad:
        with pytest.raises(ValueError, match=message):
            load_cells_file(_cells_file(tmp_path, [entry]))
    fp16 = {"precision": "fp16"}
    twice = [
        {"name": "twin", "preset": "exact", "changes": fp16},
        {"name": "twin", "preset": "medium", "changes": {"precision": "bf16"}},
    ]
    with pytest.raises(ValueError, match=r"used twice or by a default cell: \['twin'\]"):
        load_cells_file(_cells_file(tmp_path, twice))
    with pytest.raises(ValueError, match=r"used twice or by a default cell: \['large'\]"):
        load_cells_file(_cells_file(tmp_path, [{"name": "large", "preset": "exact", "changes": fp16}]))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="a cells file is"):
        load_cells_file(tmp_path / "list.json")
    (good,) = load_cells_file(_cells_file(tmp_path, [{**base, "changes": {"freeze": False}}]))
    assert good.options == PRESETS["large"].options.replace(freeze=False)
    assert good.devices == ("cuda",) and not good.warm_cache


def test_the_device_script_names_only_cells_the_driver_has():
    """scripts/device/bench.sh's cell lists reach the driver only on the GPU machine, where a
    misspelt name would cost a device call."""
    script = (REPO / "scripts" / "device" / "bench.sh").read_text()
    lists = re.findall(r'CELLS="([^"]*)"', script) + re.findall(r"CELLS:-([^}]*)\}", script)
    named = {name for names in lists for name in names.split()}
    assert len(named) >= 3
    assert named - set(TABLE) == set()


def test_skip_reasons_on_the_cpu():
    for cell in TABLE.values():
        reason = skip_reason(cell, "cpu")
        if "cpu" in cell.devices:
            assert reason is None, cell.name
        else:
            assert reason == "skipped: no CUDA device", cell.name
        assert skip_reason(cell, "cuda") is None
    runnable_on_cpu = {c.name for c in TABLE.values() if skip_reason(c, "cpu") is None}
    assert runnable_on_cpu == {"ref-fp32", "exact", "exact-buckets", "exact-aot-restart"}
    assert skip_reason(dataclasses.replace(cell_by_name("exact"), devices=("cpu",)), "cuda") == (
        "skipped: cuda not supported"
    )


def test_cell_validation_and_selection():
    fp16 = PRESETS["medium"].options
    with pytest.raises(ValueError, match="ref: a reference cell has a reference_precision"):
        Cell("ref", "x", engine="reference", reference_precision="bf16")
    with pytest.raises(ValueError, match="ref: a reference cell"):
        Cell("ref", "x", engine="reference", reference_precision="fp32", options=fp16)
    with pytest.raises(ValueError, match="cx: a tabserve cell needs ServingOptions"):
        Cell("cx", "x")
    with pytest.raises(ValueError, match="cx: unknown engine 'onnx'"):
        Cell("cx", "x", engine="onnx", options=fp16)
    with pytest.raises(ValueError, match="cx: unknown preset 'huge'"):
        Cell("cx", "x", options=fp16, preset="huge")
    with pytest.raises(ValueError, match="cx: aot packages are a restart"):
        Cell("cx", "x", options=fp16, aot=True)
    with pytest.raises(ValueError, match="cx: a restart .* restores compiled graphs"):
        Cell("cx", "x", options=fp16, warm_cache=True)
    with pytest.raises(ValueError, match="freeze is Inductor's freezing"):
        ServingOptions(precision="fp16", freeze=True)
    for fused in ("fused_ffn", "fused_norm_linear"):
        with pytest.raises(ValueError, match=f"{fused} runs under bf16 / fp16 autocast only"):
            ServingOptions(**{fused: True})
    assert Cell("cx", "x", options=fp16, warm_cache=True, aot=True, preset="medium").aot
    with pytest.raises(KeyError, match="known: ref-fp32, ref-fp16, exact"):
        cell_by_name("nothing")
    with pytest.raises(KeyError, match="unknown cell 'exact-buckets'"):
        cell_by_name("exact-buckets")  # research cells are not in the default table
    assert cell_by_name("exact-buckets", cell_table(RESEARCH)) is research("exact-buckets")
    assert select_cells(None) == list(CELLS) and select_cells([]) == list(CELLS)
    assert [c.name for c in select_cells(["ref-*"])] == ["ref-fp32", "ref-fp16"]
    with pytest.raises(KeyError, match=r"no cell matches \['zz\*'\]"):
        select_cells(["ref-*", "zz*"])
    # The order named is the order run (a deadline cuts the cells named last), each cell once.
    named = [c.name for c in select_cells(["large*", "ref-fp16", "exact", "ref-*", "large"])]
    assert named == ["large", "large-fp8", "ref-fp16", "exact", "ref-fp32"]
    table = cell_table(RESEARCH)
    assert [c.name for c in select_cells(["large-without-*"], table)] == [
        "large-without-row-tokens",
        "large-without-out-projection",
        "large-without-rope-projection",
        "large-without-freeze",
    ]


def test_list_prints_the_research_cells_with_the_default_ones(capsys):
    assert main(["--list", "--device", "cpu"]) == 0
    plain = capsys.readouterr().out
    assert main(["--list", "--device", "cpu", "--cells-file", str(RESEARCH_FILE)]) == 0
    listed = capsys.readouterr().out
    rows = {line.split()[0]: line for line in listed.splitlines() if line.strip()}
    for cell in TABLE.values():
        assert cell.name in rows
    assert "exact-buckets" not in plain and "large-fp8" in plain
    assert "skipped: no CUDA device" in rows["large-fp8"] and " yes " in rows["exact-buckets"]
    assert "small-quick" in listed and "xlarge" in listed


def test_out_defaults_to_a_results_folder_under_the_current_directory():
    assert parse_args([]).out == Path("tabserve-results")
    assert parse_args(["--out", "elsewhere"]).out == Path("elsewhere")
    assert parse_args([]).promotions is None and parse_args([]).cells_file is None


def test_workloads_have_their_documented_shapes():
    shapes = {w.name: (w.members, w.n_train, w.n_test, w.n_features) for w in WORKLOADS}
    assert shapes["small"] == (8, 512, 64, 8)
    assert shapes["medium"] == (8, 1024, 256, 20)
    assert shapes["large"] == (8, 8192, 2048, 64)
    assert shapes["xlarge"] == (8, 50000, 1000, 100)
    assert workload_by_name("many-class").n_classes == 25
    assert workload_by_name("regression").task == "reg"
    assert workload_by_name("stream").stream == 32
    assert not workload_by_name("many-class").cacheable


def test_generated_tables_are_seeded_random_and_complete():
    small = workload_by_name("small-quick")
    X, y = model_tables(small, seed=3)
    assert X.shape == (2, 160, 8) and y.shape == (2, 128) and X.dtype == torch.float32
    assert (X != 0).float().mean() > 0.99
    assert all(set(row.tolist()) == set(range(small.n_classes)) for row in y.long())
    X2, _ = model_tables(small, seed=3)
    assert torch.equal(X, X2)
    X_train, y_train, X_test = host_table(small, seed=0)
    assert X_train.shape == (128, 8) and y_train.shape == (128,) and X_test.shape == (32, 8)
    stream = workload_by_name("stream")
    shapes = stream_shapes(stream, seed=0)
    assert shapes == stream_shapes(stream, seed=0) and len(set(shapes)) == 32
    for n_train, n_test, n_features, n_classes in shapes:
        assert 64 <= n_train <= 8192 and 1 <= n_test <= 2048 and 2 <= n_features <= 64
        assert 2 <= n_classes <= 10


def test_stream_warms_every_bucket_it_visits_with_another_table():
    """A bucketed cell's stream warm-up covers each bucket of the stream once, with a table of
    the bucket's own shape (not the stream's), so the timed fresh tables must neither recompile
    nor capture; an unbucketed cell has no grid and warms on two other tables."""
    from tabserve.bench.measure import stream_warm_shapes
    from tabserve.buckets import BucketGrid

    stream = workload_by_name("stream")
    shapes = stream_shapes(stream, seed=0)
    warm = stream_warm_shapes(cell_by_name("medium"), stream, shapes, 0)
    grid = BucketGrid()
    visited = {grid.bucket_for(*s[:3]) for s in shapes}
    assert {grid.bucket_for(*w[:3]) for w in warm} == visited and len(warm) == len(visited)
    assert not set(warm) & set(shapes)  # other tables than the timed ones
    assert [tuple(w[:3]) for w in warm] == [
        (b.train_rows, b.test_rows, b.features) for b in (grid.bucket_for(*w[:3]) for w in warm)
    ]
    plain = stream_warm_shapes(cell_by_name("exact"), stream, shapes, 0)
    assert plain == stream_shapes(stream, seed=1000)[:2]


# -- subprocess isolation -----------------------------------------------------------------------


def _child(tmp_path, code, timeout=30):
    result = tmp_path / "result.json"
    script = f"import json, os, sys, time\nRESULT = {str(result)!r}\n{code}"
    return runner.run_isolated([sys.executable, "-c", script], result, timeout)


def test_isolated_success_keeps_the_child_result(tmp_path):
    out = _child(tmp_path, "json.dump({'status': 'ok', 'x': 1}, open(RESULT, 'w'))")
    assert out["status"] == "ok" and out["x"] == 1 and out["returncode"] == 0
    assert "log_tail" not in out


def test_isolated_crash_keeps_phases_measured_before_it(tmp_path):
    code = "json.dump({'status': 'running', 'cold': {'first_call_ms': 5}}, open(RESULT, 'w'))\n"
    code += "print('about to crash', flush=True)\nos.abort()"
    out = _child(tmp_path, code)
    assert out["status"] == "crashed" and out["reason"] == "killed by SIGABRT"
    assert out["cold"] == {"first_call_ms": 5} and "about to crash" in out["log_tail"]


def test_isolated_timeout_kills_the_process_group(tmp_path):
    code = "import subprocess\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    code += "time.sleep(60)"
    out = _child(tmp_path, code, timeout=1.5)
    assert out["status"] == "timeout" and out["wall_s"] < 20
    assert out["reason"] == "timeout after 1.5 s"


def test_isolated_oom_and_silent_exit_are_reported(tmp_path):
    out = _child(tmp_path, "print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(1)")
    assert out["status"] == "oom" and out["reason"] == "exit code 1"
    out = _child(tmp_path, "pass")
    assert out["status"] == "crashed" and out["reason"] == "exited without a final result"


def test_a_cell_whose_model_does_not_load_is_a_failed_result(tmp_path):
    out = runner.run_cell(
        cell_by_name("exact"),
        workload_by_name("small-quick"),
        run_dir=tmp_path,
        device="cpu",
        checkpoint=tmp_path / "missing.ckpt",
        timeout_s=120,
        timing={},
    )
    assert out["status"] == "failed" and out["reason"].startswith("loading:")
    assert out["outputs"] is None
    spec = json.loads((tmp_path / "jobs" / "small-quick__exact" / "spec.json").read_text())
    assert Cell.from_dict(spec["cell_spec"]) == cell_by_name("exact")
    skipped = runner.run_cell(
        cell_by_name("medium"),
        workload_by_name("small-quick"),
        run_dir=tmp_path,
        device="cpu",
        checkpoint=tmp_path / "missing.ckpt",
        timeout_s=1,
        timing={},
    )
    assert skipped == {
        "cell": "medium",
        "workload": "small-quick",
        "status": "skipped",
        "reason": "skipped: no CUDA device",
    }


def test_warm_cache_cell_primes_then_restarts_from_the_saved_artifacts(tmp_path, monkeypatch):
    """A restart cell: a priming process saves the artifacts, the measured process loads them;
    both start with their own empty compile caches and rebuild the cell from the spec (a
    research cell runs without its cells file). The processes are stubbed: the wiring is under
    test."""
    calls = []

    def fake_run(command, result_path, timeout_s, env):
        spec = json.loads(Path(command[-1]).read_text())
        calls.append((spec, env))
        if spec.get("compile_cache_mode") == "save":
            return {"status": "ok", "cold": {"first_call_ms": 30_000.0}, "wall_s": 40.0,
                    "compile_cache": {"bytes": 10, "artifacts": {"inductor": 2}}}  # fmt: skip
        return {"status": "ok", "cold": {"first_call_ms": 900.0}}

    monkeypatch.setattr(runner, "run_isolated", fake_run)
    cell = research("medium-compiled-restart")
    assert cell.warm_cache and not cell.aot and cell.options.compile == "default"
    args = dict(run_dir=tmp_path, device="cuda", checkpoint=tmp_path / "m.ckpt", timeout_s=9,
                timing={})  # fmt: skip
    result = runner.run_cell(cell, workload_by_name("small"), **args)
    (prime, prime_env), (measured, measured_env) = calls
    assert prime["compile_cache_mode"] == "save" and measured["compile_cache_mode"] == "load"
    assert prime["compile_cache"] == measured["compile_cache"] and prime["outputs"] is None
    assert prime["compile_cache"].endswith("compile-cache.bin")
    assert Cell.from_dict(prime["cell_spec"]) == cell == Cell.from_dict(measured["cell_spec"])
    assert prime_env["TORCHINDUCTOR_CACHE_DIR"] != measured_env["TORCHINDUCTOR_CACHE_DIR"]
    assert result["status"] == "ok" and result["priming"]["cold_ms"] == 30_000.0
    assert result["priming"]["compile_cache"]["artifacts"] == {"inductor": 2}
    # both processes know when they were spawned (ready_ms); the restart skips the KV and
    # estimator phases, which recompile and belong to the presets' own cells
    assert prime["spawned_at"] <= measured["spawned_at"]
    assert {"kv", "end_to_end"} <= set(measured["skip_phases"]) and "skip_phases" not in prime
    printed = report.render({
        "settings": {"device": "cuda", "checkpoint_note": "x"},
        "environment": {"gpu": "G", "torch": "t", "tabicl": "2", "tabserve": "0"},
        "results": [{**result, "ready_ms": 21_700.0}], "promotion": {}})  # fmt: skip
    assert ("small / medium-compiled-restart: first answer 21.7 s after the process was "
            "spawned (first call 900.0 ms; priming 30000 ms)") in printed  # fmt: skip

    def failing_prime(command, result_path, timeout_s, env):
        return {"status": "failed", "reason": "priming: nothing compiled"}

    monkeypatch.setattr(runner, "run_isolated", failing_prime)
    failed = runner.run_cell(cell, workload_by_name("small"), **args)
    assert failed["status"] == "failed" and failed["reason"].startswith("priming the compile cache")
    assert failed["outputs"] is None


# -- gates and promotion ------------------------------------------------------------------------


def _probs(seed, rows=200, classes=4):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(2, rows, classes, generator=g) * 3, -1)


def test_gate_limits_by_precision():
    ref = _probs(0)
    fp32, fp16 = cell_by_name("exact"), cell_by_name("medium")
    ok = gates.gate(fp16, "clf", {"one_shot": ref + 1e-3}, "ref-fp32", {"one_shot": ref})
    assert ok["passed"] is True and ok["one_shot"]["argmax_agreement"] == 1.0
    bad = gates.gate(fp32, "clf", {"one_shot": ref + 1e-3}, "ref-fp32", {"one_shot": ref})
    assert bad["passed"] is False and bad["one_shot"]["failures"] == ["max_prob_diff > 0.0001"]
    flipped = gates.gate(fp16, "clf", {"one_shot": _probs(1)}, "ref-fp32", {"one_shot": ref})
    assert flipped["passed"] is False
    assert "argmax_agreement < 0.995" in flipped["one_shot"]["failures"]
    kv_bad = gates.gate(
        fp16, "clf", {"one_shot": ref, "kv": _probs(1)}, "ref-fp32", {"one_shot": ref}
    )
    assert kv_bad["passed"] is False and kv_bad["one_shot"]["failures"] == []
    itself = gates.gate(fp32, "clf", {"one_shot": ref}, "exact", {"one_shot": ref})
    assert itself == {"passed": True, "reference": "exact", "note": "is the fp32 reference"}
    # The reference's own fp16 autocast is a reduced-precision cell too.
    assert cell_by_name("ref-fp16").reduced_precision and not cell_by_name("ref-fp32").reduced_precision


def test_gate_regression_padding_and_missing_reference():
    cell = cell_by_name("medium")
    mean = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) + 3
    verdict = gates.gate(cell, "reg", {"one_shot": mean * 1.001}, "exact", {"one_shot": mean})
    # The largest error over the reference's root mean square.
    error = (mean * 1.001).double() - mean.double()
    expected = error.abs().max() / mean.double().pow(2).mean().sqrt()
    assert verdict["passed"] is True
    assert verdict["one_shot"]["mean_rel_error"] == pytest.approx(float(expected), rel=1e-6)
    verdict = gates.gate(cell, "reg", {"one_shot": mean * 1.1}, "exact", {"one_shot": mean})
    assert verdict["passed"] is False
    padded = {"one_shot": mean, "padded": mean, "unpadded": mean + 1e-5}
    verdict = gates.gate(cell, "reg", padded, "exact", {"one_shot": mean})
    assert verdict["passed"] is False and verdict["padded"]["failures"]
    assert gates.gate(cell, "reg", {"one_shot": mean}, None, None)["passed"] is None
    shape = gates.gate(cell, "reg", {"one_shot": mean[:, :3]}, "exact", {"one_shot": mean})
    assert shape["passed"] is False and shape["one_shot"]["failures"] == ["shape"]


def test_gate_of_padding_under_the_cells_own_options():
    """``padded_recipe``: padded against unpadded under the cell's own kernels; fp32 cells to
    1e-5 (compiled kernels' summation order), reduced precision to 5e-3, a quarter of the
    reduced-precision gate, and the failure is named in the table's gate column."""
    ref = _probs(0)
    fp32, fp16 = research("exact-buckets"), cell_by_name("medium")

    def verdict(cell, diff):
        outputs = {"one_shot": ref, "padded_recipe": ref + diff, "unpadded_recipe": ref}
        return gates.gate(cell, "clf", outputs, "ref-fp32", {"one_shot": ref})

    assert verdict(fp32, 5e-6)["passed"] is True
    failed = verdict(fp32, 5e-5)
    assert failed["passed"] is False and failed["one_shot"]["failures"] == []
    assert failed["padded_recipe"]["failures"] == ["max_prob_diff > 1e-05"]
    passed = verdict(fp16, 2e-3)
    assert passed["passed"] is True
    assert passed["padded_recipe"]["max_prob_diff"] == pytest.approx(2e-3, rel=1e-4)  # fp32 sums
    assert report._gate_text(passed) == "pass 0.0e+00 pad 2e-03"
    failed = verdict(fp16, 1e-2)
    assert failed["passed"] is False
    assert report._gate_text(failed) == "FAIL padded_recipe: max_prob_diff > 0.005"


def test_a_padding_gate_that_could_not_run_fails_the_gate():
    """A padding cell whose gates' phase raised has no padded outputs to compare: its gate
    fails (named in the table) instead of passing on its other routes."""
    ref = _probs(0)
    cell = research("exact-buckets")
    result = {"cell": cell.name, "workload": "w", "status": "ok", "outputs": "x"}
    result["padding_gates"] = {"error": "RuntimeError", "message": "boom"}
    reference = {"cell": "ref-fp32", "workload": "w", "status": "ok", "outputs": "r"}
    workloads = {"w": workload_by_name("small-quick")}
    outputs = {"x": {"one_shot": ref}, "r": {"one_shot": ref}}
    gates.apply_gates([reference, result], TABLE, workloads, lambda r: outputs[r["outputs"]])
    assert result["gate"]["one_shot"]["failures"] == [] and result["gate"]["passed"] is False
    assert result["gate"]["reference"] == "ref-fp32"
    assert report._gate_text(result["gate"]) == "FAIL padding_gates: RuntimeError: boom"
    del result["padding_gates"]
    gates.apply_gates([reference, result], TABLE, workloads, lambda r: outputs[r["outputs"]])
    assert result["gate"]["passed"] is True
    # Without the reference, the exact cell is the fp32 cell the others gate against.
    exact = {"cell": "exact", "workload": "w", "status": "ok", "outputs": "r"}
    gates.apply_gates([exact, result], TABLE, workloads, lambda r: outputs[r["outputs"]])
    assert result["gate"]["reference"] == "exact" and exact["gate"]["note"] == "is the fp32 reference"


def _result(cell, ms, passed, status="ok", workload="w", kv=None, **extra):
    result = {"cell": cell, "workload": workload, "status": status, "one_shot": {"median_ms": ms}}
    if kv is not None:
        result["kv"] = {"median_ms": kv}
    result["gate"] = {"passed": passed}
    return {**result, **extra}


def test_promotion_takes_the_fastest_gated_preset_cell_per_route():
    results = [
        _result("ref-fp16", 1.0, True),  # baseline: never promoted
        _result("medium", 2.0, False),  # fastest preset cell, but failed its gate
        _result("large", 2.5, None),  # unchecked: never promoted
        _result("large-fp8", 2.7, True, status="timeout"),
        _result("large", 0.1, True, gate_only=True),  # gate-only: no timing of its own
        _result("small", 4.0, True, kv=0.5),
        _result("exact", 5.0, True, kv=0.4),
        _result("exact", 9.0, True, workload="v"),
    ]
    promoted = gates.promote(results, TABLE)
    assert promoted["w"] == {
        "one_shot": {"preset": "small", "median_ms": 4.0},
        "kv_predict": {"preset": "exact", "median_ms": 0.4},
    }  # no fp8 preset promoted: no second entry per route
    assert promoted["v"] == {"one_shot": {"preset": "exact", "median_ms": 9.0}}
    stream = [_result("exact", 9.0, True, workload="s"), _result("medium", 9.0, True, workload="s")]
    for r, ms in zip(stream, (30.0, 20.0)):
        del r["one_shot"]
        r["stream"] = {"median_ms": ms}
    assert gates.promote(stream, TABLE) == {"s": {"stream": {"preset": "medium", "median_ms": 20.0}}}


def test_promotion_names_the_fastest_preset_without_fp8_where_an_fp8_one_wins():
    assert cell_by_name("large-fp8").uses_fp8 and not cell_by_name("large").uses_fp8
    results = [
        _result("large-fp8", 1.0, True, kv=0.9),  # fastest one-shot, fp8
        _result("large", 1.5, True, kv=0.2),  # fastest KV, no fp8
        _result("medium", 4.0, True, kv=0.5),
        _result("exact", 5.0, True, kv=0.4),
        _result("small", 0.5, False),  # faster, but failed its gate
    ]
    promoted = gates.promote(results, TABLE)["w"]
    assert promoted["one_shot"] == {"preset": "large-fp8", "median_ms": 1.0}
    assert promoted["one_shot" + WITHOUT_FP8] == {"preset": "large", "median_ms": 1.5}
    assert promoted["kv_predict"] == {"preset": "large", "median_ms": 0.2}
    assert "kv_predict" + WITHOUT_FP8 not in promoted  # the fastest computes no fp8: said once
    assert set(promoted) == {"one_shot", "one_shot" + WITHOUT_FP8, "kv_predict"}
    # fp8 fastest and nothing else passed: no entry without fp8.
    alone = gates.promote([_result("large-fp8", 1.0, True), _result("large", 1.5, False)], TABLE)
    assert alone == {"w": {"one_shot": {"preset": "large-fp8", "median_ms": 1.0}}}


def test_research_and_restart_cells_are_never_promoted():
    """A research variant or a restart faster than every preset cell leaves the promotion to
    the fastest preset cell: ``recipe="auto"`` serves presets only."""
    results = [
        _result("exact-buckets", 1.0, True, kv=0.1),
        _result("exact-aot-restart", 0.5, True),
        _result("large-without-freeze", 0.2, True),
        _result("exact", 5.0, True, kv=0.4),
    ]
    assert gates.promote(results, TABLE) == {
        "w": {
            "one_shot": {"preset": "exact", "median_ms": 5.0},
            "kv_predict": {"preset": "exact", "median_ms": 0.4},
        }
    }
    for name in ("exact-buckets", "exact-aot-restart", "large-without-freeze"):
        assert not gates.promotable(_result(name, 1.0, True), TABLE[name])
    assert gates.promotable(_result("exact", 1.0, True), TABLE["exact"])
    assert not gates.promotable(_result("exact", 1.0, True, gate_only=True), TABLE["exact"])
    assert gates.promote(results[:3], TABLE) == {}


def test_a_research_cell_with_the_presets_options_is_never_promoted(tmp_path):
    """A cells file cannot repeat a preset unchanged; a cell built with a preset's options under
    another name still never stands in for the preset's own cell in the promotion."""
    with pytest.raises(ValueError, match="exact-again: no changes to 'exact'"):
        load_cells_file(_cells_file(tmp_path, [{"name": "exact-again", "preset": "exact"}]))
    same = Cell("exact-again", "x", options=PRESETS["exact"].options, preset="exact")
    table = {**TABLE, same.name: same}
    results = [_result("exact-again", 1.0, True), _result("exact", 5.0, True)]
    assert cell_by_name("exact").promotable_preset == "exact"
    assert same.promotable_preset is None
    assert gates.promote(results, table) == {"w": {"one_shot": {"preset": "exact", "median_ms": 5.0}}}


def _document(promotion_results, workloads, device="cpu", created="t0"):
    """A driver document of ``promotion_results`` (the promotion computed as a run does)."""
    return report.payload(
        settings={"device": device, "checkpoint_note": "x", "command": "python -m tabserve.bench"},
        cells=list(CELLS),
        workloads=[workload_by_name(w) for w in workloads],
        results=promotion_results,
        env={"gpu": "G" if device == "cuda" else None, "torch": "t", "tabicl": "2", "tabserve": "0"},
    ) | {"created": created}


def test_write_promotions_merges_per_device_and_workload(tmp_path):
    path = tmp_path / "promotions.json"
    first = _document([_result("exact", 3.0, True, workload="small", kv=1.0)], ["small"])
    report.write_promotions(path, first)
    written = json.loads(path.read_text())
    assert written["schema"] == PROMOTIONS_SCHEMA
    entry = written["devices"]["cpu"]
    assert (entry["updated"], entry["torch"], entry["command"]) == ("t0", "t", "python -m tabserve.bench")
    small = entry["workloads"]["small"]
    assert small["one_shot"] == {"preset": "exact", "median_ms": 3.0}
    assert small["kv_predict"] == {"preset": "exact", "median_ms": 1.0}
    assert small["shape"] == json.loads(json.dumps(workload_by_name("small").as_dict()))
    # A later run on another workload keeps this one; one on the same workload replaces it.
    second = _document([_result("exact", 7.0, True, workload="large")], ["large"], created="t1")
    report.write_promotions(path, second)
    third = _document([_result("medium", 2.0, True, workload="small")], ["small"], created="t2")
    report.write_promotions(path, third)
    gpu = _document([_result("large", 1.0, True, workload="large")], ["large"], device="cuda")
    report.write_promotions(path, gpu)
    devices = json.loads(path.read_text())["devices"]
    assert set(devices) == {"cpu", "G"} and devices["cpu"]["updated"] == "t2"
    assert devices["cpu"]["workloads"]["large"]["one_shot"]["preset"] == "exact"
    assert devices["cpu"]["workloads"]["small"]["one_shot"] == {"preset": "medium", "median_ms": 2.0}
    assert "kv_predict" not in devices["cpu"]["workloads"]["small"]
    assert devices["G"]["workloads"]["large"]["one_shot"]["preset"] == "large"


def test_auto_serves_what_the_driver_promoted(tmp_path):
    """The driver's promotion, written by write_promotions, is what ``recipe="auto"`` serves
    for the closest workload; ``allow_fp8=False`` takes the entry without fp8."""
    results = [
        _result("small", 2.0, True, workload="small", kv=0.3),
        _result("medium", 3.0, True, workload="small", kv=0.2),
        _result("large-fp8", 100.0, True, workload="xlarge", kv=9.0),
        _result("large", 130.0, True, workload="xlarge", kv=4.0),
        _result("medium", 90.0, False, workload="xlarge"),  # failed its gate
        _result("exact", 50.0, True, workload="regression"),
    ]
    path = tmp_path / "promotions.json"
    report.write_promotions(path, _document(results, ["small", "xlarge", "regression"]))
    promoted = json.loads(path.read_text())["devices"]["cpu"]["workloads"]
    assert promoted["xlarge"]["one_shot" + WITHOUT_FP8]["preset"] == "large"

    def auto(n_train, n_features, **kw):
        return auto_options("cpu", n_train, n_features, path=path, **kw)

    assert auto(500, 8) == "small" and auto(500, 8, kv_cache=True) == "medium"
    assert auto(40_000, 90) == "large-fp8"
    assert auto(40_000, 90, allow_fp8=False) == "large"
    assert auto(40_000, 90, kv_cache=True, allow_fp8=False) == "large"
    assert auto(500, 8, task="reg") == "exact"  # the regression workload, though farther
    assert auto_options("cpu", 500, 8, path=path, allow_fp8=False) == "small"
    # Nothing measured for the device: warns and serves exact.
    with pytest.warns(UserWarning, match="no one_shot measurement for 'cpu'; serving 'exact'"):
        assert auto_options("cpu", 500, 8, path=tmp_path / "none.json") == "exact"
    # Only an fp8 preset measured: nothing to serve without fp8.
    alone = tmp_path / "fp8.json"
    report.write_promotions(alone, _document([_result("large-fp8", 1.0, True, workload="xlarge")],
                                             ["xlarge"]))  # fmt: skip
    assert auto_options("cpu", 50_000, 100, path=alone) == "large-fp8"
    with pytest.warns(UserWarning, match="serving 'exact'"):
        assert auto_options("cpu", 50_000, 100, path=alone, allow_fp8=False) == "exact"


def test_the_shipped_promotions_name_only_presets():
    from tabserve.models.tabicl.serving.options import promotions_path

    shipped = json.loads(
        (REPO / "python" / "tabserve" / "models" / "tabicl" / "serving" / "promotions.json").read_text()
    )
    assert shipped["schema"] == PROMOTIONS_SCHEMA and shipped["devices"]
    for device, entry in shipped["devices"].items():
        for workload, routes in entry["workloads"].items():
            assert {"n_train", "n_features", "task"} <= set(routes["shape"]), (device, workload)
            for route, promoted in routes.items():
                if route != "shape":
                    assert promoted["preset"] in PRESETS, (device, workload, route)
                    if route.endswith(WITHOUT_FP8):
                        assert not PRESETS[promoted["preset"]].options.uses_fp8
    assert promotions_path().name == "promotions.json"


def test_abba_summary():
    summary = timing.abba_summary([10, 10, 10, 10], [11, 11, 12, 12])
    assert summary["windows"] == 2 and summary["consistent"]
    assert summary["change_median"] == pytest.approx(0.15)
    assert summary["first_half_mean"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        timing.abba_summary([1, 2, 3], [1, 2, 3])


def test_timing_noise_flag():
    quiet = timing.Timing([10.0, 10.1, 10.2, 9.9, 10.0]).as_dict()
    noisy = timing.Timing([10.0, 14.0, 7.0, 12.0, 9.0]).as_dict()
    assert not quiet["noisy"] and noisy["noisy"]
    assert quiet["p20_ms"] <= quiet["median_ms"] <= quiet["p80_ms"] <= quiet["p90_ms"]


def test_table_is_fixed_width():
    text = report.format_table(("name", ">ms"), [("a", "1.5"), ("longer", "10.25")])
    lines = text.splitlines()
    assert lines == ["name       ms", "------  -----", "a         1.5", "longer  10.25"]


def test_plot_orders_cells_by_the_documents_cell_table(tmp_path, monkeypatch):
    import matplotlib.axes

    ticks, colors = [], []
    original_ticks, original_barh = matplotlib.axes.Axes.set_yticks, matplotlib.axes.Axes.barh

    def recording_ticks(self, y, labels=None, **kw):
        ticks.append(list(labels))
        return original_ticks(self, y, labels, **kw)

    def recording_barh(self, y, width, **kw):
        colors.append(list(kw.get("color", [])))
        return original_barh(self, y, width, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_yticks", recording_ticks)
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", recording_barh)
    timed = {"median_ms": 2.0, "p20_ms": 1.9, "p80_ms": 2.1}
    names = ["medium", "x-other", "exact-buckets", "exact", "ref-fp16"]
    results = [
        {"cell": name, "workload": "w", "status": "ok", "one_shot": dict(timed),
         "speedup": {"one_shot": {"ref16": 1.5}}}
        for name in names
    ]  # fmt: skip
    results.append({"cell": "large", "workload": "w", "status": "failed"})  # nothing to draw
    table = [cell_by_name("ref-fp16"), cell_by_name("exact"), cell_by_name("medium")]
    table.append(research("exact-buckets"))
    document = {"cells": [c.to_dict() for c in table], "results": results}
    assert report.plot(document, tmp_path / "p.png").stat().st_size > 0
    # Both panels of the one workload: latency and speedup; cells off the table come last.
    order = ["ref-fp16", "exact", "medium", "exact-buckets", "x-other"]
    assert ticks == [order] * 2
    assert colors == [["tab:gray"] + ["tab:blue"] * 4] * 2  # the reference in gray
    assert report.plot({"cells": [], "results": results[-1:]}, tmp_path / "q.png") is None


# -- the CLI, end to end ------------------------------------------------------------------------


def test_quick_cpu_run_writes_json_table_plot_and_promotions(tmp_path, capsys):
    out = tmp_path / "results"
    argv = QUICK + ["--cells", "ref-fp32", "exact", "medium", "exact-buckets"]
    argv += ["--cells-file", str(RESEARCH_FILE), "--budget", "0.05"]
    argv += ["--out", str(out), "--quiet", "--timeout", "120"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    json_path = out / "tabiclv2_cpu-quick_small-quick.json"
    document = json.loads(json_path.read_text())

    assert document["schema"] == report.SCHEMA
    env = document["environment"]
    for key in ("torch", "cuda", "cudnn", "driver", "gpu", "tabserve", "tabicl"):
        assert key in env
    assert document["settings"]["device"] == "cpu" and document["settings"]["quick"] is True
    assert "RANDOM weights" in document["settings"]["checkpoint_note"]
    # The document's cell table: the cells as run, research ones with their options.
    assert [c["name"] for c in document["cells"]] == ["ref-fp32", "exact", "medium", "exact-buckets"]
    assert Cell.from_dict(document["cells"][3]) == research("exact-buckets")
    by_cell = {r["cell"]: r for r in document["results"]}
    assert by_cell["medium"] == {
        "cell": "medium",
        "workload": "small-quick",
        "status": "skipped",
        "reason": "skipped: no CUDA device",
    }
    for name in ("ref-fp32", "exact", "exact-buckets"):
        result = by_cell[name]
        assert result["status"] == "ok", (name, result.get("reason"), result.get("log_tail"))
        one = result["one_shot"]
        assert 0 < one["p20_ms"] <= one["median_ms"] <= one["p80_ms"]
        assert one["repeats"] >= 3 and isinstance(one["noisy"], bool)
        assert result["cold"]["first_call_ms"] > 0 and result["cold"]["jit"]["graph_breaks"] == 0
        assert result["kv"]["median_ms"] > 0 and result["end_to_end"]["fit_ms"] > 0
        # spawn to first answer: includes the first call, and the process start before it
        assert result["ready_ms"] > result["cold"]["first_call_ms"] + result["load_ms"] > 0
    assert by_cell["ref-fp32"]["gate"]["note"] == "is the fp32 reference"
    gate = by_cell["exact"]["gate"]
    assert gate["passed"] is True and gate["one_shot"]["max_prob_diff"] < 1e-5
    assert gate["reference"] == "ref-fp32"
    assert by_cell["exact"]["speedup"]["one_shot"]["ref32"] > 0
    padded = by_cell["exact-buckets"]["gate"]
    assert padded["passed"] is True and padded["padded"]["max_prob_diff"] <= 1e-6
    assert padded["padded_recipe"]["max_prob_diff"] <= 1e-5
    assert "padded_recipe" not in by_cell["exact"]["gate"]  # pads nothing
    # The gates run in their own phase, after the cold call and the ready time.
    assert by_cell["exact-buckets"]["padding_gates"]["routes"] == ["padded", "padded_recipe"]
    assert by_cell["exact"]["padding_gates"] == {"skipped": "the cell pads nothing"}
    # Only the preset cell is promoted (the research cell passed its gate too).
    promoted = document["promotion"]["small-quick"]
    assert promoted["one_shot"] == {
        "preset": "exact",
        "median_ms": by_cell["exact"]["one_shot"]["median_ms"],
    }
    assert promoted["kv_predict"]["preset"] == "exact"

    assert "Latency (ms" in printed and "exact-buckets" in printed and "Skipped cells:" in printed
    assert "  medium (small-quick): skipped: no CUDA device" in printed
    assert "small-quick: one_shot exact" in printed
    assert json_path.with_suffix(".png").stat().st_size > 1000
    promotions = out / "promotions.json"
    written = json.loads(promotions.read_text())["devices"]["cpu"]["workloads"]["small-quick"]
    assert written["one_shot"]["preset"] == "exact" and written["shape"]["n_train"] == 128
    assert f"promotions: {promotions}" in printed
    # What recipe="auto" serves from this run's promotion.
    assert auto_options("cpu", 128, 8, path=promotions) == "exact"
    written_files = {p.name for p in out.iterdir()}
    assert written_files == {"promotions.json", json_path.name, json_path.with_suffix(".png").name}


@pytest.mark.parametrize(
    "graphs", [("kv_graphs",), ("shape_graphs",), ("kv_graphs", "shape_graphs")]
)
def test_graph_cells_gate_their_padded_test_rows(tmp_path, monkeypatch, graphs):
    """A kv_graphs cell's padding gate compares its KV-cached prediction with test rows padded
    (one fewer than the workload's, off the test buckets) against the plain model's; a
    shape_graphs cell's likewise its one-shot call; a cell with both, both (joined along the
    test rows). The graphs need CUDA: here a served model replays through a CPU stand-in."""
    from tabserve.bench.engines import TabserveEngine
    from tabserve.models.tabicl.serving import served as serving

    class ServedOnCPU(serving.ServedTabICL):
        def __init__(self, model, options, grid=None):
            super().__init__(model, options.replace(kv_graphs=False, shape_graphs=False), grid)
            self.options = options
            self._raw_forward_cached = self._graph_core(self.model.forward_cached_raw)
            self._raw_forward = self._graph_core(serving._one_shot_core(self.model))

    from test_padded_inference import _ReplayOnCPU

    monkeypatch.setattr(serving, "_BucketGraph", _ReplayOnCPU)
    monkeypatch.setattr(serving, "ServedTabICL", ServedOnCPU)
    workload = workload_by_name("small-quick")
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    engine = TabserveEngine(cell_by_name("exact"), workload, checkpoint, torch.device("cpu"))
    assert engine.padding_gate(*model_tables(workload, 0, torch.device("cpu"))) is None
    options = engine.cell.options.replace(**dict.fromkeys(graphs, True))
    engine.cell = dataclasses.replace(engine.cell, options=options)
    X, y = model_tables(workload, 0, torch.device("cpu"))
    padded, unpadded = engine.padding_gate(X, y)
    assert padded.shape == unpadded.shape
    rows = (workload.n_test - 1) * len(graphs)  # 31 rows each: bucket 32
    assert padded.shape[:2] == (workload.members, rows)
    figures = gates.compare("clf", padded, unpadded)
    assert not gates.check(figures, gates.LIMITS["padded"]) and figures["max_prob_diff"] <= 1e-6


def test_graph_cells_need_a_cuda_device(tmp_path):
    from tabserve.bench.engines import UnsupportedCell, make_engine

    checkpoint = tmp_path / "never-read.ckpt"  # refused before the model loads
    with pytest.raises(UnsupportedCell, match="CUDA graphs need a CUDA device"):
        make_engine(cell_by_name("medium"), workload_by_name("small-quick"), checkpoint, "cpu")


def test_options_padding_gate_compares_the_cells_own_call(tmp_path):
    """The options' padding gate: the padded side is the cell's timed call itself, on a table
    with one train and one test row fewer than the workload's (both blocks off the grid), the
    unpadded side the same options' kernels on a plain model. A fault in the timed path only
    (here: one probability moved) fails it; the fp32 eager gate cannot see such a fault."""
    from tabserve.bench.engines import TabserveEngine

    workload = workload_by_name("small-quick")
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    cpu = torch.device("cpu")
    X, y = model_tables(workload, 0, cpu)
    plain = TabserveEngine(cell_by_name("exact"), workload, checkpoint, cpu)
    assert plain.recipe_padding_gate(X, y) is None
    engine = TabserveEngine(research("exact-buckets"), workload, checkpoint, cpu)
    assert engine.model.options.buckets
    calls = []
    one_shot = engine.one_shot
    engine.one_shot = lambda X, y: calls.append((X.shape, y.shape)) or one_shot(X, y)
    padded, unpadded = engine.recipe_padding_gate(X, y)
    n_train, n_test = workload.n_train, workload.n_test
    table = (workload.members, n_train + n_test - 2, X.shape[2])
    assert calls == [(table, (workload.members, n_train - 1))]
    assert padded.shape == unpadded.shape and padded.shape[1] == n_test - 1
    figures = gates.compare("clf", padded, unpadded)
    assert not gates.check(figures, gates.LIMITS["padded_recipe_fp32"])

    def faulty(X, y):
        out = one_shot(X, y).clone()
        least = out[0, 0].argmin()
        out[0, 0] = 0.0
        out[0, 0, least] = 1.0  # certain of the least likely class: off by >= 1 / K
        return out

    engine.one_shot = faulty
    figures = gates.compare("clf", *engine.recipe_padding_gate(X, y))
    assert gates.check(figures, gates.LIMITS["padded_recipe_fp32"])
    assert gates.check(figures, gates.LIMITS["padded_recipe_reduced"])


def test_ab_mode_alternates_two_cells_on_one_model(tmp_path):
    # In-process (the CLI runs this same function in a subprocess): saves an interpreter start.
    checkpoint = make_checkpoint("clf", tmp_path / "tiny.ckpt", size="tiny")
    buckets = research("exact-buckets")
    spec = {
        "mode": "ab",
        "cells": ["exact", buckets.name],
        "cell_specs": [cell_by_name("exact").to_dict(), buckets.to_dict()],
        "workload": "small-quick",
        "device": "cpu",
        "checkpoint": str(checkpoint),
        "windows": 2,
        "ab_calls": 1,
        "result": str(tmp_path / "ab.json"),
    }
    ab = measure.run_ab(spec)
    assert json.loads((tmp_path / "ab.json").read_text()) == ab
    assert ab["status"] == "ok" and ab["cells"] == ["exact", "exact-buckets"]
    assert len(ab["slots_ms"]["A"]) == 4 and ab["summary"]["windows"] == 2
    assert ab["outputs_stable"] == {"A": True, "B": True}
    assert ab["max_abs_diff"] <= 1e-6  # padding changes no prediction
    assert isinstance(ab["bitwise_equal"], bool)
    assert "B's output unchanged after the windows: True" in report.render_ab(ab)
    # A cell that cannot run here: refused before any job.
    refused = runner.run_ab(
        [cell_by_name("exact"), cell_by_name("medium")],
        workload_by_name("small-quick"),
        run_dir=tmp_path,
        device="cpu",
        checkpoint=checkpoint,
        timeout_s=10,
    )
    assert refused == {
        "cells": ["exact", "medium"],
        "status": "skipped",
        "reason": "medium: skipped: no CUDA device",
    }
    assert report.render_ab(refused) == (
        "ABBA ['exact', 'medium']: skipped: medium: skipped: no CUDA device"
    )


def test_deadline_reports_unstarted_jobs_as_skipped_and_writes_under_the_default_out(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    argv = QUICK + ["--cells", "exact", "exact-buckets", "--cells-file", str(RESEARCH_FILE)]
    assert main(argv + ["--deadline", "0", "--quiet", "--no-plot"]) == 0
    out = tmp_path / "tabserve-results"
    results = json.loads((out / "tabiclv2_cpu-quick_small-quick.json").read_text())["results"]
    assert [r["cell"] for r in results] == ["exact", "exact-buckets"]
    for result in results:
        assert result["status"] == "skipped"
        assert result["reason"] == "skipped: the run's --deadline of 0 s had passed"
    assert json.loads((out / "promotions.json").read_text())["devices"]["cpu"]["workloads"] == {}
    assert not list(out.glob("*.png"))


def test_cells_without_an_fp32_cell_get_a_gate_only_reference(tmp_path, capsys):
    # exact-buckets alone would be unchecked (no fp32 outputs in the run): the driver adds a
    # gate-only ref-fp32 job (one call, no timing) so the gate runs.
    out = tmp_path / "gated"
    argv = QUICK + ["--cells", "exact-buckets", "--cells-file", str(RESEARCH_FILE)]
    argv += ["--budget", "0.02", "--skip-phases", "kv", "end_to_end"]
    assert main(argv + ["--out", str(out), "--quiet", "--no-plot", "--timeout", "120"]) == 0
    document = json.loads((out / "tabiclv2_cpu-quick_small-quick.json").read_text())
    by_cell = {r["cell"]: r for r in document["results"]}
    assert list(by_cell) == ["ref-fp32", "exact-buckets"]
    reference = by_cell["ref-fp32"]
    assert reference["status"] == "ok" and reference["gate_only"] is True
    assert reference["cold"]["first_call_ms"] > 0
    assert "one_shot" not in reference and "kv" not in reference
    gate = by_cell["exact-buckets"]["gate"]
    assert gate["reference"] == "ref-fp32" and gate["passed"] is True
    assert gate["one_shot"]["max_prob_diff"] < 1e-5
    assert document["promotion"] == {}  # a research cell, gated but never promoted
    assert [c["name"] for c in document["cells"]] == ["exact-buckets", "ref-fp32"]
    printed = capsys.readouterr().out
    assert "gate-ref" in printed
    # The plot draws the timed cell only (a gate-only row has no one-shot figures).
    assert report.plot(document, tmp_path / "bench.png").stat().st_size > 0

    # Opting out leaves the gate unchecked.
    out2 = tmp_path / "ungated"
    argv2 = argv + ["--out", str(out2), "--no-gate-reference"]
    assert main(argv2 + ["--quiet", "--no-plot", "--timeout", "120"]) == 0
    ungated = json.loads((out2 / "tabiclv2_cpu-quick_small-quick.json").read_text())
    (result,) = ungated["results"]
    assert result["gate"]["passed"] is None and ungated["promotion"] == {}

    # Merging: the gate-only result never replaces the earlier measured one.
    measured = {"workload": "small-quick", "cell": "ref-fp32", "status": "ok",
                "one_shot": {"median_ms": 5.0}}  # fmt: skip
    first = dict(document, results=[measured])
    second = dict(document, results=[dict(reference)])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, doc in zip(paths, (first, second)):
        path.write_text(json.dumps(doc))
    merged_out = tmp_path / "merged"
    promotions = tmp_path / "elsewhere" / "promotions.json"
    argv3 = ["--merge", *map(str, paths), "--out", str(merged_out), "--no-plot"]
    assert main(argv3 + ["--promotions", str(promotions)]) == 0
    (kept,) = json.loads((merged_out / "tabiclv2_merged.json").read_text())["results"]
    assert kept["one_shot"]["median_ms"] == 5.0 and not kept.get("gate_only")
    assert promotions.exists() and not (merged_out / "promotions.json").exists()


def test_gate_reference_cell_choice():
    from tabserve.bench.cli import gate_reference_cell

    assert gate_reference_cell([research("exact-buckets")], "cpu").name == "ref-fp32"
    assert gate_reference_cell([cell_by_name("large")], "cuda").name == "ref-fp32"
    assert gate_reference_cell([cell_by_name("exact"), research("exact-buckets")], "cpu") is None
    assert gate_reference_cell([cell_by_name("ref-fp32"), cell_by_name("large")], "cuda") is None
    assert gate_reference_cell([], "cpu") is None


def test_aot_restart_cell_exports_then_serves_from_the_packages(tmp_path, capsys):
    """The AOT restart research cell for real on CPU: the priming process exports the workload's
    bucket package, the measured process loads it, answers from it (gated against fp32) and
    reports ready_ms."""
    out = tmp_path / "aot"
    argv = QUICK + ["--cells", "exact-aot-restart", "--cells-file", str(RESEARCH_FILE)]
    argv += ["--budget", "0.05", "--out", str(out), "--quiet"]
    assert main(argv + ["--no-plot", "--timeout", "300"]) == 0
    document = json.loads((out / "tabiclv2_cpu-quick_small-quick.json").read_text())
    result = {r["cell"]: r for r in document["results"]}["exact-aot-restart"]
    assert result["status"] == "ok", (result.get("reason"), result.get("log_tail"))
    assert result["aot"]["packages"] == 1 and result["aot"]["load_ms"] > 0
    assert result["priming"]["compile_cache"] == {"aot": ["bucket-128x32x8-b2.pt2"]}
    assert result["cold"]["jit"]["graphs"] == 0  # the restart traced nothing
    assert result["gate"]["passed"] is True and result["gate"]["one_shot"]["max_prob_diff"] < 1e-5
    assert result["ready_ms"] > result["cold"]["first_call_ms"]
    assert result["kv"] == {"skipped": "a warm-cache cell measures the restart's first answer and one-shot"}
    assert document["promotion"] == {}  # a restart is not a preset
    assert "exact-aot-restart: first answer" in capsys.readouterr().out


def test_targets_read_the_promoted_cells_and_never_call_unmeasured_met():
    from tabserve.bench import targets

    def ok(cell, workload, **phases):
        return {"cell": cell, "workload": workload, "status": "ok", **phases}

    def memory(allocated):
        return {"median_ms": 1.0, "memory": {"peak_allocated_bytes": allocated, "peak_reserved_bytes": 0}}

    results = [
        ok("large", "large", speedup={"one_shot": {"ref16": 4.2, "ref32": 9.9}, "kv": {"ref16": 3.0}}),
        ok("ref-fp16", "xlarge", one_shot=memory(100)),
        ok("large-fp8", "xlarge", one_shot=memory(120), speedup={"one_shot": {"ref16": 3.5}}),
        ok("medium", "stream", stream={"fresh_over_warm_p50": 1.1, "recompiles": 2}),
        ok("medium-compiled-restart", "small", priming={"cold_ms": 1.0}, ready_ms=21_700.0),
        {"cell": "medium-compiled-restart", "workload": "large", "status": "timeout",
         "priming": {}, "ready_ms": 9.0},
    ]  # fmt: skip

    def best(preset):
        return {"preset": preset, "median_ms": 1.0}

    promotion = {"large": {"one_shot": best("large"), "kv_predict": best("large")},
                 "xlarge": {"one_shot": best("large-fp8")}, "stream": {"stream": best("medium")}}  # fmt: skip
    rows = {r["target"]: r for r in targets.evaluate({"results": results, "promotion": promotion})}
    verdict = {name: row["verdict"] for name, row in rows.items()}
    assert rows["large one-shot vs reference fp16"]["cell"] == "large"
    assert verdict["large one-shot vs reference fp16"] == "met"  # 4.2 >= 4
    assert verdict["large one-shot vs reference fp32"] == "missed"  # 9.9 < 10
    assert verdict["large KV-cached predict vs reference cached fp16"] == "missed"
    assert verdict["small one-shot vs reference fp16"] == "not measured"  # nothing promoted
    assert rows["small one-shot vs reference fp16"]["cell"] is None
    assert verdict["xlarge one-shot vs reference fp16"] == "met"
    assert rows["xlarge peak memory over reference fp16"]["value"] == pytest.approx(1.2)
    assert verdict["xlarge peak memory over reference fp16"] == "missed"
    stream_target = "stream fresh p50 over warm, 0 recompiles / captures"
    assert verdict[stream_target] == "missed"  # fast, but recompiled
    for captures, expected in ((3, "missed"), (0, "met"), (None, "met")):  # None: no graphs
        quiet = dict(results[3], stream={"fresh_over_warm_p50": 1.1, "recompiles": 0,
                                         "captures": captures})  # fmt: skip
        again = {"results": [*results[:3], quiet, *results[4:]], "promotion": promotion}
        rows = {r["target"]: r for r in targets.evaluate(again)}
        assert rows[stream_target]["verdict"] == expected, captures
    restart = rows["restart from compile-cache artifacts, s"]  # the timed-out restart is ignored
    assert (restart["cell"], restart["workload"], restart["value"], restart["verdict"]) == (
        "medium-compiled-restart", "small", 21.7, "met")  # fmt: skip
    # A cell that captures graphs: its timed replays' peak misses the pool, the cold call's not.
    graphed = ok("large-fp8", "xlarge", one_shot=memory(30),
                 cold={"memory": {"peak_allocated_bytes": 90}},
                 captures=1, speedup={"one_shot": {"ref16": 3.5}})  # fmt: skip
    rows = {r["target"]: r for r in targets.evaluate(
        {"results": [*results[:2], graphed, *results[3:]], "promotion": promotion})}  # fmt: skip
    assert rows["xlarge peak memory over reference fp16"]["value"] == pytest.approx(0.9)
    assert targets.peak_allocated(dict(graphed, captures=None), "one_shot") == 30
    printed = report.render({"settings": {"device": "cuda", "checkpoint_note": "x"},
                             "environment": {"gpu": "G", "torch": "t", "tabicl": "2", "tabserve": "0"},
                             "results": results, "promotion": promotion})  # fmt: skip
    assert "Targets (the promoted cell's figure" in printed and "not measured" in printed
    assert "  large: one_shot large (1.000 ms), kv_predict large (1.000 ms)" in printed


def test_merged_reference_history_and_the_fastest_reference_column(tmp_path, capsys):
    """Merging keeps every run's reference medians (a merged document brings its own runs' and
    counts each run once); the speedup targets keep their same-run verdict and add the figure
    against the fastest reference run in the document (hand-computed below)."""
    from tabserve.bench import targets

    FAST = "small"

    def run(reference_ms, cell_ms, created):
        results = [
            {
                "workload": "small",
                "cell": "ref-fp16",
                "status": "ok",
                "one_shot": {"median_ms": reference_ms},
                "kv": {"median_ms": 20.0},
            },
            {
                "workload": "small",
                "cell": FAST,
                "status": "ok",
                "one_shot": {"median_ms": cell_ms},
                "kv": {"median_ms": 1.0},
                "gate": {"passed": True},
            },
        ]
        return {
            "schema": report.SCHEMA,
            "created": created,
            "environment": {"gpu": "G", "torch": "t", "tabicl": "2", "tabserve": "0"},
            "settings": {"device": "cuda", "checkpoint_note": "x"},
            "workloads": [{"name": "small"}],
            "results": results,
        }

    assert report.reference_medians(run(30.0, 4.0, "a")["results"]) == {
        "small": {"one_shot": {"ref-fp16": [30.0]}, "kv": {"ref-fp16": [20.0]}}
    }
    paths = []
    for i, (reference_ms, cell_ms) in enumerate([(30.0, 4.0), (50.0, 3.5)]):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run(reference_ms, cell_ms, str(i))))
    merged_dir = tmp_path / "merged"
    argv = ["--merge", *map(str, paths), "--out", str(merged_dir), "--no-plot"]
    assert main(argv) == 0
    merged = merged_dir / "tabiclv2_merged.json"
    document = json.loads(merged.read_text())
    assert document["reference_medians"]["small"]["one_shot"]["ref-fp16"] == [30.0, 50.0]
    assert document["reference_medians"]["small"]["kv"]["ref-fp16"] == [20.0]
    assert [c["name"] for c in document["cells"]] == ["ref-fp16", "small"]  # in table order
    # The later file's result replaces the earlier one: its figures are promoted.
    assert document["promotion"]["small"]["one_shot"] == {"preset": "small", "median_ms": 3.5}
    written = json.loads((merged_dir / "promotions.json").read_text())["devices"]["G"]
    assert written["workloads"]["small"]["one_shot"]["preset"] == "small"
    # Merging the merged document with one of its runs again adds no run twice.
    again_dir = tmp_path / "again"
    again = again_dir / "tabiclv2_merged.json"
    assert main(["--merge", str(merged), str(paths[1]), "--out", str(again_dir), "--no-plot"]) == 0
    history = json.loads(again.read_text())["reference_medians"]["small"]["one_shot"]
    assert history == {"ref-fp16": [30.0, 50.0]}
    rows = {r["target"]: r for r in document["targets"]}
    small = rows["small one-shot vs reference fp16"]
    assert small["cell"] == "small"
    assert small["value"] == pytest.approx(50.0 / 3.5) and small["verdict"] == "met"
    assert small["vs_fastest_reference"] == pytest.approx(30.0 / 3.5)
    assert small["reference_runs"] == 2
    assert "8.57 (2 runs)" in capsys.readouterr().out
    assert targets.evaluate(document) == document["targets"]
    # A later run of the reference alone (or of other cells) leaves the cell's speedup the one
    # of its own run: 50 / 3.5, not 20 / 3.5 against the later, faster reference.
    later = run(20.0, 3.0, "2")
    later["results"] = later["results"][:1]
    paths.append(tmp_path / "run2.json")
    paths[-1].write_text(json.dumps(later))
    assert main(["--merge", str(merged), str(paths[2]), "--out", str(again_dir), "--no-plot"]) == 0
    by_cell = {r["cell"]: r for r in json.loads(again.read_text())["results"]}
    assert by_cell[FAST]["speedup"]["one_shot"]["ref16"] == pytest.approx(50.0 / 3.5)
    # A run without a reference cell takes the merged document's.
    alone = run(99.0, 5.0, "3")
    alone["results"] = alone["results"][1:]
    alone["results"][0]["cell"] = "medium"
    paths.append(tmp_path / "run3.json")
    paths[-1].write_text(json.dumps(alone))
    assert main(["--merge", str(again), str(paths[3]), "--out", str(again_dir), "--no-plot"]) == 0
    by_cell = {r["cell"]: r for r in json.loads(again.read_text())["results"]}
    assert by_cell[FAST]["speedup"]["one_shot"]["ref16"] == pytest.approx(50.0 / 3.5)
    new = by_cell["medium"]["speedup"]
    assert new["one_shot"]["ref16"] == pytest.approx(20.0 / 5.0)


def test_stream_reports_fresh_over_warm_and_recompiles(tmp_path, capsys):
    """The stream phase times each fresh table once, then the same tables warm: the stream
    target (fresh p50 over the warm latency of the same bucket) comes out per cell."""
    out = tmp_path / "stream"
    argv = ["--device", "cpu", "--quick", "--model-size", "tiny", "--workloads", "stream-quick"]
    argv += ["--cells", "exact", "exact-buckets", "--cells-file", str(RESEARCH_FILE)]
    argv += ["--budget", "0.05", "--out", str(out), "--quiet"]
    assert main(argv + ["--no-plot", "--timeout", "300"]) == 0
    document = json.loads((out / "tabiclv2_cpu-quick_stream-quick.json").read_text())
    by_cell = {r["cell"]: r for r in document["results"]}
    for name in ("exact", "exact-buckets"):
        assert by_cell[name]["status"] == "ok", by_cell[name].get("log_tail")
        stream = by_cell[name]["stream"]
        assert len(stream["warm_samples_ms"]) == len(stream["shapes"]) == 4
        ratios = [f / w for f, w in zip(stream["samples_ms"], stream["warm_samples_ms"])]
        assert stream["fresh_over_warm_p50"] == pytest.approx(statistics.median(ratios))
        assert stream["warm_median_ms"] == pytest.approx(statistics.median(stream["warm_samples_ms"]))
        assert stream["recompiles"] == 0  # eager cells: nothing to compile
        assert stream["captures"] is None  # nor to capture
    assert by_cell["exact-buckets"]["gate"]["passed"] is True
    assert document["promotion"]["stream-quick"] == {
        "stream": {"preset": "exact", "median_ms": by_cell["exact"]["stream"]["median_ms"]}
    }
    printed = capsys.readouterr().out
    assert "fresh/warm p50" in printed and "target <= 1.25x" in printed


def test_profiler_splits_eager_time_by_stage_and_writes_tables(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import profile_tabiclv2

    out, js = tmp_path / "profile.txt", tmp_path / "profile.json"
    argv = ["--device", "cpu", "--workload", "small-quick", "--model-size", "tiny", "--repeats", "2"]
    argv += ["--cells", "exact", "medium", "--out", str(out), "--json", str(js)]
    assert profile_tabiclv2.main(argv + ["--trace", str(tmp_path / "traces")]) == 0
    eager, cuda_only = json.loads(js.read_text())
    assert eager["cell"] == "exact" and len(eager["wall_ms_all"]) == 2
    assert eager["wall_ms_median"] > 0
    # Every stage ran and was timed; together they fit in the same calls' wall time (read
    # against those calls, not the separately timed ones: a busy CI box slows one set alone).
    assert all(eager["stage_gpu_ms"][s] > 0 for s in ("col", "row", "icl"))
    assert len(eager["stage_call_wall_ms"]) == 2
    assert sum(eager["stage_gpu_ms"].values()) <= 1.5 * max(eager["stage_call_wall_ms"])
    # A cell that cannot run on this device is reported, not fatal.
    assert cuda_only == {"cell": "medium", "workload": "small-quick",
                         "skipped": "skipped: no CUDA device"}  # fmt: skip
    assert "device_busy_ms" not in eager  # CPU: no kernel timeline
    top = eager["top_rows"]  # the heaviest operators as data, heaviest first
    assert 0 < len(top) <= profile_tabiclv2.TOP_ROWS and all(r["calls"] >= 1 for r in top)
    assert [r["self_ms"] for r in top] == sorted((r["self_ms"] for r in top), reverse=True)
    assert any(r["name"].startswith("aten::") for r in top)
    text = out.read_text()
    assert "exact on small-quick: kernels by device time" in text and "aten::" in text
    # The profiled call as a Perfetto trace, for the cell that ran (the skipped one has none).
    (trace,) = (tmp_path / "traces").iterdir()
    assert trace.name == "trace_small-quick_exact.json.gz"
    names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
    assert any(str(n).startswith("aten::") for n in names)


def test_profiler_profiles_the_kv_cached_prediction(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import profile_tabiclv2
    from tabserve.bench import engines

    calls = []  # which engine methods the profiled and timed calls went through
    for method in ("one_shot", "build_cache", "predict_cached"):
        original = getattr(engines.TabserveEngine, method)
        monkeypatch.setattr(
            engines.TabserveEngine,
            method,
            lambda self, *a, _m=method, _f=original: calls.append(_m) or _f(self, *a),
        )
    js = tmp_path / "profile.json"
    argv = ["--device", "cpu", "--workload", "small-quick", "--model-size", "tiny", "--repeats", "2"]
    argv += ["--cells", "exact-buckets", "--cells-file", str(RESEARCH_FILE)]
    argv += ["--phase", "kv", "--out", str(tmp_path / "p.txt")]
    assert profile_tabiclv2.main(argv + ["--json", str(js)]) == 0
    (summary,) = json.loads(js.read_text())
    assert summary["cell"] == "exact-buckets"
    assert summary["phase"] == "kv" and len(summary["wall_ms_all"]) == 2
    # One cache build, then only cached predictions: 3 warm-up, 2 timed, 2 stage-timed, 1 profiled.
    assert calls == ["build_cache"] + ["predict_cached"] * 8
    with pytest.raises(SystemExit):
        profile_tabiclv2.main(argv[:-4] + ["--phase", "nope"])


def test_skipped_phases_are_reported_not_measured(tmp_path):
    out = tmp_path / "skipped"
    argv = QUICK + ["--cells", "exact", "--skip-phases", "kv", "end_to_end", "--budget", "0.02"]
    assert main(argv + ["--out", str(out), "--quiet", "--no-plot", "--timeout", "120"]) == 0
    document = json.loads((out / "tabiclv2_cpu-quick_small-quick.json").read_text())
    (result,) = document["results"]
    assert result["status"] == "ok" and result["one_shot"]["median_ms"] > 0
    for phase in ("kv", "end_to_end"):
        assert result[phase] == {"skipped": "not measured in this run (--skip-phases)"}
    assert document["settings"]["timing"]["skip_phases"] == ["end_to_end", "kv"]
    assert document["promotion"]["small-quick"] == {
        "one_shot": {"preset": "exact", "median_ms": result["one_shot"]["median_ms"]}
    }
    with pytest.raises(SystemExit):
        main(argv[:-2] + ["--skip-phases", "one_shot"])


def _without(monkeypatch, *missing):
    """importlib.util.find_spec as on a machine without the ``missing`` packages (a wheel
    installed without its bench extra)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )


def test_without_the_bench_extra_the_driver_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _without(monkeypatch, "tabicl", "matplotlib")
    with pytest.raises(SystemExit, match=r"tabserve\[bench\].*give --checkpoint"):
        main(QUICK + ["--cells", "exact", "--quiet"])
    checkpoint = make_checkpoint("clf", tmp_path / "given.ckpt", "tiny")
    argv = QUICK + ["--cells", "exact", "ref-fp32", "--checkpoint", str(checkpoint)]
    assert main(argv + ["--deadline", "0", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "no plot: matplotlib is not installed (pip install 'tabserve[bench]')" in printed
    assert not list((tmp_path / "tabserve-results").glob("*.png"))
    assert skip_reason(cell_by_name("ref-fp32"), "cpu") == (
        "skipped: tabicl is not installed (pip install 'tabserve[bench]')"
    )
