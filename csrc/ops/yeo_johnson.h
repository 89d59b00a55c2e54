// yeo_johnson_lambdas: the argument checks shared by the CPU and CUDA kernels. Contract:
// yeo_johnson.cpp (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

namespace tabserve {
namespace ops {

// Checks z: a 2-D float64 tensor (rows, columns), each error naming the argument.
void check_yeo_johnson_lambdas(const at::Tensor& z);

}  // namespace ops
}  // namespace tabserve
