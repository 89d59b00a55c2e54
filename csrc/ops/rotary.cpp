// Rotary position embedding: schema, argument checks and CPU kernel.
//
// The row stage of TabICLv2 rotates every query and key with rotate-half RoPE. As ATen ops that
// is six passes over the largest tensors of the model (negate, concatenate, two products, a sum
// and the cast back), with float32 intermediates; this operator reads x once and writes the
// result once, evaluating exactly the same float operations in the same order (each product
// rounded, then the sum, then the cast), so its output equals the composite bit for bit.
#include "rotary.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace tabserve {
namespace ops {

RotaryLayout check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() >= 2, "x must have at least 2 dimensions [..., L, D], got ", x.dim());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor, got ",
              x.scalar_type());
  const int64_t length = x.size(-2), dim = x.size(-1);
  TORCH_CHECK(dim % 2 == 0, "x's last dimension (the head dimension) must be even, got ", dim);
  for (const auto& [name, table] : {std::pair<const char*, const at::Tensor&>{"cos", cos},
                                    std::pair<const char*, const at::Tensor&>{"sin", sin}}) {
    TORCH_CHECK(table.dim() == 2 && table.size(0) == length && table.size(1) == dim, name,
                " must be [L, D] = [", length, ", ", dim, "] (x's last two dimensions), got ",
                table.sizes());
    TORCH_CHECK(table.scalar_type() == at::kFloat || table.scalar_type() == at::kDouble, name,
                " must be float32 or float64, got ", table.scalar_type());
    TORCH_CHECK(table.device() == x.device(), name, " is on ", table.device(), " but x is on ",
                x.device());
  }
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "cos and sin must have the same dtype, got ",
              cos.scalar_type(), " and ", sin.scalar_type());
  RotaryLayout layout;
  layout.out_sizes = x.sizes().vec();
  layout.compute = at::promote_types(x.scalar_type(), cos.scalar_type());
  at::Tensor x4 = x.stride(-1) == 1 ? x : x.contiguous();
  while (x4.dim() < 4) x4 = x4.unsqueeze(0);
  if (x4.dim() > 4) x4 = x4.flatten(0, x4.dim() - 4);
  layout.x4 = x4.stride(-1) == 1 ? x4 : x4.contiguous();
  return layout;
}

namespace {

template <typename scalar_t, typename acc_t>
void rotary_rows(const at::Tensor& x4, const acc_t* cos, const acc_t* sin, scalar_t* out) {
  const int64_t heads = x4.size(1), length = x4.size(2), dim = x4.size(3), half = dim / 2;
  const int64_t s0 = x4.stride(0), s1 = x4.stride(1), s2 = x4.stride(2);
  const scalar_t* x = x4.const_data_ptr<scalar_t>();
  const int64_t rows = x4.size(0) * heads * length;
  at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t l = row % length, h = (row / length) % heads, a = row / (length * heads);
      const scalar_t* in = x + a * s0 + h * s1 + l * s2;
      const acc_t* c = cos + l * dim;
      const acc_t* s = sin + l * dim;
      scalar_t* o = out + row * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const acc_t value = static_cast<acc_t>(in[d]);
        const acc_t rotated =
            d < half ? -static_cast<acc_t>(in[d + half]) : static_cast<acc_t>(in[d - half]);
        // Separate roundings, as the ATen composite: built with -ffp-contract=off (setup.py).
        const acc_t straight = value * c[d];
        const acc_t turned = rotated * s[d];
        o[d] = static_cast<scalar_t>(straight + turned);
      }
    }
  });
}

at::Tensor rotary_embedding_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const RotaryLayout layout = check_rotary(x, cos, sin);
  at::Tensor out = at::empty(layout.x4.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out.view(layout.out_sizes);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary_embedding", [&] {
    if (layout.compute == at::kDouble) {
      const at::Tensor c = cos.to(at::kDouble).contiguous(), s = sin.to(at::kDouble).contiguous();
      rotary_rows<scalar_t, double>(layout.x4, c.const_data_ptr<double>(),
                                    s.const_data_ptr<double>(), out.mutable_data_ptr<scalar_t>());
    } else {
      const at::Tensor c = cos.contiguous(), s = sin.contiguous();
      rotary_rows<scalar_t, float>(layout.x4, c.const_data_ptr<float>(), s.const_data_ptr<float>(),
                                   out.mutable_data_ptr<scalar_t>());
    }
  });
  return out.view(layout.out_sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // Rotate-half rotary position embedding of x [..., L, D] (positions along L):
  //   out[..., l, d] = x[..., l, d] * cos[l, d] + r[..., l, d] * sin[l, d]
  // with r = cat(-x[..., D/2:], x[..., :D/2]), evaluated in promote(x, cos) (float32 for
  // float32 / float16 / bfloat16 x and float32 tables), each product and the sum rounded, then
  // cast to x's dtype. cos, sin: [L, D] float32 or float64 on x's device. Returns a new
  // contiguous tensor of x's shape and dtype; x may be any strided view whose last axis is
  // contiguous (the head-split queries and keys), read in place.
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) { m.impl("rotary_embedding", &rotary_embedding_cpu); }

}  // namespace ops
}  // namespace tabserve
