// CUDA kernel of feed_forward_resident (schema and contract: ../feed_forward.cpp).
//
// Width 128 and FFN width 256 make both weight matrices 64 KiB each in half precision: a block
// copies them into shared memory once and keeps them for the whole launch (one block per SM,
// walking the token tiles with the grid's stride), so the only global traffic per tile is its
// tokens. The general Triton kernel re-reads 128 KiB of weights from L2 per 64 tokens and, at 254
// registers and 2 programs per SM, waited on those loads (Nsight Compute on the H200, 2026-11-30).
//
// A warp owns a tile of 16 tokens, the m of the m16n8k16 product, and keeps every step in
// registers:
//   1. s = x (+ update) is loaded straight into the A-fragment layout of linear1 (a lane holds
//      32 of the 128 values of tokens g and g + 8); LayerNorm's sums take two shuffles among the
//      4 lanes of a token; the normalised tile, rounded to T, is 8 A fragments (one per 16 dims);
//   2. for each step of 64 hidden units: linear1's 16 x 64 accumulators (8 tiles of 8 units),
//      plus bias, rounded, GELU, rounded, packed: these are the A fragments of linear2 over the
//      same 64 units, accumulated into the 16 x 128 output (16 tiles of 8 dims, fp32);
//   3. out = s + round(acc + b2), s re-read (from L2: the tile was read a moment ago; holding it
//      would cost 64 registers through both products), every load issued before the first store.
// The weight rows sit in shared memory with their 16-byte chunks swizzled (chunk ^ row % 8), so
// the ldmatrix loads of the B fragments (8 rows of one chunk column per matrix) meet no bank
// conflict. The next tile of every warp is prefetched into L2 before the products start.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../feed_forward.h"
#include "tensor_core.cuh"

