"""The ICL stage's attention (head dimension 64) on PyTorch's SDPA backends, large and xlarge.

The ICL stage's 12 blocks attend over the train rows with 8 heads of 64 dimensions (width 512):
at ``fit`` the train rows attend to each other (the first 11 blocks), then the test rows attend
to the train rows (every block). On the xlarge workload (8 tables, 50,000 train + 1,000 test
rows) cuDNN's attention took 1,183 ms of a 1,850 ms fp16 compiled one-shot call (H200 profile),
most of it the 11 train-row self-attentions. This benchmark times each of
those calls per backend (cuDNN, flash, memory-efficient, PyTorch's own choice), and cuDNN run on
fewer tables per call, and tabserve's own one-pass kernel (``tabserve.ops.flash_attention``) on
half and on fp8 operands, with each method's error against fp32 maths on a few query rows (on the
random values, and again on those values plus :data:`VALUE_OFFSET`), and the rate in TFLOP/s
(4 x tables x heads x queries x keys x 64 FLOP per call).

The bucketed presets run the same calls on a padded train block: every query attends over the
first n keys of a buffer of the bucket's length, n read from a device tensor
(:func:`tabserve.ops.prefix_attention`), so one captured graph serves every n of the bucket.
``--prefix`` times those calls per prefix backend (varlen flash, varlen memory-efficient, SDPA
with a key mask) on the small and large workloads' ICL calls, with the keys padded to
their train-row bucket (or n = 7/8 of the keys where the count sits on the grid, the fill
just past a bucket edge), garbage in the padded rows, against cuDNN on the keys sliced to n
(the unpadded path, which a graph cannot replay for another n): the measurement that picks
the ICL stage's padded backend.

``--cached`` times the calls of a KV-cached prediction of few rows: 1, 16 and 100 test rows
against the 10,000 cached train rows of the estimator suite's predict-many table. There a flash
kernel gives each (table, head) one block that walks all the keys (H100 profile, 1-row
prediction: 175 us a call, 2.1 ms of the 3.4 ms the GPU was busy), while reading the cache's K
and V once bounds a call at the card's bandwidth. Besides the backends it times the attention as
two batched matmuls (the softmax in fp32), and reports the rate as K and V bytes read per second.

    python benchmarks/icl_attention.py --device cuda
    python benchmarks/icl_attention.py --device cuda --prefix   # the padded (bucketed) calls
    python benchmarks/icl_attention.py --device cuda --cases xlarge --flash-sweep
    python benchmarks/icl_attention.py --device cuda --cached   # KV-cached predictions' calls
    python benchmarks/icl_attention.py --quick        # CPU, small shapes (math backend only)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    attention_benchmark_parser,
    default_json,
    print_table,
    selected_cases,
    write_json,
)
from tabserve.bench.timing import measure

HEADS, HEAD_DIM = 8, 64
#: (name, tables, queries, keys): the ICL stage's calls of the large and xlarge workloads.
CASES = [
    ("large train", 8, 8192, 8192),
    ("large test", 8, 2048, 8192),
    ("xlarge train", 8, 50000, 50000),
    ("xlarge test", 8, 1000, 50000),
]
QUICK_CASES = [("tiny train", 2, 96, 96), ("tiny test", 2, 16, 96)]
#: ``--cached``: a KV-cached prediction's calls (8 members, 10,000 cached train rows).
CACHED_CASES = [(f"cached {n} rows", 8, n, 10000) for n in (1, 16, 100)]
QUICK_CACHED_CASES = [("tiny cached 1 row", 2, 1, 96), ("tiny cached 16 rows", 2, 16, 96)]
#: The padded calls (``--prefix``): the small workload's (8 tables, 512 train + 64 test rows),
#: whose bucketed presets replay CUDA graphs, and the large one's (xlarge's 50,000 train rows
#: are past the train-row grid: never padded).
PREFIX_CASES = [
    ("small train", 8, 512, 512),
    ("small test", 8, 64, 512),
    *(case for case in CASES if case[0].startswith("large")),
]
#: Backends of :func:`tabserve.ops.prefix_attention` timed with ``--prefix`` (CUDA).
PREFIX_BACKENDS = ("flash", "efficient", "masked")
#: Query rows of the first table and head whose output is checked against fp32 maths.
CHECKED_ROWS = 64
#: Added to v for a second error check: values that share a sign, as the model's projections
#: (with their biases) give them. A kernel whose running sum loses bits block after block (fp8
#: matmuls left unpromoted on Hopper) drifts on those; zero-mean values hide it (such a kernel
#: showed 1.75e-3 here on zero-mean values and still failed the driver's model gate).
VALUE_OFFSET = 2.0
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def inputs(tables, queries, keys, dtype, device):
    """q (tables, heads, queries, 64) and k, v (tables, heads, keys, 64), standard normal scaled
    as LayerNorm-ed projections are (unit variance per element)."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (tables, HEADS)
    q = torch.randn(*shape, queries, HEAD_DIM, generator=g, device=device, dtype=dtype)
    k = torch.randn(*shape, keys, HEAD_DIM, generator=g, device=device, dtype=dtype)
    v = torch.randn(*shape, keys, HEAD_DIM, generator=g, device=device, dtype=dtype)
    return q, k, v


