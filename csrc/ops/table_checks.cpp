// The value checks of a TabICL call (schema, argument checks and CPU kernel).
//
// Before a forward pass the model checks that the table is finite and, for classification, that
// the labels of every table are exactly 0..K-1 with the same K. As ATen ops that is about fifteen
// kernels (isfinite and all twice, round, comparisons, a sort of the labels for the distinct
// counts, stacks and a concatenation) before the one transfer of the verdict to the host: on a
// small table, as many launches as the padded forward pass's replayed graph takes milliseconds
// (H200 profile of the small workload). This operator computes the same facts in one kernel: every label
// that is an integer in [0, N) marks a bit of its table's presence bitmap (N = train rows: K
// distinct labels 0..K-1 need K <= N), so the distinct count is a population count, no sort.
#include "table_checks.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace tabserve {
namespace ops {

void check_table_checks(const at::Tensor& X, const at::Tensor& y_train) {
  TORCH_CHECK(X.dim() == 3, "X must be (tables, rows, features), got shape ", X.sizes());
  TORCH_CHECK(at::isFloatingType(X.scalar_type()), "X must be a floating-point tensor, got ",
              X.scalar_type());
  TORCH_CHECK(y_train.dim() == 2 && y_train.size(0) == X.size(0),
              "y_train must be (tables, train rows) = (", X.size(0), ", N), got shape ",
              y_train.sizes());
  const auto labels = y_train.scalar_type();
  TORCH_CHECK(at::isFloatingType(labels) || labels == at::kBool || labels == at::kByte ||
                  labels == at::kChar || labels == at::kShort || labels == at::kInt ||
                  labels == at::kLong,
              "y_train must be bool, a signed integer type, uint8 or floating point, got ",
              labels);
  TORCH_CHECK(y_train.device() == X.device(), "y_train is on ", y_train.device(),
              " but X is on ", X.device());
}

namespace {

template <typename scalar_t>
int64_t count_non_finite(const at::Tensor& X) {
  const at::Tensor x = X.contiguous();
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  std::atomic<int64_t> total{0};
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t count = 0;
    for (int64_t i = begin; i < end; ++i) count += !std::isfinite(static_cast<double>(data[i]));
    total += count;
  });
  return total.load();
}

at::Tensor table_checks_cpu(const at::Tensor& X, const at::Tensor& y_train, bool classification) {
  check_table_checks(X, y_train);
  const int64_t tables = X.size(0), n = y_train.size(1);
  at::Tensor summary = at::zeros({kTableEntries + kEntriesPerTable * tables}, at::kLong);
  int64_t* out = summary.mutable_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, X.scalar_type(), "table_checks", [&] {
    out[kNonFiniteX] = count_non_finite<scalar_t>(X);
  });
  const at::Tensor labels = y_train.to(at::kDouble).contiguous();
  const double* y = labels.const_data_ptr<double>();
  std::atomic<int64_t> non_finite{0};
  at::parallel_for(0, tables, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> seen;
    for (int64_t t = begin; t < end; ++t) {
      int64_t bad = 0, distinct = 0, largest = -1, infinite = 0;
      if (classification) seen.assign(static_cast<size_t>((n + 31) / 32), 0u);
      for (int64_t j = 0; j < n; ++j) {
        const double v = y[t * n + j];
        if (!std::isfinite(v)) {
          ++infinite;
          ++bad;
        } else if (classification &&
                   !(v >= 0 && v < static_cast<double>(n) && v == std::floor(v))) {
          ++bad;
        } else if (classification) {
          const auto label = static_cast<int64_t>(v);
          uint32_t& word = seen[static_cast<size_t>(label / 32)];
          const uint32_t bit = 1u << (label % 32);
          distinct += (word & bit) == 0;
          word |= bit;
          largest = std::max(largest, label);
        }
      }
      non_finite += infinite;
      if (classification) {
        int64_t* entry = out + kTableEntries + kEntriesPerTable * t;
        entry[0] = bad;
        entry[1] = distinct;
        entry[2] = largest;
      }
    }
  });
  out[kNonFiniteLabels] = non_finite.load();
  return summary;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // The value checks of a TabICL call, as one int64 vector on X's device (one transfer reads
  // them all): X [tables, rows, features] floating point (any strides), y_train [tables, N]
  // of any real dtype (bool and integers included). Entries:
  //   [0] the values of X that are NaN or infinite, [1] the labels that are;
  //   then per table t (classification only; zeros otherwise), at 2 + 3t:
  //   the labels that are not integers in [0, N) (NaN and infinite ones included), the number
  //   of distinct labels among the others, and the largest of those (-1 if none).
  // The labels of every table are exactly 0..K-1 with one K when every count of bad labels is
  // 0, every distinct count is K and every largest label is K - 1.
  m.def("table_checks(Tensor X, Tensor y_train, bool classification) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) { m.impl("table_checks", &table_checks_cpu); }

}  // namespace ops
}  // namespace tabserve
