// CUDA kernel of feed_forward_resident (schema and contract: ../feed_forward.cpp).
//
// Width 128 and FFN width 256 make both weight matrices 64 KiB each in half precision: a block
// copies them into shared memory once and keeps them for the whole launch (one block per SM,
// walking the token tiles with the grid's stride), so the only global traffic per tile is its
// tokens. The general Triton kernel re-reads 128 KiB of weights from L2 per 64 tokens (254
// registers, 2 programs per SM, latency-bound: Nsight Compute on the H200). Measured
// (docs/reference/ops.md): faster than it on short streams (the small workload: 0.078 against
// 0.14-0.26 ms), as fast on the large ones (4.92 against 4.84 ms), so the dispatcher sends it the
// former.
//
// A warp owns a tile of 16 tokens, the m of the m16n8k16 product:
//   1. s = x (+ update) of its 16 tokens is read with whole-row loads (one token row per warp
//      instruction, 16 bytes per lane) into the warp's staging rows in shared memory, in fp32;
//   2. LayerNorm reads the staged rows in linear1's A-fragment layout (a lane holds 32 of the
//      128 values of tokens g and g + 8; the sums take two shuffles among a token's 4 lanes); the
//      normalised tile, rounded to T, is 8 A fragments (one per 16 dims);
//   3. for each step of 64 hidden units: linear1's 16 x 64 accumulators (8 tiles of 8 units),
//      plus bias, rounded, GELU, rounded, packed: these are the A fragments of linear2 over the
//      same 64 units, accumulated into the 16 x 128 output (16 tiles of 8 dims, fp32);
//   4. out = s + round(acc + b2) in place in the staging rows, then whole-row stores.
// Loads and stores straight in the fragment layout would touch 8 rows' 32-byte pieces per warp
// instruction, 8 L1 wavefronts for 256 bytes: a kernel built that way takes 7.96 ms on the large
// row stream against the Triton kernel's 4.85 (H200).
// The staging rows are padded to 136 floats so that the fragment reads (8 rows x 4 lanes x 8
// bytes per half-warp) meet no bank conflict. The weight rows sit in shared memory with their
// 16-byte chunks swizzled (chunk ^ row % 8), so the ldmatrix loads of the B fragments (8 rows of
// one chunk column per matrix) meet none either. The next tile of every warp is prefetched into
// L2 before the products start.
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
constexpr int kStagePitch = kDim + 8;   // floats per staging row (bank-conflict-free reads)
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
  const bool* skip;    // nullptr: none; else one flag per run of set_tokens tokens
  int64_t set_tokens;
  float skip_value;
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
  float stage[kWarps][kTile * kStagePitch];  // each warp's tile of s, then of the output
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

// Four consecutive elements of a row as floats (X: float, __half or __nv_bfloat16); 16-byte
// (float) or 8-byte (half) aligned.
template <typename X>
__device__ __forceinline__ float4 load_four(const X* at) {
  if constexpr (std::is_same_v<X, float>) {
    return __ldg(reinterpret_cast<const float4*>(at));
  } else {
    const uint2 packed = __ldg(reinterpret_cast<const uint2*>(at));
    const float2 lo = unpack_two<X>(packed.x), hi = unpack_two<X>(packed.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}

template <typename X>
__device__ __forceinline__ void store_four(X* at, float4 v) {
  if constexpr (std::is_same_v<X, float>) {
    *reinterpret_cast<float4*>(at) = v;
  } else {
    *reinterpret_cast<uint2*>(at) = make_uint2(pack_two<X>(v.x, v.y), pack_two<X>(v.z, v.w));
  }
}

// Step 1: s = x (+ update) of the tile's tokens into the warp's staging rows, lane l holding
// dims 4l..4l+3 of every row (rows past the end: zeros). The sum is rounded to T when x is T
// (ATen's x + update), fp32 otherwise.
template <typename T, typename X>
__device__ __forceinline__ void stage_tile(const Params& p, int64_t first, int lane,
                                           float* stage) {
  float4 s[kTile];
#pragma unroll
  for (int i = 0; i < kTile; ++i) {
    const int64_t token = first + i;
    s[i] = token < p.tokens ? load_four(static_cast<const X*>(p.x) + token * kDim + 4 * lane)
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if (p.update != nullptr) {
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
      const int64_t token = first + i;
      if (token >= p.tokens) continue;
      const float4 u = load_four(static_cast<const T*>(p.update) + token * kDim + 4 * lane);
      float4 sum = make_float4(s[i].x + u.x, s[i].y + u.y, s[i].z + u.z, s[i].w + u.w);
      if constexpr (std::is_same_v<X, T>) {
        const float2 lo = unpack_two<T>(pack_two<T>(sum.x, sum.y));
        const float2 hi = unpack_two<T>(pack_two<T>(sum.z, sum.w));
        sum = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      s[i] = sum;
    }
  }
#pragma unroll
  for (int i = 0; i < kTile; ++i) {
    *reinterpret_cast<float4*>(stage + i * kStagePitch + 4 * lane) = s[i];
  }
}

// Element offset in the staging rows of element pair `pair` (0: dims 2t, 2t + 1; 1: 2t + 8,
// 2t + 9) of 16-dim step `k`, token row g (+ 8 for half 1): linear1's A-fragment positions.
__device__ __forceinline__ int fragment_offset(int g, int half, int k, int pair, int t) {
  return (g + 8 * half) * kStagePitch + k * 16 + pair * 8 + 2 * t;
}

// Step 2: the staged tile normalised (fp32, biased variance, as ATen) and rounded to T, in
// linear1's A-fragment layout.
template <typename T>
__device__ __forceinline__ void normalised_tile(const Resident<T>& r, const float* stage,
                                                float eps, int g, int t,
                                                uint32_t (&a)[kDimSteps][4]) {
  float v[2][kDimSteps][4];
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const float2 s =
            *reinterpret_cast<const float2*>(stage + fragment_offset(g, half, k, pair, t));
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
    inv_std[half] = 1.0f / __fsqrt_rn(squares * (1.0f / kDim) + eps);
  }
#pragma unroll
  for (int k = 0; k < kDimSteps; ++k) {
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const int d = k * 16 + pair * 8 + 2 * t;
      float n[2][2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float c = (v[half][k][2 * pair + e] - mean[half]) * inv_std[half];
          n[half][e] = c * r.gamma[d + e] + r.beta[d + e];
        }
      }
      a[k][2 * pair] = pack_two<T>(n[0][0], n[0][1]);      // token row g, dims d, d + 1
      a[k][2 * pair + 1] = pack_two<T>(n[1][0], n[1][1]);  // token row g + 8
    }
  }
}

