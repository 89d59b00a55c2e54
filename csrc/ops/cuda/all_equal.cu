// CUDA kernel of all_equal (schema and contract: ../all_equal.cpp).
//
// One block per set (the grid walks the sets with its stride past 2^20 of them): the block's
// threads check the set in strides of kThreads x kPerThread values (coalesced loads, kPerThread
// of them in flight per thread), and leave it at the first stride holding another value. A set
// that is not all sentinels costs one stride; only all-sentinel sets are read whole.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../all_equal.h"

namespace tabserve {
namespace ops {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    all_equal_kernel(const scalar_t* __restrict__ x, int64_t sets, int64_t size,
                     scalar_t sentinel_value, bool* __restrict__ out) {
  using compare_t = at::opmath_type<scalar_t>;  // fp32 for fp16 / bf16 (exact), else itself
  const auto sentinel = static_cast<compare_t>(sentinel_value);
  for (int64_t s = blockIdx.x; s < sets; s += gridDim.x) {
    const scalar_t* set = x + s * size;
    bool other = false, block_other = false;
    for (int64_t start = 0; start < size; start += int64_t{kThreads} * kPerThread) {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int64_t index = start + int64_t{i} * kThreads + threadIdx.x;
        if (index < size) other |= static_cast<compare_t>(set[index]) != sentinel;
      }
      // The block's verdict, the same in every thread (thread 0's own flag is not: the first
      // GPU run wrote it and called sets with one late other value all equal).
      block_other = __syncthreads_or(other);
      if (block_other) break;
    }
    if (threadIdx.x == 0) out[s] = !block_other;
  }
}

at::Tensor all_equal_cuda(const at::Tensor& x_in, double value, int64_t dims) {
  const auto out_shape = check_all_equal(x_in, dims);
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor out = at::empty(out_shape, x_in.options().dtype(at::kBool));
  if (out.numel() == 0) return out;
  const at::Tensor x = x_in.contiguous();
  const int64_t sets = out.numel(), size = x.numel() / sets;
  const auto grid = static_cast<unsigned int>(std::min(sets, kMaxBlocks));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "all_equal", [&] {
    // value rounded to x's dtype, as ATen's x == value compares.
    all_equal_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), sets, size, static_cast<scalar_t>(value),
        out.mutable_data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) { m.impl("all_equal", &all_equal_cuda); }

}  // namespace ops
}  // namespace tabserve
