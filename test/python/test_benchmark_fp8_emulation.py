"""The fp8 attention study (benchmarks/fp8_attention_emulation.py): its roundings (the
flash_attention operator's composite, tested against fp64 maths in test_flash_attention.py), the
routing of the ICL stage's calls only, and a run on the tiny model."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tabicl")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_attention_emulation as study
from tabserve.kernels.flash_attention import flash_attention_composite
from tabserve.models.tabicl import layers


def _qkv(seed, queries=600, keys=300, head_dim=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, head_dim, generator=g) for n in (queries, keys, keys)]


def test_the_emulation_is_the_operators_composite_and_the_control_rounds_to_fp16():
    q, k, v = _qkv(1)
    fp8 = study.emulated_attention(q, k, v, fp8=True)
    assert torch.equal(fp8, flash_attention_composite(q, k, v, fp8=True))
    control = study.emulated_attention(q, k, v, fp8=False)
    assert control.dtype == torch.float32
    assert torch.equal(control, flash_attention_composite(q.half(), k.half(), v.half()).float())
    assert not torch.equal(control, flash_attention_composite(q, k, v))  # it did round


def test_only_calls_of_the_icl_head_dimension_are_replaced():
    attend = study.icl_attention_replaced(True, head_dim=64)
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
