// CUDA kernel of small_head_attention (schema and contract: ../attention.cpp).
//
// A head of dimension 16 is exactly one 16x16x16 tensor-core tile, so a warp computes the scores
// of 16 queries against 16 keys with one WMMA product. Each block serves one (batch, head) pair
// and a run of 16-query tiles, one tile per warp at a time:
//   - keys and values are staged in shared memory 128 at a time (zeros past the used keys, n read
//     from the device: padded keys cost nothing and nothing waits for the host);
//   - per 128-key chunk a warp writes its 16 x 128 fp32 scores to its shared-memory rows, two
//     lanes per query row take the online-softmax step (running max and sum in fp32, exp2 with
//     the scale folded in), write the probabilities back over the scores in the input dtype, and
//     multiply them with the values on the tensor cores; the fp32 output rows live in registers
//     and are rescaled per chunk;
//   - when all keys fit one chunk (the row stage's ~70 tokens, the induced tokens of the column
//     stage) a block stages them once and runs up to 32 query tiles over them.
// Loads use 16-byte vectors when every row is 16-byte aligned, scalar loads otherwise.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../attention.h"

namespace tabserve {
namespace ops {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kD = 16;                  // head dimension: one WMMA tile edge
constexpr int kWarps = 4;               // query tiles in flight per block
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 128;             // keys staged per pass
constexpr int kScoreLd = kChunk + 4;    // floats per score row (padding against bank conflicts)
constexpr int kProbLd = 2 * kScoreLd;   // the same rows read as 16-bit probabilities
constexpr int64_t kMaxTilesPerBlock = 32;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct Convert;
template <>
struct Convert<__half> {
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

struct Operand {
  const void* data;
  int64_t batch_stride, head_stride, row_stride;  // in elements; the last axis is contiguous
};

struct Params {
  Operand q, k, v;
  void* out;  // [B, Lq, heads, 16], contiguous
  int64_t heads, queries, keys;
  int64_t tiles_per_block, blocks_per_head;
  const void* n_keys;  // nullptr: every key is used
  bool n_keys_long;
  int64_t n_keys_stride;  // 0 for one count shared by the batch
  float scale_log2;       // softmax scale * log2(e)
  bool aligned;           // every row of q, k and v starts on a 16-byte boundary
};

__device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

// `count` (8 or 16) elements of a row into shared memory, zeros for a row past the end.
template <typename T, int count>
__device__ __forceinline__ void load_row(const T* src, T* dst, bool aligned, bool valid) {
  static_assert(count * sizeof(T) % sizeof(uint4) == 0, "whole 16-byte vectors");
  constexpr int vectors = count * sizeof(T) / sizeof(uint4);
  uint4* out = reinterpret_cast<uint4*>(dst);
  if (!valid) {
#pragma unroll
    for (int i = 0; i < vectors; ++i) out[i] = make_uint4(0, 0, 0, 0);
  } else if (aligned) {
    const uint4* in = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int i = 0; i < vectors; ++i) out[i] = in[i];
  } else {
#pragma unroll
    for (int i = 0; i < count; ++i) dst[i] = src[i];
  }
}

// Running state of one query row, held by the two lanes that own it (each keeps 8 of the 16
// output columns).
struct RowState {
  float max = -INFINITY;  // running max of the scaled scores (log2 domain)
  float sum = 0.f;        // running sum of exp2(score - max)
  float out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
};

// One chunk of `count` used keys (staged, zero-padded to `padded`, a multiple of 16) for the
// warp's 16 queries in `q_tile`. `scores` is the warp's [16, kScoreLd] fp32 scratch.
template <typename T>
__device__ __forceinline__ void attend_chunk(
    const wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>& q_tile,
    const T* keys, const T* values, float* scores, int padded, int count, float scale_log2,
    int row, int half, RowState& state) {
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  for (int tile = 0; tile < padded / 16; ++tile) {
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> key_tile;  // K^T
    wmma::load_matrix_sync(key_tile, keys + tile * 16 * kD, kD);
    wmma::fill_fragment(acc, 0.f);
    wmma::mma_sync(acc, q_tile, key_tile, acc);
    wmma::store_matrix_sync(scores + tile * 16, acc, kScoreLd, wmma::mem_row_major);
  }
  __syncwarp();

  // Lanes 2r and 2r + 1 own row r: the even and the odd columns.
  float p[kChunk / 2];
  float chunk_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kChunk / 2; ++j) {
    const int column = 2 * j + half;
    p[j] = column < count ? scores[row * kScoreLd + column] * scale_log2 : -INFINITY;
    chunk_max = fmaxf(chunk_max, p[j]);
  }
  chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, 1));
  const float new_max = fmaxf(state.max, chunk_max);  // finite: the chunk has a used key
  const float rescale = exp2f(state.max - new_max);    // 0 on the first chunk
  float chunk_sum = 0.f;
