// Padded-table operators: schemas, argument checks and CPU kernels.
//
// A table of n_train train rows and n_test test rows is padded onto its bucket (train_bucket,
// test_bucket, feature_bucket): train rows at [0, n_train), test rows at
// [train_bucket, train_bucket + n_test), everything else a fill value. The model then runs on the
// bucket's fixed shape; prefix_attention and qassmax_scale take the real number of train rows
// (keys) from a device tensor, so one compiled or captured graph serves every table of a bucket
// and the padding changes no number. Contracts: docs/reference/ops.md.
#include "padding.h"

#include "attention.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <string>


namespace tabserve {
namespace ops {

at::Tensor pad_to_bucket_with(PadRowsKernel pad_rows, const at::Tensor& x, int64_t n_train,
                              int64_t train_bucket, int64_t test_bucket, int64_t feature_bucket,
                              double fill) {
  TORCH_CHECK(x.dim() == 3, "x must be a 3-D tensor [tables, train + test rows, features], got ",
              x.dim(), " dimensions");
  const int64_t rows = x.size(1);
  TORCH_CHECK(n_train >= 0 && n_train <= rows, "n_train must be in [0, ", rows,
              "] (the rows of x), got ", n_train);
  TORCH_CHECK(train_bucket >= n_train, "train_bucket (", train_bucket,
              ") must hold the n_train = ", n_train, " train rows");
  TORCH_CHECK(test_bucket >= rows - n_train, "test_bucket (", test_bucket, ") must hold the ",
              rows - n_train, " test rows of x");
  TORCH_CHECK(feature_bucket >= x.size(2), "feature_bucket (", feature_bucket,
              ") must hold the ", x.size(2), " features of x");
  return pad_rows(x,
                  {x.size(0), n_train, rows - n_train, x.size(2), train_bucket, test_bucket,
                   feature_bucket},
                  fill);
}

at::Tensor pad_labels_with(PadRowsKernel pad_rows, const at::Tensor& y_train,
                           int64_t train_bucket, double fill) {
  TORCH_CHECK(y_train.dim() >= 1, "y_train must have at least 1 dimension [..., train rows]");
  const int64_t n_train = y_train.size(-1);
  TORCH_CHECK(train_bucket >= n_train, "train_bucket (", train_bucket, ") must hold the ",
              n_train, " train rows of y_train");
  std::vector<int64_t> sizes = y_train.sizes().vec();
  const int64_t tables = c10::multiply_integers(sizes.begin(), sizes.end() - 1);
  const at::Tensor table = y_train.reshape({tables, n_train, 1});
  sizes.back() = train_bucket;
  return pad_rows(table, {table.size(0), n_train, 0, 1, train_bucket, 0, 1}, fill).view(sizes);
}

namespace {

constexpr std::array<std::pair<std::string_view, AttentionBackend>, 4> kBackends{{
    {"auto", AttentionBackend::kAuto},
    {"flash", AttentionBackend::kFlash},
    {"efficient", AttentionBackend::kEfficient},
    {"masked", AttentionBackend::kMasked},
}};

}  // namespace

AttentionBackend check_prefix_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& n_keys,
                                        std::string_view backend) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "q, k and v must be 4-D [batch, heads, length, head_dim], got shapes ", q.sizes(),
              ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "q must be a floating-point tensor, got ",
              q.scalar_type());
  check_like_q("k", k, q);
  check_like_q("v", v, q);
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  v.size(1) == q.size(1),
              "k and v must have q's batch and heads (", q.size(0), ", ", q.size(1),
              "), got shapes ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(3) == q.size(3), "k must have q's head_dim ", q.size(3), ", got ", k.size(3));
  TORCH_CHECK(v.size(2) == k.size(2), "v must have as many keys as k (", k.size(2), "), got ",
              v.size(2));
  TORCH_CHECK(k.size(2) >= 1, "k must hold at least one key");
  check_n_keys(n_keys, q);
  for (const auto& [name, value] : kBackends) {
    if (name == backend) return value;
  }
  TORCH_CHECK(false, "backend must be one of \"auto\", \"flash\", \"efficient\", \"masked\", got \"",
              std::string(backend), "\"");
}

at::Tensor prefix_attention_output(const at::Tensor& q, const at::Tensor& v) {
  return at::empty({q.size(0), q.size(2), q.size(1), v.size(3)}, q.options()).transpose(1, 2);
}

