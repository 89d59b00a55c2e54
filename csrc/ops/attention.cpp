// small_head_attention: schema, argument checks and CPU kernel; and the checks and exact CPU
// maths every attention operator shares (prefix_attention's too).
//
// TabICLv2's column and row stages attend with 8 heads of dimension 16: the inducing points over
// a column's train rows (128 queries, up to tens of thousands of keys), every row over the
// induced tokens (many queries, 128 keys), and every row's ~70 tokens over each other, in
// batches of up to ~10^6 (table x row x head) sequences. PyTorch's fused kernels are built for
// larger heads; the CUDA kernel (cuda/attention.cu) is written for these shapes (on the H200 it
// is 2-3.6x faster than cuDNN on the row stage's short sequences, slower on the column stage's
// long key runs). The
// CPU kernel computes the same contract exactly (fp32 maths, fp64 for fp64 inputs): the
// reference of the tests. Contract: docs/reference/ops.md.
#include "attention.h"

#include <torch/library.h>

#include <algorithm>
#include <string>

namespace tabserve {
namespace ops {

void check_n_keys(const at::Tensor& n_keys, const at::Tensor& q) {
  TORCH_CHECK(n_keys.scalar_type() == at::kInt || n_keys.scalar_type() == at::kLong,
              "n_keys must be an int32 or int64 tensor, got ", n_keys.scalar_type());
  TORCH_CHECK(n_keys.dim() == 0 || (n_keys.dim() == 1 && q.dim() >= 4 &&
                                    n_keys.size(0) == q.size(0)),
              "n_keys must be 0-d or have shape [", q.size(0), "] (one count per batch entry of ",
              "a 4-D q), got shape ", n_keys.sizes(), " for q of shape ", q.sizes());
  TORCH_CHECK(n_keys.device() == q.device(), "n_keys is on ", n_keys.device(),
              " but q is on ", q.device());
}

void check_like_q(const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " has dtype ", t.scalar_type(),
              " but q has ", q.scalar_type());
}

void exact_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& n_keys, std::optional<double> scale,
                         at::Tensor& out) {
  const int64_t keys = k.size(2);
  const auto exact = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor qf = q.to(exact), kf = k.to(exact), vf = v.to(exact);
  const auto attend = [&](const at::Tensor& qb, int64_t count, const at::Tensor& kb,
                          const at::Tensor& vb) {
    return at::scaled_dot_product_attention(qb, kb.narrow(2, 0, count), vb.narrow(2, 0, count),
                                            /*attn_mask=*/{}, 0.0, false, scale);
  };
  if (!n_keys.has_value()) {
    out.copy_(attend(qf, keys, kf, vf));
    return;
  }
  const at::Tensor n = n_keys->to(at::kLong).reshape({-1});
  const int64_t* counts = n.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n.numel(); ++i) {
    TORCH_CHECK(counts[i] >= 1 && counts[i] <= keys, "n_keys must be in [1, ", keys,
                "] (the keys in k), got ", counts[i], n.numel() > 1 ? " at batch entry " : "",
                n.numel() > 1 ? std::to_string(i) : std::string());
  }
  if (n_keys->dim() == 0) {
    out.copy_(attend(qf, counts[0], kf, vf));
    return;
  }
  for (int64_t b = 0; b < q.size(0); ++b) {
    out.narrow(0, b, 1).copy_(
        attend(qf.narrow(0, b, 1), counts[b], kf.narrow(0, b, 1), vf.narrow(0, b, 1)));
  }
}

