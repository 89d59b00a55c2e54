"""tabserve::feed_forward: the fused feed-forward half of a transformer block.

References: the block's own modules under torch.autocast (bit for bit, for the composite), and
the composite for the Triton kernel, which sums its matmuls in another order: it must agree
with the composite on nearly every element (>= 90% bit for bit; a tanh-approximate GELU agrees
on about half) and stay within two fp16 roundings of the row's scale elsewhere. The kernel runs
here under Triton's interpreter (CPU, fp16; the interpreter's bf16 is broken) and on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import requires_cuda
from tabicl_helpers import interpreter_child, our_model
from tabserve import ops
from tabserve.kernels import feed_forward as ff
from tabserve.models.tabicl.network.layers import AttentionBlock
from tabserve.models.tabicl.network.stage_kernels import STAGES, StageKernels, use_stage_kernels
from tabserve.models.tabicl.serving.options import PRESETS, ServingOptions

requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

#: (tokens, leading shape, dim, hidden, x dtype, norm bias, update dtype): ragged tiles, every
#: width, a hidden width of one step and of three, fp16 and fp32 residual streams, bias-free
#: LayerNorm, with and without the attention half's output (fp16 into fp32 as autocast's
#: blocks add it; fp16 into fp16, whose sum ATen rounds to fp16).
KERNEL_CASES = [
    (300, (3, 100), 128, 256, torch.float32, True, torch.float16),
    (77, (77,), 32, 192, torch.float16, False, torch.float16),
    (130, (2, 5, 13), 16, 64, torch.float32, True, None),
    (64, (64,), 64, 128, torch.float32, False, torch.float32),
    (1, (1,), 128, 256, torch.float16, True, None),
]


def make_inputs(leading, dim, hidden, x_dtype, norm_bias, update=None, device="cpu", seed=0):
    """[x, update, norm_weight, norm_bias, w1, b1, w2, b2]: the operator's tensor arguments."""
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*leading, dim, generator=g)).to(x_dtype)
    change = None if update is None else torch.randn(*leading, dim, generator=g).to(update)
    params = [
        change,
        1 + 0.1 * torch.randn(dim, generator=g),
        0.1 * torch.randn(dim, generator=g) if norm_bias else None,
        torch.randn(hidden, dim, generator=g) / dim**0.5,
        0.1 * torch.randn(hidden, generator=g),
        torch.randn(dim, hidden, generator=g) / hidden**0.5,
        0.1 * torch.randn(dim, generator=g),
    ]
    return [x.to(device), *(None if p is None else p.to(device) for p in params)]


def stream(args) -> torch.Tensor:
    """The block's stream entering the feed-forward half: x (+ update), in float64."""
    x, update = args[0].double(), args[1]
    return x if update is None else x + update.double()


def agreement(got: torch.Tensor, want: torch.Tensor, s: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements bit for bit equal, max difference in fp16 roundings of the row's
    scale: its largest |FFN output| plus the output element's own magnitude); ``s``: the
    stream entering the feed-forward half."""
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.double() - want.double()).abs()
    y = want.double() - s.double()
    scale = (y.abs().amax(-1, keepdim=True) + want.double().abs()) * torch.finfo(torch.float16).eps
    return (diff == 0).double().mean().item(), (diff / scale).max().item()


def assert_agrees(got, want, s, where=""):
    equal, worst = agreement(got, want, s)
    assert equal >= 0.9, f"{where}: only {equal:.3f} of the elements equal the composite"
    assert worst <= 2.0, f"{where}: {worst:.2f} fp16 roundings from the composite"


# ---------------------------------------------------------------------------------------------
# The composite (every device) and the operator's dispatch


def block(dim=128, hidden=256, ln_bias=True, seed=0) -> AttentionBlock:
    torch.manual_seed(seed)
    module = AttentionBlock(dim, 8, hidden, ln_bias)
    for p in module.parameters():
        p.data.normal_(0, 0.1)
    return module


def block_args(b: AttentionBlock):
    n, l1, l2 = b.norm2, b.linear1, b.linear2
    return n.weight, n.bias, l1.weight, l1.bias, l2.weight, l2.bias, n.eps


@pytest.mark.parametrize("ln_bias", [True, False])
def test_cpu_operator_is_the_block_under_autocast_bit_for_bit(ln_bias):
    b = block(ln_bias=ln_bias)
    x = torch.randn(3, 50, 128)
    with torch.no_grad():
        # With the attention half's output added first (bf16 as autocast's out_proj gives it).
        update = torch.randn(3, 50, 128).bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, want_updated = b.feed_forward(x), b.feed_forward(x, update)
        got = ops.feed_forward(x, *block_args(b), compute_dtype=torch.bfloat16)
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want)
        want = want_updated
        got = ops.feed_forward(x, *block_args(b), torch.bfloat16, update=update)
        assert torch.equal(got, want)
        # fp32 compute: the modules without autocast.
        assert torch.equal(ops.feed_forward(x, *block_args(b), torch.float32), b.feed_forward(x))


def projection(dim, seed=1, device="cpu"):
    """An out-projection's [dim, dim] weight and [dim] bias."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(dim, dim, generator=g) / dim**0.5
    return weight.to(device), (0.1 * torch.randn(dim, generator=g)).to(device)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_cpu_operator_folds_the_out_projection_as_the_block_computes_it(x_dtype):
    """``update_weight`` / ``update_bias``: the update is first projected; bit for bit the
    block's ``out_proj`` module then its feed-forward half under autocast (the reference), on
    an fp32 residual stream (the column stage) and a bf16 one."""
    b = block()
    x = torch.randn(3, 50, 128).to(x_dtype)
    attention = torch.randn(3, 50, 128).bfloat16()  # the heads' merged output under autocast
    out_proj = torch.nn.Linear(128, 128)
    out_proj.weight.data, out_proj.bias.data = projection(128)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = b.feed_forward(x, out_proj(attention))
        got = ops.feed_forward(
            x, *block_args(b), torch.bfloat16, update=attention,
            update_weight=out_proj.weight, update_bias=out_proj.bias,
        )  # fmt: skip
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"update": None}, "update_weight projects update: it needs an update"),
        ({"update_weight": None}, "update_bias needs update_weight"),
        ({"update_weight": torch.zeros(32, 16)}, r"update_weight must have shape \(32, 32\)"),
        ({"update_bias": torch.zeros(16)}, r"update_bias must have shape \(32,\)"),
        (
            {"update_weight": torch.zeros(32, 32, dtype=torch.long)},
            "update_weight must be floating",
        ),
        ({"update_bias": torch.zeros(32, device="meta")}, "update_bias is on meta"),
    ],
    ids=["no update", "bias alone", "weight shape", "bias shape", "weight dtype", "device"],
)
def test_bad_update_projection_is_refused(change, message):
    x, update, *params = make_inputs((4, 6), 32, 64, torch.float32, True, torch.bfloat16)
    weight, bias = projection(32)
    kwargs = {"update": update, "update_weight": weight, "update_bias": bias, **change}
    with pytest.raises(ValueError, match=message):
        ops.feed_forward(x, *params, 1e-5, torch.bfloat16, **kwargs)


