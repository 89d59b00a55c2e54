// feed_forward_resident: schema, argument checks and CPU kernel.
//
// The feed-forward half of a pre-LN block at TabICLv2's width (128, FFN 256), as torch.autocast
// computes it:  s = x (+ update);  out = s + linear2(gelu(linear1(layer_norm(s)))), LayerNorm in
// fp32 rounded to the weights' dtype T, both linears accumulated in fp32 and rounded to T, the
// exact (erf) GELU in fp32 rounded to T, the residual sums as ATen adds (x + update rounded to T
// when x is T; s + y in fp32, rounded to x's dtype).
//
// The column and row stages run this on ~5 M tokens per block. The CUDA kernel
// (cuda/feed_forward.cu) keeps both weight matrices in shared memory for the whole launch and
// runs every step of a 16-token tile in one warp (staged once through shared memory), so the
// tokens are read once and written once; the general Triton operator
// (python/tabserve/kernels/feed_forward.py) re-reads the weights for every tile. This CPU kernel
// computes the same contract in fp32 with the same roundings: the tests' reference.
#include "feed_forward.h"

#include <torch/library.h>

#include <cmath>

namespace tabserve {
namespace ops {

void check_feed_forward_resident(const at::Tensor& x, const std::optional<at::Tensor>& update,
                                 const at::Tensor& norm_weight,
                                 const std::optional<at::Tensor>& norm_bias, const at::Tensor& w1,
                                 const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2,
                                 double eps, const std::optional<at::Tensor>& skip) {
  const auto compute = w1.scalar_type();
  TORCH_CHECK(compute == at::kHalf || compute == at::kBFloat16,
              "w1 must be float16 or bfloat16 (its dtype is the matmul dtype), got ", compute);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == kResidentDim, "x must be [..., ", kResidentDim,
              "], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == compute,
              "x must be float32 or the weights' dtype ", compute, ", got ", x.scalar_type());
  const auto check = [&](const char* name, const at::Tensor& t, at::IntArrayRef shape,
                         at::ScalarType dtype) {
    TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), name, " is on ", t.device(), " but x is on ",
                x.device());
  };
  if (update.has_value()) check("update", *update, x.sizes(), compute);
  check("norm_weight", norm_weight, {kResidentDim}, at::kFloat);
  if (norm_bias.has_value()) check("norm_bias", *norm_bias, {kResidentDim}, at::kFloat);
  check("w1", w1, {kResidentHidden, kResidentDim}, compute);
  check("b1", b1, {kResidentHidden}, compute);
  check("w2", w2, {kResidentDim, kResidentHidden}, compute);
  check("b2", b2, {kResidentDim}, compute);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
  if (!skip.has_value()) return;
  const int64_t dims = skip->dim();
  TORCH_CHECK(skip->scalar_type() == at::kBool && dims < x.dim() &&
                  skip->sizes() == x.sizes().slice(0, dims),
              "skip must be a bool tensor of a leading part of x's shape ",
              x.sizes().slice(0, x.dim() - 1), ", got ", skip->scalar_type(), " ", skip->sizes());
  TORCH_CHECK(skip->device() == x.device(), "skip is on ", skip->device(), " but x is on ",
              x.device());
}

at::Tensor skip_mask(const at::Tensor& skip, int64_t dims) {
  std::vector<int64_t> shape(skip.sizes().begin(), skip.sizes().end());
  shape.resize(static_cast<size_t>(dims), 1);
  return skip.view(shape);
}

namespace {

// The contract in fp32 ATen ops, each rounding to T where autocast rounds.
at::Tensor feed_forward_resident_cpu(const at::Tensor& x, const std::optional<at::Tensor>& update,
                                     const at::Tensor& norm_weight,
                                     const std::optional<at::Tensor>& norm_bias,
                                     const at::Tensor& w1, const at::Tensor& b1,
                                     const at::Tensor& w2, const at::Tensor& b2, double eps,
                                     const std::optional<at::Tensor>& skip, double skip_value) {
  check_feed_forward_resident(x, update, norm_weight, norm_bias, w1, b1, w2, b2, eps, skip);
  const auto compute = w1.scalar_type();
  const auto round = [&](const at::Tensor& t) { return t.to(compute).to(at::kFloat); };
  const at::Tensor s = update.has_value() ? x + *update : x;  // rounded to T when x is T
  const at::Tensor normed =
      round(at::layer_norm(s.to(at::kFloat), {kResidentDim}, norm_weight, norm_bias, eps));
  const at::Tensor hidden = round(at::linear(normed, w1.to(at::kFloat), b1.to(at::kFloat)));
  const at::Tensor activated = round(at::gelu(hidden));
  const at::Tensor y = round(at::linear(activated, w2.to(at::kFloat), b2.to(at::kFloat)));
  at::Tensor out = (s.to(at::kFloat) + y).to(x.scalar_type()).contiguous();
  if (skip.has_value()) out.masked_fill_(skip_mask(*skip, x.dim()), skip_value);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // The feed-forward half of a pre-LN block of width 128 and FFN width 256 (TabICLv2's column and
  // row stages), as torch.autocast to the weights' dtype T computes it:
  //   s = x (+ update);  out = s + linear2(gelu(linear1(layer_norm(s)))).
  // x: [..., 128] float32 or T; update (optional): x's shape, T (the attention half's output);
  // norm_weight, norm_bias (optional): float32 [128]; w1 [256, 128], b1 [256], w2 [128, 256],
  // b2 [128]: T, float16 or bfloat16. LayerNorm in fp32 rounded to T, both linears accumulated
  // in fp32 and rounded to T, exact (erf) GELU in fp32 rounded to T; s = x + update rounded to T
  // when x is T; out = s + y in fp32, returned contiguous in x's dtype. CPU: these maths with
  // ATen's fp32 kernels. CUDA (sm80+): both weight matrices resident in shared memory, the
  // products on tensor cores (another summation order: results differ by rounding), no host
  // synchronisation. skip (optional): bool over a leading part of x's shape; the tokens of each
  // set it marks get skip_value in every output element (the column stage's sentinel rule, so
  // that no separate masked fill reads and writes the stream again).
  m.def(
      "feed_forward_resident(Tensor x, Tensor? update, Tensor norm_weight, Tensor? norm_bias, "
      "Tensor w1, Tensor b1, Tensor w2, Tensor b2, float eps, Tensor? skip=None, "
      "float skip_value=0.0) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) {
  m.impl("feed_forward_resident", &feed_forward_resident_cpu);
}

}  // namespace ops
}  // namespace tabserve
