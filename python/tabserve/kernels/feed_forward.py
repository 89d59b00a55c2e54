"""``tabserve::feed_forward``: a pre-LN transformer block's feed-forward half in one pass.

    s = x + update          (update optional: the attention half's output, optionally
                             linear(update, update_weight, update_bias) first: its out-projection)
    out = s + linear2(gelu(linear1(layer_norm(s))))

with the roundings of ``torch.autocast``: LayerNorm in fp32, its output, both linears' outputs
and the GELU's output rounded to ``compute_dtype``, matmuls accumulated in fp32, the residual sums
in the promoted dtypes (what ``x + update`` and ``s + y`` give under autocast).

Unfused, a block's FFN reads and writes the token stream five times and its hidden activations
(twice as wide) three times; on the large workload's row stage (5.6 M tokens of width 128) the
GELU kernel alone takes 1.9 ms of HBM traffic per block on the H200. Fused, each tile of tokens
is read once and written once: LayerNorm, both matmuls (on tensor cores) and the GELU run on the
tile in registers and shared memory, the hidden activations never reach HBM.

One place for the operator: the schema (``torch.library.triton_op``, so torch.compile traces
the Triton kernel into its own graph), the composite ATen kernel (CPU, fp32 compute, shapes the
kernel does not take), the CUDA kernel (Triton) and the fake kernel (the traced function itself).
docs/reference/ops.md gives the contract.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import (
    LONG_CONFIG,
    STREAM_DTYPES,
    apply_skip,
    check_arguments,
    check_skip,
    choice_override,
    define_operator,
    kernel_takes,
    launch_limits,
    matmul_operand,
    tile_config,
    triton,
)
from ._resident import RESIDENT_DIM, RESIDENT_HIDDEN
from .layout import to_rows

if triton is not None:
    import triton.language as tl

    from ._common import layer_norm_rows, round_to

#: Hidden units per step of the kernel's loop; the hidden width must be a multiple.
HIDDEN_STEP = 64
#: Set by the benchmark's sweep (:func:`hidden_step_override`) to time another step everywhere.
HIDDEN_STEP_OVERRIDE = None
#: Long-stream tile (tokens, warps, stages) of the launches that fold the out-projection (one
#: more matmul per tile, the sum held in the output): the plain launches' tile, kept as its own
#: setting so that a sweep can time another in the whole model.
PROJECTING_LONG_CONFIG = LONG_CONFIG


@contextlib.contextmanager
def hidden_step_override(step: int):
    """Every launch inside runs ``step`` hidden units per loop step (a power of two dividing
    :data:`HIDDEN_STEP`'s multiples that the launch's hidden width also divides; the sweep's
    32 and 128): fewer or more live registers per program against more or fewer steps."""
    global HIDDEN_STEP_OVERRIDE
    if step < 16 or step & (step - 1):
        raise ValueError(f"feed_forward: hidden step must be a power of two >= 16, got {step}")
    saved, HIDDEN_STEP_OVERRIDE = HIDDEN_STEP_OVERRIDE, step
    try:
        yield
    finally:
        HIDDEN_STEP_OVERRIDE = saved


#: How the kernel evaluates the GELU's erf: ``erf``, libdevice's ``erff`` (what ATen's CUDA GELU
#: calls: two polynomials whose coefficients each element selects, 31 SASS instructions per hidden
#: unit on sm_90, about two thirds of the kernel's instructions); ``rational``,
#: ``erf(|z|) = 1 - exp(-z^2) Q(1 / (1 + |z| / 2))`` (:func:`_gelu`): one polynomial, one
#: reciprocal square root and one exp2, 22 instructions (the kernel's static count 2,648 ->
#: 2,336, its registers 230 -> 224,
#: sm_90, Triton 3.8). The two round to different fp16 GELUs on 3 of the 63,488 finite fp16 inputs
#: under Triton's interpreter and on 8 on the H200 (at most 3 units apart, in the left tail where
#: ``1 + erf`` cancels); each differs from ATen's CUDA GELU on 151 and from float64 maths on 328 /
#: 330, by at most 2 units. In the large workload's model on the H200 (erf and rational timed in the
#: same benchmark run) the rational form takes the one-shot call from 122.4 to 121.3 ms and the
#: KV-cached prediction from 22.8 to 22.1: the default. (The resident kernel,
#: ``feed_forward_resident``, keeps erff.)
GELUS = ("erf", "rational")
GELU = "rational"


def gelu_override(gelu: str):
    """Every launch inside evaluates the GELU's erf by ``gelu`` (one of :data:`GELUS`)."""
    return choice_override(sys.modules[__name__], "GELU", gelu, GELUS, "feed_forward")


