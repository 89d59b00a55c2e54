"""all_equal against the ATen check it replaces, on the column stage's cells.

The column stage asks before each induced-set block whether a set (one feature group of one
table: all its rows x 128 dims) is made only of the -100 sentinel. As ATen ops,
``(cells == -100).flatten(-2).all(-1)`` reads every cell (2.7 GB of fp32 on the large workload);
the operator leaves a set at its first other value. Cases: the small and large workloads'
cells with no sentinel set, and the large workload's with a quarter of its features padded
(all-sentinel sets, read whole by both methods). Both methods' answers are compared first.

    python benchmarks/all_equal.py --device cuda
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import compare_and_time, kernel_benchmark_args, report_kernel_benchmark

SKIP = -100.0
#: (name, tables, feature groups, rows, padded feature groups)
CASES = [
    ("small", 8, 8, 576, 0),
    ("large", 8, 64, 10240, 0),
    ("large, 16 padded features", 8, 64, 10240, 16),
]
QUICK_CASES = [("tiny", 2, 4, 50, 1)]


def aten(cells):
    return (cells == SKIP).flatten(-2).all(-1)


def operator(cells):
    return torch.ops.tabserve.all_equal(cells, SKIP, 2)


def main(argv=None) -> int:
    import tabserve  # noqa: F401  (registers the operators)

    args, device, _ = kernel_benchmark_args(__doc__, argv)
    methods = {"ATen": aten, "tabserve op": operator}
    if device.type == "cuda":
        methods["ATen compiled"] = torch.compile(aten, fullgraph=True)
    records, rows = [], []
    for name, tables, groups, n_rows, padded in QUICK_CASES if args.quick else CASES:
        g = torch.Generator().manual_seed(0)
        cells = torch.randn(tables, groups, n_rows, 128, generator=g).to(device)
        if padded:
            cells[:, groups - padded :] = SKIP
        want = aten(cells)
        case = {"case": name, "tables": tables, "groups": groups, "rows": n_rows,
                "padded_groups": padded}  # fmt: skip
        found, table = compare_and_time(
            case, methods, (cells,), want, torch.ones(1, device=device), device, args.budget
        )
        records += found
        rows += table
        del cells, want
    report_kernel_benchmark(
        "all_equal", f"all_equal (the sentinel check) on {device}", args, device, torch.float32,
        records, rows,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
