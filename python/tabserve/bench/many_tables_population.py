"""The many-tables suite's populations (as data) and their seeded tasks.

A population is many small tables of mixed shape and flavour, as a service answering many users
sees them: train and test rows drawn log-uniformly, features uniformly, 2-10 classes, a share of
tasks past 10 classes (the checkpoint's ``max_classes``: the hierarchical path), a share of
regression tasks and a share of pandas DataFrames with string columns, missing values and a few
categories unseen at predict. :func:`task_specs` draws the tasks' shapes with
``numpy.random.RandomState(seed)``; :func:`make_task` builds one task's table from its own seed,
so a child process builds the same population and the parent needs only the shapes.

The shares are counts, not draws: ``round(share * tables)``, at least one task of each kind from
4 tables up, so a handful of tables still holds the whole mix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Population:
    """Shapes and shares of a population of tasks (ranges inclusive)."""

    name: str
    tables: int
    train_rows: tuple
    test_rows: tuple
    features: tuple
    classes: tuple = (2, 10)
    many_classes: tuple = (11, 20)
    many_class_share: float = 0.05
    regression_share: float = 0.20
    frame_share: float = 0.25
    description: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


POPULATIONS: dict = {
    "full": Population(
        "full", 1000, (32, 2048), (8, 512), (3, 60), description="the default with a GPU"
    ),
    "cpu": Population(
        "cpu",
        40,
        (32, 512),
        (8, 128),
        (3, 60),
        description="the default on the CPU: fewer tables and at most 512 train and 128 test "
        "rows, so the full-size model on 2 cores answers them in minutes",
    ),
    "quick": Population("quick", 8, (32, 128), (8, 32), (3, 16), description="--quick"),
}

#: Missing values in a DataFrame task's numeric columns, and test values of its string columns
#: that no train row has.
FRAME_NAN_SHARE = 0.10
FRAME_UNSEEN_SHARE = 0.02
#: String columns of a DataFrame task (at most, leaving one numeric), categories per column.
FRAME_STRING_COLUMNS = 4
FRAME_CATEGORIES = (2, 8)


def population_for(device: str, quick: bool, tables: int | None = None) -> Population:
    """The population of a run: ``quick``, else the device's default, with ``tables`` tasks
    when given."""
    population = POPULATIONS["quick" if quick else "cpu" if device == "cpu" else "full"]
    return population if tables is None else dataclasses.replace(population, tables=int(tables))


@dataclass(frozen=True)
class TaskSpec:
    """One task's shape: ``n_classes`` 0 for regression; ``frame``: a pandas DataFrame with
    string columns and missing values; ``seed``: its table's seed."""

    index: int
    n_train: int
    n_test: int
    n_features: int
    n_classes: int
    frame: bool
    seed: int

    @property
    def task(self) -> str:
        return "reg" if self.n_classes == 0 else "clf"


def _count(share: float, tables: int) -> int:
    count = round(share * tables)
    return max(count, 1) if share > 0 and tables >= 4 else count


def _log_uniform(rng, bounds: tuple) -> int:
    low, high = bounds
    return int(np.clip(round(math.exp(rng.uniform(math.log(low), math.log(high)))), low, high))


def task_specs(population: Population, seed: int) -> list:
    """The seeded tasks of ``population`` (see the module docstring)."""
    rng = np.random.RandomState(seed)
    n = population.tables
    order = rng.permutation(n)
    n_reg = _count(population.regression_share, n)
    n_many = min(_count(population.many_class_share, n), n - n_reg)
    regression = set(order[:n_reg].tolist())
    many_class = set(order[n_reg : n_reg + n_many].tolist())
    frames = set(rng.permutation(n)[: _count(population.frame_share, n)].tolist())
    specs = []
    for index in range(n):
        n_train = _log_uniform(rng, population.train_rows)
        n_test = _log_uniform(rng, population.test_rows)
        n_features = int(rng.randint(population.features[0], population.features[1] + 1))
        bounds = population.many_classes if index in many_class else population.classes
        n_classes = 0 if index in regression else int(rng.randint(bounds[0], bounds[1] + 1))
        seed_of_table = int(rng.randint(2**31 - 1))
        specs.append(
            TaskSpec(index, n_train, n_test, n_features, n_classes, index in frames, seed_of_table)
        )
    return specs


