"""docs/results.md is rendered from the records under benchmarks/results/ (benchmarks/record.py):
a small synthetic record gives the expected table rows, and the committed page is the rendering of
the committed records."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import record  # noqa: E402

MiB = 1024 * 1024


def _timed(median, p20, p80, peak_mib=None):
    figures = {"median_ms": median, "p20_ms": p20, "p80_ms": p80}
    if peak_mib is not None:
        figures["memory"] = {"peak_allocated_bytes": peak_mib * MiB, "peak_reserved_bytes": 0}
    return figures


def _gate(max_dp=None, failures=()):
    one = {"failures": list(failures)}
    if max_dp is not None:
        one["max_prob_diff"] = max_dp
    return {"reference": "ref-fp32", "one_shot": one, "passed": not failures}


def synthetic_record() -> dict:
    ok = {"status": "ok"}
    results = [
        {"cell": "large", "workload": "small", **ok, "one_shot": _timed(4.0, 3.9, 4.2, 300),
         "kv": _timed(1.5, 1.4, 1.6), "gate": _gate(2.5e-3),
         "speedup": {"one_shot": {"ref-fp16": 8.0, "ref-fp32": 10.0},
                     "kv": {"ref-fp16": 10.0, "ref-fp32": 12.0}}},
        {"cell": "ref-fp32", "workload": "small", **ok, "one_shot": _timed(40.0, 39.0, 41.0, 450),
         "kv": _timed(18.0, 17.5, 18.5),
         "gate": {"passed": True, "reference": "ref-fp32", "note": "is the fp32 reference"}},
        {"cell": "ref-fp16", "workload": "small", **ok, "one_shot": _timed(32.0, 31.0, 33.0, 330),
         "kv": _timed(15.0, 14.0, 16.0), "gate": _gate(1.6e-3)},
        {"cell": "medium", "workload": "small", "status": "timeout",
         "reason": "timeout after 200 s"},
        {"cell": "exact", "workload": "small", **ok, "one_shot": _timed(30.0, 29.5, 30.5),
         "kv": _timed(12.0, 11.0, 13.0), "gate": _gate(3e-2, ["max_prob_diff > 1e-05"])},
        {"cell": "large-fp8", "workload": "small", "status": "skipped", "reason": "needs sm_90"},
    ]  # fmt: skip
    return {
        "schema": "tabserve.bench.tabiclv2/1",
        "created": "2000-01-01T00:00:00+00:00",
        "environment": {
            "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900, "triton": "3.6.0",
            "driver": "580.1", "tabicl": "2.2.0", "gpu": "NVIDIA H200", "git_commit": "abc1234",
        },
        "settings": {"device": "cuda", "command": "python -m tabserve.bench --device cuda"},
        "cells": [{"name": n} for n in
                  ("ref-fp32", "ref-fp16", "exact", "medium", "small", "large", "large-fp8")],
        "workloads": [{"name": "small", "description": "8 members, 512 + 64 rows, 8 features"}],
        "results": results,
    }  # fmt: skip


def test_a_driver_record_renders_one_row_per_cell_that_ran(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(synthetic_record()))
    text = record.render_results([path])
    assert "## NVIDIA H200" in text
    assert (
        "- versions: torch 2.11.0+cu130, CUDA 13.0, cuDNN 9.19.0, Triton 3.6.0, driver 580.1, "
        "tabicl 2.2.0"
    ) in text
    assert "- commit: `abc1234`" in text
    assert "- command: `python -m tabserve.bench --device cuda`" in text
    assert "### small: 8 members, 512 + 64 rows, 8 features" in text
    assert "2000" not in text  # the measurement time is not printed
    table = text[text.index("| cell |") :].split("\n\n")[0].splitlines()
    assert table[0] == (
        "| cell | one-shot ms (p20-p80) | KV-cached ms | x ref-fp16 | x ref-fp32 | peak MiB "
        "| gate |"
    )
    # Rows in the record's cell order; speed-ups stored by the run, else against the same
    # record's reference cells (exact: 32 / 30 and 15 / 12 against ref-fp16).
    assert table[2:] == [
        "| ref-fp32 | 40.0 (39.0-41.0) | 18.0 | 0.80x / 0.83x | 1.00x / 1.00x | 450 | reference |",
        "| ref-fp16 | 32.0 (31.0-33.0) | 15.0 | 1.00x / 1.00x | 1.25x / 1.20x | 330 "
        "| pass (max dp 1.6e-03) |",
        "| exact | 30.0 (29.5-30.5) | 12.0 | 1.07x / 1.25x | 1.33x / 1.50x | - "
        "| FAIL one_shot: max_prob_diff > 1e-05 |",
        "| medium | - | - | - | - | - | TIMEOUT: after 200 s |",
        "| large | 4.000 (3.900-4.200) | 1.500 | 8.00x / 10.00x | 10.00x / 12.00x | 300 "
        "| pass (max dp 2.5e-03) |",
    ]
    assert "Not run on this device: large-fp8." in text


def test_older_records_name_their_references_c1_ref_fp16_and_c0_ref_fp32(tmp_path):
    document = synthetic_record()
    renamed = {"ref-fp16": "c1-ref-fp16", "ref-fp32": "c0-ref-fp32"}
    for result in document["results"]:
        result["cell"] = renamed.get(result["cell"], result["cell"])
        for figures in result.get("speedup", {}).values():
            figures["ref16"], figures["ref32"] = figures.pop("ref-fp16"), figures.pop("ref-fp32")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(document))
    rows = [line for line in record.render_results([path]).splitlines() if line.startswith("| ")]
    exact = "| exact | 30.0 (29.5-30.5) | 12.0 | 1.07x / 1.25x | 1.33x"
    assert any(r.startswith(exact) for r in rows)
    assert any(r.startswith("| large | 4.000 (3.900-4.200) | 1.500 | 8.00x / 10.00x") for r in rows)


def test_files_that_are_no_records_are_left_out(tmp_path):
    other = tmp_path / "promotions.json"
    other.write_text(json.dumps({"schema": "tabserve.promotions/1", "devices": {}}))
    assert record.render_results([other]) == record.HEADER


def test_check_fails_on_a_stale_page_and_passes_once_rendered(tmp_path, capsys):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(synthetic_record()))
    page = tmp_path / "results.md"
    assert record.main([str(path), "-o", str(page)]) == 0
    assert record.main(["--check", str(path), "-o", str(page)]) == 0
    page.write_text(page.read_text().replace("NVIDIA H200", "another GPU"))
    assert record.main(["--check", str(path), "-o", str(page)]) == 1
    assert "out of date" in capsys.readouterr().err


def test_the_committed_page_is_rendered_from_the_committed_records():
    records = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    page = ROOT / "docs" / "results.md"
    if not records:
        pytest.skip("no records in this checkout")
    assert page.read_text() == record.render_results(records), (
        "docs/results.md is out of date: python benchmarks/record.py "
        "benchmarks/results/*.json -o docs/results.md"
    )


def test_an_estimator_suite_record_renders_its_rows_and_speedups(tmp_path):
    from tabserve.bench import estimator_suite as suite

    def result(engine, warm_ms, preset=None):
        return {
            "kind": "small", "engine": engine, "status": "ok", "served_preset": preset,
            "cold": {"cold_ms": 5000.0, "first_call_ms": 700.0},
            "warm": {"median_ms": warm_ms, "p20_ms": warm_ms, "p80_ms": warm_ms},
        }  # fmt: skip

    results = [result("tabicl", 400.0), result("tabicl-fp32", 500.0), result("tabserve-auto", 100.0, "small")]
    for i, r in enumerate(results):  # the same probabilities from every engine
        r["outputs"] = str(tmp_path / f"out{i}.npy")
        np.save(r["outputs"], np.full((3, 2), 0.5))
    kinds = [suite.Kind("small", 1, 1, 1, 2, (1, 1, 1), "")]
    suite.add_accuracy_and_speedups(results, kinds)
    document = {
        "schema": suite.SCHEMA,
        "environment": {"gpu": "GPU X", "torch": "2.x"},
        "settings": {"device": "cuda", "checkpoint_note": "random"},
        "command": "python -m tabserve.bench.estimator_suite",
        "results": results,
        "summary": suite.summarize(results, ["tabserve-auto"]),
    }
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(document))
    page = record.render_results([path])
    assert "## Estimators, fit + predict: GPU X" in page
    row = next(line for line in page.splitlines() if line.startswith("| small | tabserve-auto (small)"))
    assert "| 4.00x | 5.00x |" in row  # tabicl's 400 ms and fp32's 500 ms over 100 ms
    assert "| tabserve-auto | 4.00x |" in page


def test_a_compile_contention_record_renders_its_three_medians(tmp_path):
    path = tmp_path / "compile_contention_cpu.json"
    document = {
        "benchmark": "compile_contention", "environment": {"cpu": "Some CPU"}, "device": "cpu",
        "model_size": "tiny", "repeats": 9, "workload": {"description": "8 members"},
        "alone_ms": 64.4, "beside_ms": 1637.2, "paused_ms": 65.6,
    }  # fmt: skip
    path.write_text(json.dumps(document))
    text = record.render_results([path])
    assert "## Compile contention: Some CPU (CPU)" in text
    assert "| 8 members | 64.4 | 1637 | 65.6 |" in text
    assert "compiled tabserve's fused" not in text  # no --triton: no such table
    document["triton_here"] = {
        "compile_s": 17.3, "calls": 40, "median_ms": 26.5, "longest_ms": 169.5
    }  # fmt: skip
    document["triton_children"] = {
        "compile_s": 9.3, "calls": 21, "median_ms": 19.8, "longest_ms": 194.5
    }  # fmt: skip
    path.write_text(json.dumps(document))
    text = record.render_results([path])
    assert "| in this process | 17.3 | 40 | 26.5 | 169.5 |" in text
    assert "| in child processes | 9.3 | 21 | 19.8 | 194.5 |" in text


def test_a_kernel_record_renders_a_row_per_case_and_method(tmp_path):
    """A kernel micro-benchmark's JSON: its cases and methods in order, the median and the
    p20-p80 spread, the rate and the error its records carry, a method that failed as such."""
    path = tmp_path / "icl_attention_cached_h100.json"
    document = {
        "benchmark": "icl_attention", "device": "cuda", "dtype": "torch.float16", "cached": True,
        "environment": {"gpu": "Some GPU", "git_commit": "abc1234"},
        "records": [
            {"case": "cached 1 rows", "method": "sdpa flash", "median_ms": 0.093, "p20_ms": 0.086,
             "p80_ms": 0.103, "kv_gb_per_s": 1758.2, "max_abs_error_vs_fp32": 9.7e-06},
            {"case": "cached 1 rows", "method": "matmuls", "error": "refused"},
        ],
    }  # fmt: skip
    path.write_text(json.dumps(document))
    text = record.render_results([path])
    assert "## Kernel `icl_attention` --cached: Some GPU" in text
    assert "| case | method | median ms | p20-p80 | K+V GB/s | max abs err vs fp32 |" in text
    assert "| cached 1 rows | sdpa flash | 0.093 | 0.086-0.103 | 1,758 | 9.7e-06 |" in text
    assert "| cached 1 rows | matmuls | failed | - | - | - |" in text
    # Without records it is no record.
    path.write_text(json.dumps({**document, "records": None}))
    assert "Kernel" not in record.render_results([path])
