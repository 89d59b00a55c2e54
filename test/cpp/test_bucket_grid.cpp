// GoogleTest: csrc/core/bucket_grid.h, bucket lookup, default grids and padded-row sources.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/bucket_grid.h"

using namespace tabserve::core;

TEST(BucketGrid, SmallestBucketHoldingASize) {
  const std::vector<int64_t> grid{1, 2, 4, 8, 16, 24};
  EXPECT_EQ(bucket_size(grid, 0), 1);
  EXPECT_EQ(bucket_size(grid, 1), 1);
  EXPECT_EQ(bucket_size(grid, 3), 4);
  EXPECT_EQ(bucket_size(grid, 8), 8);
  EXPECT_EQ(bucket_size(grid, 9), 16);
  EXPECT_EQ(bucket_size(grid, 24), 24);
  EXPECT_EQ(bucket_size(grid, 25), -1);
  EXPECT_EQ(bucket_index(grid.data(), 0, 5), -1);  // an empty grid holds nothing
}

TEST(BucketGrid, LookupMatchesLinearScan) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> grid;
    int64_t size = 0;
    for (int i = 0, n = static_cast<int>(rng() % 20); i < n; ++i) {
      size += 1 + static_cast<int64_t>(rng() % 50);
      grid.push_back(size);
    }
    for (int64_t query = 0; query <= size + 3; ++query) {
      int64_t expected = -1;
      for (int64_t g : grid) {
        if (g >= query) { expected = g; break; }
      }
      ASSERT_EQ(bucket_size(grid, query), expected) << "trial " << trial << " size " << query;
    }
  }
}

TEST(BucketGrid, DefaultGridShapes) {
  // The same values are pinned in test/python/test_buckets.py (the Python mirror).
  EXPECT_EQ(make_grid(256, 16, 128, 4),
            (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224,
                                  256}));
  EXPECT_EQ(make_grid(16, 1, 8, 4), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16}));
  EXPECT_EQ(make_grid(1, 8, 64, 8), (std::vector<int64_t>{1}));
  EXPECT_EQ(make_grid(5, 8, 64, 8), (std::vector<int64_t>{1, 2, 4, 5}));  // capped at max_size
  EXPECT_EQ(make_grid(24, 3, 9, 2), (std::vector<int64_t>{1, 2, 3, 6, 9, 13, 17, 24}));
}

TEST(BucketGrid, DefaultGridsAreValidAndBoundWasteAboveTheFineRange) {
  for (int64_t steps : {1, 2, 4, 8}) {
    for (int64_t fine_step : {1, 8, 16}) {
      const int64_t fine_until = 8 * fine_step;
      const std::vector<int64_t> grid = make_grid(100000, fine_step, fine_until, steps);
      ASSERT_EQ(first_bad_bucket(grid.data(), static_cast<int64_t>(grid.size())), -1);
      ASSERT_EQ(grid.front(), 1);
      ASSERT_EQ(grid.back(), 100000);
      for (size_t i = 1; i + 1 < grid.size(); ++i) {
        if (grid[i] < fine_until) continue;
        // The worst size in (grid[i], grid[i+1]] is grid[i] + 1: waste < 1 / steps.
        const double waste = static_cast<double>(grid[i + 1] - grid[i] - 1) / grid[i + 1];
        ASSERT_LT(waste, 1.0 / steps + 1e-12) << "bucket " << grid[i + 1];
      }
    }
  }
}

TEST(BucketGrid, FirstBadBucket) {
  const std::vector<int64_t> good{1, 3, 9};
  const std::vector<int64_t> repeated{1, 3, 3};
  const std::vector<int64_t> zero{0, 3};
  EXPECT_EQ(first_bad_bucket(good.data(), 3), -1);
  EXPECT_EQ(first_bad_bucket(repeated.data(), 3), 2);
  EXPECT_EQ(first_bad_bucket(zero.data(), 2), 0);
}

TEST(BucketGrid, PaddedSourceRows) {
  // 3 train rows in a 4-row train bucket, 2 test rows in a 4-row test bucket.
  const std::vector<int64_t> expected{0, 1, 2, -1, 3, 4, -1, -1};
  for (int64_t row = 0; row < 8; ++row) {
    EXPECT_EQ(padded_source_row(row, 3, 2, 4), expected[static_cast<size_t>(row)]) << row;
  }
  // Already on the grid: the identity.
  for (int64_t row = 0; row < 5; ++row) EXPECT_EQ(padded_source_row(row, 2, 3, 2), row);
}