void check_qassmax_scale(const at::Tensor& q, const at::Tensor& n_keys,
                         const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                         const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                         const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                         const at::Tensor& query_weight2, const at::Tensor& query_bias2) {
  TORCH_CHECK(q.dim() >= 3, "q must be [..., heads, queries, head_dim], got shape ", q.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "q must be a floating-point tensor, got ",
              q.scalar_type());
  check_n_keys(n_keys, q);
  const int64_t heads = q.size(-3);
  const int64_t head_dim = q.size(-1);
  const int64_t hidden = base_weight1.dim() == 2 ? base_weight1.size(0) : -1;
  const int64_t query_hidden = query_weight1.dim() == 2 ? query_weight1.size(0) : -1;
  const struct {
    const char* name;
    const at::Tensor& tensor;
    std::vector<int64_t> shape;  // -1: heads * head_dim or heads; -2: head_dim or 1
  } weights[] = {
      {"base_weight1", base_weight1, {hidden, 1}},
      {"base_bias1", base_bias1, {hidden}},
      {"base_weight2", base_weight2, {-1, hidden}},
      {"base_bias2", base_bias2, {-1}},
      {"query_weight1", query_weight1, {query_hidden, head_dim}},
      {"query_bias1", query_bias1, {query_hidden}},
      {"query_weight2", query_weight2, {-2, query_hidden}},
      {"query_bias2", query_bias2, {-2}},
  };
  for (const auto& w : weights) {
    bool ok = w.tensor.dim() == static_cast<int64_t>(w.shape.size());
    for (size_t d = 0; ok && d < w.shape.size(); ++d) {
      const int64_t size = w.tensor.size(static_cast<int64_t>(d));
      ok = w.shape[d] == -1   ? (size == heads * head_dim || size == heads)
           : w.shape[d] == -2 ? (size == head_dim || size == 1)
                              : size == w.shape[d];
    }
    TORCH_CHECK(ok, w.name, " has shape ", w.tensor.sizes(), ", which does not fit q (heads ",
                heads, ", head_dim ", head_dim, ") and base_weight1 [hidden, 1] / query_weight1 ",
                "[hidden, head_dim]; see docs/reference/ops.md");
    TORCH_CHECK(w.tensor.device() == q.device(), w.name, " is on ", w.tensor.device(),
                " but q is on ", q.device());
    TORCH_CHECK(at::isFloatingType(w.tensor.scalar_type()), w.name,
                " must be a floating-point tensor, got ", w.tensor.scalar_type());
  }
  TORCH_CHECK(base_bias2.size(0) == base_weight2.size(0) &&
                  query_bias2.size(0) == query_weight2.size(0),
              "base_bias2 / query_bias2 must match the rows of base_weight2 / query_weight2");
}

at::Tensor qassmax_scale_maths(const at::Tensor& q, const at::Tensor& n_keys,
                               const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                               const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                               const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                               const at::Tensor& query_weight2, const at::Tensor& query_bias2) {
  const int64_t heads = q.size(-3);
  // Weights in q's dtype, as autocast runs the reference's Linear layers.
  const auto as_q = [&](const at::Tensor& t) { return t.to(q.scalar_type()); };
  // ln(max(n, 1)) in double, rounded once to q's dtype (the reference's math.log then tensor()).
  const at::Tensor log_n =
      n_keys.clamp_min(1).to(at::kDouble).log().to(q.scalar_type()).reshape({-1, 1});
  const at::Tensor base =
      at::linear(at::gelu(at::linear(log_n, as_q(base_weight1), as_q(base_bias1))),
                 as_q(base_weight2), as_q(base_bias2));  // [1 or batch, heads * (head_dim or 1)]
  std::vector<int64_t> base_shape(static_cast<size_t>(q.dim()), 1);
  base_shape[0] = n_keys.dim() == 0 ? 1 : n_keys.size(0);
  base_shape[static_cast<size_t>(q.dim() - 3)] = heads;
  base_shape.back() = base_weight2.size(0) / heads;
  const at::Tensor modulation =
      at::tanh(at::linear(at::gelu(at::linear(q, as_q(query_weight1), as_q(query_bias1))),
                          as_q(query_weight2), as_q(query_bias2)))
          .add(1);
  at::Tensor out = at::empty_like(q);
  at::mul_out(out, q, base.view(base_shape) * modulation);
  return out;
}

