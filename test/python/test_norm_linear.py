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
from cuda_helpers import requires_cuda
from tabicl_helpers import interpreter_child, our_model
from tabserve import ops
from tabserve.kernels import norm_linear as nl
from tabserve.models.tabicl.network.layers import AttentionBlock
from tabserve.models.tabicl.network.stage_kernels import StageKernels, use_stage_kernels
from tabserve.models.tabicl.serving.options import PRESETS, ServingOptions
from test_feed_forward import agreement, assert_model_outputs_agree, block, fused_and_plain

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


#: (leading shape with L last, dim, out features, rotated features, head_dim, x dtype): the row
#: stage's packed projection (queries and keys of 68 tokens rotated), its CLS queries (4
#: tokens) and keys / values, another head_dim, ragged tiles.
ROPE_CASES = [
    ((3, 68), 128, 384, 256, 16, torch.float32),
    ((2, 5, 4), 128, 128, 128, 16, torch.float16),
    ((2, 68), 128, 256, 128, 16, torch.float32),
    ((7, 9), 16, 128, 64, 8, torch.float16),
]


def rope_tables(length, head_dim, extra=3, device="cpu"):
    """RotaryEmbedding's (cos, sin) for ``length + extra`` positions (the operator reads the
    first L), positions generated in fp16 as the row stage generates them."""
    from tabserve.models.tabicl.network.layers import RotaryEmbedding

    return RotaryEmbedding(head_dim, 1e5).to(device).tables(length + extra, device, torch.float16)


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


#: Views of x the kernel reads in place or copies: (full shape, view of it, reads in place).
STRIDED_VIEWS = [
    ((2, 3, 50, 32), lambda t: t[..., :37, :], True),  # the inducing points' train rows
    ((2, 5, 12, 32), lambda t: t[..., :4, :], True),  # the row stage's CLS tokens
    ((4, 1, 9, 32), lambda t: t[1:3], True),  # a leading slice, a size-1 dimension
    ((3, 9, 32), lambda t: t.transpose(0, 1), False),  # rows not contiguous along L
    ((3, 6, 9, 32), lambda t: t[:, ::2], True),  # every other slab: one stride still
    ((3, 6, 9, 32), lambda t: t[:, :4], False),  # leading dimensions that do not collapse
]


