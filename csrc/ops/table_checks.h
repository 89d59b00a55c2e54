// Input checks of a TabICL table in one pass: shared argument checks of the CPU and CUDA kernels.
// Contract: table_checks.cpp (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

namespace tabserve {
namespace ops {

// The summary's layout: two totals, then three entries per table.
enum : int64_t {
  kNonFiniteX = 0,       // values of X that are NaN or infinite
  kNonFiniteLabels = 1,  // labels that are NaN or infinite
  kTableEntries = 2,     // first per-table entry
  kEntriesPerTable = 3,  // per table: bad labels, distinct labels, largest label
};

// Checks table_checks' arguments (each named in the message).
void check_table_checks(const at::Tensor& X, const at::Tensor& y_train);

}  // namespace ops
}  // namespace tabserve