#pragma unroll
  for (int j = 0; j < kChunk / 2; ++j) {
    p[j] = exp2f(p[j] - new_max);  // 0 for unused columns
    chunk_sum += p[j];
  }
  chunk_sum += __shfl_xor_sync(0xffffffffu, chunk_sum, 1);
  state.sum = state.sum * rescale + chunk_sum;
  state.max = new_max;
  __syncwarp();  // every lane has read its scores: the probabilities overwrite them

  T* probabilities = reinterpret_cast<T*>(scores);  // row r in the first half of score row r
#pragma unroll
  for (int j = 0; j < kChunk / 2; ++j) {
    const int column = 2 * j + half;
    if (column < padded) probabilities[row * kProbLd + column] = Convert<T>::from_float(p[j]);
  }
  __syncwarp();

  wmma::fill_fragment(acc, 0.f);
  for (int tile = 0; tile < padded / 16; ++tile) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> p_tile;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> v_tile;
    wmma::load_matrix_sync(p_tile, probabilities + tile * 16, kProbLd);
    wmma::load_matrix_sync(v_tile, values + tile * 16 * kD, kD);
    wmma::mma_sync(acc, p_tile, v_tile, acc);
  }
  __syncwarp();  // the products have read the probabilities: the chunk's output goes there
  wmma::store_matrix_sync(scores, acc, kScoreLd, wmma::mem_row_major);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    state.out[i] = state.out[i] * rescale + scores[row * kScoreLd + half * 8 + i];
  }
  __syncwarp();  // the scratch is free for the next chunk
}

template <typename T>
__global__ void __launch_bounds__(kThreads) small_head_attention_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ __align__(32) T keys[kChunk * kD];
  __shared__ __align__(32) T values[kChunk * kD];
  __shared__ __align__(32) float scratch[kWarps][16 * kScoreLd];

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = lane >> 1, half = lane & 1;
  const int64_t pair = blockIdx.x / p.blocks_per_head;  // (batch, head)
  const int64_t first_tile = (blockIdx.x % p.blocks_per_head) * p.tiles_per_block;
  const int64_t b = pair / p.heads, h = pair % p.heads;
  const int64_t end_tile = smaller(first_tile + p.tiles_per_block, (p.queries + 15) / 16);

  int64_t used = p.keys;
  if (p.n_keys != nullptr) {
    const int64_t index = b * p.n_keys_stride;
    const int64_t raw = p.n_keys_long ? static_cast<const int64_t*>(p.n_keys)[index]
                                      : static_cast<const int32_t*>(p.n_keys)[index];
    used = smaller(raw < 1 ? int64_t{1} : raw, p.keys);
  }
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.batch_stride + h * p.q.head_stride;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.batch_stride + h * p.k.head_stride;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.batch_stride + h * p.v.head_stride;
  float* scores = scratch[warp];
  const bool one_chunk = p.keys <= kChunk;  // staged once for every tile of the block

  for (int64_t round_start = first_tile; round_start < end_tile; round_start += kWarps) {
    const int64_t tile = round_start + warp;
    const bool active = tile < end_tile;
    RowState state;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_tile;
    if (active) {
      const int64_t query = tile * 16 + row;
      T* staged = reinterpret_cast<T*>(scores);
      load_row<T, 8>(q + query * p.q.row_stride + half * 8, staged + row * kD + half * 8,
                     p.aligned, query < p.queries);
      __syncwarp();
      wmma::load_matrix_sync(q_tile, staged, kD);
      __syncwarp();
    }
    for (int64_t start = 0; start < used; start += kChunk) {
      const int count = static_cast<int>(smaller(int64_t{kChunk}, used - start));
      const int padded = (count + 15) & ~15;
      if (!one_chunk || round_start == first_tile) {
        __syncthreads();  // every warp is done with the previous chunk
        for (int r = static_cast<int>(threadIdx.x); r < 2 * padded; r += kThreads) {
          const bool is_value = r >= padded;
          const int key = is_value ? r - padded : r;
          const T* src = is_value ? v + (start + key) * p.v.row_stride
                                  : k + (start + key) * p.k.row_stride;
          load_row<T, kD>(src, (is_value ? values : keys) + key * kD, p.aligned, key < count);
        }
        __syncthreads();
      }
      if (active) {
        attend_chunk<T>(q_tile, keys, values, scores, padded, count, p.scale_log2, row, half,
                        state);
      }
    }
    if (active) {
      const int64_t query = tile * 16 + row;
      if (query < p.queries) {
        const float inverse = 1.f / state.sum;
        __align__(16) T packed[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) packed[i] = Convert<T>::from_float(state.out[i] * inverse);
        T* dst = static_cast<T*>(p.out) + ((b * p.queries + query) * p.heads + h) * kD + half * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(packed);
      }
    }
  }
