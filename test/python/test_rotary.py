"""rotary_embedding (csrc/ops/rotary.cpp, csrc/ops/cuda/rotary.cu): bit for bit the ATen composite
it replaces, close to float64 maths, on seeded strided views of every float dtype; its checks,
opcheck, torch.compile, and the model's RoPE on it. CPU, and CUDA when present."""

import math

import pytest
import tabserve  # noqa: F401  (registers torch.ops.tabserve)
import torch
from cuda_helpers import requires_cuda
from tabicl_helpers import device_params
from tabserve import ops
from tabserve.models.tabicl.network import layers
from tabserve.models.tabicl.network.layers import RotaryEmbedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def tables(length, dim, device, dtype=torch.float32, base=100000.0):
    """cos / sin [L, D] as RotaryEmbedding builds them (angles = position x frequency)."""
    exponents = torch.arange(0, dim, 2)[: dim // 2].double() / dim
    freqs = (1.0 / base**exponents).to(dtype).to(device)
    angles = torch.arange(length, device=device, dtype=dtype)[:, None] * freqs[None, :]
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def composite(x, cos, sin):
    """The ATen ops the operator replaces (layers.RotaryEmbedding before it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def exact(x, cos, sin):
    """float64 maths on the same inputs."""
    x64, c, s = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], dim=-1)
    return x64 * c + rotated * s


def head_split(seed, tokens, length, heads, head_dim, dtype, device):
    """Queries as the row stage makes them: a strided view into a packed projection."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(tokens, length, 3 * heads * head_dim, generator=g) * 3
    packed = packed.to(dtype).to(device)
    q = packed[..., : heads * head_dim]
    return q.unflatten(-1, (heads, head_dim)).transpose(-3, -2)  # (tokens, heads, L, D)


SHAPES = [  # (tokens, L, heads, D)
    (5, 13, 8, 16),
    (1, 1, 1, 2),
    (3, 68, 4, 32),
    (64, 12, 8, 16),
    (2, 7, 2, 64),
]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_composite_bit_for_bit_on_strided_views(device, dtype):
    for seed, (tokens, length, heads, dim) in enumerate(SHAPES):
        x = head_split(seed, tokens, length, heads, dim, dtype, device)
        assert x.is_contiguous() == (heads == 1 or length == 1)
        cos, sin = tables(length, dim, device)
        got = ops.rotary_embedding(x, cos, sin)
        want = composite(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, want), (seed, (got.double() - want.double()).abs().max())
        # And close to float64 maths: one rounding of the float32 result to x's dtype, plus
        # float32 products and sum (float64 inputs stay float64 only with float64 tables).
        eps = torch.finfo(dtype).eps if dtype != torch.float64 else torch.finfo(torch.float32).eps
        scale = x.double().abs().amax().item() + 1e-30
        assert (got.double() - exact(x, cos, sin)).abs().max().item() <= 2 * eps * scale


@pytest.mark.parametrize("device", device_params())
def test_any_rank_and_float64_tables(device):
    g = torch.Generator().manual_seed(7)
    for shape in [(9, 4), (3, 9, 4), (2, 3, 9, 4), (2, 2, 3, 9, 4), (1, 2, 1, 3, 9, 4)]:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
        cos, sin = tables(9, 4, device, dtype=torch.float64)
        got = ops.rotary_embedding(x, cos, sin)
        assert got.shape == x.shape and torch.equal(got, composite(x, cos, sin))
    # float16 x with float64 tables: evaluated in float64, as promotion says.
    x = torch.randn(4, 9, 4, generator=g).half().to(device)
    cos, sin = tables(9, 4, device, dtype=torch.float64)
    assert torch.equal(ops.rotary_embedding(x, cos, sin), composite(x, cos, sin))
    # A last axis that is not contiguous is copied first, same result.
    x = torch.randn(3, 9, 8, generator=g).to(device)[..., ::2]
    cos, sin = tables(9, 4, device)
    assert torch.equal(ops.rotary_embedding(x, cos, sin), composite(x, cos, sin))
    # Empty inputs.
    empty = torch.empty(0, 9, 4, device=device)
    assert ops.rotary_embedding(empty, cos, sin).shape == (0, 9, 4)


def test_rotation_is_a_rotation():
    # Independent of the composite: per pair (d, d + D/2) the op rotates by position x frequency.
    length, dim = 6, 8
    x = torch.randn(2, length, dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cos, sin = tables(length, dim, "cpu", dtype=torch.float64)
    out = ops.rotary_embedding(x, cos, sin)
    half = dim // 2
    for l in range(length):
        for d in range(half):
            angle = l * (1.0 / 100000.0 ** (2 * d / dim))
            a, b = x[:, l, d], x[:, l, d + half]
            expected_a = a * math.cos(angle) - b * math.sin(angle)
            expected_b = b * math.cos(angle) + a * math.sin(angle)
            assert torch.allclose(out[:, l, d], expected_a, atol=1e-12)
            assert torch.allclose(out[:, l, d + half], expected_b, atol=1e-12)
    # Norms of each pair are kept.
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-12)


@pytest.mark.parametrize("device", device_params())
def test_opcheck(device):
    x = head_split(0, 3, 5, 2, 8, torch.float32, device)
    cos, sin = tables(5, 8, device)
    torch.library.opcheck(torch.ops.tabserve.rotary_embedding.default, (x, cos, sin))
    half = head_split(1, 3, 5, 2, 8, torch.float16, device)
    torch.library.opcheck(torch.ops.tabserve.rotary_embedding.default, (half, cos, sin))


def test_compiles_in_one_graph():
    torch._dynamo.reset()
    x = head_split(0, 4, 6, 2, 8, torch.float32, "cpu")
    cos, sin = tables(6, 8, "cpu")
    fn = torch.compile(ops.rotary_embedding, fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x, cos, sin), composite(x, cos, sin))


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda x, c, s: (x.long(), c, s), "x must be a floating-point tensor"),
        (lambda x, c, s: (x[0, 0, 0], c, s), "x must have at least 2 dimensions"),
        (lambda x, c, s: (x[..., :7], c[:, :7], s[:, :7]), "must be even"),
        (lambda x, c, s: (x, c[:-1], s), "cos must be [L, D]"),
        (lambda x, c, s: (x, c, s[:, :4]), "sin must be [L, D]"),
        (lambda x, c, s: (x, c.half(), s.half()), "cos must be float32 or float64"),
        (lambda x, c, s: (x, c, s.double()), "cos and sin must have the same dtype"),
    ],
)
def test_bad_arguments_are_named(args, message):
    x = head_split(0, 2, 5, 2, 8, torch.float32, "cpu")
    cos, sin = tables(5, 8, "cpu")
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ops.rotary_embedding(*args(x, cos, sin))
    # Still usable afterwards.
    assert torch.equal(ops.rotary_embedding(x, cos, sin), composite(x, cos, sin))


