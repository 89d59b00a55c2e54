// layer_norm_cast: schema, argument checks and CPU kernel.
//
// Under torch.autocast a pre-LN block's LayerNorm runs in fp32 and writes fp32, and the matmul
// that reads it casts that output to the autocast dtype T: two passes over the token stream, 14
// bytes per value moved, from a kernel (ATen's, one thread block per row) that reaches a fraction
// of the bandwidth at TabICLv2's widths (128 and 512). This operator is both steps in one pass,
// 6 bytes per value for an fp32 stream with T fp16 / bf16, the same roundings. The CUDA kernel
// (cuda/layer_norm.cu) gives each row to one warp; this CPU kernel is the contract in ATen ops
// (the tests' reference).
#include "layer_norm.h"

#include <torch/library.h>

#include <cmath>

namespace tabserve {
namespace ops {

void check_layer_norm_cast(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "dtype must be float16 or bfloat16 (the matmul dtype), got ", dtype);
  TORCH_CHECK(x.is_floating_point(), "x must be floating point, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) > 0,
              "weight must be a non-empty 1-D tensor, got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "weight must be float32, got ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0), "x must be [..., ", weight.size(0),
              "] (weight's length), got shape ", x.sizes());
  TORCH_CHECK(weight.device() == x.device(), "weight is on ", weight.device(), " but x is on ",
              x.device());
  if (bias.has_value()) {
    TORCH_CHECK(bias->sizes() == weight.sizes() && bias->scalar_type() == at::kFloat,
                "bias must be float32 of weight's shape ", weight.sizes(), ", got ",
                bias->scalar_type(), " ", bias->sizes());
    TORCH_CHECK(bias->device() == x.device(), "bias is on ", bias->device(), " but x is on ",
                x.device());
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
}

at::Tensor layer_norm_cast_composite(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, double eps,
                                     at::ScalarType dtype) {
  return at::layer_norm(x.to(at::kFloat), {weight.size(0)}, weight, bias, eps)
      .to(dtype)
      .contiguous();
}

namespace {

at::Tensor layer_norm_cast_cpu(const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               at::ScalarType dtype) {
  check_layer_norm_cast(x, weight, bias, eps, dtype);
  return layer_norm_cast_composite(x, weight, bias, eps, dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // LayerNorm over x's last dimension rounded to dtype, as torch.autocast to dtype computes a
  // LayerNorm whose output a matmul reads: x [..., E] floating point (fp32 maths), weight and
  // bias (optional) float32 [E], dtype float16 or bfloat16; returns x's shape in dtype,
  // contiguous. CUDA: one warp per row for an fp32 x of width 128, 256, 512 or 1024 (another
  // summation order than ATen's: results differ from the composite by rounding), the composite
  // otherwise; no host synchronisation.
  m.def(
      "layer_norm_cast(Tensor x, Tensor weight, Tensor? bias, float eps, ScalarType dtype) -> "
      "Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) { m.impl("layer_norm_cast", &layer_norm_cast_cpu); }

}  // namespace ops
}  // namespace tabserve
