"""tabserve::feed_forward_resident: the feed-forward half at width 128 / FFN 256, weights
resident in shared memory on CUDA.

References: float64 maths with autocast's roundings emulated step by step (for the CPU kernel,
which must agree nearly bit for bit), and the CPU kernel for the CUDA kernel, which sums its
products in another order: it must agree on nearly every element and stay within two roundings
of the row's scale elsewhere (the same bar as the Triton kernel's, test_feed_forward.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import requires_cuda
from tabserve import ops
from tabserve.kernels import feed_forward as ff
from tabserve.models.tabicl.network.stage_kernels import StageKernels
from test_feed_forward import agreement, block

DIM, HIDDEN = ops.RESIDENT_DIM, ops.RESIDENT_HIDDEN
HALF = (torch.float16, torch.bfloat16)


def make_args(leading, compute, x_dtype=torch.float32, update=True, norm_bias=True, seed=0):
    """The operator's arguments: (x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps)."""
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*leading, DIM, generator=g)).to(x_dtype)
    change = torch.randn(*leading, DIM, generator=g).to(compute) if update else None
    norm_weight = 1 + 0.1 * torch.randn(DIM, generator=g)
    bias = 0.1 * torch.randn(DIM, generator=g) if norm_bias else None
    w1 = (torch.randn(HIDDEN, DIM, generator=g) / DIM**0.5).to(compute)
    b1 = (0.1 * torch.randn(HIDDEN, generator=g)).to(compute)
    w2 = (torch.randn(DIM, HIDDEN, generator=g) / HIDDEN**0.5).to(compute)
    b2 = (0.1 * torch.randn(DIM, generator=g)).to(compute)
    return [x, change, norm_weight, bias, w1, b1, w2, b2, 1e-5]


def to(args, device):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def stream(args) -> torch.Tensor:
    """s = x (+ update) as ATen adds it (rounded to x's dtype), in float64."""
    x, update = args[0], args[1]
    if update is None:
        return x.double()
    return (x.double() + update.double()).to(x.dtype).double()


def float64_reference(args) -> torch.Tensor:
    """The contract in float64, rounding to the weights' dtype where autocast rounds."""
    x, _, nw, nb, w1, b1, w2, b2, eps = args
    compute = w1.dtype

    def r(t):
        return t.to(compute).double()

    s = stream(args)
    normed = r(F.layer_norm(s, (DIM,), nw.double(), None if nb is None else nb.double(), eps))
    hidden = r(F.linear(normed, w1.double(), b1.double()))
    y = r(F.linear(r(F.gelu(hidden)), w2.double(), b2.double()))
    return (s + y).to(x.dtype)


