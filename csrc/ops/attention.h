// Attention with head dimension 16 (TabICLv2's column and row stages): shared argument checks of
// the CPU and CUDA kernels. Contract: attention.cpp (next to the schema) and docs/reference/ops.md.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tabserve {
namespace ops {

// The one head dimension small_head_attention serves (8 heads over a 128-wide embedding).
constexpr int64_t kSmallHeadDim = 16;

// Checks shared by the attention operators (prefix_attention, small_head_attention,
// qassmax_scale), each naming the argument: n_keys int32 or int64, 0-d or [q.size(0)] (the latter
// for a q of at least 4 dimensions), on q's device; `t` (called `name`) on q's device in q's dtype.
void check_n_keys(const at::Tensor& n_keys, const at::Tensor& q);
void check_like_q(const char* name, const at::Tensor& t, const at::Tensor& q);

// The exact CPU maths of the attention operators, written into `out` ([B, heads, Lq, Dv]): SDPA
// of q [B, heads, Lq, D] over the first n keys of k and v (n from n_keys, checked in [1, Lk];
// every key without it), in fp32 (fp64 for fp64 inputs), one SDPA call per distinct count.
void exact_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& n_keys, std::optional<double> scale,
                         at::Tensor& out);

// Checks small_head_attention's arguments, each named in the message: q [B, heads, Lq, 16],
// k and v [B, heads, Lk, 16] (Lk >= 1), one floating dtype and device; n_keys (if given) int32 or
// int64, 0-d or [B], on q's device; rotary_cos / rotary_sin (both or neither) float32
// [L >= max(Lq, Lk), 16] on q's device.
void check_small_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& n_keys,
                                const std::optional<at::Tensor>& rotary_cos,
                                const std::optional<at::Tensor>& rotary_sin);

// The output: [B, heads, Lq, 16] in q's dtype, laid out as [B, Lq, heads, 16] (so the heads merge
// back into the embedding with a view), as prefix_attention returns it.
at::Tensor small_head_attention_output(const at::Tensor& q);

}  // namespace ops
}  // namespace tabserve
