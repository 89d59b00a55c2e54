// all_equal: schema, argument checks and CPU kernel.
//
// The column stage's sentinel rule: a set of cells (one feature group of one table) whose every
// value equals the skip value (-100) is left alone by each induced-set block. As ATen ops,
// `(cells == value).flatten(-2).all(-1)` reads all 2.7 GB of the large workload's fp32 cells
// before every block (on the H200 ~1.1-1.4 ms of Inductor reductions per block). A set
// that is not made of sentinels shows it in its first values, so both kernels stop reading a
// set at its first other value: only sets that are all sentinels (padded features) are read
// whole.
#include "all_equal.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace tabserve {
namespace ops {

std::vector<int64_t> check_all_equal(const at::Tensor& x, int64_t dims) {
  TORCH_CHECK(dims >= 1, "dims must be >= 1 (the trailing dimensions of a set), got ", dims);
  TORCH_CHECK(x.dim() >= dims, "x must have at least dims = ", dims, " dimensions, got ",
              x.dim());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor, got ",
              x.scalar_type());
  const auto sizes = x.sizes();
  return std::vector<int64_t>(sizes.begin(), sizes.end() - dims);
}

namespace {

at::Tensor all_equal_cpu(const at::Tensor& x_in, double value, int64_t dims) {
  const auto out_shape = check_all_equal(x_in, dims);
  at::Tensor out = at::empty(out_shape, x_in.options().dtype(at::kBool));
  if (out.numel() == 0) return out;
  const at::Tensor x = x_in.contiguous();
  const int64_t sets = out.numel(), size = x.numel() / sets;
  bool* result = out.mutable_data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "all_equal", [&] {
    // The comparison ATen's `x == value` makes: value rounded to x's dtype.
    const auto sentinel = static_cast<scalar_t>(value);
    const scalar_t* data = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, sets, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const scalar_t* set = data + s * size;
        bool all = true;
        for (int64_t i = 0; i < size && all; ++i) all = set[i] == sentinel;
        result[s] = all;
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // Whether every value of each set equals `value`: x [..., set dims] floating point (any
  // strides), the last `dims` dimensions one set; returns bool of shape x.shape[:-dims] on x's
  // device, as (x == value).flatten(-dims).all(-1) (value rounded to x's dtype; NaN equals
  // nothing; an empty set is all equal). Each set is read only up to its first other value.
  m.def("all_equal(Tensor x, float value, int dims) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) { m.impl("all_equal", &all_equal_cpu); }

}  // namespace ops
}  // namespace tabserve
