"""``tabserve::flash_attention``: softmax attention over long key runs in one pass, on half or fp8
(e4m3) operands.

    out = softmax(q @ k^T / sqrt(d)) @ v

Written for the ICL stage's head-dimension-64 calls, which bound the xlarge workload: its 11
train-row self-attentions (8 tables x 8 heads, 50,000 queries over 50,000 keys) take 1,098 ms of
the fp16 model's 1,850 ms one-shot call on the H200 in cuDNN's fp16 kernel, the fastest PyTorch
offers there (411 TFLOP/s); torch 2.11 has no fp8 attention. Each program takes a
tile of queries through every key block with an online softmax (running row maximum and sum in
fp32, base-2 exponentials), so the scores never reach memory.

``fp8=False``: the operands in their own dtype (fp16 / bf16), the unnormalised weights rounded to
it for the P @ V product. ``fp8=True``: Q, K and V rounded to ``float8_e4m3fn`` with one scale
per tensor (its largest magnitude over 448, computed on the device: no synchronisation), the
scores and the softmax in fp32, the weights (times :data:`P_SCALE`) rounded to e4m3 for P @ V,
each key block's product added in fp32, the row sums kept in fp32: the roundings
``benchmarks/fp8_attention_emulation.py`` measured against the model's answers. On Hopper the
two matmuls then run on the fp8 tensor cores.

One place for the operator: the schema (``torch.library.triton_op``), the composite ATen kernel
(CPU, fp32, shapes or GPUs the kernel does not take: the same roundings with a two-pass softmax,
so its weights are relative to the row's maximum over all keys rather than the running one), the
CUDA kernel (Triton) and the fake kernel (the traced function). docs/reference/ops.md gives the
contract.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._common import KERNEL_COMPUTE_DTYPES, KERNEL_WIDTHS, define_operator, triton
from .layout import MAX_GRID_BATCH as _MAX_GRID_BATCH

#: Added to the query and key counts the kernel is passed: Triton's launcher and Inductor both
#: compile an integer argument equal to 1 as a constant, and the fp8 kernel with permuted score
#: columns so specialised for one key returns NaN rows on the H200 (key order is right, and so is
#: the general kernel over one key: the CUDA tests at one key and one query pass). Offset by 16, no
#: count reaches 1 and the counts keep their divisibility by 16, the other specialisation.
COUNT_OFFSET = 16

if triton is not None:
    import triton.language as tl

    from ._common import round_to

    _COUNT_OFFSET = tl.constexpr(COUNT_OFFSET)  # (the kernel's view of it)

    try:  # Triton 3.4 on: host-side tensor descriptors (TMA)
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover
        TensorDescriptor = None

_OPERATOR = "tabserve::flash_attention"
#: e4m3's largest finite value: each tensor's largest magnitude is scaled onto it.
E4M3_MAX = 448.0
#: The softmax weights (in (0, 1]) are scaled by this before their e4m3 rounding: the largest
#: power of two below 448, so the small weights keep more of their bits.
P_SCALE = 256.0
#: Score elements per step of the composite (2^27: 512 MiB of fp32 scores): it takes as many
#: queries per step as fit, over every (table, head) and key at once.
COMPOSITE_SCORES = 1 << 27


class Tile(NamedTuple):
    """One launch configuration of the kernel."""

    #: Queries per program and keys per step: powers of two, at least 16.
    block_m: int
    block_n: int
    warps: int
    stages: int
    #: Registers per thread at most (Triton's ``maxnreg``; None: the compiler's choice). With 4
    #: warps, 168 keeps 3 programs on an SM (65,536 registers), 128 lets a fourth on.
    registers: int | None = None
    #: fp8 only: each block's score columns in :func:`_score_order`'s key order, so the weights
    #: reach the P @ V matmul without lane shuffles (the sm_90 compile of the default tile:
    #: 453 instructions per key block instead of 503, no SHFL.IDX / PRMT; 175 registers
    #: unlimited, hence 168 with it).
    permuted: bool = False
    #: fp8 only: K and V read through Hopper's tensor memory accelerator (host-side
    #: ``TensorDescriptor``s over the e4m3 copies the operator makes anyway: each head's keys
    #: padded with zeros to a multiple of 16, K stored in :func:`_score_order`'s order when
    #: ``permuted``), instead of per-thread ``cp.async`` copies and their address arithmetic.
    tma: bool = False

    @property
    def label(self) -> str:
        registers = f" r{self.registers}" if self.registers else ""
        order = " permuted" if self.permuted else ""
        tma = " tma" if self.tma else ""
        return f"{self.block_m}x{self.block_n} w{self.warps} s{self.stages}{registers}{order}{tma}"

    @property
    def fp8_only(self) -> bool:
        """Whether the tile's options act on fp8 launches only (half ones ignore them)."""
        return self.permuted or self.tma


