"""Estimators that kill their own process once, for the Ray retry tests (test_ray.py).

Ray's workers import this module by name when they unpickle one of these estimators, so the
tests put this folder on the workers' PYTHONPATH. Each estimator answers as its parent does,
except that the first call, in any process, that sees ``exit_on`` in the first feature of its
test rows ends its process (``os._exit``) instead; the file ``exit_marker``, created
exclusively, says that this has happened, so the retried call answers.
"""

from __future__ import annotations

import os

import numpy as np
from tabserve.models.tabicl import TabICLClassifier


def exit_once(estimator, first_feature) -> None:
    """Ends this process if ``first_feature`` holds ``estimator.exit_on`` and no process has
    ended for it yet (the marker file is claimed atomically: one process of several ends)."""
    if not np.any(np.asarray(first_feature, dtype=float) == estimator.exit_on):
        return
    try:
        os.close(os.open(estimator.exit_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os._exit(1)


def _first_feature(X):
    return X.iloc[:, 0] if hasattr(X, "iloc") else np.asarray(X)[:, 0]


class ExitOnceClassifier(TabICLClassifier):
    """A classifier whose ``predict_proba`` (and so ``predict``) ends its process once."""

    exit_on = np.nan
    exit_marker = ""

    def predict_proba(self, X):
        exit_once(self, _first_feature(X))
        return super().predict_proba(X)

    def fit_predict_many(self, tasks, method="predict", *, errors="raise", **params):
        tasks = list(tasks)
        for _, _, X_test in tasks:
            exit_once(self, _first_feature(X_test))
        return super().fit_predict_many(tasks, method, errors=errors, **params)
