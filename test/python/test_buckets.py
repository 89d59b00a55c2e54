"""tabserve.buckets: grid generation (pinned to the same values as test/cpp/test_bucket_grid.cpp),
bucket lookup, split plans and validation."""

import itertools
import random

import pytest
from tabserve.buckets import (
    DEFAULT_FEATURES,
    DEFAULT_TEST_ROWS,
    DEFAULT_TRAIN_ROWS,
    Bucket,
    BucketGrid,
    Chunk,
    make_grid,
)


def test_make_grid_matches_the_cpp_core():
    # The same cases as BucketGrid.DefaultGridShapes in test/cpp/test_bucket_grid.cpp.
    assert make_grid(256, 16, 128, 4) == (
        1,
        2,
        4,
        8,
        16,
        32,
        48,
        64,
        80,
        96,
        112,
        128,
        160,
        192,
        224,
        256,
    )
    assert make_grid(16, 1, 8, 4) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
    assert make_grid(1, 8, 64, 8) == (1,)
    assert make_grid(5, 8, 64, 8) == (1, 2, 4, 5)
    assert make_grid(24, 3, 9, 2) == (1, 2, 3, 6, 9, 13, 17, 24)


@pytest.mark.parametrize(
    "grid, fine_until, steps",
    [(DEFAULT_TRAIN_ROWS, 128, 4), (DEFAULT_TEST_ROWS, 64, 4), (DEFAULT_FEATURES, 8, 4)],
)
def test_default_grids_bound_padding_waste(grid, fine_until, steps):
    assert grid[0] == 1 and list(grid) == sorted(set(grid))
    for below, bucket in itertools.pairwise(grid):
        if below >= fine_until:
            assert (bucket - below - 1) / bucket < 1 / steps


def test_bucket_for_picks_the_smallest_bucket_holding_the_table():
    grid = BucketGrid(train_rows=(4, 8, 16), test_rows=(1, 2, 8), features=(1, 2, 4))
    assert grid.bucket_for(1, 1, 1) == Bucket(4, 1, 1)
    assert grid.bucket_for(8, 2, 2) == Bucket(8, 2, 2)
    assert grid.bucket_for(9, 3, 3) == Bucket(16, 8, 4)
    assert grid.bucket_for(9, 0, 3) == Bucket(16, 1, 4)
    assert grid.bucket_for(17, 1, 1) is None  # past the train-row grid: unpadded
    assert grid.bucket_for(1, 9, 1) is None
    assert grid.bucket_for(1, 1, 5) is None
    assert Bucket(16, 8, 4).rows == 24


def test_bucket_for_matches_a_linear_scan():
    rng = random.Random(0)
    grid = BucketGrid()
    for _ in range(2000):
        n = (rng.randint(1, 20000), rng.randint(0, 5000), rng.randint(1, 600))
        expected = [
            next((g for g in axis if g >= size), None)
            for axis, size in zip((grid.train_rows, grid.test_rows, grid.features), n)
        ]
        got = grid.bucket_for(*n)
        assert got == (None if None in expected else Bucket(*expected)), n


def test_plan_splits_test_rows_past_the_grid():
    grid = BucketGrid(train_rows=(4, 8), test_rows=(2, 4), features=(2,))
    assert grid.plan(3, 3, 2) == [Chunk(0, 3, Bucket(4, 4, 2))]
    assert grid.plan(3, 9, 2) == [
        Chunk(0, 4, Bucket(4, 4, 2)),
        Chunk(4, 8, Bucket(4, 4, 2)),
        Chunk(8, 9, Bucket(4, 2, 2)),
    ]
    assert grid.plan(3, 0, 1) == [Chunk(0, 0, Bucket(4, 2, 2))]
    assert grid.plan(9, 9, 2) == [Chunk(0, 9, None)]  # train rows past the grid: unpadded
    assert grid.plan(3, 9, 3) == [Chunk(0, 9, None)]


def test_buckets_lists_every_shape():
    grid = BucketGrid(train_rows=(4, 8), test_rows=(2,), features=(1, 2))
    assert grid.buckets() == [Bucket(4, 2, 1), Bucket(4, 2, 2), Bucket(8, 2, 1), Bucket(8, 2, 2)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"train_rows": ()}, "train_rows must hold at least one bucket size"),
        ({"test_rows": [4, 2]}, r"test_rows must be strictly increasing, but test_rows\[1\] = 2"),
        ({"features": (1, 1)}, "features must be strictly increasing"),
        ({"features": (0, 1)}, r"features\[0\] must be a positive int"),
        ({"train_rows": (1.5,)}, r"train_rows\[0\] must be a positive int"),
    ],
)
def test_grid_validation_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketGrid(**kwargs)


def test_counts_and_make_grid_validation():
    grid = BucketGrid()
    with pytest.raises(ValueError, match="n_train must be an int >= 1"):
        grid.bucket_for(0, 1, 1)
    with pytest.raises(ValueError, match="n_test must be an int >= 0"):
        grid.plan(1, -1, 1)
    with pytest.raises(ValueError, match="n_features must be an int >= 1"):
        grid.bucket_for(1, 1, 0)
    with pytest.raises(ValueError, match="steps_per_octave must be an int >= 1"):
        make_grid(10, 1, 1, 0)
