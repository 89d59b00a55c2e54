// Attention with head dimension 16 (TabICLv2's column and row stages): shared argument checks of
// the CPU and CUDA kernels. Contract: attention.cpp (next to the schema) and docs/ops.md.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tabserve {
namespace ops {

// The one head dimension small_head_attention serves (8 heads over a 128-wide embedding).
constexpr int64_t kSmallHeadDim = 16;

// Checks small_head_attention's arguments, each named in the message: q [B, heads, Lq, 16],
// k and v [B, heads, Lk, 16] (Lk >= 1), one floating dtype and device; n_keys (if given) int32 or
// int64, 0-d or [B], on q's device.
void check_small_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& n_keys);

// The output: [B, heads, Lq, 16] in q's dtype, laid out as [B, Lq, heads, 16] (so the heads merge
// back into the embedding with a view), as prefix_attention returns it.
at::Tensor small_head_attention_output(const at::Tensor& q);

}  // namespace ops
}  // namespace tabserve