def methods(device, flash_sweep: bool = False) -> dict:
    """``{name: attend(q, k, v)}``: each backend alone, PyTorch's choice, and on CUDA cuDNN on
    one and two tables per call (the rest of the batch in further calls) and
    ``tabserve.ops.flash_attention`` on half and fp8 operands (``flash_sweep``: also on each tile
    of its :data:`~tabserve.kernels.flash_attention.SWEEP`)."""

    def on(backend):
        def attend(q, k, v):
            with sdpa_kernel(BACKENDS[backend]):
                return F.scaled_dot_product_attention(q, k, v)

        return attend

    if device.type != "cuda":
        return {"sdpa math": on("math")}
    found = {f"sdpa {name}": on(name) for name in ("cudnn", "flash", "efficient")}
    found["sdpa default"] = F.scaled_dot_product_attention

    def split(per_call):
        def attend(q, k, v):
            with sdpa_kernel(BACKENDS["cudnn"]):
                parts = [
                    F.scaled_dot_product_attention(
                        q[i : i + per_call], k[i : i + per_call], v[i : i + per_call]
                    )
                    for i in range(0, q.shape[0], per_call)
                ]
            return torch.cat(parts)

        return attend

    found |= {f"sdpa cudnn, {n} tables per call": split(n) for n in (1, 2)}
    from tabserve import ops
    from tabserve.kernels import flash_attention as fa

    def flash(fp8, tile=None):
        def attend(q, k, v):
            if tile is None:
                return ops.flash_attention(q, k, v, fp8)
            with fa.tile_override(tile):
                return ops.flash_attention(q, k, v, fp8)

        return attend

    for fp8, label in ((False, "half"), (True, "fp8")):
        found[f"tabserve flash {label}"] = flash(fp8)
        for tile in fa.SWEEP if flash_sweep else ():
            if tile.fp8_only and not fp8:  # (permuted score columns, TMA: fp8's)
                continue
            found[f"tabserve flash {label} {tile.label}"] = flash(fp8, tile)
    return found


