"""tabserve::norm_linear: a pre-LN block's LayerNorm and input projection in one pass.

References as for feed_forward (test_feed_forward.py, whose agreement measure this file uses):
the block's modules under torch.autocast bit for bit for the composite; the composite for the
Triton kernel (>= 90% of outputs bit for bit, the rest within 2 fp16 roundings of the row's
scale), run under Triton's interpreter here (fp16) and on CUDA (fp16, bf16).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tabicl_helpers import interpreter_child, our_model
from tabserve import ops
from tabserve.kernels import norm_linear as nl
from tabserve.models.tabicl.layers import AttentionBlock
from tabserve.models.tabicl.recipes import RECIPES, recipe_from_cell, set_fused_norm_linear
from test_feed_forward import agreement, assert_model_outputs_agree, block, fused_and_plain

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

#: (leading shape, dim, out features, x dtype, norm bias): the row stage's packed q / k / v
#: (384), the column stage's k / v (256) and q (128) widths, ragged tiles, every kernel width.
KERNEL_CASES = [
    ((3, 100), 128, 384, torch.float32, True),
    ((77,), 32, 64, torch.float16, False),
    ((2, 5, 13), 16, 128, torch.float32, True),
    ((64,), 64, 256, torch.float32, False),
    ((1,), 128, 128, torch.float16, True),
]


def make_inputs(leading, dim, out_features, x_dtype, norm_bias, device="cpu", seed=0):
    """[x, norm_weight, norm_bias, weight, bias]: the operator's tensor arguments."""
    g = torch.Generator().manual_seed(seed)
    args = [
        (2 * torch.randn(*leading, dim, generator=g)).to(x_dtype),
        1 + 0.1 * torch.randn(dim, generator=g),
        0.1 * torch.randn(dim, generator=g) if norm_bias else None,
        torch.randn(out_features, dim, generator=g) / dim**0.5,
        0.1 * torch.randn(out_features, generator=g),
    ]
    return [None if a is None else a.to(device) for a in args]


def projection_agreement(got, want):
    """test_feed_forward's agreement measure for a projection (no residual: its stream is 0)."""
    return agreement(got, want, torch.zeros_like(want, dtype=torch.float64))


@pytest.mark.parametrize("ln_bias", [True, False])
def test_cpu_operator_is_the_modules_under_autocast_bit_for_bit(ln_bias):
    b = block(ln_bias=ln_bias)
    n, w, bias = b.norm1, b.attn.in_proj_weight, b.attn.in_proj_bias
    x = torch.randn(3, 50, 128)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.linear(n(x), w, bias)
        got = ops.norm_linear(x, n.weight, n.bias, w, bias, n.eps, torch.bfloat16)
        assert got.dtype == want.dtype == torch.bfloat16
        assert torch.equal(got, want)
        fp32 = ops.norm_linear(x, n.weight, n.bias, w, bias, n.eps, torch.float32)
        assert torch.equal(fp32, F.linear(n(x), w, bias))


@requires_triton
def test_kernel_under_the_interpreter_agrees_with_the_composite():
    """The Triton program on CPU tensors (``TRITON_INTERPRET=1``, set before Triton compiles it:
    a child process) for every case; the checks run here."""
    results = interpreter_child("import test_norm_linear as t; t.interpreter_cases()")
    assert len(results) == len(KERNEL_CASES)
    for case, (equal, worst, dtype, shape) in zip(KERNEL_CASES, results):
        leading, _, out_features, _, _ = case
        assert shape == [*leading, out_features] and dtype == str(torch.float16)
        assert equal >= 0.9, f"{case}: only {equal:.3f} equal"
        assert worst <= 2.0, f"{case}: {worst:.2f} roundings off"


def interpreter_cases() -> None:
    """The child's side of the interpreter test: one JSON line of agreement per case."""
    out = []
    for case in KERNEL_CASES:
        args = make_inputs(*case)
        got = nl.run_kernel(*args, 1e-5, torch.float16)
        want = nl.norm_linear_composite(*args, 1e-5, torch.float16)
        out.append([*projection_agreement(got, want), str(got.dtype), list(got.shape)])
    print(json.dumps(out))


