// Shared argument checks and helpers of the padded-table operators (CPU and CUDA kernels).
// The operator contracts are documented in docs/reference/ops.md and next to the schemas in
// padding.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "../core/bucket_grid.h"

namespace tabserve {
namespace ops {

using PadShape = core::PaddedShape;

// A device's one-pass padding kernel: x [tables, n_train + n_test, features] (checked) onto
// [tables, train_bucket + test_bucket, feature_bucket].
using PadRowsKernel = at::Tensor (*)(const at::Tensor& x, const PadShape& shape, double fill);

// pad_to_bucket and pad_labels over a device's kernel: argument checks naming each argument,
// then one kernel call (labels are padded as a table with no test rows and one feature).
at::Tensor pad_to_bucket_with(PadRowsKernel pad_rows, const at::Tensor& x, int64_t n_train,
                              int64_t train_bucket, int64_t test_bucket, int64_t feature_bucket,
                              double fill);
at::Tensor pad_labels_with(PadRowsKernel pad_rows, const at::Tensor& y_train,
                           int64_t train_bucket, double fill);

// The attention backends prefix_attention accepts; CPU computes exact math for every one.
enum class AttentionBackend { kAuto, kFlash, kEfficient, kMasked };

// Checks prefix_attention's arguments and parses `backend`.
AttentionBackend check_prefix_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& n_keys,
                                        std::string_view backend);

// The output of prefix_attention, [B, heads, Lq, Dv] laid out as [B, Lq, heads, Dv] (the layout
// the fused kernels write, as SDPA's flash path does); the fake kernel in ops.py matches it.
at::Tensor prefix_attention_output(const at::Tensor& q, const at::Tensor& v);

// Checks qassmax_scale's arguments (contract in padding.cpp), naming the one that does not fit.
void check_qassmax_scale(const at::Tensor& q, const at::Tensor& n_keys,
                         const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                         const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                         const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                         const at::Tensor& query_weight2, const at::Tensor& query_bias2);

// QASSMax query scaling as an ATen composite (linear, GELU, tanh, one product per rounding of
// the reference's autocast maths), on arguments check_qassmax_scale accepted: the CPU kernel, and
// CUDA's for the dtypes and shapes its fused kernel leaves to it.
at::Tensor qassmax_scale_maths(const at::Tensor& q, const at::Tensor& n_keys,
                               const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                               const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                               const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                               const at::Tensor& query_weight2, const at::Tensor& query_bias2);

}  // namespace ops
}  // namespace tabserve