void check_small_head_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& n_keys,
                                const std::optional<at::Tensor>& rotary_cos,
                                const std::optional<at::Tensor>& rotary_sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "q, k and v must be 4-D [batch, heads, length, 16], got shapes ", q.sizes(), ", ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "q must be a floating-point tensor, got ",
              q.scalar_type());
  TORCH_CHECK(q.size(3) == kSmallHeadDim, "q must have head_dim ", kSmallHeadDim, ", got ",
              q.size(3));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"k", k}, {"v", v}}) {
    check_like_q(name, t, q);
    TORCH_CHECK(t.size(0) == q.size(0) && t.size(1) == q.size(1), name,
                " must have q's batch and heads (", q.size(0), ", ", q.size(1), "), got shape ",
                t.sizes());
    TORCH_CHECK(t.size(3) == kSmallHeadDim, name, " must have head_dim ", kSmallHeadDim,
                ", got ", t.size(3));
  }
  TORCH_CHECK(v.size(2) == k.size(2), "v must have as many keys as k (", k.size(2), "), got ",
              v.size(2));
  TORCH_CHECK(k.size(2) >= 1, "k must hold at least one key");
  if (n_keys.has_value()) check_n_keys(*n_keys, q);
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
              "rotary_cos and rotary_sin must be given together");
  if (!rotary_cos.has_value()) return;
  const int64_t positions = std::max(q.size(2), k.size(2));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"rotary_cos", *rotary_cos},
                                {"rotary_sin", *rotary_sin}}) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) >= positions && t.size(1) == kSmallHeadDim, name,
                " must be [L, ", kSmallHeadDim, "] with L >= max(Lq, Lk) = ", positions,
                ", got shape ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32 (RoPE tables are built ",
                "and applied in fp32), got ", t.scalar_type());
    TORCH_CHECK(t.device() == q.device(), name, " is on ", t.device(), " but q is on ",
                q.device());
  }
}

at::Tensor small_head_attention_output(const at::Tensor& q) {
  return at::empty({q.size(0), q.size(2), q.size(1), kSmallHeadDim}, q.options()).transpose(1, 2);
}

namespace {

// Rotate-half RoPE at positions 0..L-1 in fp32, rounded back to x's dtype (what
// tabserve::rotary_embedding and the model's composite compute).
at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = kSmallHeadDim / 2, length = x.size(2);
  const at::Tensor rotated = at::cat({x.narrow(3, half, half).neg(), x.narrow(3, 0, half)}, 3);
  return (x * cos.narrow(0, 0, length) + rotated * sin.narrow(0, 0, length))
      .to(x.scalar_type());
}

// Exact attention (fp32 maths; fp64 for fp64 inputs), after RoPE when tables are given.
at::Tensor small_head_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& n_keys,
                                    std::optional<double> scale,
                                    const std::optional<at::Tensor>& rotary_cos,
                                    const std::optional<at::Tensor>& rotary_sin) {
  check_small_head_attention(q, k, v, n_keys, rotary_cos, rotary_sin);
  at::Tensor out = small_head_attention_output(q);
  if (out.numel() == 0) return out;
  if (rotary_cos.has_value()) {
    exact_attention_cpu(rotate_half(q, *rotary_cos, *rotary_sin),
                        rotate_half(k, *rotary_cos, *rotary_sin), v, n_keys, scale, out);
  } else {
    exact_attention_cpu(q, k, v, n_keys, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // Attention with head dimension 16: q [B, heads, Lq, 16], k and v [B, heads, Lk, 16] (Lk >= 1;
  // any strides, broadcast batch or heads with stride 0), one floating dtype. n_keys (optional):
  // int32/int64, 0-d or [B], on q's device: only the first n keys are attended to (CPU checks
  // n in [1, Lk]; CUDA clamps into it, as it cannot check without a host synchronisation).
  // Returns [B, heads, Lq, 16] = softmax(q k[:n]^T * scale) v[:n] (scale default 1/4), laid out
  // as [B, Lq, heads, 16]. CPU: fp32 maths (fp64 for fp64). CUDA: float16 / bfloat16 on sm80+,
  // tensor cores with fp32 accumulation and softmax (probabilities rounded to the input dtype
  // before the product with v, as the fused SDPA kernels do); no host synchronisation.
  // rotary_cos, rotary_sin (optional, together): float32 [L >= max(Lq, Lk), 16] tables; q and k
  // are then first rotated (rotate-half RoPE at their row positions, in fp32, rounded to their
  // dtype), as the row stage does, without the rotated copies being written out.
  m.def(
      "small_head_attention(Tensor q, Tensor k, Tensor v, Tensor? n_keys=None, "
      "float? scale=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) { m.impl("small_head_attention", &small_head_attention_cpu); }

}  // namespace ops
}  // namespace tabserve
