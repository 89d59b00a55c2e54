"""rotary_embedding against the ATen composite it replaces, on the row stage's shapes.

Cases are the row stage's queries of the driver's workloads: (tables x rows) sequences of 8 heads
x (features + 4 CLS tokens) x 16, as strided views into a packed projection. Methods: the
composite (six ATen ops, float32 intermediates), the operator, and on CUDA the composite under
torch.compile (Inductor fuses it). Every method's output is checked bit for bit against the
composite before timing.

    python benchmarks/rotary.py --device cuda
    python benchmarks/rotary.py --quick          # CPU, small cases
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import default_json, environment, print_table, write_json
from tabserve import ops
from tabserve.bench.timing import measure
from tabserve.models.tabicl.network.layers import RotaryEmbedding, rotate_half

#: (name, sequences, tokens): small / medium / large workloads' row stage (8 tables).
CASES = [("small", 8 * 576, 12), ("medium", 8 * 1280, 24), ("large", 8 * 10240, 68)]
QUICK_CASES = [("small-quick", 2 * 160, 12), ("small", 8 * 576, 12)]
HEADS, HEAD_DIM = 8, 16


def inputs(sequences: int, tokens: int, dtype, device):
    """Head-split queries (a strided view into a packed projection) and the model's tables."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(sequences, tokens, 3 * HEADS * HEAD_DIM, generator=g).to(dtype).to(device)
    x = packed[..., : HEADS * HEAD_DIM].unflatten(-1, (HEADS, HEAD_DIM)).transpose(-3, -2)
    cos, sin = RotaryEmbedding(HEAD_DIM, 100000.0).to(device).tables(tokens, device, dtype)
    return x, cos, sin


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", choices=("float16", "float32", "bfloat16"), default="float16")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # CPU half maths is not what anyone serves with
    methods = {"composite": rotate_half, "tabserve op": ops.rotary_embedding}
    if device.type == "cuda":
        methods["composite compiled"] = torch.compile(rotate_half, fullgraph=True)
    records, rows = [], []
    for name, sequences, tokens in QUICK_CASES if args.quick else CASES:
        x, cos, sin = inputs(sequences, tokens, dtype, device)
        want = rotate_half(x, cos, sin)
        for method, fn in methods.items():
            same = bool(torch.equal(fn(x, cos, sin), want))
            m = measure(lambda fn=fn, x=x, c=cos, s=sin: fn(x, c, s), device, budget_s=args.budget)
            record = {
                "case": name,
                "shape": list(x.shape),
                "method": method,
                "bitwise": same,
                **m.as_dict(),
            }
            records.append(record)
            rows.append(
                [
                    name,
                    method,
                    *m.table_cells(),
                    same,
                ]
            )
    print_table(
        f"rotary_embedding, {dtype} on {device}",
        ["case", "method", "median ms", "p20-p80", "peak extra MiB", "bitwise = composite"],
        rows,
    )
    out = args.json or default_json(f"rotary-{device.type}")
    write_json(
        out,
        {
            "benchmark": "rotary",
            "device": str(device),
            "dtype": str(dtype),
            "environment": environment(),
            "records": records,
        },
    )
    print(f"wrote {out}")
    return 0 if all(r["bitwise"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
