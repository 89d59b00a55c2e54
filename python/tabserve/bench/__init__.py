"""The TabICLv2 inference benchmark driver (``python -m tabserve.bench``).

Three suites share one child-process harness (:mod:`.runner`), one timing and statistics module
(:mod:`.timing`) and one report module (:mod:`.report`):

* the raw-model cells: cells (the serving presets and research variants of them, :mod:`.cells`)
  measured on workloads (named table shapes, :mod:`.workloads`), each (cell, workload) pair in its
  own subprocess (measured by :mod:`.measure`), checked against the fp32 cell (:mod:`.gates`) and
  reported as JSON, a table, a plot and a promotions file (:mod:`.report`);
* the estimator suite (``python -m tabserve.bench estimators``, :mod:`.estimator_suite`): the
  scikit-learn estimators of tabicl and tabserve on host tables of a few kinds;
* the many-tables suite (``python -m tabserve.bench many-tables``, :mod:`.many_tables_suite`): a
  seeded population of small tables, answered by a loop of fresh estimators and by
  ``fit_predict_many``.

The cell and workload tables load on first use: the estimator and many-tables suites' child
processes import this package and, for a tabicl engine, must not import tabserve's model code,
which :mod:`.cells` does.
"""

import importlib

_LAZY = {
    "CELLS": ".cells",
    "Cell": ".cells",
    "cell_by_name": ".cells",
    "QUICK_WORKLOADS": ".workloads",
    "WORKLOADS": ".workloads",
    "Workload": ".workloads",
    "workload_by_name": ".workloads",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CELLS",
    "QUICK_WORKLOADS",
    "WORKLOADS",
    "Cell",
    "Workload",
    "cell_by_name",
    "workload_by_name",
]
