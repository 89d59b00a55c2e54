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
        # values offset by VALUE_OFFSET: outputs near it, fp32 rounding of that size
        assert record["max_abs_error_vs_fp32_offset_values"] < 1e-5 * bench.VALUE_OFFSET


def test_offset_check_sees_a_drift_that_zero_mean_values_hide():
    """A stand-in for a kernel that loses a fixed share of its output (what an accumulator
    that drops bits on every block does to a running sum): small on zero-mean values, clear on
    values that share an offset."""
    q, k, v = bench.inputs(2, 70, 90, torch.float32, torch.device("cpu"))

    def lossy(v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v) * (1 - 1e-2)

    plain = bench.max_error(lossy(v), q, k, v)
    shifted = bench.max_error(lossy(v + bench.VALUE_OFFSET), q, k, v + bench.VALUE_OFFSET)
    assert shifted > 1e-2 * bench.VALUE_OFFSET * 0.9 > plain


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


def test_prefix_run_times_the_padded_calls_over_the_real_keys(tmp_path):
    """``--prefix``: each quick case's keys padded to their bucket (n = 7/8 of a count on the
    grid) with garbage in the padded rows; the CPU path must still equal fp32 maths over the
    first n keys, and the rate counts the real keys only."""
    out = tmp_path / "prefix.json"
    argv = ["--quick", "--prefix", "--device", "cpu", "--budget", "0.01", "--json", str(out)]
    assert bench.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["prefix"] is True
    for record, (_, tables, queries, keys) in zip(document["records"], bench.QUICK_CASES):
        n, length = bench.prefix_lengths(keys)
        assert record["padded_keys"] == length and record["shape"][3] == n < length
        assert record["max_abs_error_vs_fp32"] < 1e-5  # garbage keys would show here
        flop = 4 * tables * bench.HEADS * queries * n * bench.HEAD_DIM
        assert record["tflop_per_s"] == pytest.approx(flop / (record["median_ms"] / 1e3) / 1e12)


def test_cached_run_times_few_query_rows_with_the_matmul_form_beside_the_backends(tmp_path):
    """``--cached``: a KV-cached prediction's calls (few query rows against the cached keys),
    the backends and the two-matmul form, each equal to fp32 maths on the CPU, the rate as the
    K and V bytes read per second."""
    out = tmp_path / "cached.json"
    argv = ["--quick", "--cached", "--device", "cpu", "--budget", "0.01", "--json", str(out)]
    assert bench.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["cached"] is True
    records = document["records"]
    methods = ("sdpa math", "matmuls")
    cases = bench.QUICK_CACHED_CASES
    expected = [(case[0], method) for case in cases for method in methods]
    assert [(r["case"], r["method"]) for r in records] == expected
    for record in records:
        tables, heads, queries, keys, dim = record["shape"]
        assert queries < keys and record["max_abs_error_vs_fp32"] < 1e-5
        assert record["max_abs_error_vs_fp32_offset_values"] < 1e-5 * bench.VALUE_OFFSET
        read = 2 * tables * heads * keys * dim * 4  # K and V, fp32
        assert record["kv_gb_per_s"] == pytest.approx(read / (record["median_ms"] / 1e3) / 1e9)
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cached", "--prefix", "--device", "cpu"])


def test_the_matmul_form_is_softmax_attention_in_half_precision_too():
    q, k, v = bench.inputs(2, 3, 500, torch.float32, torch.device("cpu"))
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(bench.by_matmuls(q, k, v), exact, atol=1e-5)
    half = bench.by_matmuls(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert half.dtype == torch.bfloat16 and (half.float() - exact).abs().max() < 3e-2


def test_prefix_lengths_follow_the_train_row_grid():
    from tabserve.buckets import DEFAULT_TRAIN_ROWS

    assert 8192 in DEFAULT_TRAIN_ROWS and bench.prefix_lengths(8192) == (7168, 8192)
    n, length = bench.prefix_lengths(50000)  # past the grid's 16,384 rows: 7/8 of the count
    assert (n, length) == (43750, 50000)
    n, length = bench.prefix_lengths(8000)
    assert n == 8000 and length == min(b for b in DEFAULT_TRAIN_ROWS if b >= 8000)
    k, v = (torch.randn(1, 2, 5, 4) for _ in "kv")
    k_padded, v_padded = bench.padded_keys(k, v, 3, 8)
    assert k_padded.shape == (1, 2, 8, 4) and torch.equal(k_padded[:, :, :3], k[:, :, :3])
    assert torch.equal(v_padded[:, :, :3], v[:, :, :3]) and v_padded[:, :, 3:].abs().max() > 10


def test_cuda_methods_include_the_flash_kernel_and_its_sweep():
    """The method table on CUDA (built without a GPU: nothing runs): tabserve's one-pass kernel
    on half and fp8 operands, and with ``--flash-sweep`` each tile of its sweep (the permuted
    score columns on fp8 only)."""
    from tabserve.kernels import flash_attention as fa

    plain = bench.methods(torch.device("cuda"))
    assert {"sdpa cudnn", "tabserve flash half", "tabserve flash fp8"} <= set(plain)
    swept = set(bench.methods(torch.device("cuda"), flash_sweep=True)) - set(plain)
    fp8_only = sum(tile.fp8_only for tile in fa.SWEEP)
    assert fp8_only and len(swept) == 2 * len(fa.SWEEP) - fp8_only
    assert {
        "tabserve flash half 128x64 w8 s3",
        "tabserve flash fp8 64x64 w4 s3",
        "tabserve flash fp8 64x128 w4 s3",
        "tabserve flash fp8 64x128 w4 s3 r128",
        "tabserve flash fp8 64x128 w4 s3 r168 permuted",
        "tabserve flash fp8 64x128 w4 s2 r168 permuted",
        "tabserve flash fp8 64x128 w4 s3 r128 permuted tma",
    } <= swept