@pytest.mark.parametrize("shape, view, in_place", STRIDED_VIEWS, ids=range(len(STRIDED_VIEWS)))
def test_strided_rows_reads_slices_in_place_and_copies_the_rest(shape, view, in_place):
    """``strided_rows``: x itself (no copy) with the stride between its slabs of rows where the
    kernel's addressing (slab * stride + row * width) reaches every token, else a contiguous
    copy; either way that addressing gives x's tokens in order."""
    x = view(torch.randn(shape))
    got, stride = nl.strided_rows(x)
    assert (got.data_ptr() == x.data_ptr() and got.stride() == x.stride()) == in_place
    length, dim = x.shape[-2:]
    rows = torch.arange(x.numel() // dim)
    starts = (rows // length) * stride + (rows % length) * dim
    flat = got.as_strided((got.untyped_storage().nbytes() // 4,), (1,), 0)
    offset = got.storage_offset()
    gathered = flat[offset + starts[:, None] + torch.arange(dim)[None, :]]
    assert torch.equal(gathered, x.reshape(-1, dim))


@requires_triton
def test_kernel_reads_strided_views_under_the_interpreter():
    """The Triton program on the views above (with RoPE on the CLS tokens' view): bit for bit
    the kernel on a contiguous copy."""
    results = interpreter_child("import test_norm_linear as t; t.interpreter_strided_cases()")
    assert results == [True] * len(STRIDED_VIEWS)


def interpreter_strided_cases() -> None:
    out = []
    for shape, view, _ in STRIDED_VIEWS:
        full, *params = make_inputs(shape[:-1], shape[-1], 128, torch.float16, True)
        x = view(full)
        rope = (*rope_tables(x.shape[-2], 16), 64) if x.shape[-2] == 4 else ()
        got = nl.run_kernel(x, *params, 1e-5, torch.float16, *rope)
        want = nl.run_kernel(x.contiguous(), *params, 1e-5, torch.float16, *rope)
        out.append(bool(torch.equal(got, want)))
    print(json.dumps(out))


@requires_triton
@pytest.mark.parametrize("rotation", nl.ROTATIONS)
def test_kernel_with_rope_under_the_interpreter_agrees_with_the_composite(rotation):
    """RoPE in the projection's epilogue (both ways of pairing the halves), under Triton's
    interpreter: agreement with the composite (the rounded projection, then ATen's rotation) as
    for the plain projection; the rotation is really applied (most outputs differ from the
    unrotated projection)."""
    results = interpreter_child(
        f"import test_norm_linear as t; t.interpreter_rope_cases({rotation!r})"
    )
    assert len(results) == len(ROPE_CASES)
    for case, (equal, worst, shape, changed) in zip(ROPE_CASES, results):
        leading, _, out_features, rotary, _, _ = case
        assert shape == [*leading, out_features]
        assert equal >= 0.9, f"{case}: only {equal:.3f} equal"
        assert worst <= 2.0, f"{case}: {worst:.2f} roundings off"
        assert changed >= 0.3 * rotary / out_features, f"{case}: RoPE left {changed:.3f} changed"


def interpreter_rope_cases(rotation: str) -> None:
    """The child's side of the RoPE interpreter test: one JSON line per case."""
    out = []
    for leading, dim, out_features, rotary, head_dim, x_dtype in ROPE_CASES:
        args = make_inputs(leading, dim, out_features, x_dtype, True)
        rope = (*rope_tables(leading[-1], head_dim), rotary)
        with nl.rotation_override(rotation):
            got = nl.run_kernel(*args, 1e-5, torch.float16, *rope)
        want = nl.norm_linear_composite(*args, 1e-5, torch.float16, *rope)
        unrotated = nl.norm_linear_composite(*args, 1e-5, torch.float16)
        changed = (want != unrotated).double().mean().item()
        out.append([*projection_agreement(got, want), list(got.shape), changed])
    print(json.dumps(out))


@pytest.mark.parametrize("case", ROPE_CASES[:3], ids=lambda c: f"{c[0]}-{c[3]}")
def test_cpu_operator_with_rope_is_the_projection_then_the_row_stage_rope(case):
    """The composite with RoPE, bit for bit: the projection without it (the modules under
    autocast, test above), head split, then the row stage's own ATen rotation
    (``layers.rotate_half``) at positions 0..L-1; the features past ``rotary_features``
    untouched."""
    from tabserve.models.tabicl.network.layers import rotate_half

    leading, dim, out_features, rotary, head_dim, x_dtype = case
    x, nw, nb, w, b = make_inputs(leading, dim, out_features, x_dtype, True)
    cos, sin = rope_tables(leading[-1], head_dim)
    got = ops.norm_linear(x, nw, nb, w, b, 1e-5, torch.bfloat16, (cos, sin), rotary)
    plain = ops.norm_linear(x, nw, nb, w, b, 1e-5, torch.bfloat16)
    length = leading[-1]
    heads = plain[..., :rotary].unflatten(-1, (rotary // head_dim, head_dim)).transpose(-3, -2)
    want = rotate_half(heads, cos[:length], sin[:length]).transpose(-3, -2).flatten(-2)
    assert got.dtype == torch.bfloat16 and got.shape == plain.shape
    assert torch.equal(got[..., :rotary], want)
    assert torch.equal(got[..., rotary:], plain[..., rotary:])


#: Bad RoPE arguments: (what changes in the good call's (x, cos, sin, rotary), the message).
_BAD_ROPE = [
    (lambda x, c, s, r: (x, c, None, r), "rotary_cos and rotary_sin come together"),
    (lambda x, c, s, r: (x, None, None, r), "rotary_features=64 needs rotary_cos and rotary_sin"),
    (lambda x, c, s, r: (x, c[:5], s[:5], r), r"rotary_cos must be \[L >= 6, head_dim\]"),
    (lambda x, c, s, r: (x, c, s[:, :15], r), "rotary_sin must be .* with an even head_dim"),
    (lambda x, c, s, r: (x, c[:, 0], s, r), r"rotary_cos must be \[L >= 6"),
    (lambda x, c, s, r: (x, c.long(), s.long(), r), "rotary_cos must be floating point"),
    (lambda x, c, s, r: (x, c, torch.cat([s, s]), r), "rotary_sin must have rotary_cos's shape"),
    (
        lambda x, c, s, r: (x, c, s, 0),
        r"rotary_features must be a multiple of .* 16 in \[16, 128\]",
    ),
    (lambda x, c, s, r: (x, c, s, 24), "rotary_features must be a multiple"),
    (lambda x, c, s, r: (x, c, s, 144), "rotary_features must be a multiple"),
    (lambda x, c, s, r: (x[0, 0], c, s, r), r"RoPE needs x of \(..., L, dim\)"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake kernel's checks
@pytest.mark.parametrize("bad, match", _BAD_ROPE, ids=range(len(_BAD_ROPE)))
def test_rope_arguments_are_checked_by_name(bad, match, device):
    x, nw, nb, w, b = (t.to(device) for t in make_inputs((2, 6), 32, 128, torch.float32, True))
    cos, sin = (t.to(device) for t in rope_tables(6, 16))
    x, cos, sin, rotary = bad(x, cos, sin, 64)
    with pytest.raises(ValueError, match=match):
        nl.norm_linear_op(x, nw, nb, w, b, 1e-5, torch.float16, cos, sin, rotary)


def test_rotation_override_takes_known_rotations_only():
    with pytest.raises(ValueError, match="rotation must be one of"), nl.rotation_override("x"):
        pass
    with nl.rotation_override("dot"):
        assert nl.ROTATION == "dot"
    assert nl.ROTATION == "split"


def test_kernel_takes_rope_only_in_its_shapes():
    """Shapes the kernel's epilogue cannot rotate fall back to the composite (on CUDA): fp64
    tables, a head_dim wider than a rotated step, rotated features ending inside an output
    step (checked on meta tensors: the rule reads shapes and dtypes only)."""
    x = torch.empty(4, 68, 128, device="meta")
    w = torch.empty(384, 128, device="meta")
    cos = torch.empty(68, 16, device="meta")
    takes = lambda x, c, r: nl.kernel_applies(x, w, torch.float16, c, r)
    assert not takes(x, cos, 256)  # meta is not CUDA: the common rule refuses first
    cuda_like = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32, shape=x.shape)
    assert takes(cuda_like, cos, 256) == (nl.triton is not None)
    assert not takes(cuda_like, cos.double(), 256)
    assert not takes(cuda_like, torch.empty(68, 64, device="meta"), 256)
    assert not takes(cuda_like, cos, 96)


def test_block_takes_the_operator_in_one_compiled_graph(monkeypatch):
    """The block's fused projections under torch.compile(fullgraph=True), forced on CPU (where
    the operator runs its composite): every projection goes through it (self-attention with
    RoPE, as the row stage; cross-attention over raw key tokens, as the column stage) and the
    block equals its modules bit for bit."""
    from tabserve.models.tabicl.network import layers

    calls = []

    def op(*args):
        calls.append(tuple(args[3].shape))
        return nl.norm_linear_op(*args)

    shim = SimpleNamespace(kernel_applies=lambda *a: True, norm_linear_op=op)
    monkeypatch.setattr(layers, "_norm_linear_kernels", lambda: shim)
    b = block(dim=32, hidden=64)
    rope = layers.RotaryEmbedding(4, 1e5)
    x, kv = torch.randn(2, 9, 32), torch.randn(2, 12, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want_self, want_cross = b(x, rope=rope), b(x, kv)
        use_stage_kernels(b, StageKernels(fused_norm_linear=True))
        torch._dynamo.reset()
        got_self = torch.compile(lambda x: b(x, rope=rope), fullgraph=True, backend="aot_eager")(x)
        got_cross = torch.compile(b, fullgraph=True, backend="aot_eager")(x, kv)
    assert (96, 32) in calls and (64, 32) in calls and (32, 32) in calls  # packed, k / v, q
    assert torch.equal(got_self, want_self) and torch.equal(got_cross, want_cross)


def test_block_rotates_inside_the_projection_in_one_compiled_graph(monkeypatch):
    """``rope_in_projection``: the row stage's blocks (self-attention with RoPE; the CLS block's
    queries over every token) hand the RoPE tables to the fused projection, rotating the packed
    queries and keys (2 x dim), the CLS queries (dim) and the keys of the key / value
    projection (dim); nothing else rotates them (the block's output equals the modules' bit for
    bit, eager and under torch.compile(fullgraph=True), forced on CPU as above)."""
    from tabserve.models.tabicl.network import layers

    calls = []

    def op(*args):
        calls.append((tuple(args[3].shape), args[9] if len(args) > 9 else 0))
        return nl.norm_linear_op(*args)

    shim = SimpleNamespace(kernel_applies=lambda *a: True, norm_linear_op=op)
    monkeypatch.setattr(layers, "_norm_linear_kernels", lambda: shim)
    b = block(dim=32, hidden=64)
    rope = layers.RotaryEmbedding(4, 1e5)
    tokens = torch.randn(2, 3, 9, 32)
    self_attention = lambda t: b(t, rope=rope)
    cls_block = lambda t: b(t[..., :2, :], t, rope=rope)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want_self, want_cls = self_attention(tokens), cls_block(tokens)
        use_stage_kernels(b, StageKernels(fused_norm_linear=True, rope_in_projection=True))
        # Nothing after the projections rotates: neither a RoPE pass nor the attention kernel.
        monkeypatch.setattr(layers.RotaryEmbedding, "forward", lambda *a: pytest.fail("RoPE"))
        monkeypatch.setattr(layers.Attention, "_rope_in_kernel", lambda *a: pytest.fail("RoPE"))
        got_self, got_cls = self_attention(tokens), cls_block(tokens)
        assert sorted(set(calls)) == [((32, 32), 32), ((64, 32), 32), ((96, 32), 64)]
        torch._dynamo.reset()
        compiled = [
            torch.compile(f, fullgraph=True, backend="aot_eager")(tokens)
            for f in (self_attention, cls_block)
        ]
    for got in (got_self, compiled[0]):
        assert torch.equal(got, want_self)
    for got in (got_cls, compiled[1]):
        assert torch.equal(got, want_cls)


def test_opcheck():
    args = make_inputs((5, 7), 16, 64, torch.float32, True)
    torch.library.opcheck(torch.ops.tabserve.norm_linear.default, (*args, 1e-5, torch.bfloat16))
    args = make_inputs((9,), 16, 64, torch.bfloat16, False)
    torch.library.opcheck(torch.ops.tabserve.norm_linear.default, (*args, 0.0, torch.bfloat16))
    args = make_inputs((3, 7), 16, 128, torch.float32, True)
    rope = (*rope_tables(7, 8), 64)
    torch.library.opcheck(
        torch.ops.tabserve.norm_linear.default, (*args, 1e-5, torch.bfloat16, *rope)
    )


def test_options_and_served_models_carry_the_flag():
    from tabserve.bench.cells import cell_from_entry
    from tabserve.models.tabicl.serving.served import ServedTabICL

    with pytest.raises(ValueError, match="fused_norm_linear runs under bf16 / fp16 autocast only"):
        ServingOptions().replace(fused_norm_linear=True)
    assert ServingOptions.from_dict({"precision": "fp16", "fused_norm_linear": True}).fused_norm_linear
    with pytest.raises(ValueError, match="rope_in_projection .* needs fused_norm_linear"):
        ServingOptions(precision="fp16").replace(rope_in_projection=True)
    with pytest.raises(ValueError, match="x: .*rope_in_projection .* needs fused_norm_linear"):
        cell_from_entry({"name": "x", "preset": "small", "changes": {"fused_norm_linear": False,
                                                                      "rope_in_projection": True}})
    fields = {"precision": "fp16", "fused_norm_linear": True, "rope_in_projection": True}
    assert ServingOptions.from_dict(fields).rope_in_projection
    model = copy.deepcopy(our_model("clf", "tiny"))  # our_model is cached; serving mutates it
    blocks = [m for m in model.modules() if isinstance(m, AttentionBlock)]
    small = PRESETS["small"].options
    ServedTabICL(model, small.replace(cuda_graphs=False, compile="none", freeze=False))
    assert blocks and all(b.fused_norm_linear and b.fused_feed_forward for b in blocks)
    assert not any(b.attn.rope_in_projection for b in blocks)
    large = PRESETS["large"].options
    ServedTabICL(model, large.replace(compile="none", freeze=False, kv_graphs=False))
    assert all(b.fused_norm_linear and b.attn.rope_in_projection for b in blocks)
    ServedTabICL(model, ServingOptions(precision="fp16"))
    assert not any(b.fused_norm_linear or b.attn.rope_in_projection for b in blocks)


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
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"{c[0]}-{c[3]}")
def test_cuda_kernel_with_rope_agrees_with_the_composite(case, compute):
    leading, dim, out_features, rotary, head_dim, x_dtype = case
    args = make_inputs(leading, dim, out_features, x_dtype, True, device="cuda")
    cos, sin = rope_tables(leading[-1], head_dim, device="cuda")
    assert nl.kernel_applies(args[0], args[3], compute, cos, rotary)
    got = torch.ops.tabserve.norm_linear(*args, 1e-5, compute, cos, sin, rotary)
    want = nl.norm_linear_composite(*args, 1e-5, compute, cos, sin, rotary)
    equal, worst = projection_agreement(got, want)
    bound = 16.0 if compute == torch.bfloat16 else 2.0
    assert equal >= 0.9 and worst <= bound, (equal, worst)
    unrotated = torch.ops.tabserve.norm_linear(*args, 1e-5, compute)
    assert torch.equal(got[..., rotary:], unrotated[..., rotary:])
    for rotation in (r for r in nl.ROTATIONS if r != nl.ROTATION):  # the other pairings
        with nl.rotation_override(rotation):
            other = torch.ops.tabserve.norm_linear(*args, 1e-5, compute, cos, sin, rotary)
        equal, worst = projection_agreement(other, want)
        assert equal >= 0.9 and worst <= bound, (rotation, equal, worst)


@requires_cuda
@requires_triton
@pytest.mark.parametrize("shape, view, in_place", STRIDED_VIEWS, ids=range(len(STRIDED_VIEWS)))
def test_cuda_kernel_reads_strided_views_as_their_copies(shape, view, in_place):
    """On CUDA, eager and compiled: the operator on the views above (RoPE on the CLS tokens'
    view) equals it on contiguous copies bit for bit."""
    full, *params = make_inputs(shape[:-1], shape[-1], 128, torch.float16, True, device="cuda")
    x = view(full)
    rope = (*rope_tables(x.shape[-2], 16, device="cuda"), 64) if x.shape[-2] == 4 else ()
    want = nl.norm_linear_op(x.contiguous(), *params, 1e-5, torch.float16, *rope)
    assert torch.equal(nl.norm_linear_op(x, *params, 1e-5, torch.float16, *rope), want)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: nl.norm_linear_op(view(t), *params, 1e-5, torch.float16, *rope), fullgraph=True
    )
    assert torch.equal(compiled(full), want)


@requires_cuda
@requires_triton
def test_cuda_compiled_and_captured_equal_eager():
    b = block().cuda()
    use_stage_kernels(b, StageKernels(fused_norm_linear=True))
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
    def both(model, on):
        use_stage_kernels(model, StageKernels(fused_ffn=on, fused_norm_linear=on))

    fused, plain = fused_and_plain(task, both, nl)
    assert_model_outputs_agree(task, fused, plain)


@requires_cuda
@requires_triton
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_model_with_rope_in_the_projection_matches_the_modules_in_fp16(task):
    """The fused projections rotating the row stage's queries and keys, the
    head-dim-16 kernel (which then rotates nothing) and the fused feed-forward, against the
    modules in fp16."""

    def route(model, on):
        kernels = StageKernels(fused_ffn=on, fused_norm_linear=on, rope_in_projection=on)
        use_stage_kernels(model, kernels)
        row = StageKernels(
            attention="head16" if on else "math",
            fused_ffn=on,
            fused_norm_linear=on,
            rope_in_projection=on,
        )
        use_stage_kernels(model.row_interactor, row)

    fused, plain = fused_and_plain(task, route, nl)
    assert_model_outputs_agree(task, fused, plain)


@pytest.mark.parametrize("task", ["clf", "reg"])
def test_model_rotating_in_projections_and_folding_out_projections_changes_nothing(
    task, monkeypatch
):
    """The whole model with the fused operators forced on CPU (their composites, as above):
    adding ``rope_in_projection`` and ``fused_out_projection`` moves RoPE and the
    out-projections into those operators, and ``fused_row_tokens`` has the column stage's
    last feed-forward write the row stage's tokens, without changing a bit, unpadded, through
    padded serving and through the KV cache (bf16 autocast; seeded random tables of several
    shapes). A rotation applied twice or not at all, an out-projection dropped or the CLS
    tokens lost change the outputs."""
    from tabicl_helpers import random_table
    from tabserve.buckets import BucketGrid
    from tabserve.kernels import feed_forward as ff
    from tabserve.models.tabicl.network import layers
    from tabserve.models.tabicl.serving.served import ServedTabICL

    forced = {"kernel_applies": lambda *a: True}
    norm_linear = SimpleNamespace(**forced, norm_linear_op=nl.norm_linear_op)
    feed_forward = SimpleNamespace(**forced, feed_forward=ff.feed_forward)
    monkeypatch.setattr(layers, "_norm_linear_kernels", lambda: norm_linear)
    monkeypatch.setattr(layers, "_feed_forward_kernels", lambda: feed_forward)
    fused = ServingOptions(precision="bf16", fused_ffn=True, fused_norm_linear=True)
    moved = fused.replace(rope_in_projection=True, fused_out_projection=True)
    rows = moved.replace(fused_row_tokens=True)
    grid = BucketGrid(train_rows=(16, 64), test_rows=(4, 16), features=(4, 8))
    for seed, (n_train, n_test, n_features) in enumerate([(40, 7, 5), (13, 3, 8), (60, 12, 3)]):
        X, y = random_table(seed, 2, n_train, n_test, n_features, 3 if task == "clf" else 0)
        outputs = []
        for recipe in (fused, moved, rows):
            model = copy.deepcopy(our_model(task, "tiny"))
            with torch.no_grad():
                served = ServedTabICL(model, recipe)
                cache = served.build_cache(X[:, :n_train], y)
                outputs.append(
                    (
                        served(X, y),
                        ServedTabICL(model, recipe.replace(buckets=True), grid)(X, y),
                        served.forward_with_cache(X[:, n_train:], cache),
                    )
                )
            blocks = [m for m in model.modules() if isinstance(m, AttentionBlock)]
            assert all(b.fused_out_projection == (recipe is not fused) for b in blocks)
            assert model.row_interactor.tokens_from_column_stage == (recipe is rows)
        for recipe_outputs in outputs[1:]:
            for kind, got, want in zip(
                ("unpadded", "padded", "cached"), recipe_outputs, outputs[0]
            ):
                assert torch.equal(got, want), (seed, kind)
    # The check can fail: CLS tokens the column stage does not lead its rows with ...
    served = ServedTabICL(copy.deepcopy(our_model(task, "tiny")), rows)
    zeros = lambda self: torch.zeros_like(self.cls_tokens)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(type(served.model.row_interactor), "column_prefix", zeros)
        assert not torch.equal(served(X, y), outputs[2][0])
    # ... and RoPE left out of the row stage.
    model = copy.deepcopy(our_model(task, "tiny"))
    served = ServedTabICL(model, moved)
    monkeypatch.setattr(layers.Attention, "_project_rotating", _rotating_nothing)
    with torch.no_grad():
        assert not torch.equal(served(X, y), outputs[1][0])


def _rotating_nothing(self, x, weight, bias, norm, rope, rotary_features):
    """``Attention._project_rotating`` that claims to rotate and does not (a broken fusion)."""
    return self._project(x, weight, bias, norm), rope is not None
