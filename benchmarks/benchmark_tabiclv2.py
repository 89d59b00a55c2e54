"""TabICLv2 inference benchmark: every serving recipe (cell) on every workload, each in its own
subprocess, gated for accuracy against fp32, with a JSON result, a table, a plot and the promoted
recipes. The driver lives in the package (``python -m tabserve.bench`` is the same command); see
docs/serving.md, "The benchmark driver".

    python benchmarks/benchmark_tabiclv2.py --list
    python benchmarks/benchmark_tabiclv2.py                      # all cells, all workloads
    python benchmarks/benchmark_tabiclv2.py --quick              # CPU-sized run
    python benchmarks/benchmark_tabiclv2.py --workloads large --cells 'c[0-9]-*'
    python benchmarks/benchmark_tabiclv2.py --ab c5-fp16 c7-fp16-flash --workloads large
"""

import sys

from tabserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
