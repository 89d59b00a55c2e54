"""Bucket grids: the padded table shapes that compiled graphs and CUDA graphs are built for.

A table of (n_train, n_test, n_features) goes to the smallest bucket that holds it, one grid per
axis. Tables past the train-row or feature grid run unpadded; test rows past the test-row grid are
split into chunks that each fit a bucket (test rows never attend to each other, so a split changes
no prediction). The default grids have fine steps where padding waste is large and a few evenly
spaced steps per doubling above (:func:`make_grid`); the grids are plain data, configurable per
deployment.

:func:`make_grid` mirrors ``core::make_grid`` (csrc/core/bucket_grid.h); both test files pin the
same grids.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def make_grid(max_size: int, fine_step: int, fine_until: int, steps_per_octave: int) -> tuple:
    """Grid from 1 to ``max_size`` (always the last bucket).

    Powers of two below ``fine_step``, then multiples of ``fine_step`` up to ``fine_until``, then
    steps of ``max(fine_step, floor_pow2(size) // steps_per_octave)``: above ``fine_until`` the
    padding waste stays below ``1 / steps_per_octave`` (when ``fine_until >= fine_step *
    steps_per_octave``).

    Raises ValueError naming the argument when one is below 1.
    """
    for name, value in [
        ("max_size", max_size),
        ("fine_step", fine_step),
        ("fine_until", fine_until),
        ("steps_per_octave", steps_per_octave),
    ]:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    grid = []
    size = 1
    while size < max_size:
        grid.append(size)
        if size < fine_step:
            size = min(size * 2, fine_step)
        elif size < fine_until:
            size += fine_step
        else:
            size += max(fine_step, (1 << (size.bit_length() - 1)) // steps_per_octave)
    grid.append(max_size)
    return tuple(grid)


#: Train rows: 16-row steps to 128, then 4 steps per doubling (< 25 % waste) to 16,384. Train-row
#: padding costs attention work (keys), so the grid is finer than for test rows at the top.
DEFAULT_TRAIN_ROWS = make_grid(16384, fine_step=16, fine_until=128, steps_per_octave=4)
#: Test rows: powers of two to 8, 8-row steps to 64, then 4 steps per doubling to 4,096. Padded
#: test rows cost only their own (independent) compute; larger requests are split.
DEFAULT_TEST_ROWS = make_grid(4096, fine_step=8, fine_until=64, steps_per_octave=4)
#: Features: every count to 8 (the row stage's sequence is features + 4 tokens), then 4 steps per
#: doubling to 512.
DEFAULT_FEATURES = make_grid(512, fine_step=1, fine_until=8, steps_per_octave=4)


@dataclass(frozen=True)
class Bucket:
    """One padded table shape: ``train_rows`` + ``test_rows`` rows of ``features`` features."""

    train_rows: int
    test_rows: int
    features: int

    @property
    def rows(self) -> int:
        """Rows of the padded table (train block, then test block)."""
        return self.train_rows + self.test_rows


@dataclass(frozen=True)
class Chunk:
    """Test rows ``[start, stop)`` of a table, run with all its train rows in ``bucket``
    (``None``: unpadded, the table is past the train-row or feature grid)."""

    start: int
    stop: int
    bucket: Bucket | None


def _check_grid(name: str, grid: Sequence[int]) -> tuple:
    if isinstance(grid, (str, bytes)) or not isinstance(grid, Iterable):
        raise TypeError(
            f"{name} must be a sequence of bucket sizes (e.g. (64, 128)), got "
            f"{type(grid).__name__} {grid!r}"
        )
    grid = tuple(grid)
    if not grid:
        raise ValueError(f"{name} must hold at least one bucket size, got an empty grid")
    for i, size in enumerate(grid):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name}[{i}] must be a positive int, got {size!r}")
        if i > 0 and size <= grid[i - 1]:
            raise ValueError(
                f"{name} must be strictly increasing, but {name}[{i}] = {size} follows "
                f"{grid[i - 1]}"
            )
    return grid


def _smallest_holding(grid: tuple, size: int) -> int | None:
    i = bisect.bisect_left(grid, size)
    return grid[i] if i < len(grid) else None


@dataclass(frozen=True)
class BucketGrid:
    """Separate grids of train rows, test rows and features (each positive, strictly increasing).

    ``BucketGrid()`` gives the defaults (:data:`DEFAULT_TRAIN_ROWS`, :data:`DEFAULT_TEST_ROWS`,
    :data:`DEFAULT_FEATURES`); pass any of the three to configure it. Raises ValueError naming the
    grid when one is empty, unsorted, repeats a size or holds a non-positive size.
    """

    train_rows: tuple = field(default=DEFAULT_TRAIN_ROWS)
    test_rows: tuple = field(default=DEFAULT_TEST_ROWS)
    features: tuple = field(default=DEFAULT_FEATURES)

    def __post_init__(self):
        for name in ("train_rows", "test_rows", "features"):
            object.__setattr__(self, name, _check_grid(name, getattr(self, name)))

    def buckets(self):
        """Every bucket of the grid (train-major order): what a warm-up compiles or captures."""
        return [
            Bucket(train, test, features)
            for train in self.train_rows
            for test in self.test_rows
            for features in self.features
        ]

    def bucket_for(self, n_train: int, n_test: int, n_features: int) -> Bucket | None:
        """The smallest bucket holding the table, or None when any part is past its grid.

        ``n_train >= 1``, ``n_test >= 0`` (0 goes to the smallest test bucket),
        ``n_features >= 1``; otherwise ValueError naming the argument.
        """
        _check_counts(n_train, n_test, n_features)
        train = _smallest_holding(self.train_rows, n_train)
        test = _smallest_holding(self.test_rows, n_test)
        features = _smallest_holding(self.features, n_features)
        if train is None or test is None or features is None:
            return None
        return Bucket(train, test, features)

    def plan(self, n_train: int, n_test: int, n_features: int) -> list:
        """How to run a table: a list of :class:`Chunk` covering its test rows in order.

        Test rows past the largest test bucket are split into chunks of that size, the last chunk
        going to the smallest bucket that holds it. A table past the train-row or feature grid
        runs unpadded in one chunk (``bucket=None``).
        """
        _check_counts(n_train, n_test, n_features)
        train = _smallest_holding(self.train_rows, n_train)
        features = _smallest_holding(self.features, n_features)
        if train is None or features is None:
            return [Chunk(0, n_test, None)]
        largest = self.test_rows[-1]
        chunks = []
        for start in range(0, max(n_test, 1), largest):
            stop = min(start + largest, n_test)
            test = _smallest_holding(self.test_rows, stop - start)
            chunks.append(Chunk(start, stop, Bucket(train, test, features)))
        return chunks


def _check_counts(n_train: int, n_test: int, n_features: int) -> None:
    for name, value, least in [
        ("n_train", n_train, 1),
        ("n_test", n_test, 0),
        ("n_features", n_features, 1),
    ]:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