def _class_labels(signal, n_train: int, n_classes: int):
    """Balanced classes: the train signal's quantile bins (every class present in train)."""
    edges = np.quantile(signal[:n_train], np.linspace(0, 1, n_classes + 1)[1:-1])
    return np.searchsorted(edges, signal)


def make_task(spec: TaskSpec) -> tuple:
    """``(X_train, y_train, X_test)`` of ``spec``: float64 arrays and integer labels, or for a
    frame task a DataFrame (numeric columns with NaN, object string columns) and string labels;
    regression targets are float64."""
    rng = np.random.RandomState(spec.seed)
    rows = spec.n_train + spec.n_test
    strings = min(FRAME_STRING_COLUMNS, spec.n_features - 1) if spec.frame else 0
    numeric = spec.n_features - strings
    scale = rng.uniform(0.1, 3.1, numeric)
    X = rng.standard_normal((rows, numeric)) * scale
    weights = rng.standard_normal(min(numeric, 8))
    signal = X[:, : len(weights)] / scale[: len(weights)] @ weights
    signal = signal + 0.5 * rng.standard_normal(rows)
    if spec.frame:
        X, signal = _frame(rng, X, signal, strings, spec.n_train)
    if spec.task == "reg":
        y = signal
    else:
        y = _class_labels(signal, spec.n_train, spec.n_classes)
        if spec.frame:
            y = np.array([f"class_{c:02d}" for c in y], dtype=object)
    if spec.frame:
        train = X.iloc[: spec.n_train].reset_index(drop=True)
        test = X.iloc[spec.n_train :].reset_index(drop=True)
    else:
        train, test = X[: spec.n_train], X[spec.n_train :]
    return train, y[: spec.n_train], test


def _frame(rng, X, signal, strings: int, n_train: int):
    import pandas as pd

    rows = X.shape[0]
    X = X.copy()
    X[rng.random_sample(X.shape) < FRAME_NAN_SHARE] = np.nan
    frame = pd.DataFrame(X, columns=[f"num_{j:02d}" for j in range(X.shape[1])])
    for j in range(strings):
        size = int(rng.randint(FRAME_CATEGORIES[0], FRAME_CATEGORIES[1] + 1))
        codes = rng.randint(0, size, rows)
        signal = signal + 0.3 * (codes - size / 2)
        values = np.array([f"s{j}_{v}" for v in range(size)], dtype=object)[codes]
        unseen = (np.arange(rows) >= n_train) & (rng.random_sample(rows) < FRAME_UNSEEN_SHARE)
        values[unseen] = [f"s{j}_unseen_{k}" for k in range(int(unseen.sum()))]
        frame[f"str_{j}"] = pd.Series(values, dtype=object)
    return frame, signal


def make_population(specs: list) -> list:
    """Every task of ``specs``, in order."""
    return [make_task(spec) for spec in specs]


def describe(specs: list) -> dict:
    """What the record says of a population: its tasks by kind and flavour, and the ranges of
    their shapes."""

    def span(values):
        return [int(min(values)), int(np.median(values)), int(max(values))] if values else None

    clf = [s for s in specs if s.task == "clf"]
    return {
        "tables": len(specs),
        "clf": len(clf),
        "reg": len(specs) - len(clf),
        "many_class": sum(s.n_classes > 10 for s in clf),
        "frames": sum(s.frame for s in specs),
        "train_rows_min_median_max": span([s.n_train for s in specs]),
        "test_rows_min_median_max": span([s.n_test for s in specs]),
        "features_min_median_max": span([s.n_features for s in specs]),
        "classes_min_median_max": span([s.n_classes for s in clf]),
        "cells": int(sum((s.n_train + s.n_test) * s.n_features for s in specs)),
    }
