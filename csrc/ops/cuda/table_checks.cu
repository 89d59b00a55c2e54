// CUDA kernel of table_checks (schema and contract: ../table_checks.cpp).
//
// One launch: the first `tables` blocks take one table's labels each (a presence bitmap of its N
// possible labels in shared memory, or in a zeroed global scratch past the shared-memory limit),
// the remaining blocks count the non-finite values of X (grid-stride over X's strided elements).
// Totals meet in the zeroed summary through one atomic add per block; each table's entries are
// written by its own block. Nothing waits for the host.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../table_checks.h"

namespace tabserve {
namespace ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSharedWords = 48 * 1024 / 4;  // bitmap words without opting in
constexpr int64_t kMaxXBlocks = 1024;

struct Strides3 {
  int64_t size1, size2, s0, s1, s2;
};

// Sum of v over the block (every thread gets it); `scratch` holds one value per warp.
__device__ int64_t block_sum(int64_t v, int64_t* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch is free (a previous call's readers are done)
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  return total;
}

template <typename x_t, typename y_t>
__global__ void __launch_bounds__(kThreads)
    table_checks_kernel(const x_t* __restrict__ x, Strides3 xs, int64_t x_numel,
                        const y_t* __restrict__ y, int64_t y_s0, int64_t y_s1, int64_t tables,
                        int64_t n, bool classification, uint32_t* __restrict__ global_bits,
                        int64_t words, unsigned long long* __restrict__ summary) {
  __shared__ int64_t scratch[kThreads / 32];
  extern __shared__ uint32_t shared_bits[];
  if (blockIdx.x >= tables) {  // a block of X
    int64_t count = 0;
    const int64_t step = static_cast<int64_t>(gridDim.x - tables) * kThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x - tables) * kThreads + threadIdx.x;
         i < x_numel; i += step) {
      const int64_t k = i % xs.size2, j = (i / xs.size2) % xs.size1, t = i / (xs.size2 * xs.size1);
      count += !isfinite(static_cast<double>(x[t * xs.s0 + j * xs.s1 + k * xs.s2]));
    }
    count = block_sum(count, scratch);
    if (threadIdx.x == 0 && count) atomicAdd(summary + kNonFiniteX, count);
    return;
  }
  const int64_t t = blockIdx.x;
  uint32_t* bits = global_bits != nullptr ? global_bits + t * words : shared_bits;
  if (classification && global_bits == nullptr) {
    for (int64_t w = threadIdx.x; w < words; w += kThreads) bits[w] = 0u;
    __syncthreads();
  }
  int64_t non_finite = 0, bad = 0;
  long long largest = -1;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const double v = static_cast<double>(y[t * y_s0 + j * y_s1]);
    if (!isfinite(v)) {
      ++non_finite;
      ++bad;
    } else if (classification && !(v >= 0 && v < static_cast<double>(n) && v == floor(v))) {
      ++bad;
    } else if (classification) {
      const auto label = static_cast<int64_t>(v);
      atomicOr(bits + label / 32, 1u << (label % 32));
      largest = max(largest, static_cast<long long>(label));
    }
  }
  non_finite = block_sum(non_finite, scratch);
  if (threadIdx.x == 0 && non_finite) atomicAdd(summary + kNonFiniteLabels, non_finite);
  if (!classification) return;
  bad = block_sum(bad, scratch);
  // The largest label: a max over the block through the same scratch (labels are < 2^63).
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = largest;
  __syncthreads();  // also: every bit of the bitmap is set
  for (int w = 0; w < kThreads / 32; ++w) {
    largest = max(largest, static_cast<long long>(scratch[w]));
  }
  int64_t distinct = 0;
  for (int64_t w = threadIdx.x; w < words; w += kThreads) distinct += __popc(bits[w]);
  distinct = block_sum(distinct, scratch);
  if (threadIdx.x == 0) {
    unsigned long long* entry = summary + kTableEntries + kEntriesPerTable * t;
    entry[0] = static_cast<unsigned long long>(bad);
    entry[1] = static_cast<unsigned long long>(distinct);
    entry[2] = static_cast<unsigned long long>(largest);
  }
}

at::Tensor table_checks_cuda(const at::Tensor& X, const at::Tensor& y_train, bool classification) {
  check_table_checks(X, y_train);
  const c10::cuda::CUDAGuard guard(X.device());
  const int64_t tables = X.size(0), n = y_train.size(1);
  at::Tensor summary =
      at::zeros({kTableEntries + kEntriesPerTable * tables}, X.options().dtype(at::kLong));
  if (tables == 0) return summary;
  const int64_t words = classification ? (n + 31) / 32 : 0;
  const bool in_shared = words <= kMaxSharedWords;
  at::Tensor scratch;
  if (!in_shared) scratch = at::zeros({tables, words}, X.options().dtype(at::kInt));
  const int64_t x_blocks = std::min<int64_t>(
      kMaxXBlocks, std::max<int64_t>(1, (X.numel() + 8 * kThreads - 1) / (8 * kThreads)));
  TORCH_CHECK(tables + x_blocks <= std::numeric_limits<int32_t>::max(),
              "X has too many tables for one launch: ", tables);
  const Strides3 xs{X.size(1), X.size(2), X.stride(0), X.stride(1), X.stride(2)};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const size_t shared_bytes = in_shared ? static_cast<size_t>(words) * 4 : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, X.scalar_type(), "table_checks", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, y_train.scalar_type(),
                               "table_checks_labels", [&] {
      table_checks_kernel<x_t, scalar_t><<<static_cast<unsigned>(tables + x_blocks), kThreads,
                                           shared_bytes, stream>>>(
          X.const_data_ptr<x_t>(), xs, X.numel(), y_train.const_data_ptr<scalar_t>(),
          y_train.stride(0), y_train.stride(1), tables, n, classification,
          in_shared ? nullptr : reinterpret_cast<uint32_t*>(scratch.mutable_data_ptr<int32_t>()),
          words, reinterpret_cast<unsigned long long*>(summary.mutable_data_ptr<int64_t>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return summary;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) { m.impl("table_checks", &table_checks_cuda); }

}  // namespace ops
}  // namespace tabserve