namespace tabserve {
namespace ops {
namespace {

using tensor_core::ldmatrix_x4;
using tensor_core::mma;
using tensor_core::pack_two;
using tensor_core::to_float;
using tensor_core::unpack_two;

constexpr int kDim = static_cast<int>(kResidentDim);        // 128: 8 k-steps of linear1
constexpr int kHidden = static_cast<int>(kResidentHidden);  // 256
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;        // tokens per warp tile
constexpr int kStep = 64;        // hidden units per step: 8 accumulator tiles of linear1
constexpr int kDimSteps = kDim / 16;
constexpr int kOutTiles = kDim / 8;
constexpr int kW1Chunks = kDim / 8;     // 16-byte chunks per W1 row (128 dims)
constexpr int kW2Chunks = kHidden / 8;  // per W2 row (256 hidden units)
constexpr float kSqrtHalf = 0.70710678118654752f;

struct Params {
  const void* x;
  const void* update;  // nullptr: none
  void* out;
  const float* norm_weight;
  const float* norm_bias;  // nullptr: none
  const void* w1;
  const void* b1;
  const void* w2;
  const void* b2;
  int64_t tokens;
  float eps;
};

// Shared memory of a block: both weight matrices (swizzled) and the vectors as floats.
template <typename T>
struct Resident {
  T w1[kHidden * kDim];
  T w2[kDim * kHidden];
  float b1[kHidden];
  float b2[kDim];
  float gamma[kDim];
  float beta[kDim];
};

// Element offset of 16-byte chunk `chunk` of row `row` in a matrix of `chunks` chunks per row.
template <int kChunks>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kChunks * 8 + ((chunk ^ (row & 7)) * 8);
}

template <typename T>
__device__ void stage_weights(const Params& p, Resident<T>& r) {
  const auto* w1 = static_cast<const uint4*>(p.w1);
  const auto* w2 = static_cast<const uint4*>(p.w2);
  for (int i = threadIdx.x; i < kHidden * kW1Chunks; i += kThreads) {
    const int row = i / kW1Chunks, chunk = i % kW1Chunks;
    *reinterpret_cast<uint4*>(r.w1 + swizzled<kW1Chunks>(row, chunk)) = __ldg(w1 + i);
  }
  for (int i = threadIdx.x; i < kDim * kW2Chunks; i += kThreads) {
    const int row = i / kW2Chunks, chunk = i % kW2Chunks;
    *reinterpret_cast<uint4*>(r.w2 + swizzled<kW2Chunks>(row, chunk)) = __ldg(w2 + i);
  }
  const T* b1 = static_cast<const T*>(p.b1);
  const T* b2 = static_cast<const T*>(p.b2);
  for (int i = threadIdx.x; i < kHidden; i += kThreads) r.b1[i] = to_float(b1[i]);
  for (int i = threadIdx.x; i < kDim; i += kThreads) {
    r.b2[i] = to_float(b2[i]);
    r.gamma[i] = p.norm_weight[i];
    r.beta[i] = p.norm_bias == nullptr ? 0.0f : p.norm_bias[i];
  }
}

// Two neighbouring elements of a row as floats (X: float, __half or __nv_bfloat16).
template <typename X>
__device__ __forceinline__ float2 load_two(const X* at) {
  if constexpr (std::is_same_v<X, float>) {
    return __ldg(reinterpret_cast<const float2*>(at));
  } else {
    return unpack_two<X>(__ldg(reinterpret_cast<const unsigned int*>(at)));
  }
}

template <typename X>
__device__ __forceinline__ void store_two(X* at, float2 v) {
  if constexpr (std::is_same_v<X, float>) {
    *reinterpret_cast<float2*>(at) = v;
  } else {
    *reinterpret_cast<uint32_t*>(at) = pack_two<X>(v.x, v.y);
  }
}

// s = x (+ update) at `offset` (two elements), in fp32; rounded to T when x is T (ATen's sum).
template <typename T, typename X>
__device__ __forceinline__ float2 residual(const Params& p, int64_t offset) {
  float2 s = load_two(static_cast<const X*>(p.x) + offset);
  if (p.update != nullptr) {
    const float2 u = load_two(static_cast<const T*>(p.update) + offset);
    s = {s.x + u.x, s.y + u.y};
    if constexpr (std::is_same_v<X, T>) s = unpack_two<T>(pack_two<T>(s.x, s.y));
  }
  return s;
}

// Dims of element pair `pair` (0: 2t, 1: 2t + 8) of 16-dim step `k` for lane quad position t.
__device__ __forceinline__ int fragment_dim(int k, int pair, int t) { return k * 16 + pair * 8 + 2 * t; }

// Step 1: s of tokens `row` (and row + 8) loaded into linear1's A-fragment layout, normalised
// (fp32, biased variance, as ATen) and rounded to T. Rows past the end read as zeros.
template <typename T, typename X>
__device__ __forceinline__ void normalised_tile(const Params& p, const Resident<T>& r,
                                                int64_t row, int t, uint32_t (&a)[kDimSteps][4]) {
  float v[2][kDimSteps][4];
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t token = row + 8 * half;
    const bool inside = token < p.tokens;
#pragma unroll
    for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const float2 s = inside ? residual<T, X>(p, token * kDim + fragment_dim(k, pair, t))
                                : make_float2(0.0f, 0.0f);
        v[half][k][2 * pair] = s.x;
        v[half][k][2 * pair + 1] = s.y;
        sum[half] += s.x + s.y;
      }
    }
  }
  float mean[2], inv_std[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float total = sum[half];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    mean[half] = total * (1.0f / kDim);
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float c = v[half][k][e] - mean[half];
        squares += c * c;
      }
    }
    squares += __shfl_xor_sync(0xffffffffu, squares, 1);
    squares += __shfl_xor_sync(0xffffffffu, squares, 2);
    inv_std[half] = 1.0f / __fsqrt_rn(squares * (1.0f / kDim) + p.eps);
  }
#pragma unroll
  for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const int d = fragment_dim(k, pair, t);
      float n[2][2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float c = (v[half][k][2 * pair + e] - mean[half]) * inv_std[half];
          n[half][e] = c * r.gamma[d + e] + r.beta[d + e];
        }
      }
      a[k][2 * pair] = pack_two<T>(n[0][0], n[0][1]);      // token row, dims d, d + 1
      a[k][2 * pair + 1] = pack_two<T>(n[1][0], n[1][1]);  // token row + 8
    }
  }
}

