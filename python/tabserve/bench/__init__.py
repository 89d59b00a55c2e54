"""The TabICLv2 inference benchmark driver (``python -m tabserve.bench``).

Cells (the serving presets and research variants of them, :mod:`.cells`) are measured on workloads (named table shapes,
:mod:`.workloads`), each (cell, workload) pair in its own subprocess (:mod:`.runner`, measured by
:mod:`.measure`), checked against the fp32 cell (:mod:`.gates`) and reported as JSON, a table, a
plot and a promotions file (:mod:`.report`). Timing primitives: :mod:`.timing`.
"""

from .cells import CELLS, Cell, cell_by_name
from .workloads import QUICK_WORKLOADS, WORKLOADS, Workload, workload_by_name

__all__ = [
    "CELLS",
    "QUICK_WORKLOADS",
    "WORKLOADS",
    "Cell",
    "Workload",
    "cell_by_name",
    "workload_by_name",
]