_OPERATOR = "tabserve::feed_forward"


def _check(
    x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype, skip=None,
    update_weight=None, update_bias=None, row_prefix=None,
):  # fmt: skip
    dim = x.shape[-1] if x.dim() else 0  # (a 0-d x is refused by check_arguments)
    hidden = w1.shape[0] if w1.dim() == 2 else 0
    expected = {
        "norm_weight": (norm_weight, (dim,)),
        "b1": (b1, (hidden,)),
        "w2": (w2, (dim, hidden)),
        "b2": (b2, (dim,)),
        "norm_bias": (norm_bias, (dim,)),
        "update": (update, tuple(x.shape)),
        "update_weight": (update_weight, (dim, dim)),
        "update_bias": (update_bias, (dim,)),
    }
    check_arguments(_OPERATOR, x, ("w1", w1), expected, eps, compute_dtype)
    check_skip(_OPERATOR, x, skip)
    if update_weight is None and update_bias is not None:
        raise ValueError(f"{_OPERATOR}: update_bias needs update_weight")
    if update_weight is not None and update is None:
        raise ValueError(f"{_OPERATOR}: update_weight projects update: it needs an update")
    check_row_prefix(x, row_prefix)


def check_row_prefix(x: Tensor, row_prefix: Tensor | None) -> None:
    """``row_prefix`` (optional): a float (P, dim) tensor on x's device, x then 4-D."""
    if row_prefix is None:
        return
    if x.dim() != 4:
        raise ValueError(
            f"{_OPERATOR}: row_prefix needs x of shape (batch, sets, tokens, dim), "
            f"got {tuple(x.shape)}"
        )
    if (
        row_prefix.dim() != 2
        or row_prefix.shape[1] != x.shape[-1]
        or not row_prefix.is_floating_point()
    ):
        raise ValueError(
            f"{_OPERATOR}: row_prefix must be a floating-point (tokens, {x.shape[-1]}) tensor, "
            f"got {row_prefix.dtype} {tuple(row_prefix.shape)}"
        )
    if row_prefix.device != x.device:
        raise ValueError(
            f"{_OPERATOR}: row_prefix is on {row_prefix.device} but x is on {x.device}"
        )


def project_update(update, update_weight, update_bias, compute_dtype) -> Tensor:
    """``linear(update, update_weight, update_bias)`` as autocast computes an out-projection:
    operands cast to ``compute_dtype``, its output in it."""
    bias = None if update_bias is None else update_bias.to(compute_dtype)
    return F.linear(update.to(compute_dtype), update_weight.to(compute_dtype), bias)


def feed_forward_composite(
    x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype, skip=None,
    skip_value=0.0, update_weight=None, update_bias=None, row_prefix=None,
) -> Tensor:  # fmt: skip
    """The operator as ATen ops: what autocast makes of the module (the kernels' reference);
    the sets ``skip`` marks are then filled with ``skip_value``, and with ``row_prefix`` the
    output laid out as rows (:func:`to_rows`)."""
    dim = x.shape[-1]
    if update_weight is not None:
        update = project_update(update, update_weight, update_bias, compute_dtype)
    if update is not None:
        x = x + update
    bias = None if norm_bias is None else norm_bias.float()
    normed = F.layer_norm(x.float(), (dim,), norm_weight.float(), bias, eps).to(compute_dtype)
    hidden = F.gelu(F.linear(normed, w1.to(compute_dtype), b1.to(compute_dtype)))
    out = x + F.linear(hidden, w2.to(compute_dtype), b2.to(compute_dtype))
    return to_rows(apply_skip(out, skip, skip_value), row_prefix)