namespace {

// The CPU kernel: checks, then the composite.
at::Tensor qassmax_scale_cpu(const at::Tensor& q, const at::Tensor& n_keys,
                             const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                             const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                             const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                             const at::Tensor& query_weight2, const at::Tensor& query_bias2) {
  check_qassmax_scale(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                      query_weight1, query_bias1, query_weight2, query_bias2);
  return qassmax_scale_maths(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                             query_weight1, query_bias1, query_weight2, query_bias2);
}

// One pass over the padded table: every output element is written once, from x or the fill.
at::Tensor pad_rows_cpu(const at::Tensor& x, const PadShape& s, double fill) {
  at::Tensor out = at::empty({s.tables, s.rows(), s.feature_bucket}, x.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, x.scalar_type(), "pad_rows", [&] {
    const scalar_t fill_value = c10::Scalar(fill).to<scalar_t>();
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
    at::parallel_for(0, s.tables * s.rows(), 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t table = i / s.rows();
        const int64_t source =
            s.source_row(i % s.rows());
        scalar_t* row = dst + i * s.feature_bucket;
        int64_t c = 0;
        if (source >= 0) {
          const scalar_t* in = src + table * s0 + source * s1;
          for (; c < s.features; ++c) row[c] = in[c * s2];
        }
        for (; c < s.feature_bucket; ++c) row[c] = fill_value;
      }
    });
  });
  return out;
}

at::Tensor pad_to_bucket_cpu(const at::Tensor& x, int64_t n_train, int64_t train_bucket,
                             int64_t test_bucket, int64_t feature_bucket, double fill) {
  return pad_to_bucket_with(&pad_rows_cpu, x, n_train, train_bucket, test_bucket, feature_bucket,
                            fill);
}

at::Tensor pad_labels_cpu(const at::Tensor& y_train, int64_t train_bucket, double fill) {
  return pad_labels_with(&pad_rows_cpu, y_train, train_bucket, fill);
}

// Exact attention over the first n keys: SDPA on the sliced keys, in fp32 for narrower inputs.
at::Tensor prefix_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& n_keys, std::optional<double> scale,
                                c10::string_view backend) {
  check_prefix_attention(q, k, v, n_keys, backend);
  at::Tensor out = prefix_attention_output(q, v);
  if (out.numel() > 0) exact_attention_cpu(q, k, v, n_keys, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // Pads a table onto its bucket in one pass.
  //   x [tables, n_train + n_test, features], any dtype; n_train: its train rows (the first ones).
  //   Returns [tables, train_bucket + test_bucket, feature_bucket] (contiguous, x's dtype and
  //   device): train rows at [0, n_train), test rows at [train_bucket, train_bucket + n_test),
  //   padded rows and features equal to `fill`. Always a new tensor; the Python wrapper
  //   tabserve.ops.pad_to_bucket returns x itself when it already has the bucket's shape.
  m.def(
      "pad_to_bucket(Tensor x, int n_train, int train_bucket, int test_bucket, "
      "int feature_bucket, float fill=0.0) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Pads train labels y_train [..., n_train] to [..., train_bucket] with `fill`.
  m.def("pad_labels(Tensor y_train, int train_bucket, float fill=0.0) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // Attention of every query over the first n keys: q [B, heads, Lq, D], k [B, heads, Lk, D],
  // v [B, heads, Lk, Dv], one floating dtype; n_keys int32/int64, 0-d or [B], on q's device, in
  // [1, Lk] (CPU checks; CUDA clamps, as it cannot check without a host synchronisation).
  // Returns [B, heads, Lq, Dv] = SDPA(q, k[:, :, :n], v[:, :, :n], scale=scale).
  // backend (CUDA only): "auto", "flash" (varlen flash, seqused_k), "efficient" (memory-efficient
  // kernel, seqlen_k) or "masked" (SDPA with a boolean key mask). CPU: exact math in fp32.
  m.def(
      "prefix_attention(Tensor q, Tensor k, Tensor v, Tensor n_keys, float? scale=None, "
      "str backend=\"auto\") -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // QASSMax query scaling with n = n_keys (0-d or [batch]):
  //   q * base(ln max(n, 1))[head] * (1 + tanh(query_mlp(q)))
  // base = Linear(hidden -> heads * head_dim or heads)(GELU(Linear(1 -> hidden))),
  // query_mlp = Linear(hidden -> head_dim or 1)(GELU(Linear(head_dim -> hidden))), weights in
  // nn.Linear layout, used in q's dtype. q [..., heads, queries, head_dim]; same shape returned.
  m.def(
      "qassmax_scale(Tensor q, Tensor n_keys, Tensor base_weight1, Tensor base_bias1, "
      "Tensor base_weight2, Tensor base_bias2, Tensor query_weight1, Tensor query_bias1, "
      "Tensor query_weight2, Tensor query_bias2) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) {
  m.impl("pad_to_bucket", &pad_to_bucket_cpu);
  m.impl("pad_labels", &pad_labels_cpu);
  m.impl("prefix_attention", &prefix_attention_cpu);
  m.impl("qassmax_scale", &qassmax_scale_cpu);
}

}  // namespace ops
}  // namespace tabserve