#: Tiles per precision (``fp8``): the fastest of :data:`SWEEP` on the xlarge workload's
#: train-row call on the H200 (``benchmarks/icl_attention.py --flash-sweep``; fp8: permuted score
#: columns 73.0 ms against 77.7 in key order; with K and V through TMA at 128 registers 69.0
#: against 71.9 without TMA at 168).
TILES = {False: Tile(128, 64, 8, 3), True: Tile(64, 128, 4, 3, 128, permuted=True, tma=True)}
#: Half's tile for head dimensions up to 16, the column stage's inducing points over the train
#: rows (``benchmarks/small_head_attention.py --cases col --flash-sweep`` on the H200: xlarge
#: 6.30 ms against the default's 6.74, large 1.52 against 1.77).
SMALL_HEAD_TILE = Tile(64, 128, 4, 3, 128)


def default_tile(fp8: bool, dim: int) -> Tile:
    """The tile a launch runs without :func:`tile_override`."""
    return TILES[True] if fp8 else TILES[False] if dim > 16 else SMALL_HEAD_TILE


#: The sweep (H200, the xlarge train-row call): the three fastest of six plain tiles (fp8: 64x128
#: w4 74 ms, 64x64 79, 128x64 w8 80; half: 128x64 w8 94, 64x64 97, 64x128 100), the 64x128 fp8
#: tile with 128 registers (76.3 ms against 77.7 unlimited; half spills there), and the permuted
#: score columns (3 stages 73.0 ms, 2 stages 75.0; sm_90 SASS per thread and key block: 453
#: instructions for 64 scores against key order's 503, 430 with 2 stages). Not in it, as
#: slower: 64x64 permuted (79.1 ms; its NaN rows for one key are the one-key specialisation
#: :data:`COUNT_OFFSET` avoids). The permuted tile with K and V through TMA (72.0 ms at 168
#: registers, 69.0 at 128; sm_90 compile with Triton 3.6: 444 instructions per key block against
#: 449, the per-thread copies' address arithmetic gone; 132 registers unlimited against 175, so
#: at 128, 8 bytes spilled outside the loop, 4 programs fit an SM, 53 KB of shared memory each).
#: A 256-key block spills registers in the sm_90 compile (64 x 256, 4 warps: 892 bytes for half,
#: 8 for fp8).
SWEEP = (
    Tile(128, 64, 8, 3),
    Tile(64, 128, 4, 3),
    Tile(64, 64, 4, 3),
    Tile(64, 128, 4, 3, 128),
    Tile(64, 128, 4, 3, 168, permuted=True),
    Tile(64, 128, 4, 2, 168, permuted=True),
    Tile(64, 128, 4, 3, 168, permuted=True, tma=True),
    Tile(64, 128, 4, 3, 128, permuted=True, tma=True),
)
#: CUDA's limit on a grid's second and third axes (heads, batch), :data:`.layout.MAX_GRID_BATCH`:
#: larger batches run in several launches, more heads are folded into the batch.
MAX_GRID_BATCH = _MAX_GRID_BATCH
#: Set by :func:`tile_override` (the benchmark's sweep, the interpreter tests' small tiles).
TILE_OVERRIDE: Tile | None = None
#: Slower or no help, so not in the kernel: exponentials on fp16 pairs (`ex2.approx.f16x2`: two
#: `MUFU.EX2.F16` on sm_90, 10% slower on the H200) and row sums by a matmul of the e4m3 weights
#: by ones (slower, and 1.5e-2 less accurate); also, from the PTX that Triton compiles here for
#: sm_90 (no GPU needed: ``triton.compile`` with a ``GPUTarget``, then ``ptxas -v``): an explicit
#: ``ex2.approx.ftz.f32`` (``tl.math.exp2`` already lowers to it) and issuing block j + 1's
#: scores before block j's softmax (Triton waits on the matmul right after issuing it).


