// feed_forward_resident: the argument checks and output shared by the CPU and CUDA kernels.
// Contract: feed_forward.cpp (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tabserve {
namespace ops {

// The shapes the operator serves: TabICLv2's column and row stages (width 128, FFN 256), whose
// two weight matrices (64 KiB each in half precision) fit one SM's shared memory together.
constexpr int64_t kResidentDim = 128;
constexpr int64_t kResidentHidden = 256;

// Checks every argument, each error naming it: x float32 or the weights' dtype, [..., 128];
// update (optional) x's shape in the weights' dtype; norm_weight / norm_bias (optional) float32
// [128]; w1 [256, 128], b1 [256], w2 [128, 256], b2 [128], all float16 or all bfloat16; every
// tensor on x's device; eps finite and >= 0; skip (optional) bool of a leading part of x's shape
// (x.shape[:skip.dim()], fewer dimensions than x).
void check_feed_forward_resident(const at::Tensor& x, const std::optional<at::Tensor>& update,
                                 const at::Tensor& norm_weight,
                                 const std::optional<at::Tensor>& norm_bias, const at::Tensor& w1,
                                 const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                                 double eps, const std::optional<at::Tensor>& skip);

}  // namespace ops
}  // namespace tabserve