def test_block_takes_the_operator_in_one_compiled_graph(monkeypatch):
    """The block's fused projections under torch.compile(fullgraph=True), forced on CPU (where
    the operator runs its composite): every projection goes through it (self-attention with
    RoPE, as the row stage; cross-attention over raw key tokens, as the column stage) and the
    block equals its modules bit for bit."""
    from tabserve.models.tabicl import layers

    calls = []

    def op(*args):
        calls.append(tuple(args[3].shape))
        return nl.norm_linear_op(*args)

    shim = SimpleNamespace(kernel_applies=lambda *a: True, norm_linear_op=op)
    monkeypatch.setattr(layers, "fused_norm_linear", shim)
    b = block(dim=32, hidden=64)
    rope = layers.RotaryEmbedding(4, 1e5)
    x, kv = torch.randn(2, 9, 32), torch.randn(2, 12, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want_self, want_cross = b(x, rope=rope), b(x, kv)
        b.fused_norm_linear = True
        torch._dynamo.reset()
        got_self = torch.compile(lambda x: b(x, rope=rope), fullgraph=True, backend="aot_eager")(x)
        got_cross = torch.compile(b, fullgraph=True, backend="aot_eager")(x, kv)
    assert (96, 32) in calls and (64, 32) in calls and (32, 32) in calls  # packed, k / v, q
    assert torch.equal(got_self, want_self) and torch.equal(got_cross, want_cross)


def test_opcheck():
    args = make_inputs((5, 7), 16, 64, torch.float32, True)
    torch.library.opcheck(torch.ops.tabserve.norm_linear.default, (*args, 1e-5, torch.bfloat16))
    args = make_inputs((9,), 16, 64, torch.bfloat16, False)
    torch.library.opcheck(torch.ops.tabserve.norm_linear.default, (*args, 0.0, torch.bfloat16))


def test_recipes_and_served_models_carry_the_flag():
    from tabserve.models.tabicl.serving import ServedTabICL

    with pytest.raises(ValueError, match="fused_norm_linear runs under bf16 / fp16 autocast only"):
        RECIPES["fp32-eager"].replace(fused_norm_linear=True)
    assert recipe_from_cell({"precision": "fp16", "fused_norm_linear": True}).fused_norm_linear
    model = copy.deepcopy(our_model("clf", "tiny"))  # our_model is cached; serving mutates it
    blocks = [m for m in model.modules() if isinstance(m, AttentionBlock)]
    recipe = RECIPES["fp16-buckets-compile-cudagraphs-head16-row-fused"]
    ServedTabICL(model, recipe.replace(cuda_graphs=False, compile="none"))
    assert blocks and all(b.fused_norm_linear and b.fused_feed_forward for b in blocks)
    ServedTabICL(model, RECIPES["fp16-eager"])
    assert not any(b.fused_norm_linear for b in blocks)


# ---------------------------------------------------------------------------------------------
# CUDA


@requires_cuda
@requires_triton
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[1]}-{c[2]}-{c[3]}")
def test_cuda_kernel_agrees_with_the_composite(case, compute):
    args = make_inputs(*case, device="cuda")
    assert nl.kernel_applies(args[0], args[3], compute)
    got = torch.ops.tabserve.norm_linear(*args, 1e-5, compute)
    want = nl.norm_linear_composite(*args, 1e-5, compute)
    equal, worst = projection_agreement(got, want)
    bound = 16.0 if compute == torch.bfloat16 else 2.0  # bf16 rounds 8x coarser
    assert equal >= 0.9 and worst <= bound, (equal, worst)


@requires_cuda
@requires_triton
def test_cuda_compiled_and_captured_equal_eager():
    b = block().cuda()
    b.fused_norm_linear = True
    attn, norm = b.attn, b.norm1
    x = torch.randn(4, 70, 128, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        # The fused projection alone: the same kernel compiled or not, bit for bit.
        args = (attn.in_proj_weight, attn.in_proj_bias, norm)
        eager = attn._project(x, *args)
        torch._dynamo.reset()
        compiled = torch.compile(attn._project, fullgraph=True)(x, *args)
        # The whole block: Inductor fuses the rest of it (LayerNorm 2, GELU, residuals) its own
        # way, so compiled equals eager within fp16 roundings, not bit for bit.
        block_eager = b(x)
        torch._dynamo.reset()
        block_compiled = torch.compile(b, fullgraph=True)(x)
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        b(static_x)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            static_out = b(static_x)
        static_x.copy_(2 * x)
        graph.replay()
        again = b(2 * x)
    assert torch.equal(compiled, eager)
    equal, worst = agreement(block_compiled, block_eager, x)
    assert worst <= 8.0, (equal, worst)  # a wrong norm or weight is thousands of roundings off
    assert torch.equal(static_out, again)


@requires_cuda
@requires_triton
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_model_with_both_fused_operators_matches_the_modules_in_fp16(task):
    from tabserve.models.tabicl.recipes import set_fused_feed_forward

    def both(model, on):
        set_fused_norm_linear(model, on)
        set_fused_feed_forward(model, on)

    fused, plain = fused_and_plain(task, both, nl)
    assert_model_outputs_agree(task, fused, plain)