@contextlib.contextmanager
def tile_override(tile: Tile | tuple):
    """Every launch inside runs ``tile`` (a :class:`Tile` or its fields as a tuple)."""
    try:
        tile = Tile(*tile)
    except TypeError as e:
        raise ValueError(f"flash_attention: bad tile {tile} ({e})") from None
    if (
        any(b < 16 or b & (b - 1) for b in (tile.block_m, tile.block_n))
        or tile.warps < 1
        or tile.stages < 1
        or (tile.registers is not None and tile.registers < 32)
        or not isinstance(tile.permuted, bool)
        or not isinstance(tile.tma, bool)
    ):
        raise ValueError(f"flash_attention: bad tile {tuple(tile)}")
    global TILE_OVERRIDE
    saved, TILE_OVERRIDE = TILE_OVERRIDE, tile
    try:
        yield
    finally:
        TILE_OVERRIDE = saved


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The operator's argument rules, each error naming its argument (fake tensors too)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point() or t.dim() < 2:
            raise ValueError(
                f"flash_attention: {name} must be a floating-point tensor (..., length, dim), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"flash_attention: {name} is {t.dtype} but q is {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"flash_attention: {name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"flash_attention: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}"
        )
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"flash_attention: k must be (..., keys, dim) with q's leading shape and dim "
            f"{(*q.shape[:-2], 'keys', q.shape[-1])}, got {tuple(k.shape)}"
        )
    if k.shape[-2] < 1:
        raise ValueError("flash_attention: k must have at least one key")


def fp8_operand(t: Tensor) -> tuple[Tensor, Tensor]:
    """``t`` as e4m3 scaled onto its range, and the fp32 scale (0-d) that undoes it."""
    scale = _fp8_scale(t)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def _fp8_scale(t: Tensor) -> Tensor:
    """``t``'s largest magnitude over e4m3's (fp32, 0-d, at least fp32's smallest normal)."""
    low, high = torch.aminmax(t)
    largest = torch.maximum(high.float(), -low.float())
    return largest.clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX


