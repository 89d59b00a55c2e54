"""feed_forward against the modules it replaces, on the column and row stages' token streams.

Cases are the blocks' inputs of the driver's workloads: (tokens, 128) fp32 residual streams
(autocast keeps the residual in fp32) plus the attention half's fp16 output, hidden width 256,
fp16 matmuls. Methods: the composite (add, LayerNorm, linear, GELU, linear, add as autocast runs
them), the composite under torch.compile (Inductor fuses the pointwise parts around cuBLAS), the
Triton operator, and on CUDA the resident operator (tabserve::feed_forward_resident: weights in
shared memory, the path the models take for streams below 2^20 tokens); with ``--sweep`` the
operator's tile configurations too (tokens per program, warps, pipeline stages), which is how
the kernel's defaults were chosen. Every method's output is checked against the composite
(max |difference| in fp16 roundings of the row's scale, reported) before timing. Cases marked
"out-proj" fold the attention's out-projection into the operator (``update_weight``: the update
is then the heads' unprojected output); on CUDA they also time cuBLAS projecting first and the
operator adding its output (the route without the fold), and the resident operator is left out
(it does not fold); on CUDA the operator with each GELU form but the default too
(``kernels.feed_forward.GELUS``). The "rows" case is the column stage's last block, which writes the row
stage's tokens (``row_prefix``: 4 CLS tokens, then each row's 64 feature tokens); it also times
the operator writing its sets layout, rearranged into rows by ATen (``to_rows``).

    python benchmarks/feed_forward.py --device cuda --sweep
    python benchmarks/feed_forward.py --device cuda --sweep --stream matmul --cases out-proj
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
from tabserve.kernels import feed_forward as ff

#: (name, tokens, out-projection folded, rows): small / large workloads' row stage (8 tables x
#: rows x (features + 4 CLS)) and the large workload's column stage (8 tables x 64 features x
#: 10,240 rows), one-shot and KV-cached (test rows only); ``rows``: (tables, sets, rows per set)
#: of a case written in the row stage's layout behind ROW_PREFIX CLS tokens, else None.
CASES = [
    ("small row", 8 * 576 * 12, False, None),
    ("large row", 8 * 10240 * 68, False, None),
    ("large col", 8 * 64 * 10240, False, None),
    ("large row out-proj", 8 * 10240 * 68, True, None),
    ("large col out-proj", 8 * 64 * 10240, True, None),
    ("large col out-proj rows", 8 * 64 * 10240, True, (8, 64, 10240)),
    # KV-cached prediction of the large workload: the 2,048 test rows alone.
    ("large kv row", 8 * 2048 * 68, False, None),
    ("large kv col", 8 * 64 * 2048, False, None),
    ("large kv row out-proj", 8 * 2048 * 68, True, None),
    ("large kv col out-proj rows", 8 * 64 * 2048, True, (8, 64, 2048)),
]
QUICK_CASES = [
    ("tiny", 1000, False, None),
    ("tiny out-proj", 1000, True, None),
    ("tiny out-proj rows", 1000, True, (2, 5, 100)),
]
#: The row stage's CLS tokens ahead of each row in the "rows" cases.
ROW_PREFIX = 4
DIM, HIDDEN = 128, 256
SWEEP = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 3)))
#: Hidden units per loop step tried besides the kernel's 64, on the tiles that led the sweep.
STEP_SWEEP = (32, 128)
STEP_SWEEP_TILES = ((64, 4, 1), (64, 4, 3), (128, 8, 1))


def hidden_stepped(run, step: int):
    """``run`` with ``step`` hidden units per loop step of the kernel."""

    def stepped(*args):
        with ff.hidden_step_override(step):
            return run(*args)

    return stepped


def resident_op():
    """tabserve::feed_forward_resident called as a frozen compiled model calls it: the weights
    cast to the matmul dtype once (per weight tensor), not per call."""
    cast: dict = {}

    def run(x, update, nw, nb, w1, b1, w2, b2, eps, dtype):
        key = (w1.data_ptr(), w2.data_ptr(), dtype)
        if key not in cast:
            cast[key] = [t.to(dtype) for t in (w1, b1, w2, b2)]
        return torch.ops.tabserve.feed_forward_resident(x, update, nw, nb, *cast[key], eps)

    return run


def inputs(tokens: int, device, stream_dtype=torch.float32):
    """x (the stream, ``stream_dtype``), update (the attention half's fp16 output) and the
    block's parameters."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, DIM, generator=g).to(device, stream_dtype)
    update = torch.randn(tokens, DIM, generator=g).half().to(device)
    params = [
        1 + 0.1 * torch.randn(DIM, generator=g),
        0.1 * torch.randn(DIM, generator=g),
        torch.randn(HIDDEN, DIM, generator=g) / DIM**0.5,
        0.1 * torch.randn(HIDDEN, generator=g),
        torch.randn(DIM, HIDDEN, generator=g) / HIDDEN**0.5,
        0.1 * torch.randn(DIM, generator=g),
    ]
    return x, update, [p.to(device) for p in params]


def out_projection(device):
    """An out-projection's [128, 128] weight and [128] bias."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(DIM, DIM, generator=g) / DIM**0.5
    return weight.to(device), (0.1 * torch.randn(DIM, generator=g)).to(device)


def projected_first(
    x, update, nw, nb, w1, b1, w2, b2, eps, dtype, skip, skip_value, wo, bo, row_prefix=None
):  # fmt: skip
    """The route without the fold: cuBLAS projects the update, then the operator adds it."""
    projected = ff.project_update(update, wo, bo, dtype)
    return torch.ops.tabserve.feed_forward(
        x, projected, nw, nb, w1, b1, w2, b2, eps, dtype, None, 0.0, None, None, row_prefix
    )


def gelus() -> dict:
    """The operator with each GELU form but the default (``kernels.feed_forward.GELUS``)."""
    op = torch.ops.tabserve.feed_forward
    return overridden(op, ff.gelu_override, ff.GELUS, ff.GELU, "GELU")


def rows_after(*call):
    """The route before ``row_prefix``: the operator's sets layout, then ATen's ``to_rows``."""
    *operands, row_prefix = call
    return ff.to_rows(torch.ops.tabserve.feed_forward(*operands), row_prefix)


def main(argv=None) -> int:
    args, device, dtype = kernel_benchmark_args(__doc__, argv)
    composite = ff.feed_forward_composite
    sweep = {f"op {b}x{w}w{s}s": tile_configured(ff.run_kernel, (b, w, s)) for b, w, s in SWEEP}
    for (b, w, s), step in itertools.product(STEP_SWEEP_TILES, STEP_SWEEP):
        sweep[f"op {b}x{w}w{s}s h{step}"] = hidden_stepped(
            tile_configured(ff.run_kernel, (b, w, s)), step
        )
    methods = kernel_methods(
        composite, torch.ops.tabserve.feed_forward, device, sweep if args.sweep else None
    )
    if torch.device(device).type == "cuda":
        methods |= register_limited(ff.run_kernel, args.max_registers)
    cuda = torch.device(device).type == "cuda"
    records, rows = [], []
    for name, tokens, fold, layout in selected_cases(QUICK_CASES if args.quick else CASES, args):
        x, update, (nw, nb, w1, b1, w2, b2) = inputs(tokens, device, args.stream_dtype)
        if layout is not None:  # the column stage's (tables, sets, rows per set, width) streams
            x, update = x.view(*layout, DIM), update.view(*layout, DIM)
        call = (x, update, nw, nb, w1, b1, w2, b2, 1e-5, dtype)
        timed = methods | ({"resident op": resident_op()} | gelus() if cuda else {})
        stream = x + update
        if fold:
            projection = out_projection(device)
            call += (None, 0.0, *projection)
            timed = methods | (
                {"cuBLAS projection + op": projected_first} | gelus() if cuda else {}
            )
            stream = x + ff.project_update(update, *projection, dtype)
        if layout is not None:
            prefix = torch.randn(ROW_PREFIX, DIM, generator=torch.Generator().manual_seed(1))
            call += (prefix.to(device),)
            timed = timed | {"op, then ATen to_rows": rows_after}
            stream = ff.to_rows(stream, call[-1])
        want = composite(*call)
        # One fp16 rounding of the row's scale (as test_feed_forward.py measures agreement).
        ulp = ((want - stream).abs().amax(-1, keepdim=True) + want.abs()) * torch.finfo(dtype).eps
        del stream
        case = {"case": name, "tokens": tokens, "out_projection": fold, "rows": layout}
        found, table = compare_and_time(case, timed, call, want, ulp, device, args.budget)
        records += found
        rows += table
        del x, update, want, ulp
    report_kernel_benchmark(
        "feed_forward",
        f"feed_forward, {args.stream_dtype} stream, {dtype} matmuls on {device}",
        args,
        device,
        dtype,
        records,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
