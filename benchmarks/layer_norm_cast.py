"""layer_norm_cast against what autocast runs in its place: ATen's fp32 LayerNorm, then the cast
of its output to the matmul dtype (two passes over the stream).

The cases are the streams the blocks normalise before a matmul: the column and row stages' (width
128; the large workload's row stream, 5.6 M tokens, and the small workload's, 55 k) and the
in-context stage's (width 512; the predict-many table's 10,000 test rows of 8 members). Each
method's output is checked against ATen's in roundings of the output dtype at each value's
magnitude (at least 1/64); the report gives the time and the bytes moved per second (the fp32
stream read once, the output written once: the operator's traffic).

    python benchmarks/layer_norm_cast.py --device cuda
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    compare_and_time,
    kernel_benchmark_args,
    report_kernel_benchmark,
    selected_cases,
)

#: (name, tokens, width)
CASES = [
    ("row stream, small workload", 8 * 576 * 12, 128),
    ("row stream, large workload", 8 * 10240 * 68, 128),
    ("icl rows, predict-many", 8 * 10_000, 512),
]
QUICK_CASES = [("tiny", 300, 128), ("tiny icl", 40, 512)]


def main(argv=None) -> int:
    from tabserve import ops

    args, device, dtype = kernel_benchmark_args(__doc__, argv)

    def aten(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5).to(dtype)

    def operator(x, weight, bias):
        return ops.layer_norm_cast(x, weight, bias, 1e-5, dtype)

    methods = {"composite": aten, "tabserve op": operator}
    records, rows = [], []
    for name, tokens, width in selected_cases(QUICK_CASES if args.quick else CASES, args):
        g = torch.Generator(device).manual_seed(0)
        x = 3 * torch.randn(tokens, 1, generator=g, device=device)
        x = x + torch.randn(tokens, width, generator=g, device=device)
        weight = 1 + 0.2 * torch.randn(width, generator=g, device=device)
        bias = 0.1 * torch.randn(width, generator=g, device=device)
        want = aten(x, weight, bias)
        scale = want.float().abs().clamp_min(2.0**-6) * torch.finfo(dtype).eps
        case = {"case": name, "tokens": tokens, "width": width,
                "bytes": tokens * width * (4 + torch.finfo(dtype).bits // 8)}  # fmt: skip
        found, table = compare_and_time(
            case, methods, (x, weight, bias), want, scale, device, args.budget
        )
        for record in found:
            record["gb_per_s"] = record["bytes"] / (record["median_ms"] * 1e6)
        records += found
        rows += table
        del x, want, scale
    report_kernel_benchmark(
        "layer_norm_cast",
        f"layer_norm_cast against ATen's LayerNorm and cast, {dtype} on {device}",
        args,
        device,
        dtype,
        records,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
