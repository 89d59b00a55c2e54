"""qassmax_scale against the composite it replaces, on the QASSMax calls of the driver's workloads.

Cases are the calls a padded TabICLv2 makes (8 tables, v2's QASSMax: 8 heads, query-MLP hidden
width 64): the ICL stage's queries (head dim 64) of the train rows and of the test rows, and the
column stage's inducing points (head dim 16). Methods: the composite (two linears per MLP, GELU,
tanh and the products, weights cast to q's dtype, as autocast runs the model's modules), the
composite under torch.compile (CUDA) and the operator (its fused kernel on CUDA for fp16 / bf16,
its ATen composite elsewhere). Every method's output is checked against the composite (max
|difference| in roundings of the largest output, reported) before timing. On the H200 the
tensor-core kernel takes 32-35 us per small call here, host launch included.

    python benchmarks/qassmax_scale.py --device cuda
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
    kernel_methods,
    report_kernel_benchmark,
)

HEADS, HIDDEN = 8, 64
#: (name, q shape [..., heads, queries, head_dim], n: the real train rows).
CASES = [
    ("small ICL train rows", (8, HEADS, 512, 64), 512),
    ("small ICL test rows", (8, HEADS, 64, 64), 512),
    ("small column inducing points", (HEADS, 128, 16), 512),
    ("large ICL train rows", (8, HEADS, 8192, 64), 8192),
    ("large ICL test rows", (8, HEADS, 2048, 64), 8192),
]
QUICK_CASES = [("tiny ICL", (2, HEADS, 40, 64), 30), ("tiny column", (HEADS, 16, 16), 30)]


def composite(q, n_keys, bw1, bb1, bw2, bb2, qw1, qb1, qw2, qb2):
    """The unfused maths as autocast runs the model's QASSMax: every weight in q's dtype, ln n in
    double rounded once to it."""
    dtype = q.dtype
    log_n = n_keys.clamp_min(1).double().log().to(dtype).reshape(1, 1)
    base = F.linear(
        F.gelu(F.linear(log_n, bw1.to(dtype), bb1.to(dtype))), bw2.to(dtype), bb2.to(dtype)
    )
    base = base.view(*[1] * (q.dim() - 3), q.shape[-3], 1, -1)
    hidden = F.gelu(F.linear(q, qw1.to(dtype), qb1.to(dtype)))
    modulation = 1 + torch.tanh(F.linear(hidden, qw2.to(dtype), qb2.to(dtype)))
    return q * (base * modulation)


def inputs(shape, n: int, dtype, device):
    """q and the element-wise variant's eight fp32 weights (the model's parameters stay fp32)."""
    g = torch.Generator().manual_seed(0)
    head_dim = shape[-1]
    q = torch.randn(shape, generator=g).to(device, dtype)
    weights = [
        torch.randn(HIDDEN, 1, generator=g),
        torch.randn(HIDDEN, generator=g),
        torch.randn(HEADS * head_dim, HIDDEN, generator=g) / HIDDEN**0.5,
        torch.randn(HEADS * head_dim, generator=g),
        torch.randn(HIDDEN, head_dim, generator=g) / head_dim**0.5,
        torch.randn(HIDDEN, generator=g),
        torch.randn(head_dim, HIDDEN, generator=g) / HIDDEN**0.5,
        torch.randn(head_dim, generator=g),
    ]
    return q, torch.tensor(n, device=device), [w.to(device) for w in weights]


def main(argv=None) -> int:
    args, device, dtype = kernel_benchmark_args(__doc__, argv)
    methods = kernel_methods(composite, torch.ops.tabserve.qassmax_scale, device)
    records, rows = [], []
    for name, shape, n in QUICK_CASES if args.quick else CASES:
        q, n_keys, weights = inputs(shape, n, dtype, device)
        call = (q, n_keys, *weights)
        want = composite(*call)
        rounding = want.float().abs().max() * torch.finfo(dtype).eps
        case = {"case": name, "shape": list(shape), "n": n}
        found, table = compare_and_time(case, methods, call, want, rounding, device, args.budget)
        records += found
        rows += table
    report_kernel_benchmark(
        "qassmax_scale",
        f"qassmax_scale, {dtype} queries on {device}",
        args,
        device,
        dtype,
        records,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
