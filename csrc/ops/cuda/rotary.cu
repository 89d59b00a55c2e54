// CUDA kernel of rotary_embedding (schema and contract: ../rotary.cpp).
//
// One thread per output element (grid-stride): it reads its own element and its rotate-half
// partner from the strided input, the position's cos / sin, and writes the contiguous output.
// The products and the sum use explicitly rounded intrinsics (no FMA contraction), the cast uses
// round-to-nearest-even: the same float operations as the ATen composite, so the same bits.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../rotary.h"

namespace tabserve {
namespace ops {
namespace {

constexpr int kThreadsPerBlock = 256;

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

struct Shape4 {
  int64_t heads, length, dim;  // x4 sizes 1..3 (size 0 follows from the element count)
  int64_t s0, s1, s2;          // x4 strides 0..2 (stride 3 is 1)
};

template <typename scalar_t, typename acc_t>
__global__ void rotary_kernel(const scalar_t* __restrict__ x, Shape4 s, const acc_t* __restrict__ cos,
                              const acc_t* __restrict__ sin, int64_t total,
                              scalar_t* __restrict__ out) {
  const int64_t half = s.dim / 2;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t d = i % s.dim;
    const int64_t row = i / s.dim;
    const int64_t l = row % s.length;
    const int64_t h = (row / s.length) % s.heads;
    const int64_t a = row / (s.length * s.heads);
    const scalar_t* in = x + a * s.s0 + h * s.s1 + l * s.s2;
    const acc_t value = static_cast<acc_t>(in[d]);
    const acc_t rotated =
        d < half ? -static_cast<acc_t>(in[d + half]) : static_cast<acc_t>(in[d - half]);
    const int64_t t = l * s.dim + d;
    out[i] = static_cast<scalar_t>(add_rn(mul_rn(value, cos[t]), mul_rn(rotated, sin[t])));
  }
}

at::Tensor rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos,
                                 const at::Tensor& sin) {
  const RotaryLayout layout = check_rotary(x, cos, sin);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor& x4 = layout.x4;
  at::Tensor out = at::empty(x4.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t total = out.numel();
  if (total == 0) return out.view(layout.out_sizes);
  const Shape4 shape{x4.size(1), x4.size(2), x4.size(3), x4.stride(0), x4.stride(1), x4.stride(2)};
  const int blocks = static_cast<int>(
      std::min<int64_t>((total + kThreadsPerBlock - 1) / kThreadsPerBlock, 65536));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary_embedding", [&] {
    if (layout.compute == at::kDouble) {
      const at::Tensor c = cos.to(at::kDouble).contiguous(), s = sin.to(at::kDouble).contiguous();
      rotary_kernel<scalar_t, double><<<blocks, kThreadsPerBlock, 0, stream>>>(
          x4.const_data_ptr<scalar_t>(), shape, c.const_data_ptr<double>(),
          s.const_data_ptr<double>(), total, out.mutable_data_ptr<scalar_t>());
    } else {
      const at::Tensor c = cos.contiguous(), s = sin.contiguous();
      rotary_kernel<scalar_t, float><<<blocks, kThreadsPerBlock, 0, stream>>>(
          x4.const_data_ptr<scalar_t>(), shape, c.const_data_ptr<float>(),
          s.const_data_ptr<float>(), total, out.mutable_data_ptr<scalar_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out.view(layout.out_sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) { m.impl("rotary_embedding", &rotary_embedding_cuda); }

}  // namespace ops
}  // namespace tabserve