@pytest.mark.parametrize("device", device_params())
def test_model_rope_uses_the_operator_where_enabled_with_the_same_bits(device, monkeypatch):
    rope = RotaryEmbedding(16, 100000.0).to(device)
    x = head_split(5, 6, 11, 8, 16, torch.float16, device)
    calls = []
    real = ops.rotary_embedding
    monkeypatch.setattr(ops, "rotary_embedding", lambda *a: calls.append(1) or real(*a))
    layers._rotary_op.cache_clear()
    try:
        monkeypatch.setattr(layers, "ROTARY_OP_DEVICES", frozenset({device}))
        fused = rope(x)
        monkeypatch.setattr(layers, "ROTARY_OP_DEVICES", frozenset())
        plain = rope(x)
    finally:
        layers._rotary_op.cache_clear()
    assert calls == [1]
    assert torch.equal(fused, plain)


@pytest.mark.cuda
@requires_cuda
def test_cuda_large_grid_stride_and_cpu_agreement():
    # More elements than one launch's 65,536 x 256 threads: the grid-stride loop covers them.
    x = head_split(9, 20_000, 68, 8, 16, torch.float16, "cuda")
    cos, sin = tables(68, 16, "cuda")
    got = ops.rotary_embedding(x, cos, sin)
    assert torch.equal(got, composite(x, cos, sin))
    cpu = ops.rotary_embedding(x[:50].cpu(), cos.cpu(), sin.cpu())
    assert torch.equal(got[:50].cpu(), cpu)


def test_benchmark_quick_run_checks_bits_and_writes_json(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import rotary as benchmark

    out = tmp_path / "rotary.json"
    assert (
        benchmark.main(["--quick", "--device", "cpu", "--budget", "0.02", "--json", str(out)]) == 0
    )
    import json

    records = json.loads(out.read_text())["records"]
    assert {r["method"] for r in records} == {"composite", "tabserve op"}
    assert all(r["bitwise"] and r["median_ms"] > 0 for r in records)