def by_matmuls(q, k, v):
    """Attention as two batched matmuls, the scores' softmax in fp32 (``--cached``)."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
    return torch.matmul(scores.float().softmax(-1).to(v.dtype), v)


def padded_keys(k, v, n: int, length: int, seed: int = 1):
    """k and v's first ``n`` keys in buffers of ``length`` keys, the rest garbage (large random
    values: a kernel that reads a padded key shows it in the error)."""
    g = torch.Generator(device=k.device).manual_seed(seed)
    shape = (*k.shape[:2], length - n, k.shape[-1])
    pad = [100 * torch.randn(shape, generator=g, device=k.device, dtype=k.dtype) for _ in "kv"]
    return torch.cat([k[:, :, :n], pad[0]], 2), torch.cat([v[:, :, :n], pad[1]], 2)


def prefix_lengths(keys: int) -> tuple:
    """(n, padded length) of a call over ``keys`` train rows: n = keys and the length its
    bucket on the default train-row grid; where ``keys`` sits on the grid, n = 7/8 of it
    (a count just past the bucket below) in a buffer of ``keys``."""
    from tabserve.buckets import DEFAULT_TRAIN_ROWS

    bucket = next((b for b in DEFAULT_TRAIN_ROWS if b >= keys), keys)
    return (keys - keys // 8, keys) if bucket == keys else (keys, bucket)


def prefix_methods(device) -> dict:
    """``{name: attend(q, k_padded, v_padded, n_tensor)}``: each prefix backend (CUDA), or the
    CPU path (any backend: SDPA on the sliced keys)."""
    from tabserve import ops

    def on(backend):
        return lambda q, k, v, n: ops.prefix_attention(q, k, v, n, backend=backend)

    if device.type != "cuda":
        return {"prefix (cpu)": on("auto")}
    return {f"prefix {backend}": on(backend) for backend in PREFIX_BACKENDS}


def max_error(out, q, k, v) -> float:
    """Largest |difference| from fp32 maths on the first CHECKED_ROWS queries of table 0, head 0."""
    q0, k0, v0 = (t[0, 0].float().cpu() for t in (q[:, :, :CHECKED_ROWS], k, v))
    want = torch.softmax(q0 @ k0.T / HEAD_DIM**0.5, -1) @ v0
    return (out[0, 0, :CHECKED_ROWS].float().cpu() - want).abs().max().item()


def main(argv=None) -> int:
    parser = attention_benchmark_parser(__doc__)
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="the padded calls: tabserve.ops.prefix_attention per backend (see above)",
    )
    parser.add_argument(
        "--cached",
        action="store_true",
        help="a KV-cached prediction's calls: few query rows, many keys (see above)",
    )
    args = parser.parse_args(argv)
    if args.cached and args.prefix:
        parser.error("--cached and --prefix are separate runs")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    if args.cached:
        cases = selected_cases(QUICK_CACHED_CASES if args.quick else CACHED_CASES, args)
    else:
        cases = selected_cases(
            QUICK_CASES if args.quick else PREFIX_CASES if args.prefix else CASES, args
        )
    records, rows = [], []
    for name, tables, queries, keys in cases:
        q, k, v = inputs(tables, queries, keys, dtype, device)
        runs, length = {}, keys
        if args.prefix:
            n, length = prefix_lengths(keys)
            k, v = k[:, :, :n], v[:, :, :n]  # the real keys: the sliced reference's and the check's
            k_padded, v_padded = padded_keys(k, v, n, length)
            n_keys = torch.tensor(n, device=device)
            padded = (k_padded, v_padded, n_keys)
            for method, attend in prefix_methods(device).items():
                runs[method] = lambda f=attend, q=q, p=padded: f(q, *p)
            if device.type == "cuda":
                sliced = methods(device)["sdpa cudnn"]
                runs["sdpa cudnn, sliced keys"] = lambda f=sliced, q=q, k=k, v=v: f(q, k, v)
        else:
            found = methods(device, args.flash_sweep)
            if args.cached:
                found["matmuls"] = by_matmuls
            # v a keyword: the offset-values check below passes its own
            runs = {m: lambda f=f, q=q, k=k, v=v: f(q, k, v) for m, f in found.items()}
        flop = 4 * tables * HEADS * queries * k.shape[2] * HEAD_DIM  # over the real keys
        for method, run in runs.items():
            try:
                error = max_error(run(), q, k, v)
                offset_error = (
                    max_error(run(v=v + VALUE_OFFSET), q, k, v + VALUE_OFFSET)
                    if not args.prefix
                    else None
                )
                m = measure(run, device, budget_s=args.budget)
            except RuntimeError as failure:  # a backend that refuses the shape is a result
                records.append({"case": name, "method": method, "error": str(failure)[:300]})
                rows.append(
                    [name, method, "failed", "", "", "", str(failure).split("\n")[0][:50], ""]
                )
                continue
            tflops = flop / (m.median_ms / 1e3) / 1e12
            kv_gb_per_s = 2 * k.numel() * k.element_size() / (m.median_ms / 1e3) / 1e9
            records.append(
                {
                    "case": name,
                    "shape": [tables, HEADS, queries, k.shape[2], HEAD_DIM],
                    **({"padded_keys": length} if args.prefix else {}),
                    "method": method,
                    "max_abs_error_vs_fp32": error,
                    "max_abs_error_vs_fp32_offset_values": offset_error,
                    "tflop_per_s": tflops,
                    "kv_gb_per_s": kv_gb_per_s,
                    **m.as_dict(),
                }
            )
            offset_cell = "" if offset_error is None else f"{offset_error:.2e}"
            rate = f"{kv_gb_per_s:.0f}" if args.cached else f"{tflops:.0f}"
            rows.append([name, method, *m.table_cells(), rate, f"{error:.2e}", offset_cell])
        del q, k, v, runs
    what = "padded ICL attention (prefix_attention)" if args.prefix else "ICL attention"
    what = "KV-cached ICL attention" if args.cached else what
    print_table(
        f"{what} (head dim {HEAD_DIM}), {dtype} on {device}",
        [
            "case",
            "method",
            "median ms",
            "p20-p80",
            "peak extra MiB",
            "K+V GB/s" if args.cached else "TFLOP/s",
            "max |err|",
            f"|err| v+{VALUE_OFFSET:g}",
        ],
        rows,
    )
    stem = "icl-prefix-attention" if args.prefix else "icl-attention"
    stem = "icl-cached-attention" if args.cached else stem
    out = args.json or default_json(f"{stem}-{device.type}")
    write_json(
        out,
        {
            "benchmark": "icl_attention",
            "device": str(device),
            "dtype": str(dtype),
            "prefix": args.prefix,
            "cached": args.cached,
            "records": records,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
