// layer_norm_cast: the argument checks shared by the CPU and CUDA kernels. Contract:
// layer_norm.cpp (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tabserve {
namespace ops {

// Checks every argument, each error naming it: x floating point, at least 1-D, its last
// dimension weight's length (> 0); weight float32 1-D; bias (optional) float32 of weight's shape;
// every tensor on x's device; eps finite and >= 0; dtype float16 or bfloat16.
void check_layer_norm_cast(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           at::ScalarType dtype);

// The contract in ATen ops: LayerNorm of x in fp32 over its last dimension, rounded to dtype.
at::Tensor layer_norm_cast_composite(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, double eps,
                                     at::ScalarType dtype);

}  // namespace ops
}  // namespace tabserve
