"""One call of each heavy kernel of the large workload, for Nsight Compute (stall reasons,
occupancy, DRAM and L2 throughput): the head-dim-16 attention on the row stage (plain and with
RoPE), on the column stage's rows over the inducing points, and the fused feed-forward on the
row stage's stream. Each runs once unprofiled first (Triton compiles, caches warm).

    ncu --clock-control none --set full -k regex:"one_chunk|streaming|_feed_forward" \
        -c 4 -o probe python3 scripts/ncu_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import feed_forward as ffn_bench  # noqa: E402
import small_head_attention as attention_bench  # noqa: E402
from tabserve import ops  # noqa: E402
from tabserve.kernels import feed_forward as ff  # noqa: E402
from tabserve.models.tabicl.layers import RotaryEmbedding  # noqa: E402


def main() -> int:
    calls = []
    for name, batch, queries, keys, broadcast in attention_bench.CASES:
        if name in ("row", "col-rows"):
            q, k, v = attention_bench.inputs(batch, queries, keys, broadcast, torch.float16, "cuda")
            calls.append(lambda q=q, k=k, v=v: ops.small_head_attention(q, k, v))
        if name == "row":
            tables = RotaryEmbedding(16, 100_000.0).cuda().tables(keys, "cuda", torch.float16)
            calls.append(lambda q=q, k=k, v=v: ops.small_head_attention(q, k, v, rotary=tables))
    x, update, (nw, nb, w1, b1, w2, b2) = ffn_bench.inputs(8 * 10240 * 68, "cuda")
    calls.append(lambda: ff.run_kernel(x, update, nw, nb, w1, b1, w2, b2, 1e-5, torch.float16))
    for call in calls:  # warm-up: Triton compiles, nothing is cold when the profiler runs
        call()
    torch.cuda.synchronize()
    for call in calls:
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