def test_skipped_sets_are_the_skip_value_and_the_rest_unchanged():
    args = make_inputs((4, 6, 9), 32, 64, torch.float32, True, torch.bfloat16)
    skip = torch.tensor([[True, False, False, True, False, True]] * 4)
    skip[2] = False
    plain = ops.feed_forward(args[0], *args[2:], 1e-5, torch.bfloat16, update=args[1])
    got = ops.feed_forward(
        args[0], *args[2:], 1e-5, torch.bfloat16, update=args[1], skip=skip, skip_value=-100.0
    )
    assert bool((got[skip] == -100).all())
    assert torch.equal(got[~skip], plain[~skip])
    # A one-dimensional skip over the leading dimension only.
    first = torch.tensor([False, True, False, False])
    got = ops.feed_forward(args[0], *args[2:], 1e-5, torch.bfloat16, update=args[1], skip=first)
    assert bool((got[1] == 0).all()) and torch.equal(got[0], plain[0])


@pytest.mark.parametrize(
    "skip,message",
    [
        (torch.zeros(4, 6, dtype=torch.uint8), "skip must be a bool tensor"),
        (torch.zeros(6, dtype=torch.bool), "skip must be a bool tensor"),
        (torch.zeros(4, 6, 9, 32, dtype=torch.bool), "skip must be a bool tensor"),
        (torch.zeros(4, 6, dtype=torch.bool, device="meta"), "skip is on meta"),
    ],
    ids=["dtype", "not leading", "all of x", "device"],
)
def test_bad_skip_is_refused(skip, message):
    args = make_inputs((4, 6, 9), 32, 64, torch.float32, True, None)
    with pytest.raises(ValueError, match=message):
        ops.feed_forward(args[0], *args[2:], 1e-5, torch.bfloat16, skip=skip)