def kernel_applies(
    x: Tensor, update: Tensor | None, w1: Tensor, compute_dtype: torch.dtype
) -> bool:
    """Whether the CUDA kernel serves these operands (shapes and dtypes: static under compile;
    an update it projects itself too)."""
    return (
        kernel_takes(x, compute_dtype)
        and (update is None or update.dtype in STREAM_DTYPES)
        and w1.shape[0] % HIDDEN_STEP == 0
    )


if triton is not None:

    @triton.jit
    def _residual(
        x_ptr, update_ptr, offsets, in_range, HAS_UPDATE: tl.constexpr, SUM_ROUND: tl.constexpr
    ):
        """The stream entering the block's second half, ``x (+ update)`` in fp32, rounded as
        ATen's sum when its dtype is half precision (SUM_ROUND: 0 none, 1 fp16, 2 bf16)."""
        s = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
        if HAS_UPDATE:
            s = s + tl.load(update_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            if SUM_ROUND == 1:
                s = s.to(tl.float16).to(tl.float32)
            elif SUM_ROUND == 2:
                s = s.to(tl.bfloat16).to(tl.float32)
        return s

    @triton.jit
    def _projected_residual(
        x_ptr, update_ptr, update_weight_ptr, update_bias_ptr, offsets, in_range, cols,
        DIM: tl.constexpr, SUM_ROUND: tl.constexpr, BF16: tl.constexpr,
    ):  # fmt: skip
        """``x + linear(update, update_weight, update_bias)`` in fp32: the projection on the
        tensor cores from operands rounded to the matmul dtype, its output rounded as
        autocast's, the sum rounded as ATen's (SUM_ROUND)."""
        a = round_to(tl.load(update_ptr + offsets, mask=in_range, other=0.0), BF16)
        # update_weight is (dim out, dim in), read transposed.
        w = round_to(tl.load(update_weight_ptr + cols[None, :] * DIM + cols[:, None]), BF16)
        b = round_to(tl.load(update_bias_ptr + cols), BF16).to(tl.float32)
        projected = round_to(tl.dot(a, w) + b[None, :], BF16).to(tl.float32)
        s = tl.load(x_ptr + offsets, mask=in_range, other=0.0).to(tl.float32) + projected
        if SUM_ROUND == 1:
            s = s.to(tl.float16).to(tl.float32)
        elif SUM_ROUND == 2:
            s = s.to(tl.bfloat16).to(tl.float32)
        return s

    @triton.jit
    def _gelu(h, BY: tl.constexpr):
        """GELU in fp32, in ATen's order of operations, ``h * 0.5 * (1 + erf(h / sqrt(2)))``,
        erf from libdevice's ``erff`` (BY 0: ATen's CUDA kernel's own) or from the rational
        form (BY 1): ``erf(|z|) = 1 - exp(-z^2) Q(s)``, ``s = 1 / (1 + |z| / 2)``, Q the
        degree-8 polynomial that fits erfcx(|z|) = exp(z^2) erfc(|z|) on [0, 3.9] to 2e-8
        (relative; past 3.9 erf rounds to 1 in fp32 and the form still does), its sign then
        z's. ``1 - ...`` and the ``1 + erf`` after it round as ATen's do (the left tail's
        cancellation included), so both forms round to the same fp16 GELU almost everywhere."""
        z = h * 0.7071067811865476
        if BY == 1:
            d = 1.0 + 0.5 * tl.abs(z)
            s = tl.math.rsqrt(d * d)  # 1 / d: one MUFU, no division
            q = -0.050652191042900085 * s + 0.34304848313331604
            q = q * s - 0.899139940738678
            q = q * s + 1.026146411895752
            q = q * s - 0.4130600392818451
            q = q * s + 0.47867149114608765
            q = q * s + 0.22551031410694122
            q = q * s + 0.28995048999786377
            q = q * s - 0.0004750580701511353
            e = 1.0 - q * tl.math.exp2(z * z * -1.4426950408889634)
            erf = tl.where(z < 0.0, -e, e)
        else:
            erf = tl.math.erf(z)
        return h * 0.5 * (1.0 + erf)

    @triton.jit
    def _feed_forward_kernel(
        x_ptr,
        update_ptr,
        update_weight_ptr,
        update_bias_ptr,
        out_ptr,
        norm_weight_ptr,
        norm_bias_ptr,
        w1_ptr,
        b1_ptr,
        w2_ptr,
        b2_ptr,
        skip_ptr,
        tokens,
        set_tokens,
        row_length,
        row_sets,
        row_lead,
        EPS: tl.constexpr,  # a runtime float would reach the kernel as fp64 through Inductor
        DIM: tl.constexpr,
        HIDDEN: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr,
        HIDDEN_STEP: tl.constexpr,
        HAS_NORM_BIAS: tl.constexpr,
        HAS_UPDATE: tl.constexpr,
        PROJECT_UPDATE: tl.constexpr,
        SUM_ROUND: tl.constexpr,
        BF16: tl.constexpr,
        HAS_SKIP: tl.constexpr,
        SKIP_VALUE: tl.constexpr,
        ROWS: tl.constexpr,
        GELU_BY: tl.constexpr,
    ):
        # Dtypes travel as a flag and as the output pointer's type: torch.compile does not take
        # Triton dtypes as kernel arguments (triton-lang/triton#4072).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        cols = tl.arange(0, DIM)
        offsets = rows[:, None] * DIM + cols[None, :]
        in_range = rows[:, None] < tokens
        if ROWS:  # token (b, s, l) of x goes to (b, l, row_lead + s) of the rows layout
            sequence, position = rows // row_length, rows % row_length
            batch, set_index = sequence // row_sets, sequence % row_sets
            slot = (batch * row_length + position) * (row_lead + row_sets) + row_lead + set_index
            out_offsets = slot[:, None] * DIM + cols[None, :]
        else:
            out_offsets = offsets
        if PROJECT_UPDATE:
            x = _projected_residual(
                x_ptr, update_ptr, update_weight_ptr, update_bias_ptr, offsets, in_range, cols,
                DIM, SUM_ROUND, BF16,
            )  # fmt: skip
            # Held in the output until the end (its dtype holds the sum exactly): recomputing
            # the projection would cost a third matmul, holding the tile would spill.
            tl.store(out_ptr + out_offsets, x.to(out_ptr.dtype.element_ty), mask=in_range)
        else:
            x = _residual(x_ptr, update_ptr, offsets, in_range, HAS_UPDATE, SUM_ROUND)
        normed = layer_norm_rows(
            x, norm_weight_ptr, norm_bias_ptr, cols, DIM, EPS, HAS_NORM_BIAS, BF16
        )
        acc = tl.zeros((BLOCK_TOKENS, DIM), dtype=tl.float32)
        for start in range(0, HIDDEN, HIDDEN_STEP):
            units = start + tl.arange(0, HIDDEN_STEP)
            # linear1 over HIDDEN_STEP hidden units: W1 is (hidden, dim), read transposed.
            w1 = round_to(tl.load(w1_ptr + units[None, :] * DIM + cols[:, None]), BF16)
            b1 = round_to(tl.load(b1_ptr + units), BF16).to(tl.float32)
            h = round_to(tl.dot(normed, w1) + b1[None, :], BF16).to(tl.float32)
            g = round_to(_gelu(h, GELU_BY), BF16)
            # linear2's contribution of those units: W2 is (dim, hidden), read transposed.
            w2 = round_to(tl.load(w2_ptr + cols[None, :] * HIDDEN + units[:, None]), BF16)
            acc = tl.dot(g, w2, acc)
        b2 = round_to(tl.load(b2_ptr + cols), BF16).to(tl.float32)
        y = round_to(acc + b2[None, :], BF16).to(tl.float32)
        # The residual is read again rather than held: a tile of it in registers through both
        # matmuls would spill; the second read hits L2.
        if PROJECT_UPDATE:
            tl.debug_barrier()  # every thread's store of the sum is visible to the block
            out = tl.load(out_ptr + out_offsets, mask=in_range, other=0.0).to(tl.float32) + y
        else:
            out = _residual(x_ptr, update_ptr, offsets, in_range, HAS_UPDATE, SUM_ROUND) + y
        if HAS_SKIP:  # tokens of a skipped set (set_tokens tokens each) get the skip value
            skipped = tl.load(skip_ptr + rows // set_tokens, mask=rows < tokens, other=0) != 0
            out = tl.where(skipped[:, None], SKIP_VALUE, out)
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=in_range)

    #: SUM_ROUND codes of the residual sum's dtype.
    _SUM_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

    def _launch(
        x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype, launcher,
        skip=None, skip_value=0.0, update_weight=None, update_bias=None, row_prefix=None,
    ):  # fmt: skip
        dim, hidden = x.shape[-1], w1.shape[0]
        tokens = x.numel() // dim
        project = update_weight is not None
        # The sum's dtype: x's and the (projected: compute_dtype) update's.
        added = compute_dtype if project else (None if update is None else update.dtype)
        sum_dtype = x.dtype if added is None else torch.promote_types(x.dtype, added)
        out_dtype = torch.promote_types(sum_dtype, compute_dtype)
        if row_prefix is None:
            out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            layout = (1, 1, 0)
        else:  # the rows layout: the kernel writes every token but the leading ones
            batch, sets, length = x.shape[:3]
            lead = row_prefix.shape[0]
            out = torch.empty((batch, length, lead + sets, dim), dtype=out_dtype, device=x.device)
            out[:, :, :lead] = row_prefix.to(out_dtype)
            layout = (length, sets, lead)
        block_tokens, num_warps, num_stages = tile_config(
            tokens, PROJECTING_LONG_CONFIG if project else LONG_CONFIG
        )
        step = HIDDEN_STEP_OVERRIDE or HIDDEN_STEP
        if hidden % step:
            raise ValueError(f"feed_forward: hidden width {hidden} is not a multiple of {step}")
        grid = (triton.cdiv(tokens, block_tokens),)
        if project and update_bias is None:
            update_bias = torch.zeros(dim, dtype=compute_dtype, device=x.device)
        launcher(_feed_forward_kernel)[grid](
            x.contiguous(),
            x if update is None else update.contiguous(),
            matmul_operand(update_weight, compute_dtype) if project else x,
            update_bias.contiguous() if project else x,
            out,
            norm_weight.contiguous(),
            norm_weight if norm_bias is None else norm_bias.contiguous(),
            matmul_operand(w1, compute_dtype),
            b1.contiguous(),
            matmul_operand(w2, compute_dtype),
            b2.contiguous(),
            x if skip is None else skip.contiguous(),  # bool: Triton's *i1 (no dtype view,
            # which Inductor cannot lower for bool)
            tokens,
            1 if skip is None else max(1, tokens // max(1, skip.numel())),
            *layout,
            EPS=eps,
            DIM=dim,
            HIDDEN=hidden,
            BLOCK_TOKENS=block_tokens,
            HIDDEN_STEP=step,
            HAS_NORM_BIAS=norm_bias is not None,
            HAS_UPDATE=update is not None,
            PROJECT_UPDATE=project,
            SUM_ROUND=_SUM_ROUND[sum_dtype],
            BF16=compute_dtype == torch.bfloat16,
            HAS_SKIP=skip is not None,
            SKIP_VALUE=float(skip_value),
            ROWS=row_prefix is not None,
            GELU_BY=GELUS.index(GELU),
            num_warps=num_warps,
            num_stages=num_stages,
            **launch_limits(),
        )
        return out

    def run_kernel(
        x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype,
        skip=None, skip_value=0.0, update_weight=None, update_bias=None, row_prefix=None,
    ):  # fmt: skip
        """The Triton kernel called directly (tests run it on CPU tensors under
        ``TRITON_INTERPRET=1``); no checks beyond :func:`_check`."""
        args = (x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype)
        projection = (update_weight, update_bias)
        _check(*args, skip, *projection, row_prefix)
        return _launch(*args, lambda k: k, skip, skip_value, *projection, row_prefix)


def _feed_forward(
    x: Tensor,
    update: Tensor | None,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    eps: float,
    compute_dtype: torch.dtype,
    skip: Tensor | None = None,
    skip_value: float = 0.0,
    update_weight: Tensor | None = None,
    update_bias: Tensor | None = None,
    row_prefix: Tensor | None = None,
) -> Tensor:
    args = (x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype)
    projection = (update_weight, update_bias)
    _check(*args, skip, *projection, row_prefix)
    if not kernel_applies(x, update, w1, compute_dtype):
        return feed_forward_composite(*args, skip, skip_value, *projection, row_prefix)
    from torch.library import wrap_triton

    return _launch(*args, wrap_triton, skip, skip_value, *projection, row_prefix)


feed_forward_op = define_operator(_OPERATOR, _feed_forward)

#: Route the shapes ``tabserve::feed_forward_resident`` serves (width 128, FFN width 256: the
#: column and row stages) to that C++/CUDA operator, whose weights stay in shared memory for the
#: whole launch, for streams shorter than RESIDENT_MAX_TOKENS. On the H200
#: (``benchmarks/feed_forward.py``, "resident op" against "tabserve op") it takes 0.078 ms on
#: the small workload's row stream (55 k tokens) against the Triton kernel's 0.137-0.259 ms,
#: and 4.92 / 4.82 ms on the large row / column streams (5.6 / 5.2 M tokens) against 4.84 / 4.55.
RESIDENT_KERNEL = True
RESIDENT_MAX_TOKENS = 1 << 20
#: Whether this build has the operator's CUDA kernel (read once: the package has loaded its
#: library before any of its modules).
_RESIDENT_BUILT = torch._C._dispatch_has_kernel_for_dispatch_key(
    "tabserve::feed_forward_resident", "CUDA"
)


def resident_applies(
    x: Tensor, update: Tensor | None, w1: Tensor, compute_dtype: torch.dtype
) -> bool:
    """Whether ``tabserve::feed_forward_resident``'s CUDA kernel serves these operands (shapes
    and dtypes only: static under compile)."""
    return (
        RESIDENT_KERNEL
        and x.device.type == "cuda"
        and x.numel() < RESIDENT_MAX_TOKENS * x.shape[-1]
        and compute_dtype in (torch.float16, torch.bfloat16)
        and x.shape[-1] == RESIDENT_DIM
        and tuple(w1.shape) == (RESIDENT_HIDDEN, RESIDENT_DIM)
        and x.dtype in (torch.float32, compute_dtype)
        and (update is None or update.dtype == compute_dtype)
        and _RESIDENT_BUILT
    )


def feed_forward(
    x: Tensor,
    update: Tensor | None,
    norm_weight: Tensor,
    norm_bias: Tensor | None,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    eps: float,
    compute_dtype: torch.dtype,
    skip: Tensor | None = None,
    skip_value: float = 0.0,
    update_weight: Tensor | None = None,
    update_bias: Tensor | None = None,
    row_prefix: Tensor | None = None,
) -> Tensor:
    """The feed-forward half through the fastest operator that serves the operands: the
    resident CUDA kernel (:func:`resident_applies`; an update it does not project itself is
    projected first, by cuBLAS, and a ``row_prefix`` layout is made after it by ATen), else
    ``tabserve::feed_forward`` (Triton kernel or composite). The casts to the operators'
    dtypes are ATen ops before the call, so under Inductor's freezing they fold into constants
    once per compiled graph. ``skip``, ``update_weight``, ``row_prefix``: see
    :func:`tabserve.ops.feed_forward`."""
    if update_weight is not None and resident_applies(x, update, w1, compute_dtype):
        update = project_update(update, update_weight, update_bias, compute_dtype)
        update_weight = update_bias = None
    args = (x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype)
    if update_weight is None and resident_applies(x, update, w1, compute_dtype):
        check_row_prefix(x, row_prefix)
        return to_rows(_resident(*args, skip, skip_value), row_prefix)
    if update_weight is not None:
        update_weight = matmul_operand(update_weight, compute_dtype)
        update_bias = None if update_bias is None else update_bias.to(compute_dtype)
    return feed_forward_op(*args, skip, skip_value, update_weight, update_bias, row_prefix)


def _resident(
    x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype, skip, skip_value
) -> Tensor:
    bias = None if norm_bias is None else norm_bias.float()
    return torch.ops.tabserve.feed_forward_resident(
        x, update, norm_weight.float(), bias, matmul_operand(w1, compute_dtype),
        b1.to(compute_dtype), matmul_operand(w2, compute_dtype), b2.to(compute_dtype), eps,
        skip, skip_value,
    )  # fmt: skip
