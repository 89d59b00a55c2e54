// Shared argument checks and helpers of the padded-table operators (CPU and CUDA kernels).
// The operator contracts are documented in docs/ops.md and next to the schemas in padding.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "../core/bucket_grid.h"

namespace tabserve {
namespace ops {

using PadShape = core::PaddedShape;

// Checks pad_to_bucket's arguments, naming each one, and returns the padded shape.
PadShape check_pad_to_bucket(const at::Tensor& x, int64_t n_train, int64_t train_bucket,
                             int64_t test_bucket, int64_t feature_bucket);

// Checks pad_labels' arguments and returns y_train viewed as a [tables, n_train, 1] table with
// its shape (the labels are padded as a table with no test rows and one feature).
std::pair<at::Tensor, PadShape> labels_as_table(const at::Tensor& y_train, int64_t train_bucket);

// The attention backends prefix_attention accepts; CPU computes exact math for every one.
enum class AttentionBackend { kAuto, kFlash, kEfficient, kMasked };

// Checks prefix_attention's arguments and parses `backend`.
AttentionBackend check_prefix_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& n_keys,
                                        std::string_view backend);

// The output of prefix_attention, [B, heads, Lq, Dv] laid out as [B, Lq, heads, Dv] (the layout
// the fused kernels write, as SDPA's flash path does); the fake kernel in ops.py matches it.
at::Tensor prefix_attention_output(const at::Tensor& q, const at::Tensor& v);

// QASSMax query scaling (the same ATen composite on every device; contract in padding.cpp).
at::Tensor qassmax_scale_composite(const at::Tensor& q, const at::Tensor& n_keys,
                                   const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                                   const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                                   const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                                   const at::Tensor& query_weight2, const at::Tensor& query_bias2);

}  // namespace ops
}  // namespace tabserve