// GELU (exact, erf) in fp32 in ATen's order of operations.
__device__ __forceinline__ float gelu(float h) { return h * 0.5f * (1.0f + erff(h * kSqrtHalf)); }

// Step 2, one step of kStep hidden units: linear1 (+ bias, rounded), GELU (rounded), and their
// contribution to linear2's accumulators.
template <typename T>
__device__ __forceinline__ void hidden_step(const Resident<T>& r, int step, int lane,
                                            const uint32_t (&a)[kDimSteps][4],
                                            float (&acc)[kOutTiles][4]) {
  const int t = lane & 3;
  // ldmatrix: lanes 8m..8m+7 address rows (m / 2) * 8 + lane % 8 of 8-row tile pairs, chunk
  // column m % 2 of a 16-wide step; every row's swizzle is lane % 8.
  const int row_in_pair = (lane >> 4) * 8 + (lane & 7), upper = (lane >> 3) & 1, swz = lane & 7;
  float h[kStep / 8][4];
#pragma unroll
  for (int j = 0; j < kStep / 8; ++j) h[j][0] = h[j][1] = h[j][2] = h[j][3] = 0.0f;
#pragma unroll
  for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
    for (int pair = 0; pair < kStep / 16; ++pair) {
      const int unit = step * kStep + pair * 16 + row_in_pair;
      uint32_t b[4];
      ldmatrix_x4(b, r.w1 + unit * kDim + (((2 * k + upper) ^ swz) * 8));
      mma<T>(h[2 * pair], a[k], b[0], b[1]);
      mma<T>(h[2 * pair + 1], a[k], b[2], b[3]);
    }
  }
  uint32_t g[kStep / 16][4];
#pragma unroll
  for (int j = 0; j < kStep / 8; ++j) {
    const int unit = step * kStep + j * 8 + 2 * t;
    const float bias0 = r.b1[unit], bias1 = r.b1[unit + 1];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 hidden =
          unpack_two<T>(pack_two<T>(h[j][2 * half] + bias0, h[j][2 * half + 1] + bias1));
      g[j / 2][(j % 2) * 2 + half] = pack_two<T>(gelu(hidden.x), gelu(hidden.y));
    }
  }
#pragma unroll
  for (int k = 0; k < kStep / 16; ++k) {
    const int chunk = step * (kStep / 8) + ((2 * k + upper) ^ swz);
#pragma unroll
    for (int pair = 0; pair < kOutTiles / 2; ++pair) {
      const int dim = pair * 16 + row_in_pair;
      uint32_t b[4];
      ldmatrix_x4(b, r.w2 + dim * kHidden + chunk * 8);
      mma<T>(acc[2 * pair], g[k], b[0], b[1]);
      mma<T>(acc[2 * pair + 1], g[k], b[2], b[3]);
    }
  }
}

// Pulls a warp tile's tokens (and update) into L2, one 128-byte line per lane at a time.
template <typename T, typename X>
__device__ __forceinline__ void prefetch_tile(const Params& p, int64_t tile, int lane) {
  const int64_t first = tile * kTile, last = std::min<int64_t>(first + kTile, p.tokens);
  const auto prefetch = [&](const char* base, int64_t element_bytes) {
    const char* begin = base + first * kDim * element_bytes;
    const int64_t bytes = (last - first) * kDim * element_bytes;
    for (int64_t offset = lane * 128; offset < bytes; offset += 32 * 128) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(begin + offset));
    }
  };
  prefetch(static_cast<const char*>(p.x), sizeof(X));
  if (p.update != nullptr) prefetch(static_cast<const char*>(p.update), sizeof(T));
}

