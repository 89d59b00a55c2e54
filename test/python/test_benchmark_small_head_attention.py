"""The head-dim-16 attention benchmark (benchmarks/small_head_attention.py): its quick CPU run and
the rates it derives from a median (least memory traffic, FLOP), checked against the element
counts of the tensors it times."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import small_head_attention as bench
from tabserve import ops


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rates_count_each_operand_once(broadcast, dtype):
    batch, queries, keys, ms = 3, 5, 7, 2.0
    q, k, v = bench.inputs(batch, queries, keys, broadcast, dtype, "cpu")
    out = ops.small_head_attention(q.float(), k.float(), v.float())
    # The broadcast queries are one stored set; every other operand is read or written once.
    stored_q = q[0].numel() if broadcast else q.numel()
    elements = stored_q + k.numel() + v.numel() + out.numel()
    gb_s, tflop_s = bench.floor_rates(batch, queries, keys, broadcast, dtype, ms)
    assert gb_s == pytest.approx(elements * dtype.itemsize / (ms / 1e3) / 1e9)
    # Two products of [Lq x 16] by [16 x Lk] (and [Lq x Lk] by [Lk x 16]) per (batch, head).
    heads = q.shape[1]
    flop = 2 * (2 * queries * keys * 16) * batch * heads
    assert tflop_s == pytest.approx(flop / (ms / 1e3) / 1e12)


def test_quick_run_reports_rates_and_errors(tmp_path):
    out = tmp_path / "sha.json"
    assert bench.main(["--quick", "--device", "cpu", "--budget", "0.01", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["case"] for r in records} == {case[0] for case in bench.QUICK_CASES}
    for record in records:
        assert record["median_ms"] > 0 and record["least_traffic_gb_per_s"] > 0
        assert record["tflop_per_s"] > 0
        assert record["max_abs_error_vs_fp32"] < 1e-5  # fp32 on the CPU: exact maths


def test_methods_hold_the_flash_kernel_and_with_the_sweep_its_half_tiles(tmp_path):
    """The flash kernel is a method on every device; ``--flash-sweep`` adds each half tile of
    its sweep (the fp8-only tiles left out), and a quick run of those agrees with fp32
    maths on the CPU (the composite) and filters cases by ``--cases``."""
    from tabserve.kernels import flash_attention as fa

    plain = bench.methods(torch.device("cpu"))
    assert {"tabserve op", "tabserve flash half"} <= set(plain)
    swept = set(bench.methods(torch.device("cpu"), flash_sweep=True)) - set(plain)
    assert swept == {f"tabserve flash half {t.label}" for t in fa.SWEEP if not t.fp8_only}
    out = tmp_path / "sweep.json"
    argv = ["--quick", "--device", "cpu", "--budget", "0.01", "--cases", "row", "--flash-sweep"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["case"] for r in records} == {"row"}
    assert {r["method"] for r in records} >= swept
    assert all(r["max_abs_error_vs_fp32"] < 1e-5 for r in records)
    with pytest.raises(SystemExit, match="matches no case"):
        bench.main(["--quick", "--device", "cpu", "--cases", "nothing-like-it"])
