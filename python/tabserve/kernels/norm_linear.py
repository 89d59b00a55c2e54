"""``tabserve::norm_linear``: a pre-LN block's LayerNorm and input projection in one pass.

    out = linear(layer_norm(x), weight, bias)

with the roundings of ``torch.autocast``: LayerNorm in fp32, its output rounded to
``compute_dtype``, the weight and bias cast to it, the product accumulated in fp32 and rounded.
Unfused, autocast writes the normalised tokens (in ``compute_dtype``) and the projection reads
them back; in the row stage's packed q / k / v projection and the column stage's projections of
the train rows those are 1.4 GB each way per block on the large workload. Fused, a tile of
tokens is read once, normalised in registers and multiplied by the weight in column chunks on
the tensor cores; only the projection is written.

One place for the operator, as ``feed_forward``: schema (``torch.library.triton_op``), composite
ATen kernel (CPU, fp32 compute, shapes the kernel does not take), Triton CUDA kernel and fake
kernel (the traced function). docs/ops.md gives the contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import (
    check_arguments,
    define_operator,
    kernel_takes,
    matmul_operand,
    tile_config,
    triton,
)

if triton is not None:
    import triton.language as tl

    from ._common import layer_norm_rows, round_to

#: Long streams (>= 2^20 tokens): 128 tokens x 8 warps x 1 stage, the fastest of the sweep on the
#: large workload's three projections (H200, 2026-11-30, ``benchmarks/norm_linear.py --sweep``:
#: row q/k/v 3.03 ms, column k/v 1.66, column q 1.28; the feed-forward operator's 64 x 4 x 1
#: took 3.51 / 1.86 / 1.36).
LONG_CONFIG = (128, 8, 1)

#: Output features per step of the kernel's loop; the output width must be a multiple.
OUTPUT_STEP = 64

_OPERATOR = "tabserve::norm_linear"


def _check(x, norm_weight, norm_bias, weight, bias, eps, compute_dtype) -> None:
    dim = x.shape[-1] if x.dim() else 0  # (a 0-d x is refused by check_arguments)
    out_features = weight.shape[0] if weight.dim() == 2 else 0
    expected = {
        "norm_weight": (norm_weight, (dim,)),
        "bias": (bias, (out_features,)),
        "norm_bias": (norm_bias, (dim,)),
    }
    check_arguments(_OPERATOR, x, ("weight", weight), expected, eps, compute_dtype)


def norm_linear_composite(x, norm_weight, norm_bias, weight, bias, eps, compute_dtype) -> Tensor:
    """The operator as ATen ops: what autocast makes of ``linear(norm(x))`` (the reference)."""
    dim = x.shape[-1]
    shift = None if norm_bias is None else norm_bias.float()
    normed = F.layer_norm(x.float(), (dim,), norm_weight.float(), shift, eps).to(compute_dtype)
    return F.linear(normed, weight.to(compute_dtype), bias.to(compute_dtype))


def kernel_applies(x: Tensor, weight: Tensor, compute_dtype: torch.dtype) -> bool:
    """Whether the CUDA kernel serves these operands (shapes and dtypes: static under compile)."""
    return kernel_takes(x, compute_dtype) and weight.shape[0] % OUTPUT_STEP == 0


if triton is not None:

    @triton.jit
    def _norm_linear_kernel(
        x_ptr,
        out_ptr,
        norm_weight_ptr,
        norm_bias_ptr,
        weight_ptr,
        bias_ptr,
        tokens,
        EPS: tl.constexpr,  # a runtime float would reach the kernel as fp64 through Inductor
        DIM: tl.constexpr,
        OUT_FEATURES: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr,
        OUTPUT_STEP: tl.constexpr,
        HAS_NORM_BIAS: tl.constexpr,
        BF16: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        cols = tl.arange(0, DIM)
        in_range = rows[:, None] < tokens
        x = tl.load(x_ptr + rows[:, None] * DIM + cols[None, :], mask=in_range, other=0.0)
        x = x.to(tl.float32)
        normed = layer_norm_rows(
            x, norm_weight_ptr, norm_bias_ptr, cols, DIM, EPS, HAS_NORM_BIAS, BF16
        )
        for start in range(0, OUT_FEATURES, OUTPUT_STEP):
            features = start + tl.arange(0, OUTPUT_STEP)
            # weight is (out_features, dim), read transposed.
            w = round_to(tl.load(weight_ptr + features[None, :] * DIM + cols[:, None]), BF16)
            b = round_to(tl.load(bias_ptr + features), BF16).to(tl.float32)
            y = round_to(tl.dot(normed, w) + b[None, :], BF16)
            offsets = rows[:, None] * OUT_FEATURES + features[None, :]
            tl.store(out_ptr + offsets, y, mask=in_range)

    def _launch(x, norm_weight, norm_bias, weight, bias, eps, compute_dtype, launcher):
        dim, out_features = x.shape[-1], weight.shape[0]
        tokens = x.numel() // dim
        out = torch.empty((*x.shape[:-1], out_features), dtype=compute_dtype, device=x.device)
        # Tiles: LONG_CONFIG (its own sweep) on long streams, the shared short-stream tile else.
        block_tokens, num_warps, num_stages = tile_config(tokens, LONG_CONFIG)
        launcher(_norm_linear_kernel)[(triton.cdiv(tokens, block_tokens),)](
            x.contiguous(),
            out,
            norm_weight.contiguous(),
            norm_weight if norm_bias is None else norm_bias.contiguous(),
            matmul_operand(weight, compute_dtype),
            bias.contiguous(),
            tokens,
            EPS=eps,
            DIM=dim,
            OUT_FEATURES=out_features,
            BLOCK_TOKENS=block_tokens,
            OUTPUT_STEP=OUTPUT_STEP,
            HAS_NORM_BIAS=norm_bias is not None,
            BF16=compute_dtype == torch.bfloat16,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        return out

    def run_kernel(x, norm_weight, norm_bias, weight, bias, eps, compute_dtype) -> Tensor:
        """The Triton kernel called directly (tests run it on CPU tensors under
        ``TRITON_INTERPRET=1``); no checks beyond :func:`_check`."""
        args = (x, norm_weight, norm_bias, weight, bias, eps, compute_dtype)
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
) -> Tensor:
    args = (x, norm_weight, norm_bias, weight, bias, eps, compute_dtype)
    _check(*args)
    if not kernel_applies(x, weight, compute_dtype):
        return norm_linear_composite(*args)
    from torch.library import wrap_triton

    return _launch(*args, wrap_triton)


norm_linear_op = define_operator(_OPERATOR, _norm_linear)