def rows_reference(out: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The ``row_prefix`` layout built token by token (independent of ``to_rows``): row (b, l)
    is the prefix's tokens, then token l of every set s of table b."""
    batch, sets, length, dim = out.shape
    rows = torch.empty(batch, length, len(prefix) + sets, dim, dtype=out.dtype)
    for b in range(batch):
        for position in range(length):
            rows[b, position, : len(prefix)] = prefix.to(out.dtype)
            for s in range(sets):
                rows[b, position, len(prefix) + s] = out[b, s, position]
    return rows


@pytest.mark.parametrize("lead", [4, 0])
def test_row_prefix_lays_the_output_out_as_rows(lead):
    """``row_prefix``: the same values as without it (skip and the folded out-projection
    included), each token moved to its row behind the prefix's tokens, in the output dtype."""
    args = make_inputs((2, 3, 5), 32, 64, torch.float32, True, torch.bfloat16)
    prefix = torch.randn(lead, 32, generator=torch.Generator().manual_seed(3))
    skip = torch.tensor([[False, True, False], [False, False, False]])
    kwargs = {"update": args[1], "skip": skip, "skip_value": -100.0}
    fold = dict(zip(("update_weight", "update_bias"), projection(32)))
    plain = ops.feed_forward(args[0], *args[2:], 1e-5, torch.bfloat16, **kwargs, **fold)
    got = ops.feed_forward(
        args[0], *args[2:], 1e-5, torch.bfloat16, **kwargs, **fold, row_prefix=prefix
    )
    assert got.dtype == plain.dtype == torch.float32 and got.shape == (2, 5, lead + 3, 32)
    assert torch.equal(got, rows_reference(plain, prefix))
    assert bool((got[0, :, lead + 1] == -100).all())


@pytest.mark.parametrize(
    "x_shape, prefix, message",
    [
        ((6, 5, 32), torch.zeros(4, 32), r"row_prefix needs x of shape \(batch, sets, tokens"),
        ((2, 3, 5, 32), torch.zeros(32), "row_prefix must be a floating-point"),
        ((2, 3, 5, 32), torch.zeros(4, 16), r"row_prefix must be a floating-point \(tokens, 32\)"),
        ((2, 3, 5, 32), torch.zeros(4, 32, dtype=torch.long), "row_prefix must be a floating"),
        ((2, 3, 5, 32), torch.zeros(4, 32, device="meta"), "row_prefix is on meta"),
    ],
    ids=["x not 4-D", "prefix 1-D", "width", "dtype", "device"],
)
def test_bad_row_prefix_is_refused(x_shape, prefix, message):
    args = make_inputs(x_shape[:-1], 32, 64, torch.float32, True, None)
    with pytest.raises(ValueError, match=message):
        ops.feed_forward(args[0], *args[2:], 1e-5, torch.bfloat16, row_prefix=prefix)


def test_composite_is_float64_maths_within_bf16_rounding():
    x, _, nw, nb, w1, b1, w2, b2 = make_inputs((40,), 64, 128, torch.float32, True)
    got = ops.feed_forward(x, nw, nb, w1, b1, w2, b2, 1e-5, torch.bfloat16)
    d = x.double()
    normed = F.layer_norm(d, (64,), nw.double(), nb.double(), 1e-5)
    h = F.gelu(F.linear(normed, w1.double(), b1.double()))
    exact = d + F.linear(h, w2.double(), b2.double())
    y_scale = (exact - d).abs().amax(-1, keepdim=True)
    assert ((got.double() - exact).abs() / y_scale).max() <= 8 * torch.finfo(torch.bfloat16).eps


@requires_triton
def test_kernel_under_the_interpreter_agrees_with_the_composite():
    """Runs the Triton program on CPU tensors (``TRITON_INTERPRET=1`` must be set before Triton
    compiles it, hence a child process) for every case; the checks run here."""
    results = interpreter_child("import test_feed_forward as t; t.interpreter_cases()")
    projected = [c for c in KERNEL_CASES if c[6] is not None]
    assert len(results) == len(KERNEL_CASES) + len(OTHER_STEPS) + 1 + len(projected) + 2 + 2
    cases = KERNEL_CASES + [KERNEL_CASES[0]] * (len(OTHER_STEPS) + 1)
    # The projected update is in the compute dtype (fp16) whatever update's own dtype.
    cases += [(*c[:6], torch.float16) for c in projected]
    cases += [ROWS_CASE, (*ROWS_CASE[:6], torch.float16)]  # plain, then projected
    cases += [KERNEL_CASES[0], (*projected[0][:6], torch.float16)]  # the other GELU form
    for case, (equal, worst, dtype, shape) in zip(cases, results):
        _, leading, dim, _, x_dtype, _, update = case
        if case[1] is ROWS_CASE[1]:  # (B, S, L) sets -> (B, L, P + S) rows
            leading = (leading[0], leading[2], ROWS_LEAD + leading[1])
        assert shape == [*leading, dim]
        sum_dtype = x_dtype if update is None else torch.promote_types(x_dtype, update)
        assert dtype == str(torch.promote_types(sum_dtype, torch.float16))
        assert equal >= 0.9, f"{case}: only {equal:.3f} equal"
        assert worst <= 2.0, f"{case}: {worst:.2f} roundings off"


def interpreter_cases() -> None:
    """The child's side of the interpreter test: one JSON line of agreement per case."""
    out = []
    for _, leading, dim, hidden, x_dtype, norm_bias, update in KERNEL_CASES:
        args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update)
        got = ff.run_kernel(*args, 1e-5, torch.float16)
        want = ff.feed_forward_composite(*args, 1e-5, torch.float16)
        out.append([*agreement(got, want, stream(args)), str(got.dtype), list(got.shape)])
    # The benchmark sweep's other hidden steps, on the first case.
    _, leading, dim, hidden, x_dtype, norm_bias, update = KERNEL_CASES[0]
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update)
    want = ff.feed_forward_composite(*args, 1e-5, torch.float16)
    for step in OTHER_STEPS:
        with ff.hidden_step_override(step):
            got = ff.run_kernel(*args, 1e-5, torch.float16)
        out.append([*agreement(got, want, stream(args)), str(got.dtype), list(got.shape)])
    # Skipped sets (the first case's 3 sets of 100 tokens): the kernel writes the skip value.
    skip = torch.tensor([True, False, True])
    got = ff.run_kernel(*args, 1e-5, torch.float16, skip, -100.0)
    want = ff.feed_forward_composite(*args, 1e-5, torch.float16, skip, -100.0)
    assert bool((got[skip] == -100).all()) and torch.equal(
        got[1], ff.run_kernel(*args, 1e-5, torch.float16)[1]
    )
    out.append([*agreement(got, want, stream(args)), str(got.dtype), list(got.shape)])
    # The out-projection folded in (update_weight), on every case with an update.
    for _, leading, dim, hidden, x_dtype, norm_bias, update in KERNEL_CASES:
        if update is None:
            continue
        args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update)
        fold = projection(dim)
        got = ff.run_kernel(*args, 1e-5, torch.float16, None, 0.0, *fold)
        want = ff.feed_forward_composite(*args, 1e-5, torch.float16, None, 0.0, *fold)
        projected = ff.project_update(args[1], *fold, torch.float16)
        s = args[0].double() + projected.double()
        out.append([*agreement(got, want, s), str(got.dtype), list(got.shape)])
    # row_prefix: the rows layout, without and with the folded out-projection (skipped sets
    # too); the same values as without it, bit for bit.
    _, leading, dim, hidden, x_dtype, norm_bias, update = ROWS_CASE
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update)
    prefix = torch.randn(ROWS_LEAD, dim, generator=torch.Generator().manual_seed(5))
    skip = torch.tensor([[False, True, False], [True, False, False]])
    for fold in ((None, None), projection(dim)):
        extra = (skip, -100.0, *fold)
        got = ff.run_kernel(*args, 1e-5, torch.float16, *extra, prefix)
        assert torch.equal(
            got, rows_reference(ff.run_kernel(*args, 1e-5, torch.float16, *extra), prefix)
        )
        want = ff.feed_forward_composite(*args, 1e-5, torch.float16, *extra, prefix)
        s = stream(args)
        if fold[0] is not None:
            s = args[0].double() + ff.project_update(args[1], *fold, torch.float16).double()
        rows = ff.to_rows(s, prefix.double())
        out.append([*agreement(got, want, rows), str(got.dtype), list(got.shape)])
    # Every GELU form but the default: the first case, then the first one projecting.
    (other,) = (g for g in ff.GELUS if g != ff.GELU)
    first_projected = next(c for c in KERNEL_CASES if c[6] is not None)
    for case, folds in ((KERNEL_CASES[0], False), (first_projected, True)):
        _, leading, dim, hidden, x_dtype, norm_bias, update = case
        args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update)
        fold = (None, 0.0, *projection(dim)) if folds else ()
        with ff.gelu_override(other):
            got = ff.run_kernel(*args, 1e-5, torch.float16, *fold)
        want = ff.feed_forward_composite(*args, 1e-5, torch.float16, *fold)
        s = stream(args)
        if fold:
            s = args[0].double() + ff.project_update(args[1], *fold[2:], torch.float16).double()
        out.append([*agreement(got, want, s), str(got.dtype), list(got.shape)])
    print(json.dumps(out))


