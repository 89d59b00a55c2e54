"""The fp8 attention study (benchmarks/fp8_attention_emulation.py): its roundings against fp64
maths, the routing of the ICL stage's calls only, and a run on the tiny model."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tabicl")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_attention_emulation as study
from tabserve.models.tabicl import layers


def _exact_attention(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


def _qkv(seed, queries=600, keys=300, head_dim=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, head_dim, generator=g) for n in (queries, keys, keys)]


def test_e4m3_rounding_keeps_three_mantissa_bits_and_maps_the_largest_value_to_448():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 5
    scale = study.per_tensor_scale(x)
    rounded = study.round_to(x, torch.float8_e4m3fn, scale)
    assert float(rounded.abs().max()) == pytest.approx(float(x.abs().max()), rel=1e-6)
    normal = x.abs() >= scale * 2.0**-6  # e4m3's smallest normal, scaled
    relative = ((rounded - x).abs() / x.abs())[normal]
    assert float(relative.max()) <= 2.0**-4 + 1e-7  # half a unit in the last of 3 bits
    assert float(relative.max()) > 2.0**-6  # and it does round (fp16 would be below 2^-11)
    assert (x / scale).to(torch.float8_e4m3fn).to(torch.float32).unique().numel() <= 256


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 2e-3), (torch.float8_e4m3fn, 0.15)])
def test_emulated_attention_errs_as_its_precision_does(dtype, bound):
    q, k, v = _qkv(1)
    exact = _exact_attention(q, k, v)
    out = study.emulated_attention(q, k, v, dtype, p_scale=256.0)
    assert out.shape == q.shape and out.dtype == torch.float32
    error = float((out.double() - exact).abs().max())
    assert error <= bound * float(exact.abs().max())
    if dtype == torch.float8_e4m3fn:  # the fp8 roundings show against the fp16 control
        control = study.emulated_attention(q, k, v, torch.float16, p_scale=256.0)
        assert error > 10 * float((control.double() - exact).abs().max())


def test_query_chunks_do_not_change_the_result(monkeypatch):
    q, k, v = _qkv(2, queries=70)
    whole = study.emulated_attention(q, k, v, torch.float8_e4m3fn, 256.0)
    monkeypatch.setattr(study, "QUERY_CHUNK", 16)
    assert torch.equal(study.emulated_attention(q, k, v, torch.float8_e4m3fn, 256.0), whole)


def test_only_calls_of_the_icl_head_dimension_are_replaced():
    attend = study.icl_attention_replaced(torch.float8_e4m3fn, 256.0, head_dim=64)
    q16, k16, v16 = _qkv(3, head_dim=16)
    assert torch.equal(attend(q16, k16, v16), layers.batched_sdpa(q16, k16, v16))
    assert attend.calls == 0
    q, k, v = _qkv(3)
    assert not torch.allclose(attend(q, k, v), layers.batched_sdpa(q, k, v), atol=1e-3)
    assert attend.calls == 1


def test_tiny_model_run_gates_both_variants_and_restores_the_model(tmp_path):
    out = tmp_path / "fp8.json"
    argv = [
        "--size",
        "tiny",
        "--members",
        "2",
        "--n-train",
        "48",
        "--n-test",
        "16",
        "--features",
        "5",
        "--seeds",
        "0",
        "--json",
        str(out),
    ]
    original = layers.batched_sdpa
    payload = study.main(argv)
    assert json.loads(out.read_text())["results"] == payload["results"]
    assert layers.batched_sdpa is original  # the stand-in is gone
    results = {r["variant"]: r for r in payload["results"]}
    assert set(results) == {"fp16 (control)", "fp8 e4m3"}
    for result in results.values():
        assert result["icl_calls"] >= 1  # the tiny model's ICL head dimension (16) was routed
        assert 0.0 < result["max_prob_diff"] < 1.0
        assert result["failures"] == [] or result["max_prob_diff"] > 2e-2
    assert results["fp8 e4m3"]["max_prob_diff"] > results["fp16 (control)"]["max_prob_diff"]
    with pytest.raises(SystemExit):
        study.main(["--p-scale", "1000"])
