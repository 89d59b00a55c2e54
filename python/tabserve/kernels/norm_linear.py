"""``tabserve::norm_linear``: a pre-LN block's LayerNorm and input projection in one pass.

    out = linear(layer_norm(x), weight, bias)
    out[..., :rotary_features] = rope(out[..., :rotary_features])    (optional)

with the roundings of ``torch.autocast``: LayerNorm in fp32, its output rounded to
``compute_dtype``, the weight and bias cast to it, the product accumulated in fp32 and rounded.
Unfused, autocast writes the normalised tokens (in ``compute_dtype``) and the projection reads
them back; in the row stage's packed q / k / v projection and the column stage's projections of
the train rows those are 1.4 GB each way per block on the large workload. Fused, a tile of
tokens is read once, normalised in registers and multiplied by the weight in column chunks on
the tensor cores; only the projection is written.

With RoPE tables, the leading ``rotary_features`` outputs (a packed projection's queries and
keys, head by head) are also rotated at their token's position along x's second-to-last axis
(rotate-half RoPE in fp32 on the rounded projection, rounded again: what the row stage's
``RotaryEmbedding`` computes on the projection's output), so the attention after it reads
rotated queries and keys and nothing rotates them in a pass or kernel of its own.

One place for the operator, as ``feed_forward``: schema (``torch.library.triton_op``), composite
ATen kernel (CPU, fp32 compute, shapes the kernel does not take), Triton CUDA kernel and fake
kernel (the traced function). docs/reference/ops.md gives the contract.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import (
    check_arguments,
    choice_override,
    define_operator,
    kernel_takes,
    launch_limits,
    matmul_operand,
    tile_config,
    triton,
)

if triton is not None:
    import triton.language as tl

    from ._common import layer_norm_rows, round_to

#: Long streams (>= 2^20 tokens): 128 tokens x 8 warps x 1 stage, the fastest of the sweep on the
#: large workload's three projections (H200, ``benchmarks/norm_linear.py --sweep``:
#: row q/k/v 3.03 ms, column k/v 1.66, column q 1.28; the feed-forward operator's 64 x 4 x 1
#: takes 3.51 / 1.86 / 1.36).
LONG_CONFIG = (128, 8, 1)

#: Output features per step of the kernel's loop; the output width must be a multiple.
OUTPUT_STEP = 64
#: Output features per step over the rotated ones (whole heads): a narrower tile than
#: OUTPUT_STEP keeps the rotation's split halves and tables in registers (sm_90, 128 tokens x 8
#: warps, compiled by Triton 3.8 without alignment hints: 64 spills 56 bytes a thread, 32 8
#: bytes; compiled with the pointer and stride alignment Triton specialises launches on,
#: neither spills: 118 and 97 registers. The step stays 32, the measured one).
ROTARY_STEP = 32
#: How the epilogue pairs each rotated output with its partner (the other half of its head):
#: ``split`` reshapes the tile and splits the halves apart (measured on the H200: the row stage's
#: packed projection 2.37 -> 3.34 ms per call with it); ``dot`` multiplies the rounded tile by a
#: signed permutation matrix on the tensor cores (exact: one +-1 per column), which keeps the tile
#: in its accumulator layout, and is slower on the H200 (4.27 against split's 3.55 ms); ``partner``
#: computes the partners themselves, a second product of the normalised tile with the partner rows
#: of the weight (the same dot products as the partner outputs', so the same values), in the tile's
#: own layout: no shuffle, one more matmul on tensor cores that the kernel leaves mostly idle, and
#: is the slowest on the H200 (fp16 stream: the row stage's packed projection 5.07 ms against dot's
#: 4.12 and split's 3.43, 2.50 without RoPE; the CLS block's key / value 3.18 / 2.73 / 2.36): its
#: second weight read costs more than the shuffle it saves. ``benchmarks/norm_linear.py`` times
#: every rotation (:func:`rotation_override`).
ROTATIONS = ("split", "dot", "partner")
ROTATION = "split"


def rotation_override(rotation: str):
    """Every launch inside pairs rotated outputs by ``rotation`` (one of :data:`ROTATIONS`)."""
    return choice_override(sys.modules[__name__], "ROTATION", rotation, ROTATIONS, "norm_linear")


_OPERATOR = "tabserve::norm_linear"


def _check(
    x, norm_weight, norm_bias, weight, bias, eps, compute_dtype, cos=None, sin=None, rotary=0
) -> None:
    dim = x.shape[-1] if x.dim() else 0  # (a 0-d x is refused by check_arguments)
    out_features = weight.shape[0] if weight.dim() == 2 else 0
    expected = {
        "norm_weight": (norm_weight, (dim,)),
        "bias": (bias, (out_features,)),
        "norm_bias": (norm_bias, (dim,)),
    }
    check_arguments(_OPERATOR, x, ("weight", weight), expected, eps, compute_dtype)
    _check_rotary(x, out_features, cos, sin, rotary)


def _check_rotary(x, out_features, cos, sin, rotary) -> None:
    """The RoPE arguments: both tables or neither; [>= L, head_dim] floating tables on x's
    device (L = x.shape[-2], the positions' axis), an even head_dim; ``rotary_features`` a
    multiple of head_dim in [head_dim, out_features] with tables, 0 without."""
    op = _OPERATOR
    if (cos is None) != (sin is None):
        raise ValueError(f"{op}: rotary_cos and rotary_sin come together, got only one of them")
    if cos is None:
        if rotary != 0:
            raise ValueError(f"{op}: rotary_features={rotary} needs rotary_cos and rotary_sin")
        return
    if x.dim() < 2:
        raise ValueError(
            f"{op}: RoPE needs x of (..., L, dim) (positions along L), got {tuple(x.shape)}"
        )
    for name, table in (("rotary_cos", cos), ("rotary_sin", sin)):
        if table.dim() != 2 or table.shape[0] < x.shape[-2] or table.shape[1] % 2:
            raise ValueError(
                f"{op}: {name} must be [L >= {x.shape[-2]}, head_dim] with an even head_dim, "
                f"got {tuple(table.shape)}"
            )
        if not table.is_floating_point():
            raise ValueError(f"{op}: {name} must be floating point, got {table.dtype}")
        if table.device != x.device:
            raise ValueError(f"{op}: {name} is on {table.device} but x is on {x.device}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"{op}: rotary_sin must have rotary_cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}"
        )
    head_dim = cos.shape[1]
    if not 0 < rotary <= out_features or rotary % head_dim:
        raise ValueError(
            f"{op}: rotary_features must be a multiple of the tables' head_dim {head_dim} in "
            f"[{head_dim}, {out_features}], got {rotary}"
        )


def norm_linear_composite(
    x, norm_weight, norm_bias, weight, bias, eps, compute_dtype, cos=None, sin=None, rotary=0
) -> Tensor:
    """The operator as ATen ops: what autocast makes of ``linear(norm(x))`` (the reference),
    then RoPE of the leading ``rotary`` outputs (``tabserve::rotary_embedding``: bit for bit
    the row stage's ATen rotation)."""
    dim = x.shape[-1]
    shift = None if norm_bias is None else norm_bias.float()
    normed = F.layer_norm(x.float(), (dim,), norm_weight.float(), shift, eps).to(compute_dtype)
    out = F.linear(normed, weight.to(compute_dtype), bias.to(compute_dtype))
    if cos is None:
        return out
    length, head_dim = x.shape[-2], cos.shape[1]
    # (..., L, heads, head_dim) seen as (..., heads, L, head_dim): positions along L.
    heads = out[..., :rotary].unflatten(-1, (rotary // head_dim, head_dim)).transpose(-3, -2)
    rotated = torch.ops.tabserve.rotary_embedding(heads, cos[:length], sin[:length])
    return torch.cat([rotated.transpose(-3, -2).flatten(-2), out[..., rotary:]], dim=-1)


def kernel_applies(
    x: Tensor, weight: Tensor, compute_dtype: torch.dtype, cos: Tensor | None = None,
    rotary: int = 0,
) -> bool:  # fmt: skip
    """Whether the CUDA kernel serves these operands (shapes and dtypes: static under compile):
    with RoPE, fp32 tables of a power-of-two head_dim whose heads tile the kernel's rotated
    steps, over whole output steps."""
    applies = kernel_takes(x, compute_dtype) and weight.shape[0] % OUTPUT_STEP == 0
    if cos is None or not applies:
        return applies
    head_dim = cos.shape[-1]
    return (
        cos.dtype == torch.float32
        and head_dim >= 2
        and head_dim & (head_dim - 1) == 0
        and ROTARY_STEP % head_dim == 0
        and rotary % OUTPUT_STEP == 0
    )


def strided_rows(x: Tensor) -> tuple[Tensor, int]:
    """``(x, stride)`` where the kernel can read x in place: its tokens are contiguous rows
    along its second-to-last axis and its leading dimensions step by one stride together (a
    slice along that axis of a contiguous tensor: the inducing points' train rows
    ``cells[..., :n_train, :]``, the row stage's CLS tokens); else ``(x.contiguous(), rows x
    width)``. Strides only: static under compile."""
    if x.dim() < 2:
        return x.contiguous(), 0
    length, dim = x.shape[-2:]
    lead = [(size, stride) for size, stride in zip(x.shape[:-2], x.stride()[:-2]) if size > 1]
    rows_in_place = x.stride(-1) == 1 and (length == 1 or x.stride(-2) == dim)
    steps = [stride for _, stride in lead]
    collapses = all(outer == inner * size for outer, (size, inner) in zip(steps, lead[1:]))
    if rows_in_place and collapses:
        return x, steps[-1] if steps else length * dim
    return x.contiguous(), length * dim


if triton is not None:

    @triton.jit
    def _rotate_heads(
        y, cos_ptr, sin_ptr, positions, BLOCK_TOKENS: tl.constexpr, WIDTH: tl.constexpr,
        HEAD_DIM: tl.constexpr, BF16: tl.constexpr,
    ):  # fmt: skip
        """Rotate-half RoPE of a (tokens, WIDTH) tile of rounded projections, WIDTH / HEAD_DIM
        whole heads, each token at ``positions``: ``lo' = lo cos - hi sin``, ``hi' = hi cos +
        lo sin`` in fp32 per (dim, dim + HEAD_DIM / 2) pair, rounded to the matmul dtype."""
        HALF: tl.constexpr = HEAD_DIM // 2
        # (tokens, heads, 2, HALF) -> (tokens, heads, HALF, 2): the pairs split apart.
        pairs = tl.permute(tl.reshape(y, (BLOCK_TOKENS, WIDTH // HEAD_DIM, 2, HALF)), (0, 1, 3, 2))
        lo, hi = tl.split(pairs.to(tl.float32))
        table = positions[:, None] * HEAD_DIM + tl.arange(0, HALF)[None, :]
        cos_lo = tl.load(cos_ptr + table)[:, None, :]
        sin_lo = tl.load(sin_ptr + table)[:, None, :]
        cos_hi = tl.load(cos_ptr + table + HALF)[:, None, :]
        sin_hi = tl.load(sin_ptr + table + HALF)[:, None, :]
        new_lo = lo * cos_lo - hi * sin_lo
        new_hi = hi * cos_hi + lo * sin_hi
        joined = tl.permute(tl.join(new_lo, new_hi), (0, 1, 3, 2))
        return round_to(tl.reshape(joined, (BLOCK_TOKENS, WIDTH)), BF16)

    @triton.jit
    def _rotate_heads_by_dot(
        y, cos_ptr, sin_ptr, positions, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr,
        BF16: tl.constexpr,
    ):  # fmt: skip
        """:func:`_rotate_heads` with each output's signed partner (``-hi`` for a low dim,
        ``lo`` for a high one) from ``y @ P``, P the [WIDTH, WIDTH] signed permutation that
        swaps the halves of every head: exact in the fp32 accumulator (one +-1 per column),
        and the result stays in the tile's layout."""
        HALF: tl.constexpr = HEAD_DIM // 2
        source = tl.arange(0, WIDTH)[:, None]
        target = tl.arange(0, WIDTH)[None, :]
        sign = tl.where(target % HEAD_DIM < HALF, -1.0, 1.0)
        swap = tl.where(source == (target ^ HALF), sign, 0.0).to(y.dtype)
        partner = tl.dot(y, swap)
        table = positions[:, None] * HEAD_DIM + (tl.arange(0, WIDTH) % HEAD_DIM)[None, :]
        rotated = y.to(tl.float32) * tl.load(cos_ptr + table) + partner * tl.load(sin_ptr + table)
        return round_to(rotated, BF16)

    @triton.jit
    def _rotate_heads_by_partner(
        normed, y, weight_ptr, bias_ptr, cos_ptr, sin_ptr, positions, features, cols,
        DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BF16: tl.constexpr,
    ):  # fmt: skip
        """:func:`_rotate_heads` with each output's partner (the same position in the other
        half of its head: feature ``f ^ HEAD_DIM / 2``, heads starting at multiples of the
        power-of-two HEAD_DIM) projected again from the partner's weight row and bias: the
        same dot product as the partner output's own, rounded the same way, so the same value,
        and already in the tile's layout."""
        HALF: tl.constexpr = HEAD_DIM // 2
        partners = features ^ HALF
        w = round_to(tl.load(weight_ptr + partners[None, :] * DIM + cols[:, None]), BF16)
        b = round_to(tl.load(bias_ptr + partners), BF16).to(tl.float32)
        partner = round_to(tl.dot(normed, w) + b[None, :], BF16).to(tl.float32)
        in_head = features % HEAD_DIM
        signed = tl.where((in_head < HALF)[None, :], -partner, partner)
        table = positions[:, None] * HEAD_DIM + in_head[None, :]
        rotated = y.to(tl.float32) * tl.load(cos_ptr + table) + signed * tl.load(sin_ptr + table)
        return round_to(rotated, BF16)

    @triton.jit
    def _norm_linear_kernel(
        x_ptr,
        out_ptr,
        norm_weight_ptr,
        norm_bias_ptr,
        weight_ptr,
        bias_ptr,
        cos_ptr,
        sin_ptr,
        tokens,
        period,
        length,
        x_outer_stride,
        EPS: tl.constexpr,  # a runtime float would reach the kernel as fp64 through Inductor
        DIM: tl.constexpr,
        OUT_FEATURES: tl.constexpr,
        ROTARY_FEATURES: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr,
        OUTPUT_STEP: tl.constexpr,
        ROTARY_STEP: tl.constexpr,
        ROTATE_BY: tl.constexpr,  # 0 split, 1 dot, 2 partner (ROTATIONS' order)
        HAS_NORM_BIAS: tl.constexpr,
        BF16: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        cols = tl.arange(0, DIM)
        in_range = rows[:, None] < tokens
        # Token r is row r % length of slab r // length of x (slabs x_outer_stride apart).
        x_rows = (rows // length) * x_outer_stride + (rows % length) * DIM
        x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=in_range, other=0.0)
        x = x.to(tl.float32)
        normed = layer_norm_rows(
            x, norm_weight_ptr, norm_bias_ptr, cols, DIM, EPS, HAS_NORM_BIAS, BF16
        )
        # Outputs [0, ROTARY_FEATURES) rotated at the token's position along x's L axis (rows
        # past the stream read the tables at a valid position too; they are never stored).
        positions = rows % period
        for start in range(0, ROTARY_FEATURES, ROTARY_STEP):
            features = start + tl.arange(0, ROTARY_STEP)
            w = round_to(tl.load(weight_ptr + features[None, :] * DIM + cols[:, None]), BF16)
            b = round_to(tl.load(bias_ptr + features), BF16).to(tl.float32)
            y = round_to(tl.dot(normed, w) + b[None, :], BF16)
            if ROTATE_BY == 1:
                y = _rotate_heads_by_dot(
                    y, cos_ptr, sin_ptr, positions, ROTARY_STEP, HEAD_DIM, BF16
                )
            elif ROTATE_BY == 2:
                y = _rotate_heads_by_partner(
                    normed, y, weight_ptr, bias_ptr, cos_ptr, sin_ptr, positions, features,
                    cols, DIM, HEAD_DIM, BF16,
                )  # fmt: skip
            else:
                y = _rotate_heads(
                    y, cos_ptr, sin_ptr, positions, BLOCK_TOKENS, ROTARY_STEP, HEAD_DIM, BF16
                )
            offsets = rows[:, None] * OUT_FEATURES + features[None, :]
            tl.store(out_ptr + offsets, y, mask=in_range)
        for start in range(ROTARY_FEATURES, OUT_FEATURES, OUTPUT_STEP):
            features = start + tl.arange(0, OUTPUT_STEP)
            # weight is (out_features, dim), read transposed.
            w = round_to(tl.load(weight_ptr + features[None, :] * DIM + cols[:, None]), BF16)
            b = round_to(tl.load(bias_ptr + features), BF16).to(tl.float32)
            y = round_to(tl.dot(normed, w) + b[None, :], BF16)
            offsets = rows[:, None] * OUT_FEATURES + features[None, :]
            tl.store(out_ptr + offsets, y, mask=in_range)

    def _launch(
        x, norm_weight, norm_bias, weight, bias, eps, compute_dtype, cos, sin, rotary, launcher
    ):  # fmt: skip
        dim, out_features = x.shape[-1], weight.shape[0]
        tokens = x.numel() // dim
        out = torch.empty((*x.shape[:-1], out_features), dtype=compute_dtype, device=x.device)
        x, outer_stride = strided_rows(x)
        # Tiles: LONG_CONFIG (its own sweep) on long streams, the shared short-stream tile else.
        block_tokens, num_warps, num_stages = tile_config(tokens, LONG_CONFIG)
        launcher(_norm_linear_kernel)[(triton.cdiv(tokens, block_tokens),)](
            x,
            out,
            norm_weight.contiguous(),
            norm_weight if norm_bias is None else norm_bias.contiguous(),
            matmul_operand(weight, compute_dtype),
            bias.contiguous(),
            norm_weight if cos is None else cos.contiguous(),
            norm_weight if sin is None else sin.contiguous(),
            tokens,
            x.shape[-2] if cos is not None else 1,
            x.shape[-2] if x.dim() > 1 else max(1, tokens),
            outer_stride,
            EPS=eps,
            DIM=dim,
            OUT_FEATURES=out_features,
            ROTARY_FEATURES=rotary,
            HEAD_DIM=2 if cos is None else cos.shape[1],
            BLOCK_TOKENS=block_tokens,
            OUTPUT_STEP=OUTPUT_STEP,
            ROTARY_STEP=ROTARY_STEP,
            ROTATE_BY=ROTATIONS.index(ROTATION),
            HAS_NORM_BIAS=norm_bias is not None,
            BF16=compute_dtype == torch.bfloat16,
            num_warps=num_warps,
            num_stages=num_stages,
            **launch_limits(),
        )
        return out

    def run_kernel(
        x, norm_weight, norm_bias, weight, bias, eps, compute_dtype, cos=None, sin=None, rotary=0
    ) -> Tensor:
        """The Triton kernel called directly (tests run it on CPU tensors under
        ``TRITON_INTERPRET=1``); no checks beyond :func:`_check`."""
        args = (x, norm_weight, norm_bias, weight, bias, eps, compute_dtype, cos, sin, rotary)
        _check(*args)
        return _launch(*args, lambda k: k)


def _norm_linear(
    x: Tensor,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    compute_dtype: torch.dtype,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    rotary_features: int = 0,
) -> Tensor:
    args = (x, norm_weight, norm_bias, weight, bias, eps, compute_dtype)
    rope = (rotary_cos, rotary_sin, rotary_features)
    _check(*args, *rope)
    if not kernel_applies(x, weight, compute_dtype, rotary_cos, rotary_features):
        return norm_linear_composite(*args, *rope)
    from torch.library import wrap_triton

    return _launch(*args, *rope, wrap_triton)


norm_linear_op = define_operator(_OPERATOR, _norm_linear)
