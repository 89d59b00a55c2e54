"""tabserve::layer_norm_cast: a LayerNorm rounded to the matmul dtype in one pass, and the
blocks' eager CUDA autocast path that runs it and ``feed_forward_resident`` instead of the
modules.

References: float64 LayerNorm maths rounded once to the output dtype (the CPU kernel, fp32
maths, must be within one rounding of it and nearly always equal), the CPU kernel for the CUDA
kernel (another summation order), and the modules under autocast for the blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import requires_cuda
from tabserve import ops
from tabserve.models.tabicl.network import layers
from test_feed_forward import agreement, block

HALF = (torch.float16, torch.bfloat16)


def make_args(leading, width, seed=0, bias=True, x_dtype=torch.float32, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)
    # An offset and a spread per row, as the residual streams have.
    x = 3 * torch.randn(*leading, 1, generator=g, device=device)
    x = x + torch.randn(*leading, width, generator=g, device=device)
    weight = 1 + 0.2 * torch.randn(width, generator=g, device=device)
    b = 0.1 * torch.randn(width, generator=g, device=device) if bias else None
    return x.to(x_dtype), weight, b


def float64_reference(x, weight, bias, eps, dtype):
    w = weight.double()
    b = None if bias is None else bias.double()
    return F.layer_norm(x.double(), (x.shape[-1],), w, b, eps).to(dtype)


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in roundings of ``want``'s dtype at each element's magnitude, or
    at 1/64 for smaller ones: below it fp32 maths' own error (about 3e-7 after the mean's
    cancellation in rows offset by a few units) is more than half a rounding."""
    eps = torch.finfo(want.dtype).eps
    scale = want.double().abs().clamp_min(2.0**-6) * eps
    return ((got.double() - want.double()).abs() / scale).max().item()


