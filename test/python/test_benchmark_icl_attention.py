"""The ICL attention benchmark (benchmarks/icl_attention.py): its quick CPU run, the rate it
derives from each median and its error against fp32 maths."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import icl_attention as bench


def test_quick_run_reports_rates_and_errors(tmp_path):
    out = tmp_path / "icl.json"
    argv = ["--quick", "--device", "cpu", "--budget", "0.01", "--json", str(out)]
    assert bench.main(argv) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["case"] for r in records] == [case[0] for case in bench.QUICK_CASES]
    for record, (_, tables, queries, keys) in zip(records, bench.QUICK_CASES):
        assert record["shape"] == [tables, bench.HEADS, queries, keys, bench.HEAD_DIM]
        flop = 4 * tables * bench.HEADS * queries * keys * bench.HEAD_DIM
        assert record["tflop_per_s"] == pytest.approx(flop / (record["median_ms"] / 1e3) / 1e12)
        assert record["max_abs_error_vs_fp32"] < 1e-5  # fp32 maths on the CPU


def test_error_is_measured_against_fp32_softmax_attention():
    q, k, v = bench.inputs(2, 70, 90, torch.float32, torch.device("cpu"))
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert bench.max_error(exact, q, k, v) < 1e-5
    off = exact.clone()
    off[0, 0, 3, 5] += 0.01  # a checked row: found
    assert bench.max_error(off, q, k, v) == pytest.approx(0.01, abs=1e-5)
    unchecked = exact.clone()
    unchecked[1, 0, 3, 5] += 1.0  # another table: not among the checked rows
    assert bench.max_error(unchecked, q, k, v) < 1e-5
    with pytest.raises(SystemExit, match="matches no case"):
        bench.main(["--quick", "--device", "cpu", "--cases", "xlarge"])
