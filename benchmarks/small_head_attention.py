"""small_head_attention against PyTorch's SDPA backends on the column and row stages' shapes.

Cases are the head-dim-16 attentions of the driver's large workload (8 tables, 8,192 train +
2,048 test rows, 64 features): the row stage's self-attention over 68 tokens and its last block
(the 4 CLS tokens over 68), the column stage's inducing points over the train rows and every row
over the 128 induced tokens, with q, k and v as head-split views of packed projections (as the
model makes them); and the xlarge workload's inducing points over its 50,000 train rows (one of
the column stage's chunks: 40 feature groups of 8 tables). Methods: the operator, SDPA with
PyTorch's own choice, SDPA restricted to cuDNN, memory-efficient and flash (chunked to the
65,535 batch limit, as the model does), and ``tabserve.ops.flash_attention`` on half operands
(read in place; ``head16-flash`` serves the inducing points with it). Each method's error
against fp32 maths on the first batch entries is reported next to its time.

    python benchmarks/small_head_attention.py --device cuda
    python benchmarks/small_head_attention.py --quick        # CPU, small cases (op vs SDPA)
    python benchmarks/small_head_attention.py --methods "tabserve op" "sdpa cudnn"
    python benchmarks/small_head_attention.py --device cuda --cases col-inducing
    python benchmarks/small_head_attention.py --device cuda --cases col --flash-sweep
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    attention_benchmark_parser,
    default_json,
    environment,
    print_table,
    selected_cases,
    write_json,
)
from tabserve import ops
from tabserve.bench.timing import measure
from tabserve.models.tabicl.network.layers import _in_cuda_batch_chunks
from tabserve.models.tabicl.serving.options import sdpa_context

HEADS = 8
#: (name, batch, queries, keys, broadcast queries): the large workload's head-dim-16 attentions
#: and one xlarge column-stage chunk's inducing points.
CASES = [
    ("row", 8 * 10240, 68, 68, False),
    ("row-cls", 8 * 10240, 4, 68, False),
    ("col-inducing", 8 * 64, 128, 8192, True),
    ("col-rows", 8 * 64, 10240, 128, False),
    ("xlarge col-inducing", 8 * 40, 128, 50000, True),
]
QUICK_CASES = [("row", 64, 12, 12, False), ("col-inducing", 8, 128, 160, True)]
#: Rows of the batch the error is measured on (fp32 maths on the host's copy).
CHECKED = 4


def inputs(batch, queries, keys, broadcast, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)  # on the device: xlarge's are 12 GB
    width = 3 * HEADS * 16

    def split(t, i):
        return (
            t[..., i * HEADS * 16 : (i + 1) * HEADS * 16].unflatten(-1, (HEADS, 16)).transpose(1, 2)
        )

    if broadcast:  # the learned inducing points, one set for every column
        q = torch.randn(1, queries, HEADS * 16, generator=g, device=device).to(dtype)
        q = q.unflatten(-1, (HEADS, 16)).transpose(1, 2).expand(batch, -1, -1, -1)
    else:
        q = split(torch.randn(batch, queries, width, generator=g, device=device).to(dtype), 0)
    kv = torch.randn(batch, keys, width, generator=g, device=device).to(dtype)
    return q, split(kv, 1), split(kv, 2)


def methods(device, flash_sweep: bool = False):
    """``{name: attend(q, k, v)}``: the operator, ``tabserve.ops.flash_attention`` (half; with
    ``flash_sweep`` also on each tile of its sweep but the fp8-only ones) and, on CUDA,
    the SDPA backends."""
    found = {"tabserve op": ops.small_head_attention, "tabserve flash half": ops.flash_attention}
    if flash_sweep:
        from tabserve.kernels import flash_attention as fa

        def tiled(tile):
            def attend(q, k, v):
                with fa.tile_override(tile):
                    return ops.flash_attention(q, k, v)

            return attend

        for tile in fa.SWEEP:
            if not tile.fp8_only:
                found[f"tabserve flash half {tile.label}"] = tiled(tile)
    if device.type != "cuda":
        found["sdpa"] = F.scaled_dot_product_attention
        return found

    def sdpa(backend=None):
        def attend(q, k, v):
            # reshape: the broadcast queries materialised, as the model's reshape does
            q = q.reshape(q.shape)
            if backend is None:
                return _in_cuda_batch_chunks(F.scaled_dot_product_attention, q, k, v)
            with sdpa_context(backend):
                return _in_cuda_batch_chunks(F.scaled_dot_product_attention, q, k, v)

        return attend

    found["sdpa default"] = sdpa()
    for backend in ("cudnn", "efficient", "flash"):
        found[f"sdpa {backend}"] = sdpa(backend)
    return found


def floor_rates(batch, queries, keys, broadcast, dtype, ms):
    """The least memory traffic and the maths of one call, as rates at ``ms``: (GB/s, TFLOP/s).
    Traffic: q once (one set when broadcast), k and v once, the output once; maths: the two
    products (4 x B x heads x Lq x Lk x 16 FLOP). Against the H200's ~4.8 TB/s and ~990 TFLOP/s
    (fp16 dense) they say how far a kernel is from its floor."""
    head_elements = HEADS * 16
    elements = head_elements * (
        queries * (1 if broadcast else batch) + 2 * batch * keys + batch * queries
    )
    seconds = ms / 1e3
    flop = 4 * batch * HEADS * queries * keys * 16
    return elements * dtype.itemsize / seconds / 1e9, flop / seconds / 1e12


def max_error(out, q, k, v):
    q, k, v = (t[:CHECKED].float().cpu() for t in (q, k, v))
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
    return (out[:CHECKED].float().cpu() - want).abs().max().item()


def main(argv=None) -> int:
    parser = attention_benchmark_parser(__doc__)
    parser.add_argument(
        "--methods", nargs="+", metavar="NAME", help="only these methods (as the table names them)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    records, rows = [], []
    for name, batch, queries, keys, broadcast in selected_cases(
        QUICK_CASES if args.quick else CASES, args
    ):
        q, k, v = inputs(batch, queries, keys, broadcast, dtype, device)
        for method, fn in methods(device, args.flash_sweep).items():
            if args.methods and method not in args.methods:
                continue
            try:
                error = max_error(fn(q, k, v), q, k, v)
                m = measure(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), device, budget_s=args.budget)
            except RuntimeError as failure:  # a backend that refuses the shape is a result
                records.append({"case": name, "method": method, "error": str(failure)[:300]})
                rows.append([name, method, "failed", "", "", str(failure).split("\n")[0][:50]])
                continue
            gb_s, tflop_s = floor_rates(batch, queries, keys, broadcast, dtype, m.median_ms)
            records.append(
                {
                    "case": name,
                    "shape": [batch, HEADS, queries, keys],
                    "method": method,
                    "max_abs_error_vs_fp32": error,
                    "least_traffic_gb_per_s": gb_s,
                    "tflop_per_s": tflop_s,
                    **m.as_dict(),
                }
            )
            rows.append(
                [name, method, *m.table_cells(), f"{gb_s:.0f}", f"{tflop_s:.1f}", f"{error:.2e}"]
            )
        del q, k, v
    print_table(
        f"small_head_attention, {dtype} on {device}",
        [
            "case",
            "method",
            "median ms",
            "p20-p80",
            "peak extra MiB",
            "GB/s (least)",
            "TFLOP/s",
            "max |err| vs fp32",
        ],
        rows,
    )
    out = (
        args.json or default_json(f"small-head-attention-{device.type}")
    )
    write_json(
        out,
        {
            "benchmark": "small_head_attention",
            "device": str(device),
            "dtype": str(dtype),
            "environment": environment(),
            "records": records,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