def gelu_table(device: str = "cpu") -> dict:
    """Each GELU form of the kernel (:func:`kernels.feed_forward._gelu`) on every finite fp16
    and bf16 number, rounded to its dtype, against torch's GELU and float64 maths: per dtype,
    ``{form: [mismatches with torch, with float64, worst units off float64]}`` and the
    forms' mismatches with each other (under the interpreter on CPU: the child's side)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_kernel(x_ptr, y_ptr, n, BY: tl.constexpr, BLOCK: tl.constexpr):
        # fp32 out, rounded by torch (the interpreter's bf16 cast truncates)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        h = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        tl.store(y_ptr + i, ff._gelu(h, BY), mask=i < n)

    def units(a, b):  # distance in representable numbers (same-sign values)
        ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
        ai = torch.where(ai < 0, -(ai & 0x7FFF), ai)
        bi = torch.where(bi < 0, -(bi & 0x7FFF), bi)
        return (ai - bi).abs()

    table = {}
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        x = x[torch.isfinite(x)].to(device)
        exact = (x.double() * 0.5 * (1 + torch.special.erf(x.double() / math.sqrt(2)))).to(dtype)
        aten = F.gelu(x.float()).to(dtype)
        forms, row = {}, {}
        for by, form in enumerate(ff.GELUS):
            y = torch.empty_like(x, dtype=torch.float32)
            gelu_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BY=by, BLOCK=1024)
            forms[form] = y = y.to(dtype)
            off = units(y, exact)
            row[form] = [int((units(y, aten) > 0).sum()), int((off > 0).sum()), int(off.max())]
        between = units(*forms.values())
        row["between"] = [int((between > 0).sum()), int(between.max())]
        row["numbers"] = x.numel()
        table[str(dtype)] = row
    return table


def _assert_gelu_forms_agree(table: dict) -> None:
    """The rational form rounds as erff does on all but a few numbers (< 0.1%), and is no
    further from float64 maths than erff: on hardly more numbers, by no more units (at most
    2). Where they differ, they differ by no more than their two distances from float64 (the
    left tail, where ``1 + erf`` cancels and one fp32 unit of erf is a few fp16 units of the
    GELU: 3 on the H200)."""
    for dtype, row in table.items():
        erf, rational = row["erf"], row["rational"]
        changed, worst = row["between"]
        assert changed <= row["numbers"] // 1000 and worst <= erf[2] + rational[2], (dtype, row)
        assert rational[1] <= erf[1] + row["numbers"] // 1000, (dtype, row)
        assert rational[2] <= max(erf[2], 2), (dtype, row)


def test_gelu_override_takes_the_known_forms_only():
    with pytest.raises(ValueError, match="gelu must be one of"), ff.gelu_override("tanh"):
        pass
    with ff.gelu_override("erf"):
        assert ff.GELU == "erf"
    assert ff.GELU == "rational"


def test_gelu_forms_round_alike_on_every_half_precision_number():
    """The kernel's two GELU forms on all 63,488 finite fp16 and 65,280 finite bf16 numbers,
    under Triton's interpreter (numpy's fp32 maths)."""
    table = interpreter_child(
        "import test_feed_forward as t, json; print(json.dumps(t.gelu_table()))"
    )
    _assert_gelu_forms_agree(table)
    assert table["torch.float16"]["between"][0] <= 8  # 3 when measured (Triton 3.8, numpy)


#: The interpreter's row_prefix case: 2 tables of 3 sets of 45 tokens (tiles straddle sets).
ROWS_CASE = (270, (2, 3, 45), 32, 64, torch.float32, True, torch.float16)
ROWS_LEAD = 4


#: Hidden units per loop step other than the kernel's own that the interpreter test runs.
OTHER_STEPS = (32, 128)


@pytest.mark.parametrize("step", [48, 8, 0])
def test_hidden_step_override_takes_powers_of_two_only(step):
    with (
        pytest.raises(ValueError, match="hidden step must be a power of two >= 16"),
        ff.hidden_step_override(step),
    ):
        pass
    assert ff.HIDDEN_STEP_OVERRIDE is None


def test_compiles_in_one_graph_and_traces_its_shape():
    x, _, *params = make_inputs((2, 30), 32, 64, torch.float32, True)
    fn = torch.compile(
        lambda x: ops.feed_forward(x, *params, 1e-5, torch.bfloat16),
        fullgraph=True,
        backend="aot_eager",
    )
    got = fn(x)
    assert torch.equal(got, ops.feed_forward(x, *params, 1e-5, torch.bfloat16))


def test_block_takes_the_operator_in_one_compiled_graph(monkeypatch):
    """The block's fused branch under torch.compile(fullgraph=True): on CPU the operator runs
    its composite, so the branch is forced (as CUDA takes it) and must equal the modules."""
    from types import SimpleNamespace

    from tabserve.models.tabicl.network import layers

    calls = []

    def op(*args):
        calls.append(args[9])  # the compute dtype
        return ff.feed_forward_op(*args)

    shim = SimpleNamespace(kernel_applies=lambda *a: True, feed_forward=op)
    monkeypatch.setattr(layers, "_feed_forward_kernels", lambda: shim)
    b = block(dim=32, hidden=64)
    x = torch.randn(2, 9, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = b(x)
        b.kernels = StageKernels(fused_ffn=True)
        torch._dynamo.reset()
        got = torch.compile(b, fullgraph=True, backend="aot_eager")(x)
    assert calls and set(calls) == {torch.bfloat16}
    assert torch.equal(got, want)


def test_block_folds_its_out_projection_in_one_compiled_graph(monkeypatch):
    """``fused_out_projection``: the block hands its attention's unprojected output and
    ``out_proj`` to the fused operator (forced on CPU as above) and equals the modules bit for
    bit, eager and compiled; broadcast queries (the inducing points) are projected first."""
    from types import SimpleNamespace

    from tabserve.models.tabicl.network import layers

    calls = []

    def op(*args):
        calls.append(args[12] is not None)  # update_weight given
        return ff.feed_forward_op(*args)

    shim = SimpleNamespace(kernel_applies=lambda *a: True, feed_forward=op)
    monkeypatch.setattr(layers, "_feed_forward_kernels", lambda: shim)
    b = block(dim=32, hidden=64)
    x, inducing = torch.randn(2, 9, 32), torch.randn(1, 5, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_broadcast = b(x), b(inducing, x)
        b.kernels = StageKernels(fused_ffn=True, fused_out_projection=True)
        # The out-projection module is never called on the folded path.
        got = b(x)
        assert calls == [True]
        got_broadcast = b(inducing, x)
        assert calls == [True, False]
        torch._dynamo.reset()
        compiled = torch.compile(b, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want) and torch.equal(compiled, want)
    assert torch.equal(got_broadcast, want_broadcast)


def test_opcheck():
    args = make_inputs((5, 7), 16, 64, torch.float32, True, torch.bfloat16)
    torch.library.opcheck(torch.ops.tabserve.feed_forward.default, (*args, 1e-5, torch.bfloat16))
    fold = projection(16)
    torch.library.opcheck(
        torch.ops.tabserve.feed_forward.default,
        (*args, 1e-5, torch.bfloat16, None, 0.0, *fold),
    )
    skip = torch.tensor([True, False, False, True, False])
    torch.library.opcheck(
        torch.ops.tabserve.feed_forward.default, (*args, 1e-5, torch.bfloat16, skip, -100.0)
    )
    sets = make_inputs((2, 3, 4), 16, 64, torch.float32, True, torch.bfloat16)
    torch.library.opcheck(
        torch.ops.tabserve.feed_forward.default,
        (*sets, 1e-5, torch.bfloat16, None, 0.0, *fold, torch.randn(4, 16)),
    )
    x16, *params = make_inputs((9,), 16, 64, torch.bfloat16, False)
    torch.library.opcheck(
        torch.ops.tabserve.feed_forward.default, (x16, *params, 0.0, torch.bfloat16)
    )


def test_kernel_applies_only_where_it_is_built_for():
    x = torch.empty(4, 128, device="meta")
    w1 = torch.empty(256, 128, device="meta")
    assert not ff.kernel_applies(x, None, w1, torch.float16)  # not CUDA
    if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
        return
    x, w1 = torch.empty(4, 128, device="cuda"), torch.empty(256, 128, device="cuda")
    half = torch.float16
    assert ff.kernel_applies(x, None, w1, half) and ff.kernel_applies(x, x, w1, torch.bfloat16)
    assert not ff.kernel_applies(x, None, w1, torch.float32)
    assert not ff.kernel_applies(torch.empty(4, 96, device="cuda"), None, w1[:, :96], half)
    assert not ff.kernel_applies(x, None, w1[:100], half)
    assert not ff.kernel_applies(x, x.double(), w1, half)


# ---------------------------------------------------------------------------------------------
# Serving options


def test_options_refuse_the_fused_ffn_without_autocast():
    with pytest.raises(ValueError, match="fused_ffn runs under bf16 / fp16 autocast only"):
        ServingOptions(precision="fp32", fused_ffn=True)
    fields = {"precision": "fp16", "compile": "default", "attention": {"row": "head16"}}
    assert ServingOptions.from_dict({**fields, "fused_ffn": True}).fused_ffn
    assert not ServingOptions.from_dict(fields).fused_ffn
    assert all(PRESETS[name].options.fused_ffn for name in ("small", "large", "large-fp8"))


def test_served_model_points_every_block_at_its_options():
    from tabserve.models.tabicl.serving.served import ServedTabICL

    model = copy.deepcopy(our_model("clf", "tiny"))  # our_model is cached; serving mutates it
    blocks = [m for m in model.modules() if isinstance(m, AttentionBlock)]
    fp16 = ServingOptions(precision="fp16")
    ServedTabICL(model, fp16.replace(fused_ffn=True))
    assert blocks and all(b.fused_feed_forward for b in blocks)
    assert not any(b.fused_out_projection for b in blocks)
    ServedTabICL(model, fp16.replace(fused_ffn=True, fused_out_projection=True))
    assert all(b.fused_feed_forward and b.fused_out_projection for b in blocks)
    assert not model.row_interactor.tokens_from_column_stage
    large = PRESETS["large"].options.replace(compile="none", freeze=False, kv_graphs=False)
    ServedTabICL(model, large)
    assert model.row_interactor.tokens_from_column_stage
    assert model.row_interactor.column_prefix() is model.row_interactor.cls_tokens
    # One frozen object per stage: every module of a stage holds the same one.
    for stage, module in STAGES.items():
        held = {m.kernels for m in getattr(model, module).modules() if hasattr(m, "kernels")}
        assert held == {large.stage_kernels(stage)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks[0].kernels.fused_ffn = False
    ServedTabICL(model, fp16)
    assert not any(b.fused_feed_forward or b.fused_out_projection for b in blocks)
    assert model.row_interactor.column_prefix() is None
    for folded in ("fused_out_projection", "fused_row_tokens"):
        with pytest.raises(ValueError, match=f"{folded} .* needs fused_ffn"):
            fp16.replace(**{folded: True})


# ---------------------------------------------------------------------------------------------
# CUDA


@requires_cuda
@requires_triton
def test_cuda_gelu_forms_round_alike_on_every_half_precision_number():
    """As the interpreter test, on the GPU: libdevice's erff, ex2.approx, rsqrt.approx and FMA
    contraction; torch's GELU is then ATen's CUDA kernel (erff too)."""
    table = gelu_table("cuda")
    _assert_gelu_forms_agree(table)
    # erff as ATen's: 151 of the 63,488 fp16 GELUs differ from ATen's CUDA kernel's on the
    # H200 (Triton 3.6; each by at most 2 units from float64, as ATen's).
    assert table["torch.float16"]["erf"][0] <= 63488 // 200, table


@requires_cuda
@requires_triton
@pytest.mark.parametrize("gelu", ff.GELUS)
@pytest.mark.parametrize("fold", [False, True], ids=["plain", "out-proj"])
def test_cuda_kernel_agrees_with_the_composite_with_each_gelu(gelu, fold):
    case = next(c for c in KERNEL_CASES if c[6] is not None)
    _, leading, dim, hidden, x_dtype, norm_bias, update = case
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update, device="cuda")
    extra = (None, 0.0, *(p.cuda() for p in projection(dim))) if fold else ()
    with ff.gelu_override(gelu):
        got = torch.ops.tabserve.feed_forward(*args, 1e-5, torch.float16, *extra)
    want = ff.feed_forward_composite(*args, 1e-5, torch.float16, *extra)
    s = stream(args)
    if fold:
        s = args[0].double() + ff.project_update(args[1], *extra[2:], torch.float16).double()
    assert_agrees(got, want, s, f"{case} {gelu}")


@requires_cuda
@requires_triton
def test_cuda_launch_that_would_compile_is_refused_inside_no_triton_compiles():
    """A specialization not compiled yet (an eps of its own: a constant of the kernel) raises
    WouldCompile inside the guard, launching nothing; once compiled outside it, the same launch
    runs inside and answers as before."""
    from tabserve.kernels._common import WouldCompile, no_triton_compiles

    _, leading, dim, hidden, x_dtype, norm_bias, update = KERNEL_CASES[0]
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update, device="cuda")
    eps = 1.2345e-5  # used by no other test: its kernel is compiled here first
    with no_triton_compiles(), pytest.raises(WouldCompile, match="_feed_forward_kernel"):
        torch.ops.tabserve.feed_forward(*args, eps, torch.float16)
    want = torch.ops.tabserve.feed_forward(*args, eps, torch.float16)
    with no_triton_compiles():
        got = torch.ops.tabserve.feed_forward(*args, eps, torch.float16)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@requires_cuda
@requires_triton
def test_cuda_kernel_compiled_in_a_child_launches_here_without_compiling(monkeypatch):
    """The packs' warm-up path on a real launch: listed inside collect_compiles (not compiled
    nor launched), compiled by a child, then launched here from Triton's cache with compiling
    made impossible in this process, answering as the kernel does."""
    from triton.backends.nvidia.compiler import CUDABackend

    from tabserve.kernels.precompile import collect_compiles, compile_elsewhere

    _, leading, dim, hidden, x_dtype, norm_bias, update = KERNEL_CASES[0]
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update, device="cuda")
    eps = 2.3456e-5  # used by no other test: its kernel is compiled here first
    with collect_compiles() as found:
        torch.ops.tabserve.feed_forward(*args, eps, torch.float16)
    assert [s.qualname for s in found] == ["_feed_forward_kernel"]
    compile_elsewhere(found)

    def no_compiling_here(*args, **kwargs):
        raise AssertionError("compiled in this process")

    monkeypatch.setattr(CUDABackend, "add_stages", no_compiling_here)
    got = torch.ops.tabserve.feed_forward(*args, eps, torch.float16)
    assert_agrees(got, ff.feed_forward_composite(*args, eps, torch.float16), stream(args), "child")


@requires_cuda
@requires_triton
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]}x{c[2]}-{c[3]}")
def test_cuda_kernel_agrees_with_the_composite(case, compute):
    _, leading, dim, hidden, x_dtype, norm_bias, update = case
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update, device="cuda")
    assert ff.kernel_applies(args[0], args[1], args[4], compute)
    got = torch.ops.tabserve.feed_forward(*args, 1e-5, compute)
    want = ff.feed_forward_composite(*args, 1e-5, compute)
    if compute == torch.bfloat16:  # bf16 rounds 8x coarser than the fp16 scale of agreement
        equal, worst = agreement(got, want, stream(args))
        assert equal >= 0.9 and worst <= 16.0, (equal, worst)
    else:
        assert_agrees(got, want, stream(args), str(case))


@requires_cuda
@requires_triton
@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case", [c for c in KERNEL_CASES if c[6] is not None], ids=lambda c: f"{c[0]}x{c[2]}-{c[3]}"
)
def test_cuda_kernel_with_the_out_projection_agrees_with_the_composite(case, compute):
    """The Triton kernel projecting the update itself (and holding the sum in its output until
    its epilogue) against the composite, with skipped sets too."""
    _, leading, dim, hidden, x_dtype, norm_bias, update = case
    args = make_inputs(leading, dim, hidden, x_dtype, norm_bias, update, device="cuda")
    fold = projection(dim, device="cuda")
    skip = torch.arange(leading[0], device="cuda") % 3 == 1
    got = torch.ops.tabserve.feed_forward(*args, 1e-5, compute, skip, -100.0, *fold)
    want = ff.feed_forward_composite(*args, 1e-5, compute, skip, -100.0, *fold)
    s = args[0].double() + ff.project_update(args[1], *fold, compute).double()
    equal, worst = agreement(got, want, s)
    bound = 16.0 if compute == torch.bfloat16 else 2.0
    assert equal >= 0.9 and worst <= bound, (equal, worst)
    assert bool((got[skip] == -100).all())


@requires_cuda
@requires_triton
def test_cuda_kernel_writes_the_skip_value_of_skipped_sets():
    # Sets of 700 tokens (tiles of 64 straddle them), fp32 stream with an fp16 update.
    args = make_inputs((6, 700), 128, 256, torch.float32, True, torch.float16, device="cuda")
    skip = torch.tensor([True, False, True, True, False, False], device="cuda")
    got = torch.ops.tabserve.feed_forward(*args, 1e-5, torch.float16, skip, -100.0)
    plain = torch.ops.tabserve.feed_forward(*args, 1e-5, torch.float16)
    assert bool((got[skip] == -100).all()) and torch.equal(got[~skip], plain[~skip])


@requires_cuda
@requires_triton
@pytest.mark.parametrize("route", ["triton", "triton-projecting", "resident"])
def test_cuda_rows_layout_is_the_sets_output_moved(route, monkeypatch):
    """``row_prefix`` on CUDA: the Triton kernel writing its tiles into the rows layout (sets of
    700 tokens, tiles straddling them, skipped sets, the folded out-projection) and the
    resident kernel's output rearranged equal the output without it moved token by token."""
    monkeypatch.setattr(ff, "RESIDENT_KERNEL", route == "resident")
    args = make_inputs((2, 3, 700), 128, 256, torch.float32, True, torch.float16, "cuda")
    fold = projection(128, device="cuda") if route == "triton-projecting" else (None, None)
    skip = torch.tensor([[False, True, False], [True, False, False]], device="cuda")
    prefix = torch.randn(4, 128, generator=torch.Generator().manual_seed(7)).cuda()
    extra = (skip, -100.0, *fold)
    got = ff.feed_forward(*args, 1e-5, torch.float16, *extra, prefix)
    plain = ff.feed_forward(*args, 1e-5, torch.float16, *extra)
    assert torch.equal(got.cpu(), rows_reference(plain.cpu(), prefix.cpu()))