template <typename T, typename X>
__global__ void __launch_bounds__(kThreads, 1) feed_forward_resident_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) unsigned char shared[];
  auto& r = *reinterpret_cast<Resident<T>*>(shared);
  stage_weights<T>(p, r);
  __syncthreads();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t tiles = (p.tokens + kTile - 1) / kTile;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t tile = blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5); tile < tiles;
       tile += stride) {
    if (tile + stride < tiles) prefetch_tile<T, X>(p, tile + stride, lane);
    const int64_t row = tile * kTile + g;
    uint32_t a[kDimSteps][4];
    normalised_tile<T, X>(p, r, row, t, a);
    float acc[kOutTiles][4];
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll 1
    for (int step = 0; step < kHidden / kStep; ++step) hidden_step<T>(r, step, lane, a, acc);
    // Step 3: out = s + round(y + b2). Every residual load is issued before the first store:
    // the compiler cannot tell `out` from x, so a store between two loads would order them and
    // make each wait a full L2 round trip.
    X* out = static_cast<X*>(p.out);
    float2 s[2][kOutTiles];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t token = row + 8 * half;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        s[half][j] = token < p.tokens ? residual<T, X>(p, token * kDim + j * 8 + 2 * t)
                                      : make_float2(0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t token = row + 8 * half;
      if (token >= p.tokens) continue;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        const int d = j * 8 + 2 * t;
        const float2 y = unpack_two<T>(
            pack_two<T>(acc[j][2 * half] + r.b2[d], acc[j][2 * half + 1] + r.b2[d + 1]));
        store_two(out + token * kDim + d, make_float2(s[half][j].x + y.x, s[half][j].y + y.y));
      }
    }
  }
#endif
}

// A contiguous tensor whose data starts on a 16-byte boundary (the kernel's vector loads).
at::Tensor contiguous_aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<std::uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : c.clone();
}

at::Tensor feed_forward_resident_cuda(const at::Tensor& x_in,
                                      const std::optional<at::Tensor>& update_in,
                                      const at::Tensor& norm_weight,
                                      const std::optional<at::Tensor>& norm_bias,
                                      const at::Tensor& w1_in, const at::Tensor& b1,
                                      const at::Tensor& w2_in, const at::Tensor& b2, double eps) {
  check_feed_forward_resident(x_in, update_in, norm_weight, norm_bias, w1_in, b1, w2_in, b2, eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int device = x_in.get_device();
  int major = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TORCH_CHECK(major >= 8, "feed_forward_resident needs a GPU of compute capability 8.0 or newer ",
              "(fp16 / bf16 tensor-core tiles), got major version ", major);
  const at::Tensor x = contiguous_aligned(x_in);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t tokens = x.numel() / kDim;
  if (tokens == 0) return out;
  at::Tensor update, bias;
  if (update_in.has_value()) update = contiguous_aligned(*update_in);
  if (norm_bias.has_value()) bias = norm_bias->contiguous();
  const at::Tensor w1 = contiguous_aligned(w1_in), w2 = contiguous_aligned(w2_in);
  const at::Tensor b1c = b1.contiguous(), b2c = b2.contiguous(), gamma = norm_weight.contiguous();

  Params p{};
  p.x = x.const_data_ptr();
  p.update = update.defined() ? update.const_data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.norm_weight = gamma.const_data_ptr<float>();
  p.norm_bias = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  p.w1 = w1.const_data_ptr();
  p.b1 = b1c.const_data_ptr();
  p.w2 = w2.const_data_ptr();
  p.b2 = b2c.const_data_ptr();
  p.tokens = tokens;
  p.eps = static_cast<float>(eps);

  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t warp_tiles = (tokens + kTile - 1) / kTile;
  const auto grid = static_cast<unsigned int>(
      std::min<int64_t>(sms, (warp_tiles + kWarps - 1) / kWarps));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto compute, auto stream_element) {
    using T = decltype(compute);
    using X = decltype(stream_element);
    const auto kernel = feed_forward_resident_kernel<T, X>;
    constexpr size_t shared = sizeof(Resident<T>);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shared)));
    kernel<<<grid, kThreads, shared, stream>>>(p);
  };
  const bool stream_fp32 = x.scalar_type() == at::kFloat;
  if (w1.scalar_type() == at::kHalf) {
    stream_fp32 ? launch(__half{}, float{}) : launch(__half{}, __half{});
  } else {
    stream_fp32 ? launch(__nv_bfloat16{}, float{}) : launch(__nv_bfloat16{}, __nv_bfloat16{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) {
  m.impl("feed_forward_resident", &feed_forward_resident_cuda);
}

}  // namespace ops
}  // namespace tabserve