CPU_CASES = [((7,), 128, True), ((2, 9), 512, False), ((3,), 96, True), ((1, 1, 4), 33, True)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpu_kernel_is_float64_maths_rounded_once(case, dtype):
    leading, width, bias = case
    x, weight, b = make_args(leading, width, bias=bias)
    got = ops.layer_norm_cast(x, weight, b, 1e-5, dtype)
    want = float64_reference(x, weight, b, 1e-5, dtype)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert (got == want).double().mean().item() >= 0.99
    assert ulps(got, want) <= 1.0


def test_cpu_kernel_is_autocasts_layer_norm_and_cast_bit_for_bit():
    """What a LayerNorm followed by a linear sees under autocast: the fp32 LayerNorm, then the
    cast of its output."""
    norm = torch.nn.LayerNorm(128)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    torch.nn.init.normal_(norm.bias, 0.0, 0.1)
    x, *_ = make_args((4, 10), 128, seed=1)
    with torch.no_grad():
        want = norm(x).bfloat16()
        got = ops.layer_norm_cast(x, norm.weight, norm.bias, norm.eps, torch.bfloat16)
    assert torch.equal(got, want)


def test_half_input_is_read_in_float32():
    x, weight, b = make_args((5,), 128, x_dtype=torch.float16)
    got = ops.layer_norm_cast(x, weight, b, 1e-5, torch.float16)
    assert torch.equal(got, F.layer_norm(x.float(), (128,), weight, b, 1e-5).half())


def test_opcheck_and_one_graph():
    for args in (make_args((5, 3), 128), make_args((4,), 512, bias=False)):
        torch.library.opcheck(
            torch.ops.tabserve.layer_norm_cast.default, (*args, 1e-5, torch.float16)
        )
    x, weight, b = make_args((6, 11), 128)
    fn = torch.compile(
        lambda x: torch.ops.tabserve.layer_norm_cast(x, weight, b, 1e-5, torch.bfloat16),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    torch._dynamo.reset()
    assert torch.equal(fn(x), ops.layer_norm_cast(x, weight, b, 1e-5, torch.bfloat16))


BAD_INPUTS = [
    ("dtype", {"dtype": torch.float32}, "dtype must be float16 or bfloat16"),
    ("x dtype", {"x": torch.ones(4, 128, dtype=torch.int32)}, "x must be floating point"),
    ("x width", {"x": torch.ones(4, 64)}, r"x must be \[\.\.\., 128\]"),
    ("x scalar", {"x": torch.tensor(1.0)}, r"x must be \[\.\.\., 128\]"),
    ("weight dtype", {"weight": torch.ones(128).half()}, "weight must be float32"),
    ("weight shape", {"weight": torch.ones(2, 64)}, "weight must be a non-empty 1-D"),
    ("bias shape", {"bias": torch.ones(64)}, "bias must be float32 of weight's shape"),
    ("bias dtype", {"bias": torch.ones(128).double()}, "bias must be float32"),
    ("eps negative", {"eps": -1.0}, "eps must be finite and >= 0"),
    ("eps nan", {"eps": float("nan")}, "eps must be finite and >= 0"),
]


def call_with(changes: dict, device="cpu"):
    args = {"x": torch.ones(4, 128), "weight": torch.ones(128), "bias": torch.zeros(128),
            "eps": 1e-5, "dtype": torch.float16}  # fmt: skip
    args.update(changes)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return torch.ops.tabserve.layer_norm_cast(**moved)


@pytest.mark.parametrize("name,changes,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_naming_the_argument(name, changes, message):
    with pytest.raises(RuntimeError, match=message):
        call_with(changes)
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=message):
            call_with(changes, "cuda")


def test_fake_kernel_refuses_what_the_kernels_refuse():
    assert call_with({}, "meta").shape == (4, 128)
    with pytest.raises(RuntimeError, match="dtype must be float16 or bfloat16"):
        call_with({"dtype": torch.float32}, "meta")
    with pytest.raises(RuntimeError, match="bias is on cpu but x is on meta"):
        torch.ops.tabserve.layer_norm_cast(
            torch.ones(4, 128, device="meta"), torch.ones(128, device="meta"),
            torch.ones(128), 1e-5, torch.float16,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The blocks' routing


def test_off_cuda_and_under_compile_the_modules_normalise():
    b = block()
    x = torch.randn(2, 5, 128)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layers.matmul_input(b.norm1, x), b.norm1(x))
        assert not layers._resident_serves(x, None, b.linear1.weight)
    meta = torch.empty(2, 5, 128, device="meta")
    assert layers._eager_cuda_autocast(meta) is None


# ---------------------------------------------------------------------------------------------
# CUDA

#: (leading shape, width, bias): one row, ragged blocks of warps, every width the kernel takes,
#: a width it does not (the composite), and more rows than one grid pass holds (2**20 blocks of
#: 8 rows).
CUDA_CASES = [
    ((1,), 128, True),
    ((3, 43), 128, False),
    ((1000,), 256, True),
    ((5, 77), 512, True),
    ((9,), 1024, False),
    ((13,), 96, True),
    ((9_000_000,), 128, True),
]


@requires_cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_cuda_kernel_agrees_with_the_composite(case, dtype):
    """Against the contract's ATen composite (the CPU kernel's maths) on the device."""
    leading, width, bias = case
    x, weight, b = make_args(leading, width, seed=width, bias=bias, device="cuda")
    got = ops.layer_norm_cast(x, weight, b, 1e-5, dtype)
    want = F.layer_norm(x, (width,), weight, b, 1e-5).to(dtype)
    assert got.dtype == dtype and got.shape == x.shape and got.device == x.device
    assert (got == want).double().mean().item() >= 0.99
    assert ulps(got, want) <= 1.0
    if x.numel() < 1 << 20:  # and the CPU kernel itself
        cpu = ops.layer_norm_cast(x.cpu(), weight.cpu(), None if b is None else b.cpu(), 1e-5, dtype)
        assert ulps(got.cpu(), cpu) <= 1.0


@requires_cuda
def test_cuda_reads_unaligned_strided_and_half_inputs():
    x, weight, b = (t.cuda() for t in make_args((50,), 128))
    want = ops.layer_norm_cast(x, weight, b, 1e-5, torch.float16)
    flat = torch.empty(x.numel() + 1, device="cuda")
    shifted = flat[1:].view(x.shape)  # contiguous, 4 bytes past a 16-byte boundary
    shifted.copy_(x)
    strided = torch.empty(128, 50, device="cuda").t()
    strided.copy_(x)
    # Strided: copied contiguous, then the kernel. Unaligned: the composite (ATen's sums).
    assert torch.equal(ops.layer_norm_cast(strided, weight, b, 1e-5, torch.float16), want)
    composite = ops.layer_norm_cast(shifted, weight, b, 1e-5, torch.float16)
    assert (composite == want).double().mean().item() >= 0.99 and ulps(composite, want) <= 1.0
    half = ops.layer_norm_cast(x.half(), weight, b, 1e-5, torch.float16)
    assert ulps(half.cpu(), ops.layer_norm_cast(x.half().cpu(), *(t.cpu() for t in (weight, b)),
                                                1e-5, torch.float16)) <= 1.0  # fmt: skip


@requires_cuda
def test_cuda_kernel_replays_in_a_cuda_graph():
    x, weight, b = (t.cuda() for t in make_args((300,), 512))
    want = ops.layer_norm_cast(x, weight, b, 1e-5, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.layer_norm_cast(x, weight, b, 1e-5, torch.bfloat16)  # warm-up off the capture
        with torch.cuda.graph(graph):
            out = ops.layer_norm_cast(x, weight, b, 1e-5, torch.bfloat16)
    torch.cuda.synchronize()
    x.copy_(torch.randn_like(x))  # new rows (LayerNorm ignores a shift or a scale of the old)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ops.layer_norm_cast(x, weight, b, 1e-5, torch.bfloat16))
    assert not torch.equal(out, want)


def _calls(monkeypatch) -> dict:
    """Counts the blocks' calls of the two operators."""
    counts = {"layer_norm_cast": 0, "feed_forward_resident": 0}
    for name in counts:
        real = getattr(ops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, counted)
    return counts


@requires_cuda
@pytest.mark.parametrize("dim,hidden", [(128, 256), (512, 1024)])
def test_cuda_block_under_autocast_runs_the_operators_and_agrees_with_the_modules(
    monkeypatch, dim, hidden
):
    b = block(dim, hidden).cuda()
    torch.manual_seed(1)
    q = torch.randn(3, 40, dim, device="cuda")
    kv = torch.randn(3, 70, dim, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        counts = _calls(monkeypatch)
        got = b(q, kv)
        monkeypatch.setattr(layers, "_eager_cuda_autocast", lambda x: None)
        want = b(q, kv)  # the modules
    # norm1 of the keys and of the queries, norm2 unless the resident kernel takes the half.
    resident = dim == 128
    assert counts == {"layer_norm_cast": 2 + (not resident), "feed_forward_resident": resident}
    assert got.dtype == want.dtype == torch.float32
    # Where a LayerNorm output lands on the neighbouring fp16 value, every output of its row
    # moves by a fraction of a rounding (0.58 at most on an H100, 10% of the outputs at width
    # 512): the bound is on that size, the share only rules out a wholesale difference.
    equal, worst = agreement(got.cpu(), want.cpu(), q.cpu())
    assert equal >= 0.75 and worst <= 2.0, (equal, worst)
