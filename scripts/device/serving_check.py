"""GPU check of the serving presets (ServedTabICL): agreement with fp32, recompiles, warm latency.

Full-size random-weight classifier, a small bucket grid, the driver's small workload (8 members,
512 train + 64 test rows, 8 features) and a fresh table inside the same bucket:

    python3 scripts/device/serving_check.py [--presets exact medium ...] [--out results.json]

Per preset: warm-up time (compile / capture), the fresh table's max probability difference and
argmax agreement against unpadded fp32 eager, new Dynamo graphs after warm-up, CUDA-graph
captures and the median warm latency (tabserve.bench.timing, CUDA events).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "python"))

from tabicl_helpers import our_model, random_table
from tabserve.bench.timing import time_calls
from tabserve.buckets import BucketGrid
from tabserve.models.tabicl.serving.options import PRESETS, precision_flags
from tabserve.models.tabicl.serving.served import ServedTabICL
from torch._dynamo.utils import counters

GRID = BucketGrid(train_rows=(512,), test_rows=(64,), features=(8,))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="*", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = our_model("clf", "full").cuda()
    tables = [
        [t.cuda() for t in random_table(seed, 8, n, 64 - seed, 8 - seed, 4)]
        for seed, n in ((0, 512), (1, 500))
    ]
    with torch.no_grad(), precision_flags("fp32"):
        expected = [base(X, y, return_logits=False) for X, y in tables]
    results = []
    for name in args.presets:
        torch._dynamo.reset()
        counters.clear()
        served = ServedTabICL(copy.deepcopy(base), name, GRID)
        row = {"preset": name}
        try:
            start = time.perf_counter()
            served(*tables[0], return_logits=False)
            torch.cuda.synchronize()
            row["warm_up_s"] = time.perf_counter() - start
            graphs = counters["stats"].get("unique_graphs", 0)
            got = served(*tables[1], return_logits=False)
            diff = (got.float() - expected[1]).abs().max().item()
            agree = (got.argmax(-1) == expected[1].argmax(-1)).float().mean().item()
            row.update(max_prob_diff=diff, argmax_agreement=agree)
            row["new_graphs"] = counters["stats"].get("unique_graphs", 0) - graphs
            row["captures"] = served.captures
            row["median_ms"] = time_calls(
                lambda served=served: served(*tables[1], return_logits=False), "cuda",
                min_repeats=20, max_repeats=20,
            ).median_ms  # fmt: skip
        except Exception as error:  # noqa: BLE001  (report and go on with the next preset)
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
