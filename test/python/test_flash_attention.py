"""tabserve::flash_attention: softmax attention in one pass over the keys, half or fp8 operands.

References: fp64 softmax attention of the same operands (the composite's and the kernel's errors
are bounded against it: a few half-precision roundings of the output's scale for ``fp8=False``,
e4m3's for ``fp8=True``); the composite for the Triton kernel, run under Triton's interpreter
here (fp16; the interpreter rounds fp32 to e4m3 otherwise than the GPU's round-to-nearest-even,
so its fp8 runs are held to the fp64 bound only) and on CUDA (fp16, bf16, fp8).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib.util
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from cuda_helpers import requires_cuda
from tabicl_helpers import interpreter_child
from tabserve import ops
from tabserve.kernels import flash_attention as fa

requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

#: (leading shape, queries, keys, dim): the ICL stage's shape at small sizes (heads of 64),
#: ragged query and key tiles, one key, every kernel width, no leading dimension and three.
CASES = [
    ((2, 8), 40, 70, 64),
    ((3,), 16, 1, 64),
    ((1, 2), 33, 200, 16),
    ((2,), 20, 48, 32),
    ((1, 1), 17, 65, 128),
    ((), 24, 40, 32),
    ((2, 2, 3), 20, 30, 16),
    ((2,), 1, 33, 64),
]
#: Largest |error| against fp64 maths, in units of the output's largest magnitude, for half
#: operands (weights rounded to fp16 each: a few roundings) and for fp8 ones (e4m3 keeps 3
#: mantissa bits: 2^-4 relative per rounding of q, k, v and the weights).
HALF_BOUND, FP8_BOUND = 4e-3, 0.25


def exact(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v


def operands(case, dtype=torch.float16, device="cpu", seed=0):
    lead, queries, keys, dim = case
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn(*lead, n, dim, generator=g, device=device).to(dtype)
        for n in (queries, keys, keys)
    ]


def model_layouts(case, dtype=torch.float16, device="cpu", seed=0):
    """Operands of a ``((batch, heads), queries, keys, dim)`` case as the model hands them:
    head-split views of packed projections (batch, length, 3 x heads x dim), and the same with
    one set of queries broadcast over the batch (stride 0: the column stage's inducing
    points). Returns both (q, k, v) triples."""
    (batch, heads), queries, keys, dim = case
    g = torch.Generator(device=device).manual_seed(seed)
    width = heads * dim

    def split(packed, i):
        return packed[..., i * width : (i + 1) * width].unflatten(-1, (heads, dim)).transpose(1, 2)

    packed_q, packed_kv = (
        torch.randn(batch, n, 3 * width, generator=g, device=device).to(dtype)
        for n in (queries, keys)
    )
    k, v = split(packed_kv, 1), split(packed_kv, 2)
    shared = split(packed_q[:1], 0).expand(batch, -1, -1, -1)
    return (split(packed_q, 0), k, v), (shared, k, v)


def layouts_agree(run, case, device="cpu", precisions=(False, True)) -> list[bool]:
    """Per model layout and precision (``fp8``): ``run`` on the strided operands gives the bits
    it gives on contiguous copies, in the (batch, queries, heads, dim) layout SDPA's kernels
    write."""
    found = []
    for operands_ in model_layouts(case, device=device):
        copies = [t.contiguous() for t in operands_]
        for fp8 in precisions:
            out = run(*operands_, fp8)
            found.append(
                torch.equal(out, run(*copies, fp8)) and out.transpose(1, 2).is_contiguous()
            )
    return found


def relative_error(out, q, k, v) -> float:
    want = exact(q, k, v)
    return float((out.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fp8", [False, True])
def test_composite_errs_as_its_roundings_do(case, fp8):
    q, k, v = operands(case)
    out = fa.flash_attention_composite(q, k, v, fp8)
    assert out.dtype == q.dtype and out.shape == q.shape
    error = relative_error(out, q, k, v)
    assert error <= (FP8_BOUND if fp8 else HALF_BOUND)
    if fp8 and case[2] > 1:  # one key: every weight is 1, the output v's rounding alone
        assert error > relative_error(fa.flash_attention_composite(q, k, v), q, k, v)


def test_composite_in_fp32_is_softmax_attention():
    q, k, v = operands(CASES[0], torch.float32)
    out = ops.flash_attention(q, k, v)
    assert out.dtype == torch.float32
    assert relative_error(out, q, k, v) < 1e-6
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-6)


def test_fp8_operands_are_e4m3_scaled_onto_its_range():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 7
    rounded, scale = fa.fp8_operand(x)
    assert rounded.dtype == torch.float8_e4m3fn and scale.dim() == 0
    assert float(rounded.float().abs().max()) == fa.E4M3_MAX
    back = rounded.float() * scale
    normal = x.abs() >= scale * 2.0**-6
    assert float(((back - x).abs() / x.abs())[normal].max()) <= 2.0**-4 + 1e-6
    zero, zero_scale = fa.fp8_operand(torch.zeros(5))
    assert torch.equal(zero.float(), torch.zeros(5)) and float(zero_scale) > 0


def test_cpu_operator_runs_the_composite_and_opcheck_passes():
    q, k, v = operands(CASES[0])
    for fp8 in (False, True):
        got = torch.ops.tabserve.flash_attention(q, k, v, fp8)
        assert torch.equal(got, fa.flash_attention_composite(q, k, v, fp8))
        torch.library.opcheck(torch.ops.tabserve.flash_attention.default, (q, k, v, fp8))
    empty = ops.flash_attention(q[..., :0, :], k, v)
    assert empty.shape == (*q.shape[:-2], 0, q.shape[-1])


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v: (q.int(), k, v), "q must be a floating-point tensor"),
        (lambda q, k, v: (q, k[0, 0, 0], v), "k must be a floating-point tensor"),
        (lambda q, k, v: (q, k.float(), v), "k is torch.float32 but q is torch.float16"),
        (lambda q, k, v: (q, k, v[..., :5, :]), "v must have k's shape"),
        (lambda q, k, v: (q, k[:1], v[:1]), "k must be \\(\\.\\.\\., keys, dim\\) with q's"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), "with q's leading shape and dim"),
        (lambda q, k, v: (q, k[..., :0, :], v[..., :0, :]), "k must have at least one key"),
    ],
)
def test_bad_arguments_are_named(change, match):
    q, k, v = operands(CASES[0])
    for device in ("cpu", "meta"):  # meta: the checks the traced (fake) kernel runs
        with pytest.raises(ValueError, match=match):
            ops.flash_attention(*change(q.to(device), k.to(device), v.to(device)))


def test_meta_tensors_give_the_output_shape_and_dtype():
    q, k, v = (t.to("meta") for t in operands(CASES[0]))
    for fp8 in (False, True):
        out = torch.ops.tabserve.flash_attention(q, k, v, fp8)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"


@requires_cuda
@pytest.mark.cuda
def test_cuda_operands_on_another_device_are_named():
    q, k, v = operands(CASES[0])
    with pytest.raises(ValueError, match="k is on cuda"):
        ops.flash_attention(q, k.cuda(), v)


def test_tile_override_takes_powers_of_two_from_16_only():
    bad = (
        (8, 64, 4, 3),
        (128, 96, 4, 3),
        (64, 64, 0, 3),
        (64, 64, 4, 3, 16),  # registers
        (64, 64, 4, 3, None, 1),  # permuted: a bool
        (64, 64, 4, 3, None, False, 1),  # tma: a bool
        (64, 64, 4, 3, None, False, False, 8),  # too many fields
        (64, 64),
    )
    for tile in bad:
        with pytest.raises(ValueError, match="bad tile"), fa.tile_override(tile):
            pass
    for tile in ((16, 32, 1, 1), (64, 128, 4, 3, 128), fa.Tile(64, 128, 4, 3, 168, True)):
        with fa.tile_override(tile):
            assert fa.TILE_OVERRIDE == fa.Tile(*tile)
    assert fa.TILE_OVERRIDE is None
    assert fa.Tile(64, 128, 4, 3, 168, True).label == "64x128 w4 s3 r168 permuted"
    assert fa.Tile(64, 128, 4, 3, 128, True, True).label == "64x128 w4 s3 r128 permuted tma"
    assert fa.Tile(64, 64, 4, 3, tma=True).fp8_only and not fa.Tile(64, 64, 4, 3).fp8_only


def test_kernel_applies_to_cuda_half_operands_of_its_widths_only():
    q = torch.empty(2, 3, 64, dtype=torch.float16)
    assert not fa.kernel_applies(q, False)  # CPU
    if torch.cuda.is_available() and fa.triton is not None:
        assert fa.kernel_applies(q.cuda(), False)
        assert not fa.kernel_applies(q.cuda().float(), False)
        assert not fa.kernel_applies(q[..., :48].cuda(), False)
        assert fa.kernel_applies(q[..., :16].cuda(), False)
        assert not fa.kernel_applies(q[..., :16].cuda(), True)  # fp8 sums 32 or more


@requires_triton
def test_kernel_under_the_interpreter_agrees_with_the_composite():
    """The Triton program on CPU tensors (a child under ``TRITON_INTERPRET=1``) with 16 x 16 and
    32 x 64 tiles: ragged tiles, the masked last key block, every width; operands in the
    model's strided layouts; a batch in several launches; fp8's permuted score columns and
    TMA descriptors."""
    results = interpreter_child("import test_flash_attention as t; t.interpreter_cases()")
    assert results["batches_in_parts_equal_one_launch"] == [True, True]
    # head-split views and broadcast queries read in place: the copies' bits, in SDPA's layout
    assert results["strided_layouts_equal_contiguous"] == [[True] * 4] * 2
    # the permuted score columns (ragged last blocks included) change only the sums' order
    assert max(results["fp8_permuted_vs_key_order"]) <= 2.0**-10
    # TMA descriptors over the padded copies read what the pointers read (keys past 16-key
    # groups, ragged last blocks, K in score order)
    assert results["fp8_tma_equals_pointer_loads"] == [True] * 2 * len(CASES)
    assert len(results["cases"]) == 2 * len(CASES)  # two tiles
    for half_vs_composite, half_error, fp8_error, shape in results["cases"]:
        assert half_vs_composite <= 2 * 2.0**-10, shape  # two fp16 roundings of the scale
        assert half_error <= HALF_BOUND and fp8_error <= FP8_BOUND, shape


def sm90_compile(fp8: bool, tile) -> tuple[str, str, collections.Counter]:
    """The kernel compiled for sm_90 (the H200) here, without a GPU, as the JIT specialises the
    xlarge call's launch (16-divisible pointers, sizes and strides; the unit stride a
    constant) with ``tile`` (a :class:`~tabserve.kernels.flash_attention.Tile`): its PTX,
    ``ptxas -v``'s report on it, and the opcodes of its main loop's SASS (``nvdisasm``)."""
    import subprocess

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tile = fa.Tile(*tile)
    element = "*fp8e4nv" if fp8 else "*fp16"
    types = {"Q": element, "K": element, "V": element, "Out": "*fp16", "Scales": "*fp32"}
    tma = fp8 and tile.tma
    if tma:  # the 2-d descriptors over K's (keys, dim) and V's (dim, keys) storage
        types["K"] = f"tensordesc<fp8e4nv[{tile.block_n}, 64]>"
        types["V"] = f"tensordesc<fp8e4nv[64, {tile.block_n}]>"
    constants = {
        "SM_SCALE_LOG2": math.log2(math.e) / 8,
        "HEAD_DIM": 64,
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "FP8": fp8,
        "BF16": False,
        "PERMUTED": fp8 and tile.permuted,
        "TMA": tma,
        # fp8's v is keys-contiguous, half's dims-contiguous
        ("stride_vn" if fp8 else "stride_vd"): 1,
    }
    names = fa._flash_attention_kernel.arg_names
    signature = {
        n: "constexpr" if n in constants else types.get(n, "i64" if "_b" in n else "i32")
        for n in names
    }
    hints = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constants and not types.get(n, "").startswith("tensordesc")
    }
    source = ASTSource(fa._flash_attention_kernel, signature, constexprs=constants, attrs=hints)
    options = {"num_warps": tile.warps, "num_stages": tile.stages}
    if tile.registers:
        options["maxnreg"] = tile.registers
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    folder = Path(tempfile.mkdtemp())
    (folder / "flash.ptx").write_text(compiled.asm["ptx"])
    (folder / "flash.cubin").write_bytes(compiled.asm["cubin"])
    limit = [f"--maxrregcount={tile.registers}"] if tile.registers else []
    report = subprocess.run(  # the ptxas Triton compiled with
        [knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", *limit, str(folder / "flash.ptx")]
        + ["-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    )
    sass = subprocess.run(
        [knobs.nvidia.nvdisasm.path, "-c", str(folder / "flash.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return compiled.asm["ptx"], report.stdout + report.stderr, main_loop_opcodes(sass)


def main_loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (without modifiers) of the longest loop in ``nvdisasm`` output: from a label to
    the last predicated branch back to it (an unconditional one back is the return from an
    out-of-line wait, as TMA's barrier waits have)."""
    lines = [re.sub(r"/\*[^*]*\*/", "", line) for line in sass.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.L\w+):", line))}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := re.search(r"@!?U?P\w+\s+BRA\s+`\((\.L\w+)\)", line))
        and labels.get(m.group(1), i) < i
    ]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    found = collections.Counter()
    for line in lines[start:end]:
        if m := re.match(r"\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)\b", line):
            found[m.group(1)] += 1
    return found


@requires_triton
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_compiles_for_the_h200_without_spills_or_serialised_matmuls(fp8):
    """The default tile compiled for sm_90 (no GPU needed): no local-memory traffic in the
    key-block loop (fp8's register cap, 168, spills a few bytes outside it: at most 16), and no
    matmul that ptxas had to serialise (warning C7514, which Triton's own fp8 promotion,
    ``max_num_imprecise_acc``, caused; the kernel's per-block fp32 add does not)."""
    tile = fa.TILES[fp8]
    ptx, report, loop = sm90_compile(fp8, tile)
    used = re.search(r"Used (\d+) registers", report)
    assert used and int(used.group(1)) <= (tile.registers or 255), report
    spilled = re.search(r"\b(\d+) bytes spill stores", report)
    assert spilled and int(spilled.group(1)) <= (16 if tile.registers else 0), report
    assert loop["STL"] == loop["LDL"] == 0, loop
    assert "C7514" not in report and "serialized" not in report, report
    if fp8:
        # P @ V (weights from registers, m64 x n64 x k32 steps): each key block's product starts
        # from a zero accumulator (scale-d 0 on its first step) and is added in fp32 after, so
        # the tensor cores' reduced-precision adds never chain across blocks.
        pv = re.findall(
            r"wgmma\.mma_async[^\n]*m64n64k32\.f32\.e4m3\.e4m3 \{[^}]*\}, \{[^\n]*", ptx
        )
        fresh = [line for line in pv if line.rstrip().endswith(", 0, 1, 1;")]
        steps = fa.TILES[True][1] // 32
        assert pv and len(fresh) * steps == len(pv), pv


@requires_triton
def test_permuted_fp8_tile_hands_its_weights_to_the_matmul_without_lane_shuffles():
    """The default fp8 tile (permuted, in the sweep) compiled for sm_90: its main loop has no
    lane shuffle other than the row reductions' butterflies, no byte permutes and no
    local-memory traffic, and at least 40 instructions fewer per key block than the same tile
    in key order; at most 168 registers (3 programs per SM)."""
    tile = fa.TILES[True]
    assert tile.permuted and tile in fa.SWEEP
    _, report, permuted = sm90_compile(True, tile)
    _, _, natural = sm90_compile(True, tile._replace(permuted=False))
    used = re.search(r"Used (\d+) registers", report)
    assert used and int(used.group(1)) <= 168, report
    assert natural["PRMT"] and natural["SHFL"] > permuted["SHFL"]  # what the order removes
    assert permuted["PRMT"] == 0 and permuted["STL"] == permuted["LDL"] == 0, permuted
    assert sum(natural.values()) - sum(permuted.values()) >= 40, (natural, permuted)


@requires_triton
@pytest.mark.parametrize("tile", [t for t in fa.SWEEP if t.tma], ids=lambda t: t.label)
def test_tma_fp8_tiles_load_through_descriptors_without_per_thread_copies(tile):
    """Each TMA tile of the sweep compiled for sm_90: its key-block loop issues TMA loads
    (UTMALDG) and no per-thread copies (LDGSTS), touches no local memory, and keeps within
    its register cap (128: four 4-warp programs per SM)."""
    _, report, loop = sm90_compile(True, tile)
    used = re.search(r"Used (\d+) registers", report)
    assert used and int(used.group(1)) <= tile.registers, report
    assert loop["UTMALDG"] and not loop["LDGSTS"], loop
    assert loop["STL"] == loop["LDL"] == 0, loop


def tma_operator_case() -> None:
    """The child's side of the TMA operator test: the operator eager, compiled (fullgraph) and
    under fake tensors on CPU operands (the interpreter runs its launches)."""
    import json

    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = operands(CASES[0])
    q = q.transpose(-2, -3).contiguous().transpose(-2, -3)  # a head-split layout, read in place
    eager = fa._tma_op(q, k, v)
    with fa.tile_override(fa.TILES[True]):
        launched = fa.run_kernel(q, k, v, True)
    compiled = torch.compile(lambda a, b, c: fa._tma_op(a, b, c) * 2, fullgraph=True)(q, k, v)
    with FakeTensorMode() as mode:
        fake = fa._tma_op(*(mode.from_tensor(t) for t in (q, k, v)))
    print(
        json.dumps(
            {
                "eager_equals_launch": torch.equal(eager, launched),
                "compiled_equals_eager": torch.equal(compiled, eager * 2),
                "fake_layout": [list(fake.shape), list(fake.stride())],
                "eager_layout": [list(eager.shape), list(eager.stride())],
            }
        )
    )


@requires_triton
def test_tma_operator_compiles_and_fakes_its_output_layout():
    """``tabserve::flash_attention_tma``, the operator Inductor calls as it is (CPU operands,
    the launches under the interpreter): the default fp8 tile's bits eager and compiled, and
    a fake kernel giving the real output's shape and strides."""
    results = interpreter_child("import test_flash_attention as t; t.tma_operator_case()")
    assert results["eager_equals_launch"] and results["compiled_equals_eager"]
    assert results["fake_layout"] == results["eager_layout"]


def interpreter_cases() -> None:
    """The child's side of the interpreter test: per tile and case, [the fp16 kernel's largest
    difference from the composite, both precisions' errors against fp64 (relative to the
    output's largest magnitude), the output shape]; and whether a batch launched in parts (the
    grid's limit lowered to 3 of its 16 tables x heads) gives the one launch's bits."""
    import json

    q, k, v = operands(CASES[0])
    parts = []
    for fp8 in (False, True):
        with fa.tile_override((16, 16, 1, 1)):
            whole = fa.run_kernel(q, k, v, fp8)
            saved, fa.MAX_GRID_BATCH = fa.MAX_GRID_BATCH, 3
            try:
                parts.append(torch.equal(fa.run_kernel(q, k, v, fp8), whole))
            finally:
                fa.MAX_GRID_BATCH = saved
    out = []
    for tile in ((16, 16, 1, 1), (32, 64, 1, 1)):
        with fa.tile_override(tile):
            for case in CASES:
                q, k, v = operands(case)
                half = fa.run_kernel(q, k, v)
                scale = float(exact(q, k, v).abs().max())
                composite = fa.flash_attention_composite(q, k, v)
                out.append(
                    [
                        float((half.double() - composite.double()).abs().max()) / scale,
                        relative_error(half, q, k, v),
                        relative_error(fa.run_kernel(q, k, v, True), q, k, v),
                        list(half.shape),
                    ]
                )
    with fa.tile_override((16, 16, 1, 1)):
        layouts = [layouts_agree(fa.run_kernel, case) for case in (CASES[0], CASES[2])]
    # fp8 with the permuted score columns against key order: the same weights and products,
    # the row sums added in another order (largest difference over the output's scale)
    permuted = []
    for case in CASES:
        q, k, v = operands(case)
        with fa.tile_override((32, 64, 1, 1)):
            natural = fa.run_kernel(q, k, v, True)
        with fa.tile_override((32, 64, 1, 1, None, True)):
            reordered = fa.run_kernel(q, k, v, True)
        scale = float(natural.double().abs().max())
        permuted.append(float((reordered.double() - natural.double()).abs().max()) / scale)
    # K and V through TMA descriptors (zero-padded e4m3 copies, K stored in score order when
    # permuted) against pointer loads, key order and permuted: the same bits
    tma = []
    for case in CASES:
        q, k, v = operands(case)
        for order in (False, True):
            with fa.tile_override((32, 64, 1, 1, None, order)):
                loaded = fa.run_kernel(q, k, v, True)
            with fa.tile_override((32, 64, 1, 1, None, order, True)):
                tma.append(torch.equal(fa.run_kernel(q, k, v, True), loaded))
    print(
        json.dumps(
            {
                "cases": out,
                "batches_in_parts_equal_one_launch": parts,
                "strided_layouts_equal_contiguous": layouts,
                "fp8_permuted_vs_key_order": permuted,
                "fp8_tma_equals_pointer_loads": tma,
            }
        )
    )


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_kernel_agrees_with_the_composite(case, dtype):
    q, k, v = operands(case, dtype, "cuda")
    got = ops.flash_attention(q, k, v)
    want = fa.flash_attention_composite(q, k, v)
    scale = float(exact(q, k, v).abs().max())
    eps = torch.finfo(dtype).eps
    assert float((got.double() - want.double()).abs().max()) <= 4 * eps * scale
    assert relative_error(got, q, k, v) <= (HALF_BOUND if dtype == torch.float16 else 8 * eps)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_cuda_fp8_kernel_agrees_with_the_composite(case):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    q, k, v = operands(case, torch.float16, "cuda")
    got = ops.flash_attention(q, k, v, fp8=True)
    want = fa.flash_attention_composite(q, k, v, fp8=True)
    error = relative_error(got, q, k, v)
    assert error <= FP8_BOUND
    # Same operands, same rounding of the weights up to the running maximum's rescaling.
    assert error <= 2 * relative_error(want, q, k, v) + 1e-3


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("tile", fa.SWEEP, ids=lambda t: t.label.replace(" ", "-"))
def test_cuda_fp8_sweep_tiles_agree_with_the_composite(tile):
    """Each tile the benchmark's sweep may promote to the default (the permuted score order
    included) on the ragged cases: the composite's error bound, and where its key blocks are
    the default tile's (so are the running maxima the weights are rounded under), the default
    tile's result up to the order of the sums."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    for case in CASES:
        if case[-1] < 32:  # (fp8 runs head dims from 32)
            continue
        q, k, v = operands(case, torch.float16, "cuda", seed=5)
        default = ops.flash_attention(q, k, v, fp8=True)
        with fa.tile_override(tile):
            got = ops.flash_attention(q, k, v, fp8=True)
        want = fa.flash_attention_composite(q, k, v, fp8=True)
        assert relative_error(got, q, k, v) <= 2 * relative_error(want, q, k, v) + 1e-3, case
        if tile.block_n == fa.TILES[True].block_n:
            scale = float(default.abs().max())
            assert float((got - default).abs().max()) <= 2.0**-8 * scale, case


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_long_keys_with_values_of_one_sign_keep_their_sum(fp8):
    """20,000 keys whose values share an offset (as a projection's bias gives them): the
    output is near the offset, and a running sum that lost bits block after block (Hopper's
    fp8 matmuls accumulate in reduced precision unless promoted) would drift from it. The
    kernel stays within its composite's error plus a few roundings."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    q, k, v = operands(((2, 2), 256, 20_000, 64), torch.float16, "cuda", seed=3)
    v = (v.float() * 0.5 + 3.0).half()
    got = ops.flash_attention(q, k, v, fp8)
    want = fa.flash_attention_composite(q, k, v, fp8)
    bound = relative_error(want, q, k, v) + (2e-3 if fp8 else 2 * 2.0**-10)
    assert relative_error(got, q, k, v) <= bound


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("case", [((8, 8), 300, 1000, 64), ((40, 8), 128, 3000, 16)])
def test_cuda_model_layouts_read_in_place_give_the_copies_bits(case):
    """The ICL stage's head-split projections and the column stage's broadcast inducing points
    (head dim 16, long key runs): read at their strides, the copies' results bit for bit."""
    # fp8 where the kernel takes it (head dims from 32, compute capability 8.9)
    fp8 = case[-1] >= 32 and torch.cuda.get_device_capability() >= (8, 9)
    agree = layouts_agree(ops.flash_attention, case, "cuda", (False, True) if fp8 else (False,))
    assert all(agree), agree


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [((3,), 16, 1, 64), ((2,), 1, 33, 64), ((2,), 1, 1, 64)])
def test_cuda_fp8_one_key_or_one_query_eager_and_compiled(shape):
    """Counts of one, which Triton and Inductor would compile as constants (a kernel so
    specialised returned NaN rows for one key): the default fp8 tile's output is finite and
    within the composite's error bound, eager and compiled alike."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    q, k, v = operands(shape, torch.float16, "cuda", seed=5)
    eager = ops.flash_attention(q, k, v, True)
    want = fa.flash_attention_composite(q, k, v, fp8=True)
    assert relative_error(eager, q, k, v) <= 2 * relative_error(want, q, k, v) + 1e-3
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: ops.flash_attention(a, b, c, True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize(
    "tile", [None, *(t for t in fa.SWEEP if t.tma)], ids=lambda t: t and t.label.replace(" ", "-")
)
def test_cuda_icl_shape_compiles_into_one_graph_and_replays(tile):
    """The ICL stage's call at a reduced size: 8 tables x 8 heads of 64, 3,000 keys; compiled
    with fullgraph and captured in a CUDA graph, both equal to eager bit for bit; with the
    default tiles and each TMA tile of the sweep (fp8: descriptors made at trace time by
    Inductor, and baked into the graph)."""
    q, k, v = operands(((8, 8), 1000, 3000, 64), torch.float16, "cuda")
    torch._dynamo.reset()  # (the tile is read when tracing)
    with fa.tile_override(tile) if tile else contextlib.nullcontext():
        for fp8 in (False, True) if tile is None else (True,):
            if fp8 and torch.cuda.get_device_capability() < (8, 9):
                continue
            eager = ops.flash_attention(q, k, v, fp8)
            compiled = torch.compile(
                lambda a, b, c, fp8=fp8: ops.flash_attention(a, b, c, fp8), fullgraph=True
            )
            assert torch.equal(compiled(q, k, v), eager)
            graph = torch.cuda.CUDAGraph()
            ops.flash_attention(q, k, v, fp8)  # warm up outside the capture
            with torch.cuda.graph(graph):
                replayed = ops.flash_attention(q, k, v, fp8)
            graph.replay()
            assert torch.equal(replayed, eager)


@pytest.mark.parametrize("backend", ["flash-half", "flash-fp8"])
def test_model_stage_on_the_operator_routes_its_unpadded_calls(backend, monkeypatch):
    """A ``flash-*`` attention backend for the ICL stage sends that stage's unpadded attention to
    the operator (the column and row stages keep SDPA). On CPU in fp32 the composite runs: on
    half operands that is softmax attention (the model's answers within fp32 rounding), on fp8
    ones the answers move, by less than the reduced-precision gate (2e-2)."""
    from tabicl_helpers import our_model, random_table
    from tabserve.models.tabicl.network import layers
    from tabserve.models.tabicl.network.stage_kernels import StageKernels, use_stage_kernels

    calls = []
    original = layers._flash_attention_op()
    monkeypatch.setattr(
        layers, "_flash_attention_op", lambda: lambda *a: calls.append(a[3]) or original(*a)
    )
    plain = our_model("clf", "tiny")  # cached: shared with other tests, so not changed here
    routed = copy.deepcopy(plain)
    use_stage_kernels(routed.icl_predictor, StageKernels(attention=backend))
    X, y = random_table(5, 2, 40, 12, 5, 3)
    with torch.no_grad():
        want = plain(X, y, return_logits=False)
        got = routed(X, y, return_logits=False)
    assert calls and set(calls) == {backend == "flash-fp8"}
    difference = float((got - want).abs().max())
    if backend == "flash-half":
        assert difference <= 1e-5
    else:
        assert 1e-5 < difference < 2e-2


def test_column_stage_on_head16_flash_splits_its_calls_by_key_run(monkeypatch):
    """``head16-flash`` in the column stage: the rows over the 128 induced tokens on the
    head-dim-16 operator, the inducing points over the train rows (longer runs) on this one,
    half operands. Run on the CPU (fp32, heads of 4) with the head-dim-16 operator let in and
    stood in for by SDPA: the answers are the plain model's within fp32 rounding."""
    from tabicl_helpers import our_model, random_table
    from tabserve.models.tabicl.network import layers
    from tabserve.models.tabicl.network.stage_kernels import StageKernels, use_stage_kernels

    small, flash = [], []
    original_flash = layers._flash_attention_op()
    monkeypatch.setattr(layers, "_small_head_kernel_applies", lambda q, k, v: True)
    monkeypatch.setattr(
        ops,
        "small_head_attention",
        lambda q, k, v, n_keys, rotary: (
            small.append((k.shape[-2], n_keys, rotary))
            or torch.nn.functional.scaled_dot_product_attention(q, k, v)
        ),
    )
    monkeypatch.setattr(
        layers,
        "_flash_attention_op",
        lambda: (
            lambda q, k, v, fp8: flash.append((k.shape[-2], fp8)) or original_flash(q, k, v, fp8)
        ),
    )
    plain = our_model("clf", "tiny")
    routed = copy.deepcopy(plain)
    use_stage_kernels(routed.col_embedder, StageKernels(attention="head16-flash"))
    X, y = random_table(5, 2, 200, 12, 5, 3)  # 200 train rows: past the 128-key chunk
    with torch.no_grad():
        want = plain(X, y, return_logits=False)
        got = routed(X, y, return_logits=False)
    inducing = routed.col_embedder.tf_col.blocks[0].ind_vectors.shape[0]
    assert small and set(small) == {(inducing, None, None)}
    assert flash and set(flash) == {(200, False)}
    assert float((got - want).abs().max()) <= 1e-5


def test_composite_steps_through_queries_without_changing_the_result(monkeypatch):
    """fp32: no roundings of the weights, which BLAS's shape-dependent sums could flip."""
    q, k, v = operands(CASES[0], torch.float32)
    whole = fa.flash_attention_composite(q, k, v)
    monkeypatch.setattr(fa, "COMPOSITE_SCORES", 3 * 16 * 70)  # 3 queries per step
    torch.testing.assert_close(fa.flash_attention_composite(q, k, v), whole, rtol=1e-5, atol=2e-6)