def flash_attention_composite(q: Tensor, k: Tensor, v: Tensor, fp8: bool = False) -> Tensor:
    """The operator in ATen maths (fp32), with the kernel's roundings of its operands and
    weights (half: the operands' own dtype; fp8: e4m3 as the module docstring says)."""
    if fp8:
        (q8, q_scale), (k8, k_scale), (v8, v_scale) = (fp8_operand(t) for t in (q, k, v))
        qf, kf, vf = q8.float() * q_scale, k8.float() * k_scale, v8.float() * v_scale
    else:
        qf, kf, vf = q.float(), k.float(), v.float()
    scale = 1.0 / math.sqrt(q.shape[-1])
    step = max(1, COMPOSITE_SCORES // max(1, math.prod(k.shape[:-1])))
    parts = []
    for start in range(0, q.shape[-2], step):
        scores = qf[..., start : start + step, :] @ kf.transpose(-2, -1) * scale
        if fp8:
            parts.append(_fp8_weighted_sum(scores, vf))
            continue
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        row_sum = weights.sum(-1, keepdim=True)
        parts.append((weights.to(q.dtype).float() @ vf) / row_sum)
    out = torch.cat(parts, dim=-2) if parts else qf.new_empty(qf.shape)
    return out.to(q.dtype)


def _fp8_weighted_sum(scores: Tensor, v: Tensor) -> Tensor:
    """The fp8 kernel's softmax of ``scores`` (fp32) times ``v`` (fp32, e4m3 values): base-2
    weights times :data:`P_SCALE` (added to their exponent), rounded to e4m3 for the product,
    the row sums taken from the fp32 weights."""
    logits = scores * math.log2(math.e)
    weights = torch.exp2(logits - logits.amax(-1, keepdim=True) + math.log2(P_SCALE))
    rounded = weights.to(torch.float8_e4m3fn).float()
    return (rounded @ v) / weights.sum(-1, keepdim=True)


#: Head dimensions of the fp8 kernel: Hopper's fp8 matmuls sum over at least 32 elements.
FP8_WIDTHS = (32, 64, 128)


def kernel_applies(q: Tensor, fp8: bool) -> bool:
    """Whether the Triton kernel serves these operands (shapes, dtypes and the GPU only: static
    under compile): CUDA, fp16 / bf16, head dimension 16-128 (fp8: 32-128), and for fp8 a GPU
    with fp8 tensor cores (compute capability 8.9 or later)."""
    if triton is None or q.device.type != "cuda" or q.dtype not in KERNEL_COMPUTE_DTYPES:
        return False
    if q.shape[-1] not in (FP8_WIDTHS if fp8 else KERNEL_WIDTHS):
        return False
    return not fp8 or torch.cuda.get_device_capability(q.device) >= (8, 9)


if triton is not None:

    @triton.jit
    def _load_keys(k_ptrs, keys_left, offs_n, MASKED: tl.constexpr):
        """A block of K, (HEAD_DIM, BLOCK_N); ``MASKED``: the keys past ``keys_left`` zero."""
        if MASKED:
            return tl.load(k_ptrs, mask=offs_n[None, :] < keys_left, other=0.0)
        else:
            return tl.load(k_ptrs)

    @triton.jit
    def _score_order(offs_n, PERMUTED: tl.constexpr):
        """The key behind each score column of a block: ``offs_n`` itself, or with ``PERMUTED``
        within each 16 keys the order that puts Hopper's fp32 matmul result where its fp8
        A operand wants it (:func:`_natural_order` undoes it for P @ V). A wgmma result gives
        lane l % 4 the columns {2q, 2q+1, 2q+8, 2q+9} (q = l % 4: column bits 1-2 are lane
        bits), an e4m3 A operand wants {4q..4q+3} (bits 2-3); so column c holds key
        c0 + 2 c3 + 4 c1 + 8 c2 (bits of c), and the weights need no lane shuffles."""
        if PERMUTED:
            return (
                (offs_n & ~15)
                | (offs_n & 1)
                | (((offs_n >> 3) & 1) << 1)
                | (((offs_n >> 1) & 1) << 2)
                | (((offs_n >> 2) & 1) << 3)
            )
        else:
            return offs_n

    @triton.jit
    def _natural_order(weights):
        """Weights whose column c scores key :func:`_score_order`'s f(c), in key order: a
        permutation within each lane's registers (the lane bits stay put)."""
        rows: tl.constexpr = weights.shape[0]
        cols: tl.constexpr = weights.shape[1]
        bits = tl.reshape(weights, (rows, cols // 16, 2, 2, 2, 2))
        return tl.reshape(tl.permute(bits, (0, 1, 3, 4, 2, 5)), (rows, cols))

    @triton.jit
    def _key_block(
        acc,
        row_sum,
        row_max,
        q,
        k_src,
        v_src,
        k_row,
        v_row,
        start,
        keys_left,
        offs_n,
        offs_s,
        QK_SCALE,
        MASKED: tl.constexpr,
        FP8: tl.constexpr,
        BF16: tl.constexpr,
        PERMUTED: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """One key block into the online softmax and the weighted values (``offs_s``: the key
        of each score column, ``offs_n`` of each row of V). K's and V's blocks come from the
        pointer blocks ``k_src`` / ``v_src``, or with ``TMA`` from their descriptors at rows
        ``k_row`` and (``v_row``, ``start``) (V stored (dim, keys): zeros past the keys, no
        mask needed)."""
        if TMA:
            scores = tl.dot(q, tl.trans(k_src.load([k_row, 0])))
        else:
            scores = tl.dot(q, _load_keys(k_src, keys_left, offs_s, MASKED))
        if MASKED:
            scores = tl.where(offs_s[None, :] < keys_left, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1) * QK_SCALE)
        correction = tl.math.exp2(row_max - new_max)
        if TMA:
            v = tl.trans(v_src.load([v_row, start]))
        elif MASKED:
            v = tl.load(v_src, mask=offs_n[:, None] < keys_left, other=0.0)
        else:
            v = tl.load(v_src)
        if FP8:
            # log2(P_SCALE) = 8 added to the exponent: weights in (0, 256], one multiply-add.
            weights = tl.math.exp2(scores * QK_SCALE - (new_max[:, None] - 8.0))
            if PERMUTED:
                rounded = _natural_order(weights).to(tl.float8e4nv)
            else:
                rounded = weights.to(tl.float8e4nv)
        else:
            weights = tl.math.exp2(scores * QK_SCALE - new_max[:, None])
            rounded = round_to(weights, BF16)
        row_sum = row_sum * correction + tl.sum(weights, 1)
        if FP8:
            # Hopper's fp8 matmuls add into their accumulator in reduced precision, and Triton
            # leaves them unpromoted there by default: chained over every key block, the running
            # sum drifts (~2.6e-2 over 50,000 keys whose values share a sign: the model then fails
            # its reduced-precision gate on the H200). Each block's product starts from zero and is added
            # in fp32 here. (Triton's own promotion, ``max_num_imprecise_acc``, makes ptxas
            # serialise the matmuls: warning C7514 in the sm_90 compile.)
            acc = acc * correction[:, None] + tl.dot(rounded, v)
        else:
            acc = tl.dot(rounded, v, acc * correction[:, None])
        return acc, row_sum, new_max

    @triton.jit
    def _flash_attention_kernel(
        Q,
        K,
        V,
        Out,
        Scales,
        query_limit,
        key_limit,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_om,
        SM_SCALE_LOG2: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        FP8: tl.constexpr,
        BF16: tl.constexpr,
        PERMUTED: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """A tile of BLOCK_M queries of one (batch entry, head) through all its keys: program
        (query tile, head, batch entry). Each operand is read at its own (batch, head, row)
        strides, the head dimension contiguous (V's may be the keys instead: the fp8 launch's
        layout), so head-split views of packed projections and broadcast queries (stride 0) need
        no copy; Out gets q's dtype at its strides. Scales holds the fp8 scales of q, k and v
        (unused otherwise). The scale is a constexpr (it depends on HEAD_DIM only): a float
        argument arrives as fp64 under torch.compile, and fp64 would spread. With ``TMA``, K
        and V are 2-d descriptors over the e4m3 copies, (batch x heads x padded keys, dim) and
        (batch x heads x dim, padded keys), each head's keys padded to a multiple of 16 (K's
        stored in score order where ``PERMUTED``); their strides arguments are unused.
        ``query_limit`` and ``key_limit`` are the counts plus :data:`COUNT_OFFSET`."""
        n_queries = query_limit - _COUNT_OFFSET
        n_keys = key_limit - _COUNT_OFFSET
        head = tl.program_id(1).to(tl.int64)
        batch = tl.program_id(2).to(tl.int64)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        rows = offs_m[:, None] < n_queries
        q_base = Q + batch * stride_qb + head * stride_qh
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=rows, other=0.0)
        if FP8:
            qk_scale = SM_SCALE_LOG2 * tl.load(Scales) * tl.load(Scales + 1)
        else:
            qk_scale = tl.full([], SM_SCALE_LOG2, tl.float32)
        # K's block read as (HEAD_DIM, BLOCK_N) and V's as (BLOCK_N, HEAD_DIM), the summed
        # dimension contiguous in both when V comes transposed (the fp8 launch's layout).
        offs_s = _score_order(offs_n, PERMUTED)  # the key behind each score column
        full_keys = (n_keys // BLOCK_N) * BLOCK_N
        if TMA:
            # the descriptors, at this (batch entry, head)'s first key and first dim
            pair = (batch * tl.num_programs(1) + head).to(tl.int32)
            k_src, k_row = K, pair * ((n_keys + 15) // 16 * 16)
            v_src, v_row = V, pair * HEAD_DIM
        else:
            k_src = K + batch * stride_kb + head * stride_kh
            k_src += offs_d[:, None] + offs_s[None, :] * stride_kn
            v_src = V + batch * stride_vb + head * stride_vh
            v_src += offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
            k_row = 0
            v_row = 0
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(0, full_keys, BLOCK_N):
            acc, row_sum, row_max = _key_block(
                acc, row_sum, row_max, q, k_src, v_src, k_row + start, v_row, start, BLOCK_N,
                offs_n, offs_s, qk_scale, False, FP8, BF16, PERMUTED, TMA,
            )  # fmt: skip
            if not TMA:
                k_src += BLOCK_N * stride_kn
                v_src += BLOCK_N * stride_vn
        if full_keys < n_keys:
            acc, row_sum, row_max = _key_block(
                acc, row_sum, row_max, q, k_src, v_src, k_row + full_keys, v_row, full_keys,
                n_keys - full_keys, offs_n, offs_s, qk_scale, True, FP8, BF16, PERMUTED, TMA,
            )  # fmt: skip
        out = acc / row_sum[:, None]
        if FP8:
            out = out * tl.load(Scales + 2)
        out_ptrs = Out + batch * stride_ob + head * stride_oh
        tl.store(
            out_ptrs + offs_m[:, None] * stride_om + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=rows,
        )

    @triton.jit
    def _quantize_kernel(
        X,
        Y,
        Scales,
        which,
        n_rows,
        n_out,
        stride_xb,
        stride_xh,
        stride_xr,
        stride_yb,
        stride_yh,
        stride_yr,
        stride_yd,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,
        PERMUTED: tl.constexpr,
    ):
        """One block of rows of one (batch entry, head) of X (DIM contiguous) divided by
        Scales[which] and rounded to e4m3 into Y at its strides (V's transposed layout): Y's
        ``n_out`` rows, those from X's ``n_rows`` on zero; with ``PERMUTED``, row r of Y is
        X's row :func:`_score_order` (r) (the TMA launch's K: loaded in order, it gives the
        score columns that order)."""
        head = tl.program_id(1).to(tl.int64)
        batch = tl.program_id(2).to(tl.int64)
        offs_r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, DIM)
        source = _score_order(offs_r, PERMUTED)
        x_ptrs = X + batch * stride_xb + head * stride_xh
        x = tl.load(
            x_ptrs + source[:, None] * stride_xr + offs_d[None, :],
            source[:, None] < n_rows,
            other=0.0,
        )
        y = tl.math.div_rn(x.to(tl.float32), tl.load(Scales + which))
        y_ptrs = Y + batch * stride_yb + head * stride_yh
        tl.store(
            y_ptrs + offs_r[:, None] * stride_yr + offs_d[None, :] * stride_yd,
            y.to(tl.float8e4nv),
            offs_r[:, None] < n_out,
        )

    def _batch_parts(batch: int):
        """Slices of the batch axis that fit the grid's third axis (:data:`MAX_GRID_BATCH`)."""
        return [
            slice(start, min(batch, start + MAX_GRID_BATCH))
            for start in range(0, batch, MAX_GRID_BATCH)
        ]

    def _launch_quantize(
        x: Tensor,
        scales: Tensor,
        which: int,
        keys_major: bool,
        launcher,
        n_out: int | None = None,
        permuted: bool = False,
    ):
        """``x`` (batch, heads, rows, dim) as e4m3 over ``scales[which]``, contiguous, with
        ``n_out`` rows (``x``'s by default; zeros past them) and ``permuted`` in
        :func:`_score_order`'s order; ``keys_major``: stored (batch, heads, dim, rows),
        returned as its transpose (the fp8 P @ V operand's layout)."""
        batch, heads, n_rows, dim = x.shape
        n_out = n_rows if n_out is None else n_out
        shape = (batch, heads, dim, n_out) if keys_major else (batch, heads, n_out, dim)
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
        y = out.transpose(2, 3) if keys_major else out
        block = 64
        for part in _batch_parts(batch):
            grid = (triton.cdiv(n_out, block), heads, part.stop - part.start)
            launcher(_quantize_kernel)[grid](
                x[part], y[part], scales, which, n_rows, n_out, x.stride(0), x.stride(1),
                x.stride(2), y.stride(0), y.stride(1), y.stride(2), y.stride(3), DIM=dim,
                BLOCK=block, PERMUTED=permuted,
            )  # fmt: skip
        return y

    def _batch_heads(t: Tensor) -> Tensor:
        """``t`` (..., rows, dim) as a (batch, heads, rows, dim) view with the head dimension
        contiguous, copying only where no such view exists (a strided last dimension, leading
        dimensions that do not merge, more heads than the grid's axis takes)."""
        if t.stride(-1) != 1:
            t = t.contiguous()
        if t.dim() == 2:
            t = t[None, None]
        elif t.dim() == 3:
            t = t[:, None]
        elif t.dim() > 4:
            t = t.flatten(0, -4)  # a view where the leading strides allow
        if t.shape[1] > MAX_GRID_BATCH:
            t = t.flatten(0, 1)[:, None]
        return t

    def _padded_keys(n_keys: int) -> int:
        """Each head's keys in the TMA launch's copies: a multiple of 16 (16-byte row pitch)."""
        return -(-n_keys // 16) * 16

    def _uses_tma(q: Tensor, k: Tensor, fp8: bool) -> bool:
        """Whether this launch reads K and V through TMA descriptors: an fp8 tile asking for
        it (:data:`TILE_OVERRIDE` or the default) where :func:`_tma_applies`."""
        tile = TILE_OVERRIDE or default_tile(fp8, q.shape[-1])
        if not (fp8 and tile.tma):
            return False
        rows = math.prod(k.shape[:-2]) * max(_padded_keys(k.shape[-2]), k.shape[-1])
        return _tma_applies(q, rows)

    def _launch(q: Tensor, k: Tensor, v: Tensor, fp8: bool, launcher, tma: bool) -> Tensor:
        *lead, n_queries, dim = q.shape
        n_keys = k.shape[-2]
        q4, k4, v4 = (_batch_heads(t) for t in (q, k, v))
        batch, heads = q4.shape[:2]
        tile = TILE_OVERRIDE or default_tile(fp8, dim)
        padded = _padded_keys(n_keys)
        if fp8:
            scales = torch.stack([_fp8_scale(t) for t in (q4, k4, v4)])
            n_out = padded if tma else n_keys
            q4 = _launch_quantize(q4, scales, 0, False, launcher)
            k4 = _launch_quantize(k4, scales, 1, False, launcher, n_out, tma and tile.permuted)
            v4 = _launch_quantize(v4, scales, 2, True, launcher, n_out)  # keys contiguous
        else:
            scales = q4  # never read without FP8: any pointer will do
        out4 = _new_output(q, batch, heads).transpose(1, 2)
        limit = {"maxnreg": tile.registers} if tile.registers else {}
        # Query tiles of one (batch entry, head) run next to each other and share its keys in
        # L2; the batch rides the grid's third axis (CUDA's limit: MAX_GRID_BATCH).
        for part in _batch_parts(batch):
            grid = (triton.cdiv(n_queries, tile.block_m), heads, part.stop - part.start)
            k_arg, v_arg = k4[part], v4[part]
            if tma:  # 2-d views of the e4m3 copies' storage
                k_arg = TensorDescriptor.from_tensor(k_arg.reshape(-1, dim), [tile.block_n, dim])
                v_arg = TensorDescriptor.from_tensor(
                    v_arg.transpose(2, 3).reshape(-1, padded), [dim, tile.block_n]
                )
            launcher(_flash_attention_kernel)[grid](
                q4[part], k_arg, v_arg, out4[part], scales, n_queries + COUNT_OFFSET,
                n_keys + COUNT_OFFSET,
                q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
                v4.stride(0), v4.stride(1), v4.stride(2), v4.stride(3),
                out4.stride(0), out4.stride(1), out4.stride(2),
                SM_SCALE_LOG2=math.log2(math.e) / math.sqrt(dim), HEAD_DIM=dim,
                BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, FP8=fp8,
                BF16=q.dtype == torch.bfloat16, PERMUTED=fp8 and tile.permuted, TMA=tma,
                num_warps=tile.warps, num_stages=tile.stages, **limit,
            )  # fmt: skip
        return out4.reshape(*lead, n_queries, dim)

    def _tma_applies(q: Tensor, rows: int) -> bool:
        """Whether a launch may read through TMA descriptors: Triton's host-side descriptors,
        a GPU with a tensor memory accelerator (Hopper on) or the interpreter (CPU tensors),
        and descriptor rows that int32 coordinates reach."""
        if TensorDescriptor is None or rows >= 2**31:
            return False
        return q.device.type == "cpu" or torch.cuda.get_device_capability(q.device) >= (9, 0)

    def _new_output(q: Tensor, batch: int, heads: int) -> Tensor:
        """The output's storage, (batch, queries, heads, dim), as SDPA's kernels write theirs:
        merging the heads back into the embedding (the model's next step) is then a view."""
        return q.new_empty((batch, q.shape[-2], heads, q.shape[-1]))

    def run_kernel(q: Tensor, k: Tensor, v: Tensor, fp8: bool = False) -> Tensor:
        """The Triton kernel called directly (tests run it on CPU tensors under
        ``TRITON_INTERPRET=1``); no checks beyond :func:`_check`."""
        _check(q, k, v)
        return _launch(q, k, v, fp8, lambda kernel: kernel, _uses_tma(q, k, fp8))

    def _tma_launch(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The fp8 launch with TMA descriptors, by Triton's own launcher: torch 2.11's
        ``triton_op`` tracing keeps a host-side descriptor as an object holding a fake tensor
        (Inductor's graph cache then fails on it, H200), so these
        launches sit in an operator Inductor calls as it is (its scales and quantisation
        included)."""
        return _launch(q, k, v, True, lambda kernel: kernel, True)

    def _tma_output(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """:func:`_tma_launch`'s fake kernel: its output's shape and strides."""
        *lead, n_queries, dim = q.shape
        batch, heads = _batch_heads(q).shape[:2]
        out4 = _new_output(q, batch, heads).transpose(1, 2)
        return out4.reshape(*lead, n_queries, dim)

    _tma_op = torch.library.custom_op("tabserve::flash_attention_tma", _tma_launch, mutates_args=())
    _tma_op.register_fake(_tma_output)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, fp8: bool = False) -> Tensor:
    _check(q, k, v)
    if q.shape[-2] == 0 or not kernel_applies(q, fp8):
        return flash_attention_composite(q, k, v, fp8)
    if _uses_tma(q, k, fp8):
        return _tma_op(q, k, v)
    from torch.library import wrap_triton

    return _launch(q, k, v, fp8, wrap_triton, False)


flash_attention_op = define_operator(_OPERATOR, _flash_attention)