@requires_cuda
@requires_triton
def test_cuda_large_stream_past_int32_offsets_of_a_tile_grid():
    # 5.6 M tokens of width 128: the large workload's row stage (element offsets past 2**29).
    args = make_inputs((8 * 10240 * 68,), 128, 256, torch.float32, True, torch.float16, "cuda")
    got = torch.ops.tabserve.feed_forward(*args, 1e-5, torch.float16)
    want = ff.feed_forward_composite(*args, 1e-5, torch.float16)
    assert_agrees(got, want, stream(args), "large row stage")


@requires_cuda
@requires_triton
def test_cuda_compiled_and_captured_equal_eager():
    b = block().cuda()
    b.kernels = StageKernels(fused_ffn=True)
    x = torch.randn(4, 300, 128, device="cuda")
    u = torch.randn(4, 300, 128, device="cuda").half()  # the attention half's output
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        eager = b.feed_forward(x, u)
        torch._dynamo.reset()
        compiled = torch.compile(b.feed_forward, fullgraph=True)(x, u)
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        b.feed_forward(static_x, u)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            static_out = b.feed_forward(static_x, u)
        static_x.copy_(2 * x)
        graph.replay()
        again = b.feed_forward(2 * x, u)
    assert torch.equal(compiled, eager)
    assert torch.equal(static_out, again)
    b.kernels = StageKernels()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        assert_agrees(eager, b.feed_forward(x, u), x.double() + u.double(), "fused vs modules")


