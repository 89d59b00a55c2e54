// CUDA kernel of yeo_johnson_lambdas (schema and contract: ../yeo_johnson.cpp).
//
// One block per column (the grid walks the columns with its stride past 2^16 of them). The
// block's threads first reduce the column's statistics and write each value's signed log to a
// scratch column; then every thread of the block runs the same search (core::BoundedBrent, the
// same state in each: every reduction hands all threads one value, summed in one order), and
// each objective evaluation is two block reductions over the scratch column. The host never
// waits: the number of evaluations is decided on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../../core/yeo_johnson.h"
#include "../yeo_johnson.h"

namespace tabserve {
namespace ops {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

// The block's sum, the same in every thread: lane 0 of each warp publishes its warp's sum, and
// every thread adds the warps' sums in one order.
__device__ double block_sum(double v, double* partials) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();  // the previous reduction's readers are done with `partials`
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kWarps; ++w) total += partials[w];
  return total;
}

__device__ double block_max(double v, double* partials) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) partials[threadIdx.x / 32] = v;
  __syncthreads();
  double best = partials[0];
  for (int w = 1; w < kWarps; ++w) best = fmax(best, partials[w]);
  return best;
}

__global__ void __launch_bounds__(kThreads)
    yeo_johnson_lambdas_kernel(const double* __restrict__ z, int64_t rows, int64_t columns,
                               double* __restrict__ signed_log, double* __restrict__ lambdas) {
  __shared__ double partials[kWarps];
  const auto n_rows = static_cast<double>(rows);
  for (int64_t c = blockIdx.x; c < columns; c += gridDim.x) {
    double* column_log = signed_log + c * rows;
    core::CompensatedSum total, sum_log;
    double max_abs = 0, count = 0;
    bool any_negative = false, all_negative = true;
    for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
      const double x = z[i * columns + c];
      total.add(x);  // a missing value makes the column's mean NaN, as in NumPy
      double s = x;  // NaN marks a missing value in the scratch column too
      if (!isnan(x)) {
        const bool negative = x < 0;
        s = negative ? -log1p(-x) : log1p(x);
        sum_log.add(s);
        max_abs = fmax(max_abs, fabs(x));
        count += 1;
        any_negative |= negative;
        all_negative &= negative;
      }
      column_log[i] = s;
    }
    const double mean = block_sum(total.value(), partials) / n_rows;
    core::CompensatedSum squares;
    for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
      const double d = z[i * columns + c] - mean;
      squares.add(d * d);
    }
    const double variance = block_sum(squares.value(), partials) / n_rows;
    count = block_sum(count, partials);
    const double column_sum_log = block_sum(sum_log.value(), partials);
    max_abs = block_max(max_abs, partials);
    any_negative = __syncthreads_or(any_negative);
    all_negative = __syncthreads_and(all_negative);
    // Uniform across the block: every operand is a block-wide value.
    if (count == 0 || max_abs == 0 || core::yeo_johnson_constant(mean, variance, n_rows)) {
      if (threadIdx.x == 0) lambdas[c] = 1.0;
      continue;
    }
    const auto bounds = core::yeo_johnson_bounds(max_abs, any_negative, all_negative);
    core::BoundedBrent search(bounds.lower, bounds.upper);
    while (search.wants_more()) {
      const double lambda = search.point();
      core::CompensatedSum sum;
      for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
        const double s = column_log[i];
        if (!isnan(s)) sum.add(core::yeo_johnson_value(s, lambda));
      }
      const double y_mean = block_sum(sum.value(), partials) / count;
      core::CompensatedSum deviations;
      for (int64_t i = threadIdx.x; i < rows; i += kThreads) {
        const double s = column_log[i];
        if (isnan(s)) continue;
        const double d = core::yeo_johnson_value(s, lambda) - y_mean;
        deviations.add(d * d);
      }
      const double variance_y = block_sum(deviations.value(), partials) / count;
      search.observe(core::yeo_johnson_neg_llf(variance_y, count, lambda, column_sum_log));
    }
    if (threadIdx.x == 0) lambdas[c] = search.best();
  }
}

at::Tensor yeo_johnson_lambdas_cuda(const at::Tensor& z_in) {
  check_yeo_johnson_lambdas(z_in);
  const c10::cuda::CUDAGuard guard(z_in.device());
  const int64_t rows = z_in.size(0), columns = z_in.size(1);
  at::Tensor out = at::empty({columns}, z_in.options());
  if (columns == 0) return out;
  const at::Tensor z = z_in.contiguous();
  // Each value's signed log, column-major: the evaluations' reads are coalesced.
  at::Tensor signed_log = at::empty({columns, rows}, z_in.options());
  const auto grid = static_cast<unsigned int>(std::min(columns, kMaxBlocks));
  yeo_johnson_lambdas_kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      z.const_data_ptr<double>(), rows, columns, signed_log.mutable_data_ptr<double>(),
      out.mutable_data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) { m.impl("yeo_johnson_lambdas", &yeo_johnson_lambdas_cuda); }

}  // namespace ops
}  // namespace tabserve
