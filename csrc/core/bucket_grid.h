// Torch-free bucket-grid maths: which padded shape (bucket) a table goes to, the default grids,
// and where each row of a padded table comes from.
//
// A grid is a strictly increasing list of positive sizes. A size goes to the smallest bucket that
// holds it; a size past the last bucket has none (the table runs unpadded, or its test rows are
// split). Default grids have fine steps where relative padding waste is large and about
// `steps_per_octave` evenly spaced steps per doubling above, so the waste there stays below
// 1 / steps_per_octave (python/tabserve/buckets.py mirrors make_grid; tests pin both to the same
// values).
//
// A padded table holds its train rows at [0, n_train) and its test rows at
// [train_bucket, train_bucket + n_test); padded_source_row says which input row each padded row
// reads, and is shared by the CPU and CUDA padding kernels.
#pragma once

#include <cstdint>
#include <vector>

#if !defined(TABSERVE_HOST_DEVICE)
#if defined(__CUDACC__)
#define TABSERVE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TABSERVE_HOST_DEVICE inline
#endif
#endif

namespace tabserve {
namespace core {

// Index of the smallest bucket >= size in a sorted grid of `count` sizes, or -1 when size is past
// the last bucket. Sizes <= 0 go to the first bucket.
inline int64_t bucket_index(const int64_t* grid, int64_t count, int64_t size) {
  int64_t lo = 0, hi = count;  // the answer lies in [lo, hi]; hi == count means none
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (grid[mid] >= size) hi = mid; else lo = mid + 1;
  }
  return lo < count ? lo : -1;
}

// The bucket holding `size`, or -1 when the grid has none.
inline int64_t bucket_size(const std::vector<int64_t>& grid, int64_t size) {
  const int64_t i = bucket_index(grid.data(), static_cast<int64_t>(grid.size()), size);
  return i < 0 ? -1 : grid[static_cast<size_t>(i)];
}

// Largest power of two <= x (x >= 1).
inline int64_t floor_pow2(int64_t x) {
  int64_t p = 1;
  while (p <= x / 2) p *= 2;
  return p;
}

// Index of the first entry that breaks "positive and strictly increasing", or -1 for a valid grid.
inline int64_t first_bad_bucket(const int64_t* grid, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (grid[i] <= 0 || (i > 0 && grid[i] <= grid[i - 1])) return i;
  }
  return -1;
}

// The default grid shape, from 1 up to max_size (always the last bucket):
//   powers of two below fine_step, then multiples of fine_step up to fine_until, then steps of
//   max(fine_step, floor_pow2(size) / steps_per_octave).
// Arguments must be >= 1 (callers validate); fine_until below fine_step means no linear part.
inline std::vector<int64_t> make_grid(int64_t max_size, int64_t fine_step, int64_t fine_until,
                                      int64_t steps_per_octave) {
  std::vector<int64_t> grid;
  for (int64_t size = 1; size < max_size;) {
    grid.push_back(size);
    if (size < fine_step) {
      size = size * 2 < fine_step ? size * 2 : fine_step;
    } else if (size < fine_until) {
      size += fine_step;
    } else {
      const int64_t step = floor_pow2(size) / steps_per_octave;
      size += step > fine_step ? step : fine_step;
    }
  }
  grid.push_back(max_size);
  return grid;
}

// Input row read by row `row` of a padded table, or -1 for a padding row. Train rows sit at
// [0, n_train) of both; test row t sits at n_train + t in the input and train_bucket + t in the
// padded table.
TABSERVE_HOST_DEVICE int64_t padded_source_row(int64_t row, int64_t n_train, int64_t n_test,
                                               int64_t train_bucket) {
  if (row < train_bucket) return row < n_train ? row : -1;
  const int64_t test_row = row - train_bucket;
  return test_row < n_test ? n_train + test_row : -1;
}

// One padding: x [tables, n_train + n_test, features] onto
// [tables, train_bucket + test_bucket, feature_bucket]. Passed by value to the CUDA kernels.
struct PaddedShape {
  int64_t tables, n_train, n_test, features, train_bucket, test_bucket, feature_bucket;

  TABSERVE_HOST_DEVICE int64_t rows() const { return train_bucket + test_bucket; }
  TABSERVE_HOST_DEVICE int64_t source_row(int64_t row) const {
    return padded_source_row(row, n_train, n_test, train_bucket);
  }
};

}  // namespace core
}  // namespace tabserve