@requires_cuda
@requires_triton
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "triton"])
def test_cuda_compiled_skip_from_all_equal_equals_eager(resident, monkeypatch):
    """The induced-set block's pattern under Inductor: ``all_equal``'s flags (a bool tensor
    made in the graph) into either kernel's skip epilogue. The wiring fails to lower when the
    Triton launch views the flags as uint8."""
    monkeypatch.setattr(ff, "RESIDENT_KERNEL", resident)
    b = block().cuda()
    b.kernels = StageKernels(fused_ffn=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, 128, generator=g).cuda()
    x[1] = x[3] = -100.0  # two sets made only of the sentinel
    u = torch.randn(4, 300, 128, generator=g).cuda().half()

    def forward(x, u):
        return b.feed_forward(x, u, torch.ops.tabserve.all_equal(x, -100.0, 2))

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        eager = forward(x, u)
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True)(x, u)
        plain = b.feed_forward(x, u)
    assert torch.equal(compiled, eager)
    assert bool((eager[[1, 3]] == -100).all())
    assert torch.equal(eager[[0, 2]], plain[[0, 2]])


def fused_and_plain(
    task: str, set_flags, kernel_module, launcher: str = "_launch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full v2 model's outputs on one table in fp16 on CUDA with ``set_flags(model, True)``
    and with ``set_flags(model, False)``; asserts that ``kernel_module``'s ``launcher`` ran."""
    model = copy.deepcopy(our_model(task, "full")).cuda()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(2, 300, 10, generator=g).cuda()
    y = (torch.arange(240) % 4).float()[None].expand(2, -1).cuda()
    if task == "reg":
        y = torch.randn(2, 240, generator=g).cuda()
    calls, launch = [], getattr(kernel_module, launcher)
    setattr(kernel_module, launcher, lambda *a: calls.append(1) or launch(*a))
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            set_flags(model, True)
            fused = model(X, y).float()
            set_flags(model, False)
            plain = model(X, y).float()
    finally:
        setattr(kernel_module, launcher, launch)
    assert calls, "the fused kernel never ran"
    return fused, plain


def assert_model_outputs_agree(task: str, fused: torch.Tensor, plain: torch.Tensor) -> None:
    """fp16 recipes' tolerance: probabilities within 2e-2 and argmax agreement >= 99%
    (classifier), median relative difference <= 1e-2 (regressor quantiles)."""
    if task == "clf":
        p, q = fused.softmax(-1), plain.softmax(-1)
        assert (p - q).abs().max() <= 2e-2
        assert (p.argmax(-1) == q.argmax(-1)).double().mean() >= 0.99
    else:
        assert ((fused - plain).abs() / plain.abs().clamp_min(1e-3)).median() <= 1e-2


@requires_cuda
@requires_triton
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "triton"])
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_model_with_the_fused_ffn_matches_the_modules_in_fp16(task, resident, monkeypatch):
    def fused_feed_forward(model, on):
        use_stage_kernels(model, StageKernels(fused_ffn=on))

    monkeypatch.setattr(ff, "RESIDENT_KERNEL", resident)
    launcher = "_resident" if resident else "_launch"
    fused, plain = fused_and_plain(task, fused_feed_forward, ff, launcher)
    assert_model_outputs_agree(task, fused, plain)


