// CUDA kernel of layer_norm_cast (schema and contract: ../layer_norm.cpp).
//
// One warp per row: a row of width 128 * kChunks is kChunks coalesced 512-byte loads (a float4
// per lane each), held in registers; the mean and then the sum of squared deviations (two
// passes over the registers, as exact as Welford's) are warp shuffles; each lane writes its
// values rounded to T, 8 bytes per float4. The stream is read once and written once at T's
// width, where autocast reads it twice and writes it twice (LayerNorm in fp32, then the cast).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../layer_norm.h"

namespace tabserve {
namespace ops {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

template <typename T>
struct Pair;
template <>
struct Pair<at::Half> {
  using type = __half2;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct Pair<at::BFloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type make(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

template <int kChunks, typename T>
__global__ void __launch_bounds__(kThreads)
    layer_norm_cast_kernel(const float4* __restrict__ x, const float4* __restrict__ weight,
                           const float4* __restrict__ bias, T* __restrict__ out, int64_t rows,
                           float eps) {
  using pair_t = typename Pair<T>::type;
  constexpr int kWidth = kChunks * 128;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += stride) {
    const float4* in = x + row * (kWidth / 4);
    float4 v[kChunks];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      v[j] = in[j * 32 + lane];
      sum += (v[j].x + v[j].y) + (v[j].z + v[j].w);
    }
    const float mean = warp_sum(sum) / kWidth;
    float squares = 0.f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      v[j].x -= mean;
      v[j].y -= mean;
      v[j].z -= mean;
      v[j].w -= mean;
      squares += (v[j].x * v[j].x + v[j].y * v[j].y) + (v[j].z * v[j].z + v[j].w * v[j].w);
    }
    const float rstd = rsqrtf(warp_sum(squares) / kWidth + eps);
    uint2* row_out = reinterpret_cast<uint2*>(out + row * kWidth);
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const float4 w = weight[j * 32 + lane];
      const float4 b = bias != nullptr ? bias[j * 32 + lane] : make_float4(0.f, 0.f, 0.f, 0.f);
      const pair_t lo = Pair<T>::make(v[j].x * rstd * w.x + b.x, v[j].y * rstd * w.y + b.y);
      const pair_t hi = Pair<T>::make(v[j].z * rstd * w.z + b.z, v[j].w * rstd * w.w + b.w);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      row_out[j * 32 + lane] = packed;
    }
  }
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

template <typename T>
void launch(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
            at::Tensor& out, int64_t rows, int64_t width, float eps) {
  const auto grid = static_cast<unsigned int>(std::min((rows + kWarps - 1) / kWarps, kMaxBlocks));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* in = reinterpret_cast<const float4*>(x.const_data_ptr<float>());
  const auto* w = reinterpret_cast<const float4*>(weight.const_data_ptr<float>());
  const auto* b =
      bias.has_value() ? reinterpret_cast<const float4*>(bias->const_data_ptr<float>()) : nullptr;
  T* o = out.mutable_data_ptr<T>();
  switch (width) {
    case 128:
      layer_norm_cast_kernel<1, T><<<grid, kThreads, 0, stream>>>(in, w, b, o, rows, eps);
      break;
    case 256:
      layer_norm_cast_kernel<2, T><<<grid, kThreads, 0, stream>>>(in, w, b, o, rows, eps);
      break;
    case 512:
      layer_norm_cast_kernel<4, T><<<grid, kThreads, 0, stream>>>(in, w, b, o, rows, eps);
      break;
    default:
      layer_norm_cast_kernel<8, T><<<grid, kThreads, 0, stream>>>(in, w, b, o, rows, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor layer_norm_cast_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                                const std::optional<at::Tensor>& bias_in, double eps,
                                at::ScalarType dtype) {
  check_layer_norm_cast(x_in, weight_in, bias_in, eps, dtype);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t width = weight_in.size(0);
  const bool served = x_in.scalar_type() == at::kFloat &&
                      (width == 128 || width == 256 || width == 512 || width == 1024);
  if (!served) return layer_norm_cast_composite(x_in, weight_in, bias_in, eps, dtype);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const std::optional<at::Tensor> bias =
      bias_in.has_value() ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  if (!aligned16(x.const_data_ptr()) || !aligned16(weight.const_data_ptr()) ||
      (bias.has_value() && !aligned16(bias->const_data_ptr()))) {
    return layer_norm_cast_composite(x, weight, bias, eps, dtype);
  }
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  const int64_t rows = x.numel() / width;
  if (rows == 0) return out;
  if (dtype == at::kHalf) {
    launch<at::Half>(x, weight, bias, out, rows, width, static_cast<float>(eps));
  } else {
    launch<at::BFloat16>(x, weight, bias, out, rows, width, static_cast<float>(eps));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) { m.impl("layer_norm_cast", &layer_norm_cast_cuda); }

}  // namespace ops
}  // namespace tabserve
