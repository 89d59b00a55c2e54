"""TabICLv2 inference benchmark: the same command as ``python -m tabserve.bench`` (the driver lives
in the package, python/tabserve/bench/). Every cell (the reference baselines and one cell per
serving preset) on every workload, each in its own subprocess, gated for accuracy against fp32,
with a JSON result, a table, a plot and the promotions, written under ``--out`` (default
./tabserve-results/).

    python benchmarks/benchmark_tabiclv2.py --list
    python benchmarks/benchmark_tabiclv2.py                      # default cells, all workloads
    python benchmarks/benchmark_tabiclv2.py --quick              # CPU-sized run
    python benchmarks/benchmark_tabiclv2.py --workloads large --cells 'ref-*' large
    python benchmarks/benchmark_tabiclv2.py --cells-file benchmarks/cells/research.json --list
    python benchmarks/benchmark_tabiclv2.py --ab medium small --workloads small
    python benchmarks/benchmark_tabiclv2.py estimators --kinds mixed   # the estimator suite
"""

import sys

from tabserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