CPU_CASES = [
    ((40,), torch.float16, torch.float32, True, True),
    ((3, 17), torch.bfloat16, torch.float32, False, True),
    ((2, 9), torch.float16, torch.float16, True, False),
    ((1,), torch.bfloat16, torch.bfloat16, True, True),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpu_kernel_is_float64_maths_with_the_same_roundings(case):
    leading, compute, x_dtype, update, norm_bias = case
    args = make_args(leading, compute, x_dtype, update, norm_bias)
    got = ops.feed_forward_resident(*args[:1], *args[2:8], args[8], update=args[1])
    want = float64_reference(args)
    assert got.dtype == x_dtype and got.shape == args[0].shape and got.is_contiguous()
    # fp32 sums against fp64 ones: a rounding to the weights' dtype flips now and then, the
    # flip then travels through the rest of the row's products.
    equal, worst = agreement(got, want, stream(args))
    assert equal >= 0.97 and worst <= (2.0 if compute == torch.float16 else 16.0), (equal, worst)


def test_cpu_kernel_is_the_block_under_autocast():
    """The operator with the block's parameters cast as the dispatcher casts them gives the
    block's own feed-forward half under CPU autocast (bf16; fp32 stream, bf16 update)."""
    b = block()
    x = torch.randn(2, 30, DIM)
    update = torch.randn(2, 30, DIM).bfloat16()
    n, l1, l2 = b.norm2, b.linear1, b.linear2
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = b.feed_forward(x, update)
        bf = torch.bfloat16
        got = ops.feed_forward_resident(
            x, n.weight, n.bias, l1.weight.to(bf), l1.bias.to(bf), l2.weight.to(bf),
            l2.bias.to(bf), n.eps, update=update,
        )  # fmt: skip
    equal, worst = agreement(got, want, x.double() + update.double())
    assert equal >= 0.97 and worst <= 16.0, (equal, worst)


def test_skipped_sets_get_the_skip_value():
    args = make_args((3, 4, 5), torch.float16)
    skip = torch.tensor([[False, True, False, True]] * 3)
    skip[1, 1] = False
    plain = torch.ops.tabserve.feed_forward_resident(*args)
    got = torch.ops.tabserve.feed_forward_resident(*args, skip, -100.0)
    assert bool((got[skip] == -100).all()) and torch.equal(got[~skip], plain[~skip])


def test_opcheck():
    for args in (
        make_args((5, 3), torch.float16),
        make_args((4,), torch.bfloat16, torch.bfloat16, update=False, norm_bias=False),
    ):
        torch.library.opcheck(torch.ops.tabserve.feed_forward_resident.default, tuple(args))
    skip = torch.tensor([True, False, False, True, False])
    args = (*make_args((5, 3), torch.float16), skip, -100.0)
    torch.library.opcheck(torch.ops.tabserve.feed_forward_resident.default, args)


def test_compiles_in_one_graph():
    args = make_args((6, 11), torch.bfloat16)
    fn = torch.compile(lambda *a: torch.ops.tabserve.feed_forward_resident(*a), fullgraph=True,
                       backend="aot_eager")  # fmt: skip
    torch._dynamo.reset()
    assert torch.equal(fn(*args), torch.ops.tabserve.feed_forward_resident(*args))


def bad(args, **changes):
    names = ["x", "update", "norm_weight", "norm_bias", "w1", "b1", "w2", "b2", "eps"]
    for name, value in changes.items():
        args[names.index(name)] = value
    return args


BAD_INPUTS = [
    ("w1", lambda a: bad(a, w1=a[4].float()), "w1 must be float16 or bfloat16"),
    ("x width", lambda a: bad(a, x=a[0][..., :64]), r"x must be \[\.\.\., 128\]"),
    ("x dtype", lambda a: bad(a, x=a[0].double()), "x must be float32 or the weights' dtype"),
    ("x other half", lambda a: bad(a, x=a[0].bfloat16()), "x must be float32 or the weights'"),
    ("update shape", lambda a: bad(a, update=a[1][:3]), "update must have shape"),
    ("update dtype", lambda a: bad(a, update=a[1].float()), "update must be Half"),
    ("norm_weight shape", lambda a: bad(a, norm_weight=a[2][:5]), "norm_weight must have shape"),
    ("norm_weight dtype", lambda a: bad(a, norm_weight=a[2].half()), "norm_weight must be Float"),
    ("norm_bias", lambda a: bad(a, norm_bias=a[3].double()), "norm_bias must be Float"),
    ("w1 shape", lambda a: bad(a, w1=a[4][:128]), "w1 must have shape"),
    ("b1 shape", lambda a: bad(a, b1=a[5][:7]), "b1 must have shape"),
    ("w2 shape", lambda a: bad(a, w2=a[6].t().contiguous()), "w2 must have shape"),
    ("b2 dtype", lambda a: bad(a, b2=a[7].float()), "b2 must be Half"),
    ("eps negative", lambda a: bad(a, eps=-1.0), "eps must be finite and >= 0"),
    ("eps inf", lambda a: bad(a, eps=float("inf")), "eps must be finite and >= 0"),
    ("skip dtype", lambda a: [*a, torch.zeros(4, dtype=torch.uint8)], "skip must be a bool"),
    ("skip shape", lambda a: [*a, torch.zeros(5, dtype=torch.bool)], "skip must be a bool"),
    ("skip of all", lambda a: [*a, torch.zeros(4, 5, 128, dtype=torch.bool)], "skip must be"),
]


@pytest.mark.parametrize("name,change,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_naming_the_argument(name, change, message):
    args = change(make_args((4, 5), torch.float16))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.tabserve.feed_forward_resident(*args)
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=message):
            torch.ops.tabserve.feed_forward_resident(*to(args, "cuda"))


def test_fake_kernel_refuses_what_the_kernels_refuse():
    args = to(make_args((4, 5), torch.float16), "meta")
    assert torch.ops.tabserve.feed_forward_resident(*args).shape == (4, 5, DIM)
    with pytest.raises(RuntimeError, match="w1 must be float16 or bfloat16"):
        torch.ops.tabserve.feed_forward_resident(*bad(list(args), w1=args[4].float()))
    with pytest.raises(RuntimeError, match="b1 must be"):
        torch.ops.tabserve.feed_forward_resident(*bad(list(args), b1=args[5][:3]))
    with pytest.raises(RuntimeError, match="b2 is on cpu but x is on meta"):
        torch.ops.tabserve.feed_forward_resident(*bad(list(args), b2=torch.zeros(DIM).half()))


def test_dispatcher_routes_only_what_the_resident_kernel_serves(monkeypatch):
    x, w1 = torch.empty(4, DIM, device="meta"), torch.empty(HIDDEN, DIM, device="meta")
    assert not ff.resident_applies(x, None, w1, torch.float16)  # not CUDA
    if not torch.cuda.is_available():
        return
    x, w1 = torch.empty(4, DIM, device="cuda"), torch.empty(HIDDEN, DIM, device="cuda")
    half = torch.float16
    assert ff.resident_applies(x, None, w1, half) and ff.resident_applies(x, x.half(), w1, half)
    assert ff.resident_applies(x.bfloat16(), x.bfloat16(), w1, torch.bfloat16)
    assert not ff.resident_applies(x, None, w1, torch.float32)
    assert not ff.resident_applies(x, x, w1, half)  # fp32 update: the Triton kernel
    assert not ff.resident_applies(x.half(), None, w1, torch.bfloat16)
    assert not ff.resident_applies(x, None, w1[:192], half)
    long_stream = x[:1].expand(ff.RESIDENT_MAX_TOKENS, DIM)  # the Triton kernel's (no memory)
    assert not ff.resident_applies(long_stream, None, w1, half)
    assert ff.resident_applies(long_stream[1:], None, w1, half)
    monkeypatch.setattr(ff, "RESIDENT_KERNEL", False)
    assert not ff.resident_applies(x, None, w1, half)


# ---------------------------------------------------------------------------------------------
# CUDA

#: (leading shape, x dtype, update, norm bias): one token, ragged warp tiles, one block's worth,
#: and more tiles than a grid of one block per SM takes in one pass (the persistent loop).
CUDA_CASES = [
    ((1,), torch.float32, True, True),
    ((17,), "half", False, True),
    ((3, 43), torch.float32, False, False),
    ((128,), "half", True, True),
    ((8, 2131), torch.float32, True, True),
    ((5, 3000), "half", True, False),
]


@requires_cuda
@pytest.mark.parametrize("compute", HALF, ids=str)
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_cuda_kernel_agrees_with_the_cpu_kernel(case, compute):
    leading, x_dtype, update, norm_bias = case
    x_dtype = compute if x_dtype == "half" else x_dtype
    args = make_args(leading, compute, x_dtype, update, norm_bias, seed=len(leading))
    got = torch.ops.tabserve.feed_forward_resident(*to(args, "cuda")).cpu()
    want = torch.ops.tabserve.feed_forward_resident(*args)
    equal, worst = agreement(got, want, stream(args))
    assert equal >= 0.9 and worst <= (2.0 if compute == torch.float16 else 16.0), (equal, worst)


@requires_cuda
def test_cuda_skipped_sets_get_the_skip_value():
    args = make_args((6, 700), torch.float16, seed=3)  # sets of 700 tokens: tiles straddle them
    skip = torch.tensor([True, False, True, True, False, False])
    got = torch.ops.tabserve.feed_forward_resident(*to(args, "cuda"), skip.cuda(), -100.0).cpu()
    plain = torch.ops.tabserve.feed_forward_resident(*to(args, "cuda")).cpu()
    assert bool((got[skip] == -100).all()) and torch.equal(got[~skip], plain[~skip])


@requires_cuda
def test_cuda_large_stream_agrees_with_the_triton_kernel():
    # The large workload's row stage: 5.6 M tokens (element offsets past 2**31 bytes of fp32).
    args = to(make_args((8 * 10240 * 68,), torch.float16), "cuda")
    got = torch.ops.tabserve.feed_forward_resident(*args)
    x, update, nw, nb, w1, b1, w2, b2, eps = args
    want = ff.feed_forward_op(x, update, nw, nb, w1, b1, w2, b2, eps, torch.float16)
    equal, worst = agreement(got, want, x.double() + update.double())
    assert equal >= 0.9 and worst <= 2.0, (equal, worst)


@requires_cuda
def test_cuda_reads_unaligned_and_strided_tensors():
    args = to(make_args((50,), torch.float16), "cuda")
    want = torch.ops.tabserve.feed_forward_resident(*args)
    x, update = args[0], args[1]
    flat = torch.empty(x.numel() + 1, device="cuda")
    shifted = flat[1:].view(x.shape)  # contiguous, 4 bytes past a 16-byte boundary
    shifted.copy_(x)
    strided = torch.empty(DIM, 50, device="cuda", dtype=update.dtype).t()
    strided.copy_(update)
    got = torch.ops.tabserve.feed_forward_resident(shifted, strided, *args[2:])
    assert torch.equal(got, want)


@requires_cuda
def test_cuda_block_routes_to_the_resident_kernel_compiled_and_captured():
    b = block().cuda()
    b.kernels = StageKernels(fused_ffn=True)
    x = torch.randn(4, 70, DIM, device="cuda")
    update = torch.randn(4, 70, DIM, device="cuda").half()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        assert ff.resident_applies(x, update, b.linear1.weight, torch.float16)
        eager = b.feed_forward(x, update)
        torch._dynamo.reset()
        compiled = torch.compile(b.feed_forward, fullgraph=True)
        assert torch.equal(compiled(x, update), eager)
        graph = torch.cuda.CUDAGraph()
        compiled(x, update)
        with torch.cuda.graph(graph):
            captured = b.feed_forward(x, update)
        graph.replay()
        assert torch.equal(captured, eager)
        modules = b.linear2(F.gelu(b.linear1(b.norm2(x + update)))) + (x + update)
    equal, worst = agreement(eager, modules, (x + update).double())
    assert equal >= 0.9 and worst <= 2.0, (equal, worst)
