// Rotary position embedding (rotate-half RoPE) in one pass: shared checks and layout helpers of
// the CPU and CUDA kernels. Contract: rotary.cpp (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

namespace tabserve {
namespace ops {

// x viewed as [A, H, L, D] (leading axes merged or added; the last axis contiguous), with the
// output's shape and the dtype the rotation is evaluated in.
struct RotaryLayout {
  at::Tensor x4;                    // [A, H, L, D] view (or copy) of x, stride(3) == 1
  std::vector<int64_t> out_sizes;   // x's shape
  at::ScalarType compute;           // promote(x, cos): float or double
};

// Checks rotary_embedding's arguments (each named in the message) and lays x out as [A, H, L, D].
RotaryLayout check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace ops
}  // namespace tabserve