// GELU (exact, erf) in fp32 in ATen's order of operations.
__device__ __forceinline__ float gelu(float h) { return h * 0.5f * (1.0f + erff(h * kSqrtHalf)); }

// Step 3, one step of kStep hidden units: linear1 (+ bias, rounded), GELU (rounded), and their
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
  float* stage = r.stage[threadIdx.x >> 5];
  X* out = static_cast<X*>(p.out);
  const int64_t tiles = (p.tokens + kTile - 1) / kTile;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t tile = blockIdx.x * int64_t{kWarps} + (threadIdx.x >> 5); tile < tiles;
       tile += stride) {
    const int64_t first = tile * kTile;
    stage_tile<T, X>(p, first, lane, stage);
    if (tile + stride < tiles) prefetch_tile<T, X>(p, tile + stride, lane);
    __syncwarp();
    uint32_t a[kDimSteps][4];
    normalised_tile<T>(r, stage, p.eps, g, t, a);
    float acc[kOutTiles][4];
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll 1
    for (int step = 0; step < kHidden / kStep; ++step) hidden_step<T>(r, step, lane, a, acc);
    // Step 4: out = s + round(y + b2) over the staged s (each lane rewrites the elements it
    // reads), then whole rows to memory.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        const int d = j * 8 + 2 * t;
        const float2 y = unpack_two<T>(
            pack_two<T>(acc[j][2 * half] + r.b2[d], acc[j][2 * half + 1] + r.b2[d + 1]));
        auto* at = reinterpret_cast<float2*>(stage + (g + 8 * half) * kStagePitch + d);
        const float2 s = *at;
        *at = make_float2(s.x + y.x, s.y + y.y);
      }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
      const int64_t token = first + i;
      if (token < p.tokens) {
        float4 v = *reinterpret_cast<const float4*>(stage + i * kStagePitch + 4 * lane);
        if (p.skip != nullptr && p.skip[token / p.set_tokens]) {
          v = make_float4(p.skip_value, p.skip_value, p.skip_value, p.skip_value);
        }
        store_four(out + token * kDim + 4 * lane, v);
      }
    }
    __syncwarp();  // the staging rows are free for the next tile
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
                                      const at::Tensor& w2_in, const at::Tensor& b2, double eps,
                                      const std::optional<at::Tensor>& skip_in,
                                      double skip_value) {
  check_feed_forward_resident(x_in, update_in, norm_weight, norm_bias, w1_in, b1, w2_in, b2, eps,
                              skip_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int multiprocessors =
      tensor_core::tensor_core_multiprocessors("feed_forward_resident", x_in.get_device());
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
  at::Tensor skip;
  if (skip_in.has_value() && skip_in->numel() > 0) {
    skip = skip_in->contiguous();
    p.skip = skip.const_data_ptr<bool>();
    p.set_tokens = tokens / skip.numel();
    p.skip_value = static_cast<float>(skip_value);
  }

  const int64_t warp_tiles = (tokens + kTile - 1) / kTile;
  const auto grid = static_cast<unsigned int>(
      std::min<int64_t>(multiprocessors, (warp_tiles + kWarps - 1) / kWarps));
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
