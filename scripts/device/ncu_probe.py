"""One call of each heavy kernel of the large workload, for Nsight Compute (stall reasons,
occupancy, DRAM and L2 throughput): the head-dim-16 attention on the row stage (plain and with
RoPE), on the column stage's rows over the inducing points, and the fused feed-forward on the
row stage's stream; with ``--feed-forward`` only the two feed-forward kernels on that stream
(the Triton one and tabserve::feed_forward_resident); with ``--flash`` only
tabserve::flash_attention on the ICL stage's train-row call (8 tables x 8 heads of 64, 16,384
keys: xlarge's shape at a third of its rows, so each of Nsight's replays takes ~8 ms), fp8 then
half operands. Each runs once first (Triton compiles, caches warm): skip those launches with
``--launch-skip``.

    ncu --clock-control none --set full -k regex:"one_chunk|streaming|_feed_forward" \
        -c 4 -o probe python3 scripts/device/ncu_probe.py
    NCU_ARGS=--flash NCU_KERNELS=_flash_attention_kernel bash scripts/device/bench.sh ncu
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import feed_forward as ffn_bench  # noqa: E402
import small_head_attention as attention_bench  # noqa: E402
from tabserve import ops  # noqa: E402
from tabserve.kernels import feed_forward as ff  # noqa: E402
from tabserve.models.tabicl.network.layers import RotaryEmbedding  # noqa: E402


def feed_forward_calls() -> list:
    """The Triton feed-forward kernel and tabserve::feed_forward_resident on the large row
    stream (the same inputs; the resident op with its weights cast once, as frozen graphs pass
    them)."""
    x, update, (nw, nb, w1, b1, w2, b2) = ffn_bench.inputs(8 * 10240 * 68, "cuda")
    resident = ffn_bench.resident_op()
    return [
        lambda: ff.run_kernel(x, update, nw, nb, w1, b1, w2, b2, 1e-5, torch.float16),
        lambda: resident(x, update, nw, nb, w1, b1, w2, b2, 1e-5, torch.float16),
    ]


def flash_calls() -> list:
    """tabserve::flash_attention on the ICL train-row call's shape (fewer keys), fp8 then half:
    where its time goes between the exponentials, the other vector work and the matmuls."""
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(8, 8, 16_384, 64, generator=g, device="cuda").half() for _ in range(3))
    return [lambda: ops.flash_attention(q, k, v, True), lambda: ops.flash_attention(q, k, v)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = "--feed-forward" in argv or "--flash" in argv
    calls = flash_calls() if "--flash" in argv else feed_forward_calls() if only else []
    for name, batch, queries, keys, broadcast in [] if only else attention_bench.CASES:
        if name in ("row", "col-rows"):
            q, k, v = attention_bench.inputs(batch, queries, keys, broadcast, torch.float16, "cuda")
            calls.append(lambda q=q, k=k, v=v: ops.small_head_attention(q, k, v))
        if name == "row":
            tables = RotaryEmbedding(16, 100_000.0).cuda().tables(keys, "cuda", torch.float16)
            calls.append(
                lambda q=q, k=k, v=v, t=tables: ops.small_head_attention(q, k, v, rotary=t)
            )
    if not only:
        calls += feed_forward_calls()[:1]
    for call in calls:  # warm-up: Triton compiles, nothing is cold when the profiler runs
        call()
    torch.cuda.synchronize()
    for call in calls:
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
