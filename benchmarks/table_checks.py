"""table_checks against the ATen checks it replaces, as the model runs them before a forward pass.

Both methods are the model's own `check_inputs` (the value checks of a call, then the one
transfer of their verdict to the host): with the operator (one kernel, the default when the
extension is built) and without it (about fifteen ATen ops: isfinite / all twice, round and
comparisons, a sort of the labels for the distinct counts, stacks and a concatenation). The
cases are the driver's workloads (8 tables of 512 train + 64 test rows and 8 features; of
8,192 + 2,048 rows and 64 features), fp32 tables and float labels. Each method's K is checked
against the other's before timing. On CUDA the time is host and device together: the checks
end in a synchronisation, so their launches are latency the caller waits for.

    python benchmarks/table_checks.py --device cuda
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import compare_and_time, kernel_benchmark_args, report_kernel_benchmark

#: (name, tables, train rows, test rows, features, classes)
CASES = [
    ("small", 8, 512, 64, 8, 10),
    ("large", 8, 8192, 2048, 64, 10),
]
QUICK_CASES = [("tiny", 2, 40, 8, 5, 3)]


def checker(device):
    """A model whose `check_inputs` the methods call (its weights play no part)."""
    from tabserve.models.tabicl import TabICLv2, TabICLv2Config

    config = TabICLv2Config(
        embed_dim=16, col_num_inds=4, row_num_cls=1, icl_num_blocks=1, col_num_blocks=1,
        row_num_blocks=1, col_nhead=2, row_nhead=2, icl_nhead=2,
    )  # fmt: skip
    return TabICLv2(config).to(device)


def main(argv=None) -> int:
    from tabserve.models.tabicl.network import model as model_module

    args, device, _ = kernel_benchmark_args(__doc__, argv)
    model = checker(device)

    def aten(X, y):
        with mock.patch.object(model_module, "extension_ops", lambda: None):
            return torch.tensor([model.check_inputs(X, y)[1]])

    def operator(X, y):
        return torch.tensor([model.check_inputs(X, y)[1]])

    methods = {"ATen checks": aten, "tabserve op": operator}
    records, rows = [], []
    for name, tables, train, test, features, classes in QUICK_CASES if args.quick else CASES:
        g = torch.Generator().manual_seed(0)
        X = torch.randn(tables, train + test, features, generator=g).to(device)
        y = (torch.arange(train).repeat(tables, 1) % classes).float().to(device)
        want = aten(X, y)
        case = {"case": name, "tables": tables, "train_rows": train, "test_rows": test,
                "features": features, "classes": classes}  # fmt: skip
        found, table = compare_and_time(
            case, methods, (X, y), want, torch.ones(1), device, args.budget
        )
        records += found
        rows += table
    report_kernel_benchmark(
        "table_checks",
        f"table_checks (the model's input checks) on {device}",
        args,
        device,
        torch.float32,
        records,
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
