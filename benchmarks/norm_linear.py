"""norm_linear against the modules it replaces, on the column and row stages' projections.

Cases are the blocks' projections of the driver's workloads: fp32 token streams of width 128
projected to the row stage's packed q / k / v (384), the column stage's k / v of the train rows
(256) and q of all rows (128), fp16 matmuls. Methods: the composite (LayerNorm, its cast,
linear, as autocast runs them), the composite under torch.compile, and the operator; with
``--sweep`` the operator's tile configurations too. Every method's output is checked against the
composite (max |difference| in fp16 roundings of the row's scale, reported) before timing.

    python benchmarks/norm_linear.py --device cuda --sweep
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import compare_and_time, environment, print_table, write_json
from tabserve.kernels import norm_linear as nl
from tabserve.kernels._common import tile_override

#: (name, tokens, output features) on the small / large workloads (8 tables).
CASES = [
    ("small row q/k/v", 8 * 576 * 12, 384),
    ("large row q/k/v", 8 * 10240 * 68, 384),
    ("large col k/v", 8 * 64 * 8192, 256),
    ("large col q", 8 * 64 * 10240, 128),
]
QUICK_CASES = [("tiny", 1000, 384)]
DIM = 128
SWEEP = list(itertools.product((32, 64, 128), (4, 8), (1, 2)))


def inputs(tokens: int, out_features: int, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, DIM, generator=g).to(device)
    params = [
        1 + 0.1 * torch.randn(DIM, generator=g),
        0.1 * torch.randn(DIM, generator=g),
        torch.randn(out_features, DIM, generator=g) / DIM**0.5,
        0.1 * torch.randn(out_features, generator=g),
    ]
    return x, [p.to(device) for p in params]


def with_config(config):
    """The operator's Triton kernel with tile ``config`` (tokens, warps, stages)."""

    def run(*args):
        with tile_override(config):
            return nl.run_kernel(*args)

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time tile configurations too")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    composite = nl.norm_linear_composite
    methods = {"composite": composite, "tabserve op": torch.ops.tabserve.norm_linear}
    if device.type == "cuda":
        methods["composite compiled"] = torch.compile(composite, fullgraph=True)
        if args.sweep:
            methods |= {f"op {b}x{w}w{s}s": with_config((b, w, s)) for b, w, s in SWEEP}
    records, rows = [], []
    for name, tokens, out_features in QUICK_CASES if args.quick else CASES:
        x, (nw, nb, w, b) = inputs(tokens, out_features, device)
        call = (x, nw, nb, w, b, 1e-5, dtype)
        want = composite(*call)
        ulp = want.float().abs().amax(-1, keepdim=True) * torch.finfo(dtype).eps
        case = {"case": name, "tokens": tokens, "out_features": out_features}
        found, table = compare_and_time(case, methods, call, want, ulp, device, args.budget)
        records += found
        rows += table
        del x, want, ulp
    print_table(
        f"norm_linear, fp32 stream, {dtype} matmuls on {device}",
        ["case", "method", "median ms", "p20-p80", "peak extra MiB", "max err (roundings)"],
        rows,
    )
    out = args.json or Path(__file__).parent / "results" / f"norm-linear-{device.type}.json"
    write_json(
        out,
        {"benchmark": "norm_linear", "device": str(device), "dtype": str(dtype),
         "environment": environment(), "records": records},
    )  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