#endif
}

Operand operand(const at::Tensor& t) {
  return {t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

bool rows_aligned(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
}

at::Tensor small_head_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                     const at::Tensor& v_in,
                                     const std::optional<at::Tensor>& n_keys,
                                     std::optional<double> scale) {
  check_small_head_attention(q_in, k_in, v_in, n_keys);
  TORCH_CHECK(q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16,
              "small_head_attention on CUDA takes float16 or bfloat16 q, k and v (tensor cores), "
              "got ", q_in.scalar_type(), "; fp32 attention runs through SDPA");
  const c10::cuda::CUDAGuard guard(q_in.device());
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q_in.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q_in.get_device()));
  TORCH_CHECK(major >= 8, "small_head_attention needs a GPU of compute capability 8.0 or newer ",
              "(bf16 / fp16 tensor-core tiles), got ", major, ".", minor);
  at::Tensor out = small_head_attention_output(q_in);
  if (out.numel() == 0) return out;
  const auto unit_last = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in);

  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), keys = k.size(2);
  const int64_t tiles = (queries + 15) / 16;
  const int64_t per_block = keys <= kChunk ? std::min(tiles, kMaxTilesPerBlock) : kWarps;
  const int64_t blocks_per_head = (tiles + per_block - 1) / per_block;
  const int64_t blocks = batch * heads * blocks_per_head;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
              "small_head_attention: batch * heads * query blocks must fit the grid (2^31 - 1), ",
              "got ", blocks);

  Params params{};
  params.q = operand(q);
  params.k = operand(k);
  params.v = operand(v);
  params.out = out.data_ptr();
  params.heads = heads;
  params.queries = queries;
  params.keys = keys;
  params.tiles_per_block = per_block;
  params.blocks_per_head = blocks_per_head;
  params.n_keys = nullptr;
  if (n_keys.has_value()) {
    params.n_keys = n_keys->const_data_ptr();
    params.n_keys_long = n_keys->scalar_type() == at::kLong;
    params.n_keys_stride = n_keys->dim() == 0 ? 0 : n_keys->stride(0);
  }
  params.scale_log2 = static_cast<float>(scale.value_or(0.25)) * kLog2e;
  params.aligned = rows_aligned(q) && rows_aligned(k) && rows_aligned(v);

  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto grid = static_cast<unsigned int>(blocks);
  if (q.scalar_type() == at::kHalf) {
    small_head_attention_kernel<__half><<<grid, kThreads, 0, stream>>>(params);
  } else {
    small_head_attention_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(params);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) {
  m.impl("small_head_attention", &small_head_attention_cuda);
}

}  // namespace ops
}  // namespace tabserve
