"""norm_linear against the modules it replaces, on the column and row stages' projections.

Cases are the blocks' projections of the driver's workloads: fp32 token streams of width 128
projected to the row stage's packed q / k / v (384), the column stage's k / v of the train rows
(256) and q of all rows (128), fp16 matmuls. Methods: the composite (LayerNorm, its cast,
linear, as autocast runs them), the composite under torch.compile, and the operator; with
``--sweep`` the operator's tile configurations too. Every method's output is checked against the
composite (max |difference| in fp16 roundings of the row's scale, reported) before timing.
Cases marked RoPE rotate the leading outputs in the epilogue (the row stage's packed projection
and its CLS block's key / value projection, rows of 68 tokens); on CUDA they also time the
operator with its other way of pairing the halves (``norm_linear.ROTATIONS``).

    python benchmarks/norm_linear.py --device cuda --sweep
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    compare_and_time,
    kernel_benchmark_args,
    kernel_methods,
    overridden,
    register_limited,
    report_kernel_benchmark,
    selected_cases,
    tile_configured,
)
from tabserve.kernels import norm_linear as nl
from tabserve.models.tabicl.network.layers import RotaryEmbedding

#: (name, tokens, output features, rotated features) on the small / large workloads (8
#: tables); rotated cases hold rows of ROPE_ROW tokens.
CASES = [
    ("small row q/k/v", 8 * 576 * 12, 384, 0),
    ("large row q/k/v", 8 * 10240 * 68, 384, 0),
    ("large row q/k/v + RoPE", 8 * 10240 * 68, 384, 256),
    ("large row CLS k/v + RoPE", 8 * 10240 * 68, 256, 128),
    ("large col k/v", 8 * 64 * 8192, 256, 0),
    ("large col q", 8 * 64 * 10240, 128, 0),
]
QUICK_CASES = [("tiny", 1000, 384, 0), ("tiny + RoPE", 1020, 384, 256)]
ROPE_ROW = 68
DIM = 128
SWEEP = list(itertools.product((32, 64, 128), (4, 8), (1, 2)))


def inputs(tokens: int, out_features: int, device, stream_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, DIM, generator=g).to(device, stream_dtype)
    params = [
        1 + 0.1 * torch.randn(DIM, generator=g),
        0.1 * torch.randn(DIM, generator=g),
        torch.randn(out_features, DIM, generator=g) / DIM**0.5,
        0.1 * torch.randn(out_features, generator=g),
    ]
    return x, [p.to(device) for p in params]


def rotations(device) -> dict:
    """On CUDA, the operator with each way of pairing the rotated halves but the default."""
    if torch.device(device).type != "cuda":
        return {}
    op = torch.ops.tabserve.norm_linear
    return overridden(op, nl.rotation_override, nl.ROTATIONS, nl.ROTATION, "rotation")


def main(argv=None) -> int:
    args, device, dtype = kernel_benchmark_args(__doc__, argv)
    composite = nl.norm_linear_composite
    sweep = {f"op {b}x{w}w{s}s": tile_configured(nl.run_kernel, (b, w, s)) for b, w, s in SWEEP}
    methods = kernel_methods(
        composite, torch.ops.tabserve.norm_linear, device, sweep if args.sweep else None
    )
    if torch.device(device).type == "cuda":
        methods |= register_limited(nl.run_kernel, args.max_registers)
    records, rows = [], []
    for name, tokens, out_features, rotary in selected_cases(
        QUICK_CASES if args.quick else CASES, args
    ):
        x, (nw, nb, w, b) = inputs(tokens, out_features, device, args.stream_dtype)
        call = (x, nw, nb, w, b, 1e-5, dtype)
        timed = methods
        if rotary:
            rope = RotaryEmbedding(16, 1e5).to(device)
            call = (x.view(-1, ROPE_ROW, DIM), *call[1:], *rope.tables(ROPE_ROW, device, dtype))
            call += (rotary,)
            timed = methods | rotations(device)
        want = composite(*call)
        ulp = want.float().abs().amax(-1, keepdim=True) * torch.finfo(dtype).eps
        case = {"case": name, "tokens": tokens, "out_features": out_features, "rotary": rotary}
        found, table = compare_and_time(case, timed, call, want, ulp, device, args.budget)
        records += found
        rows += table
        del x, want, ulp
    report_kernel_benchmark(
        "norm_linear",
        f"norm_linear, {args.stream_dtype} stream, {dtype} matmuls on {device}",
        args,
        device,
        dtype,
        records,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