@requires_cuda
@requires_triton
@pytest.mark.parametrize("row_tokens", [False, True], ids=["out-projection", "row-tokens"])
@pytest.mark.parametrize("task", ["clf", "reg"])
def test_cuda_model_with_the_out_projection_folded_matches_the_modules_in_fp16(
    task, row_tokens, monkeypatch
):
    """Both fused operators, RoPE in the projections, the out-projections in the feed-forward's
    Triton kernel and the head-dim-16 kernel, with and without the column stage's last
    feed-forward writing the row stage's tokens (the large preset's kernels), against the
    modules in fp16. This
    table's streams are short enough for the resident kernel, which does not fold the
    projection: it is turned off, so the Triton kernel serves every block."""
    monkeypatch.setattr(ff, "RESIDENT_KERNEL", False)

    def route(model, on):
        kernels = StageKernels(
            fused_ffn=on,
            fused_norm_linear=on,
            rope_in_projection=on,
            fused_out_projection=on,
            fused_row_tokens=on and row_tokens,
        )
        use_stage_kernels(model, kernels)
        row = dataclasses.replace(kernels, attention="head16" if on else "math")
        use_stage_kernels(model.row_interactor, row)

    fused, plain = fused_and_plain(task, route, ff)
    assert_model_outputs_agree(task, fused, plain)
