"""The fused-operator benchmarks (benchmarks/feed_forward.py, norm_linear.py, qassmax_scale.py,
table_checks.py, layer_norm_cast.py): their quick CPU runs time every method on every quick case and report each
method's error against the composite, which on the CPU (the operators' composite kernels) is
within a rounding."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import feed_forward
import layer_norm_cast
import norm_linear
import qassmax_scale
import table_checks


@pytest.mark.parametrize(
    "bench",
    [feed_forward, norm_linear, qassmax_scale, table_checks, layer_norm_cast],
    ids=lambda b: b.__name__,
)
def test_quick_cpu_run_times_every_method_and_checks_it(bench, tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--device", "cpu", "--budget", "0.01", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["environment"]["torch"]
    records = report["records"]
    # CPU methods: the composite (table_checks: the ATen checks) and the operator, on every
    # quick case; feed_forward's rows case also the route before row_prefix.
    composite = "ATen checks" if bench is table_checks else "composite"
    expected = {
        (case[0], method) for case in bench.QUICK_CASES for method in (composite, "tabserve op")
    }
    if bench is feed_forward:
        expected.add(("tiny out-proj rows", "op, then ATen to_rows"))
    assert {(r["case"], r["method"]) for r in records} == expected
    for record in records:
        assert record["median_ms"] > 0
        assert record["max_error_roundings"] <= 1.0, record


@pytest.mark.parametrize("bench", [feed_forward, norm_linear], ids=lambda b: b.__name__)
def test_stream_in_the_matmul_dtype_is_what_the_benchmark_times(bench, tmp_path):
    """``--stream matmul``: the token stream in the matmul dtype (the model's streams under
    autocast), recorded in the JSON; the operator still agrees with the composite."""
    out = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--budget", "0.01", "--stream", "matmul"]
    assert bench.main([*argv, "--dtype", "bfloat16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["stream_dtype"] == "torch.bfloat16" and report["dtype"] == "torch.bfloat16"
    assert all(r["max_error_roundings"] <= 1.0 for r in report["records"])
    widths = [384] if bench is norm_linear else []  # norm_linear's inputs take its out width
    x = bench.inputs(8, *widths, "cpu", torch.bfloat16)[0]
    assert x.dtype == torch.bfloat16


def test_cases_pick_cases_by_their_names(tmp_path):
    """``--cases TEXT...``: only the cases whose name holds one of the texts; none is an error
    naming the cases."""
    out = tmp_path / "bench.json"
    argv = ["--quick", "--device", "cpu", "--budget", "0.01", "--json", str(out)]
    assert feed_forward.main([*argv, "--cases", "rows"]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["case"] for r in records} == {"tiny out-proj rows"}
    assert all(r["rows"] == [2, 5, 100] for r in records)  # (tables, sets, rows per set)
    with pytest.raises(SystemExit, match="matches no case; the cases: tiny, tiny out-proj"):
        feed_forward.main([*argv, "--cases", "nothing"])
