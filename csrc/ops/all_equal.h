// all_equal: the argument checks shared by the CPU and CUDA kernels. Contract: all_equal.cpp
// (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

namespace tabserve {
namespace ops {

// Checks x (floating point, at least `dims` dimensions) and dims (>= 1), each error naming its
// argument; returns the output's shape, x's leading dimensions x.shape[:-dims].
std::vector<int64_t> check_all_equal(const at::Tensor& x, int64_t dims);

}  // namespace ops
}  // namespace tabserve
