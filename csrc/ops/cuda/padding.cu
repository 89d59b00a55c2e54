// CUDA kernels of the padded-table operators (schemas and contracts: ../padding.cpp).
//
// Nothing here synchronises with the host: the real key count stays in a device tensor and
// reaches the attention kernels as per-batch lengths (flash's seqused_k, the memory-efficient
// kernel's seqlen_k, or a boolean key mask), so every call can be captured in a CUDA graph and
// replayed for any n in the bucket. Out-of-range counts are clamped into [1, keys] on the device.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <type_traits>

#include "../padding.h"

namespace tabserve {
namespace ops {
namespace {

constexpr int kThreadsPerBlock = 256;

// One thread per padded element (grid-stride): the element's input row from the shared row map,
// or the fill value.
template <typename scalar_t>
__global__ void pad_rows_kernel(const scalar_t* x, int64_t s0, int64_t s1, int64_t s2,
                                PadShape s, scalar_t fill, scalar_t* out) {
  const int64_t total = s.tables * s.rows() * s.feature_bucket;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t column = i % s.feature_bucket;
    const int64_t row = i / s.feature_bucket;
    const int64_t table = row / s.rows();
    const int64_t source =
        s.source_row(row % s.rows());
    out[i] = (source >= 0 && column < s.features) ? x[table * s0 + source * s1 + column * s2]
                                                  : fill;
  }
}

at::Tensor pad_rows_cuda(const at::Tensor& x, const PadShape& s, double fill) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({s.tables, s.rows(), s.feature_bucket}, x.options());
  const int64_t total = out.numel();
  if (total == 0) return out;
  const int blocks =
      static_cast<int>(std::min<int64_t>((total + kThreadsPerBlock - 1) / kThreadsPerBlock, 65536));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, x.scalar_type(), "pad_rows", [&] {
    pad_rows_kernel<scalar_t><<<blocks, kThreadsPerBlock, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.stride(2), s,
        c10::Scalar(fill).to<scalar_t>(), out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor pad_to_bucket_cuda(const at::Tensor& x, int64_t n_train, int64_t train_bucket,
                              int64_t test_bucket, int64_t feature_bucket, double fill) {
  return pad_to_bucket_with(&pad_rows_cuda, x, n_train, train_bucket, test_bucket,
                            feature_bucket, fill);
}

at::Tensor pad_labels_cuda(const at::Tensor& y_train, int64_t train_bucket, double fill) {
  return pad_labels_with(&pad_rows_cuda, y_train, train_bucket, fill);
}

// Which fused kernel can run these shapes: varlen flash takes fp16 / bf16 with head_dim a
// multiple of 8 up to 256 and Dv == D; the memory-efficient kernel takes fp32 / fp16 / bf16 rows
// of q, k and v that are whole 16-byte vectors (it has no fp16 kernel for head_dim 4: "cutlassF:
// no kernel found to launch"). "auto" takes flash, then efficient, then the masked SDPA, which
// runs any shape; an explicit fused backend that cannot run the shapes is refused by name.
bool flash_applies(const at::Tensor& q, const at::Tensor& v) {
  const bool half = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  return half && q.size(3) % 8 == 0 && q.size(3) <= 256 && v.size(3) == q.size(3);
}

bool efficient_applies(const at::Tensor& q, const at::Tensor& v) {
  if (q.scalar_type() == at::kDouble) return false;
  const int64_t bytes = static_cast<int64_t>(q.element_size());
  return q.size(3) * bytes % 16 == 0 && v.size(3) * bytes % 16 == 0;
}

AttentionBackend resolve(AttentionBackend backend, const at::Tensor& q, const at::Tensor& v) {
  TORCH_CHECK(backend != AttentionBackend::kFlash || flash_applies(q, v),
              "prefix_attention: backend \"flash\" needs float16 or bfloat16 q with head_dim a "
              "multiple of 8 up to 256 and v's head_dim equal to it, got ", q.scalar_type(),
              ", head_dim ", q.size(3), ", v head_dim ", v.size(3), "; use \"auto\" or \"masked\"");
  TORCH_CHECK(backend != AttentionBackend::kEfficient || efficient_applies(q, v),
              "prefix_attention: backend \"efficient\" needs float32, float16 or bfloat16 q and "
              "head_dim and v's head_dim to fill whole 16-byte vectors, got ", q.scalar_type(),
              " with head_dim ", q.size(3), ", v head_dim ", v.size(3),
              "; use \"auto\" or \"masked\"");
  if (backend != AttentionBackend::kAuto) return backend;
  if (flash_applies(q, v)) return AttentionBackend::kFlash;
  return efficient_applies(q, v) ? AttentionBackend::kEfficient : AttentionBackend::kMasked;
}

// lengths = [starts_q (batch + 1), starts_k (batch + 1), used_k (batch)]: sequence starts over
// the padded [batch * length] buffers, and n (0-d or per batch entry) clamped into [1, keys].
__global__ void prefix_lengths_kernel(const void* n_keys, bool n_is_int64, bool n_per_batch,
                                      int64_t batch, int32_t queries, int32_t keys,
                                      int32_t* lengths) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i > batch) return;
  lengths[i] = static_cast<int32_t>(i * queries);
  lengths[batch + 1 + i] = static_cast<int32_t>(i * keys);
  if (i == batch) return;
  const int64_t index = n_per_batch ? i : 0;
  const int64_t n = n_is_int64 ? static_cast<const int64_t*>(n_keys)[index]
                               : static_cast<const int32_t*>(n_keys)[index];
  lengths[2 * batch + 2 + i] = static_cast<int32_t>(n < 1 ? 1 : (n > keys ? keys : n));
}

// [B, heads, L, D] -> [B * L, heads, D]: a view for the usual head-split projection layout
// ([B, L, heads * D] split into heads), a copy otherwise; the kernels need unit last stride.
at::Tensor packed(const at::Tensor& t) {
  const at::Tensor p = t.transpose(1, 2).reshape({t.size(0) * t.size(2), t.size(1), t.size(3)});
  return p.stride(2) == 1 ? p : p.contiguous();
}

at::Tensor prefix_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& n_keys, std::optional<double> scale,
                                 c10::string_view backend_name) {
  const AttentionBackend backend =
      resolve(check_prefix_attention(q, k, v, n_keys, backend_name), q, v);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), keys = k.size(2);
  if (batch * heads * queries * v.size(3) == 0) return prefix_attention_output(q, v);
  if (backend == AttentionBackend::kMasked) {
    const at::Tensor counts = n_keys.clamp(1, keys).reshape({-1, 1, 1, 1});
    const at::Tensor mask = at::arange(keys, counts.options()).view({1, 1, 1, keys}) < counts;
    at::Tensor out = prefix_attention_output(q, v);
    out.copy_(at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale));
    return out;
  }
  TORCH_CHECK((batch + 1) * std::max(queries, keys) <= std::numeric_limits<int32_t>::max(),
              "prefix_attention: batch * length must fit in int32 for the fused kernels, got ",
              "batch ", batch, ", ", queries, " queries and ", keys, " keys");
  // Uniform sequence starts over the padded buffers and the clamped key counts, from one kernel.
  const at::Tensor lengths = at::empty({3 * batch + 2}, n_keys.options().dtype(at::kInt));
  const at::Tensor n = n_keys.contiguous();
  prefix_lengths_kernel<<<static_cast<unsigned>((batch + kThreadsPerBlock) / kThreadsPerBlock),
                          kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      n.const_data_ptr(), n.scalar_type() == at::kLong, n.dim() == 1, batch,
      static_cast<int32_t>(queries), static_cast<int32_t>(keys), lengths.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor starts_q = lengths.slice(0, 0, batch + 1);
  const at::Tensor starts_k = lengths.slice(0, batch + 1, 2 * batch + 2);
  const at::Tensor used_k = lengths.slice(0, 2 * batch + 2);
  const at::Tensor pq = packed(q), pk = packed(k), pv = packed(v);
  at::Tensor result;  // [B * Lq, heads, Dv]: prefix_attention_output's layout
  if (backend == AttentionBackend::kFlash) {
    result = std::get<0>(at::_flash_attention_forward(
        pq, pk, pv, starts_q, starts_k, queries, keys, 0.0, /*is_causal=*/false,
        /*return_debug_mask=*/false, scale, std::nullopt, std::nullopt, used_k));
  } else {
    result = std::get<0>(at::_efficient_attention_forward(
                             pq.unsqueeze(0), pk.unsqueeze(0), pv.unsqueeze(0), std::nullopt,
                             starts_q, starts_k, queries, keys, 0.0, /*custom_mask_type=*/0,
                             /*compute_log_sumexp=*/false, scale, used_k))
                 .squeeze(0);
  }
  return result.view({batch, queries, heads, v.size(3)}).transpose(1, 2);
}

// -- qassmax_scale: one fused kernel ------------------------------------------------------------
//
// The composite (padding.cpp) launches about twenty kernels per call (eight weight casts, two
// GEMMs per MLP, GELU, tanh, products). For fp16 / bf16 q (the serving recipes; fp32 keeps the
// composite, see qassmax_scale_cuda) one kernel runs it all: each block stages the query MLP's
// weights in shared memory once, in q's dtype, then walks a contiguous run of 64-row tiles (one
// tile: 64 query rows of one (outer index, head)). Each warp owns 16 rows of a tile and runs the
// query MLP's two linears on tensor cores (WMMA 16x16x16, q's dtype in, fp32 sums as cuBLAS's),
// with bias, GELU, tanh and the scaling in fp32 between them. Every intermediate is rounded to
// q's dtype where the composite (the reference under autocast) rounds it. The head's base vector
// (from n) is recomputed only when a tile's (n, head) differs from the block's previous tile.
//
// One query row per thread (8,192 serial FMAs per row) takes 52-87 us per call of a small table
// on the H200, a third of its replayed graph; this kernel takes 32-35 us per call there, host
// launch included (docs/reference/ops.md).

constexpr int kQassmaxWarps = 4;
constexpr int kQassmaxThreads = kQassmaxWarps * 32;
constexpr int kQassmaxTileRows = kQassmaxWarps * 16;  // 16 rows per warp
constexpr int kQassmaxMaxOuter = 6;  // q's leading dimensions before [heads, queries, head_dim]
constexpr int kQassmaxMaxHidden = 128;
constexpr int kQassmaxMaxBaseHidden = 1024;
constexpr int kQassmaxPad = 8;  // extra 16-bit elements per shared row (fewer bank conflicts)

// The weights in the order of the schema: base_weight1, base_bias1, base_weight2, base_bias2,
// query_weight1, query_bias1, query_weight2, query_bias2, as contiguous fp32 (the host converts
// other floating dtypes first: exact for fp16 / bf16; a double goes through float as the
// composite's cast to q's dtype does).
struct QassmaxWeights {
  std::array<const float*, 8> data;
};
enum : int { kBaseW1, kBaseB1, kBaseW2, kBaseB2, kQueryW1, kQueryB1, kQueryW2, kQueryB2 };

struct QassmaxShape {
  int64_t outer_sizes[kQassmaxMaxOuter];
  int64_t q_outer_strides[kQassmaxMaxOuter];
  int64_t out_outer_strides[kQassmaxMaxOuter];
  int outer_dims;
  int64_t outer_count;
  int64_t q_head_stride, q_row_stride, out_head_stride, out_row_stride;
  int64_t rows;        // queries per (outer index, head)
  int64_t row_tiles;   // ceil(rows / kQassmaxTileRows)
  int64_t tiles;       // outer_count * heads * row_tiles
  int64_t tiles_per_block;
  int heads, head_dim, query_hidden, base_hidden;
  int query_out;  // head_dim (element-wise) or 1
  int base_out;   // head_dim (element-wise) or 1, per head
  const void* n_keys;
  bool n_is_int64, n_per_batch;
  bool vector_rows;  // q's rows hold exactly the kernel's kDim and are 16-byte aligned
};

// The shared-memory layout of one block, in bytes from the (128-byte aligned) start; every
// region starts on a 128-byte boundary, as WMMA's loads and stores need 32.
struct QassmaxLayout {
  int hidden_padded;             // the kernel's kHidden: query_hidden rounded up to 64 or 128
  int x_ld, h_ld, sums_ld;       // row lengths (elements) of the x, hidden and sums tiles
  size_t w1, w2, x, h, sums, b1, b2, base_hidden, base, bytes;

  __host__ __device__ QassmaxLayout(int dim, int padded_hidden, int base_hidden_units) {
    hidden_padded = padded_hidden;
    x_ld = dim + kQassmaxPad;
    h_ld = hidden_padded + kQassmaxPad;
    sums_ld = (hidden_padded > dim ? hidden_padded : dim) + 4;
    size_t at = 0;
    const auto take = [&at](size_t size) {
      const size_t start = at;
      at = (at + size + 127) / 128 * 128;
      return start;
    };
    w1 = take(2 * size_t(hidden_padded) * x_ld);          // [hidden][x_ld]: query_weight1
    w2 = take(2 * size_t(dim) * h_ld);                    // [dim][h_ld]: query_weight2
    x = take(2 * size_t(kQassmaxTileRows) * x_ld);        // the tile's queries
    h = take(2 * size_t(kQassmaxTileRows) * h_ld);        // GELU(first linear), q's dtype
    sums = take(4 * size_t(kQassmaxTileRows) * sums_ld);  // fp32 sums of either linear
    b1 = take(4 * size_t(hidden_padded));
    b2 = take(4 * size_t(dim));
    base_hidden = take(4 * size_t(base_hidden_units));
    base = take(4 * size_t(dim));
    bytes = at;
  }
};

// The 16-bit type WMMA takes for c10's Half / BFloat16 (same bits).
template <typename scalar_t>
struct WmmaType;
template <>
struct WmmaType<at::Half> {
  using type = __half;
};
template <>
struct WmmaType<at::BFloat16> {
  using type = __nv_bfloat16;
};

// x rounded to q's dtype and back (the composite's tensors between two ops).
template <typename scalar_t>
__device__ __forceinline__ float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

__device__ __forceinline__ float gelu_erf(float x) {
  return x * 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
}

// The head's base vector for n, into shared `base`: ln max(n, 1) in double, to float, to q's
// dtype (PyTorch's double -> half conversion goes through float too), then Linear(1, h), GELU,
// Linear(h, .). Called by the whole block; ends with a barrier. Output d = warp + 4u: each lane
// sums the columns j = lane + 32 * step of its warp's outputs, then a butterfly sum per output.
// The first two steps' weights (every base hidden width up to 64) and the biases are loaded
// before the first barrier, so a base costs one trip to memory, not one per step.
template <typename scalar_t, int kDim>
__device__ void qassmax_base(const QassmaxShape& s, const QassmaxWeights& w, int64_t n, int head,
                             float* base_hidden, float* base) {
  constexpr int kOutputs = kDim / kQassmaxWarps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* weights = w.data[kBaseW2] + static_cast<int64_t>(head) * s.base_out * s.base_hidden;
  float early[2][kOutputs], bias[kOutputs];
#pragma unroll
  for (int u = 0; u < kOutputs; ++u) {
    const int d = warp + kQassmaxWarps * u;
    const bool real = d < s.base_out;
    const float* row = weights + static_cast<int64_t>(d) * s.base_hidden;
    early[0][u] = real && lane < s.base_hidden ? __ldg(row + lane) : 0.0f;
    early[1][u] = real && lane + 32 < s.base_hidden ? __ldg(row + lane + 32) : 0.0f;
    bias[u] = real ? __ldg(w.data[kBaseB2] + static_cast<int64_t>(head) * s.base_out + d) : 0.0f;
  }
  const float log_n =
      rounded<scalar_t>(static_cast<float>(log(static_cast<double>(n < 1 ? 1 : n))));
  __syncthreads();  // every warp is done with the previous base
  for (int j = threadIdx.x; j < s.base_hidden; j += blockDim.x) {
    const float pre = rounded<scalar_t>(rounded<scalar_t>(__ldg(w.data[kBaseW1] + j)) * log_n +
                                        rounded<scalar_t>(__ldg(w.data[kBaseB1] + j)));
    base_hidden[j] = rounded<scalar_t>(gelu_erf(pre));
  }
  __syncthreads();
  float sum[kOutputs];
#pragma unroll
  for (int u = 0; u < kOutputs; ++u) {
    sum[u] = fmaf(rounded<scalar_t>(early[0][u]), lane < s.base_hidden ? base_hidden[lane] : 0.0f,
                  0.0f);
    sum[u] = fmaf(rounded<scalar_t>(early[1][u]),
                  lane + 32 < s.base_hidden ? base_hidden[lane + 32] : 0.0f, sum[u]);
  }
  for (int j = lane + 64; j < s.base_hidden; j += 32) {  // wider base MLPs
#pragma unroll
    for (int u = 0; u < kOutputs; ++u) {
      const int d = warp + kQassmaxWarps * u;
      const float weight =
          d < s.base_out ? __ldg(weights + static_cast<int64_t>(d) * s.base_hidden + j) : 0.0f;
      sum[u] = fmaf(rounded<scalar_t>(weight), base_hidden[j], sum[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < kOutputs; ++u) {
    const int d = warp + kQassmaxWarps * u;
    float total = sum[u];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    }
    if (lane == 0 && d < s.base_out) {
      base[d] = rounded<scalar_t>(total + rounded<scalar_t>(bias[u]));
    }
  }
  __syncthreads();
}

// kDim: head_dim rounded up to 16 or 64; kHidden: the query MLP's width rounded up to 64 or 128
// (padding: zero weights and biases, GELU(0) = 0, zero second-linear columns; padded dims meet
// zero queries). Both are compile-time so that every index split is a shift.
template <typename scalar_t, int kDim, int kHidden>
__global__ void __launch_bounds__(kQassmaxThreads)
    qassmax_scale_kernel(const scalar_t* __restrict__ q, QassmaxShape s, QassmaxWeights w,
                         scalar_t* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using T = typename WmmaType<scalar_t>::type;
  extern __shared__ __align__(128) unsigned char smem[];
  const QassmaxLayout l(kDim, kHidden, s.base_hidden);
  const int hidden = s.query_hidden, dim = s.head_dim;
  scalar_t* w1 = reinterpret_cast<scalar_t*>(smem + l.w1);
  scalar_t* w2 = reinterpret_cast<scalar_t*>(smem + l.w2);
  scalar_t* xs = reinterpret_cast<scalar_t*>(smem + l.x);
  scalar_t* hs = reinterpret_cast<scalar_t*>(smem + l.h);
  float* sums = reinterpret_cast<float*>(smem + l.sums);
  float* b1 = reinterpret_cast<float*>(smem + l.b1);
  float* b2 = reinterpret_cast<float*>(smem + l.b2);
  float* base_hidden = reinterpret_cast<float*>(smem + l.base_hidden);
  float* base = reinterpret_cast<float*>(smem + l.base);

  // Stage the query MLP in q's dtype: w1 [kHidden][kDim] from query_weight1 [hidden][dim], w2
  // [kDim][kHidden] from query_weight2 [query_out][hidden], the biases; zero past the real
  // sizes. kStage loads in flight per thread before their stores, both matrices in one loop.
  constexpr int kCount = kHidden * kDim;
  constexpr int kStage = kCount / kQassmaxThreads < 32 ? kCount / kQassmaxThreads : 32;
  static_assert(kHidden <= kQassmaxThreads && kCount % (kQassmaxThreads * kStage) == 0);
  for (int first = threadIdx.x; first < kCount; first += kQassmaxThreads * kStage) {
    float a[kStage], b[kStage];
#pragma unroll
    for (int u = 0; u < kStage; ++u) {
      const int i = first + u * kQassmaxThreads;
      const int j1 = i / kDim, d1 = i % kDim;     // w1[j1][d1]
      const int d2 = i / kHidden, j2 = i % kHidden;  // w2[d2][j2]
      a[u] = i < kCount && j1 < hidden && d1 < dim ? __ldg(w.data[kQueryW1] + j1 * dim + d1)
                                                   : 0.0f;
      b[u] = i < kCount && d2 < s.query_out && j2 < hidden
                 ? __ldg(w.data[kQueryW2] + d2 * hidden + j2)
                 : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kStage; ++u) {
      const int i = first + u * kQassmaxThreads;
      if (i < kCount) {
        w1[(i / kDim) * l.x_ld + i % kDim] = static_cast<scalar_t>(a[u]);
        w2[(i / kHidden) * l.h_ld + i % kHidden] = static_cast<scalar_t>(b[u]);
      }
    }
  }
  if (threadIdx.x < kHidden) {
    b1[threadIdx.x] =
        threadIdx.x < hidden ? rounded<scalar_t>(__ldg(w.data[kQueryB1] + threadIdx.x)) : 0.0f;
  }
  if (threadIdx.x < kDim) {
    b2[threadIdx.x] =
        threadIdx.x < s.query_out ? rounded<scalar_t>(__ldg(w.data[kQueryB2] + threadIdx.x)) : 0.0f;
  }
  // (qassmax_base's first barrier publishes the staged weights.)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  scalar_t* x_rows = xs + warp * 16 * l.x_ld;
  scalar_t* h_rows = hs + warp * 16 * l.h_ld;
  float* sum_rows = sums + warp * 16 * l.sums_ld;
  int64_t based_n = -1;
  int based_head = -1;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * s.tiles_per_block;
  const int64_t last_tile = min(first_tile + s.tiles_per_block, s.tiles);
  for (int64_t tile = first_tile; tile < last_tile; ++tile) {
    const int64_t row_tile = tile % s.row_tiles;
    const int head = static_cast<int>((tile / s.row_tiles) % s.heads);
    const int64_t outer = tile / s.row_tiles / s.heads;
    int64_t q_offset = head * s.q_head_stride, out_offset = head * s.out_head_stride;
    int64_t rest = outer, batch = 0;
    for (int d = s.outer_dims - 1; d >= 0; --d) {
      const int64_t coordinate = rest % s.outer_sizes[d];
      rest /= s.outer_sizes[d];
      q_offset += coordinate * s.q_outer_strides[d];
      out_offset += coordinate * s.out_outer_strides[d];
      batch = coordinate;  // ends as the coordinate of dimension 0
    }
    const int64_t n_index = s.n_per_batch ? batch : 0;
    const int64_t n = s.n_is_int64 ? static_cast<const int64_t*>(s.n_keys)[n_index]
                                   : static_cast<const int32_t*>(s.n_keys)[n_index];
    if (n != based_n || head != based_head) {  // the same for the whole block
      qassmax_base<scalar_t, kDim>(s, w, n, head, base_hidden, base);
      based_n = n;
      based_head = head;
    }

    // This warp's 16 rows of the tile (zeros past the last query), every load of a lane issued
    // before its first store (one after another, a tile waited on 32 round trips to memory).
    const int64_t row0 = row_tile * kQassmaxTileRows + warp * 16;
    if (s.vector_rows) {  // 16-byte vectors: rows of exactly kDim, 16-byte aligned
      constexpr int kVectorsPerRow = kDim / 8, kPerLane = 16 * kVectorsPerRow / 32;
      uint4 v[kPerLane];
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        const int i = lane + 32 * u, r = i / kVectorsPerRow, c = i % kVectorsPerRow;
        const int64_t row = row0 + r;
        v[u] = row < s.rows ? *reinterpret_cast<const uint4*>(q + q_offset + row * s.q_row_stride +
                                                              8 * c)
                            : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        const int i = lane + 32 * u, r = i / kVectorsPerRow, c = i % kVectorsPerRow;
        *reinterpret_cast<uint4*>(x_rows + r * l.x_ld + 8 * c) = v[u];
      }
    } else {
      constexpr int kPerLane = 16 * kDim / 32;
      scalar_t v[kPerLane];
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        const int i = lane + 32 * u, r = i / kDim, d = i % kDim;
        const int64_t row = row0 + r;
        v[u] = row < s.rows && d < dim ? q[q_offset + row * s.q_row_stride + d]
                                       : static_cast<scalar_t>(0.0f);
      }
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        const int i = lane + 32 * u;
        x_rows[(i / kDim) * l.x_ld + i % kDim] = v[u];
      }
    }
    __syncwarp();

    // hidden = GELU(x @ W1^T + b1), rounded as the composite's linear and GELU outputs.
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> x_frag[kDim / 16];
#pragma unroll
    for (int kt = 0; kt < kDim / 16; ++kt) {
      wmma::load_matrix_sync(x_frag[kt], reinterpret_cast<const T*>(x_rows + kt * 16), l.x_ld);
    }
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c[kDim / 16];
#pragma unroll
    for (int jt = 0; jt < kHidden / 16; ++jt) {
      wmma::fill_fragment(c[0], 0.0f);
#pragma unroll
      for (int kt = 0; kt < kDim / 16; ++kt) {
        wmma::load_matrix_sync(b, reinterpret_cast<const T*>(w1 + jt * 16 * l.x_ld + kt * 16),
                               l.x_ld);
        wmma::mma_sync(c[0], x_frag[kt], b, c[0]);
      }
      wmma::store_matrix_sync(sum_rows + jt * 16, c[0], l.sums_ld, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll 4
    for (int i = lane; i < 16 * kHidden; i += 32) {
      const int r = i / kHidden, j = i % kHidden;
      const float pre = rounded<scalar_t>(sum_rows[r * l.sums_ld + j] + b1[j]);
      h_rows[r * l.h_ld + j] = static_cast<scalar_t>(gelu_erf(pre));
    }
    __syncwarp();

    // modulation = hidden @ W2^T (+ b2 below): only the first 16 columns when it is one column.
    const int out_tiles = s.query_out == 1 ? 1 : kDim / 16;
#pragma unroll
    for (int dt = 0; dt < kDim / 16; ++dt) wmma::fill_fragment(c[dt], 0.0f);
#pragma unroll
    for (int jt = 0; jt < kHidden / 16; ++jt) {
      wmma::load_matrix_sync(x_frag[0], reinterpret_cast<const T*>(h_rows + jt * 16), l.h_ld);
#pragma unroll
      for (int dt = 0; dt < kDim / 16; ++dt) {
        if (dt >= out_tiles) break;
        wmma::load_matrix_sync(b, reinterpret_cast<const T*>(w2 + dt * 16 * l.h_ld + jt * 16),
                               l.h_ld);
        wmma::mma_sync(c[dt], x_frag[0], b, c[dt]);
      }
    }
#pragma unroll
    for (int dt = 0; dt < kDim / 16; ++dt) {
      if (dt >= out_tiles) break;
      wmma::store_matrix_sync(sum_rows + dt * 16, c[dt], l.sums_ld, wmma::mem_row_major);
    }
    __syncwarp();

    // q * (base * (1 + tanh(modulation))), written along each row (coalesced).
#pragma unroll 4
    for (int i = lane; i < 16 * kDim; i += 32) {
      const int r = i / kDim, d = i % kDim;
      const int64_t row = row0 + r;
      if (d >= dim || row >= s.rows) continue;
      const int column = s.query_out == 1 ? 0 : d;
      const float t = rounded<scalar_t>(
          tanhf(rounded<scalar_t>(sum_rows[r * l.sums_ld + column] + b2[column])));
      const float scale =
          rounded<scalar_t>(base[s.base_out == 1 ? 0 : d] * rounded<scalar_t>(t + 1.0f));
      out[out_offset + row * s.out_row_stride + d] =
          static_cast<scalar_t>(static_cast<float>(x_rows[r * l.x_ld + d]) * scale);
    }
    __syncwarp();  // the next tile's rows overwrite x_rows and sum_rows
  }
#endif
}

at::Tensor qassmax_scale_cuda(const at::Tensor& q, const at::Tensor& n_keys,
                              const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                              const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                              const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                              const at::Tensor& query_weight2, const at::Tensor& query_bias2) {
  check_qassmax_scale(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                      query_weight1, query_bias1, query_weight2, query_bias2);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t head_dim = q.size(-1), hidden = query_weight1.size(0);
  const int max_dim = head_dim <= 16 ? 16 : 64;
  const int64_t base_hidden = base_weight1.size(0);
  const int hidden_padded = hidden <= 64 ? 64 : 128;
  const QassmaxLayout layout(max_dim, hidden_padded,
                             static_cast<int>(std::min<int64_t>(base_hidden, 1 << 20)));
  const auto attribute = [device = q.device().index()](cudaDeviceAttr which) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, which, device));
    return value;
  };
  // fp16 / bf16 on sm_80 and later only: in fp32 the composite's cuBLAS sums equal the unpadded
  // model's own QASSMax bit for bit, which keeps fp32 padded inference equal to unpadded
  // inference; WMMA on bf16 needs sm_80. Rows of q must be contiguous along head_dim (every
  // layout the model makes; others keep their strides through the composite).
  const auto dtype = q.scalar_type();
  const bool fused = (dtype == at::kHalf || dtype == at::kBFloat16) &&
                     attribute(cudaDevAttrComputeCapabilityMajor) >= 8 && q.stride(-1) == 1 &&
                     head_dim <= 64 && hidden <= kQassmaxMaxHidden &&
                     base_hidden <= kQassmaxMaxBaseHidden &&
                     layout.bytes <= static_cast<size_t>(attribute(
                                         cudaDevAttrMaxSharedMemoryPerBlockOptin)) &&
                     q.dim() - 3 <= kQassmaxMaxOuter;
  if (!fused) {
    return qassmax_scale_maths(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                               query_weight1, query_bias1, query_weight2, query_bias2);
  }
  // q's strides where they keep head_dim contiguous (a size-1 head_dim may not).
  at::Tensor out = at::empty_like(q);
  if (out.stride(-1) != 1) out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  const at::Tensor& x = q;

  QassmaxShape s{};
  s.outer_dims = static_cast<int>(q.dim() - 3);
  s.outer_count = 1;
  for (int d = 0; d < s.outer_dims; ++d) {
    s.outer_sizes[d] = q.size(d);
    s.q_outer_strides[d] = x.stride(d);
    s.out_outer_strides[d] = out.stride(d);
    s.outer_count *= q.size(d);
  }
  s.q_head_stride = x.stride(-3);
  s.q_row_stride = x.stride(-2);
  s.out_head_stride = out.stride(-3);
  s.out_row_stride = out.stride(-2);
  s.rows = q.size(-2);
  s.heads = static_cast<int>(q.size(-3));
  s.row_tiles = (s.rows + kQassmaxTileRows - 1) / kQassmaxTileRows;
  s.tiles = s.outer_count * s.heads * s.row_tiles;
  s.head_dim = static_cast<int>(head_dim);
  s.query_hidden = static_cast<int>(hidden);
  s.base_hidden = static_cast<int>(base_hidden);
  s.query_out = static_cast<int>(query_weight2.size(0));
  s.base_out = static_cast<int>(base_weight2.size(0) / q.size(-3));
  s.n_is_int64 = n_keys.scalar_type() == at::kLong;
  s.n_per_batch = n_keys.dim() == 1;
  bool aligned = reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < q.dim(); ++d) aligned = aligned && x.stride(d) % 8 == 0;
  s.vector_rows = head_dim == max_dim && aligned;

  // Contiguous fp32 weights (nn.Linear's fp32 parameters already are: no copy), so the kernel's
  // loads are plain float loads it can pipeline.
  std::array<at::Tensor, 8> weights{base_weight1, base_bias1, base_weight2, base_bias2,
                                    query_weight1, query_bias1, query_weight2, query_bias2};
  QassmaxWeights w{};
  for (size_t i = 0; i < weights.size(); ++i) {
    weights[i] = weights[i].to(at::kFloat).contiguous();
    w.data[i] = weights[i].const_data_ptr<float>();
  }
  const at::Tensor n_contiguous = n_keys.contiguous();
  s.n_keys = n_contiguous.data_ptr();

  const auto stream = c10::cuda::getCurrentCUDAStream();
  // c10's Half / BFloat16 convert to and from float on the device with round-to-nearest.
  const auto launch = [&](auto type_tag, auto dim_tag, auto hidden_tag) {
    using scalar_t = decltype(type_tag);
    const auto kernel =
        &qassmax_scale_kernel<scalar_t, decltype(dim_tag)::value, decltype(hidden_tag)::value>;
    // The body exists for sm_80 and later only: a binary built for older GPUs alone (running
    // here through PTX) takes the composite.
    cudaFuncAttributes built{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&built, kernel));
    if (built.binaryVersion < 80 && built.ptxVersion < 80) return false;
    if (layout.bytes > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(layout.bytes)));
    }
    // As many blocks as fit on the device at once, each over a contiguous run of tiles (the
    // query MLP is staged once per block, the base vector once per run of equal (n, head)).
    int blocks_per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                                 kQassmaxThreads, layout.bytes));
    const int64_t resident = static_cast<int64_t>(std::max(blocks_per_sm, 1)) *
                             attribute(cudaDevAttrMultiProcessorCount);
    s.tiles_per_block = (s.tiles + resident - 1) / resident;
    const auto blocks =
        static_cast<unsigned>((s.tiles + s.tiles_per_block - 1) / s.tiles_per_block);
    kernel<<<blocks, kQassmaxThreads, layout.bytes, stream>>>(
        x.const_data_ptr<scalar_t>(), s, w, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  };
  const auto with_hidden = [&](auto type_tag, auto dim_tag) {
    return hidden_padded == 64 ? launch(type_tag, dim_tag, std::integral_constant<int, 64>{})
                               : launch(type_tag, dim_tag, std::integral_constant<int, 128>{});
  };
  const auto with_dim = [&](auto type_tag) {
    return max_dim == 16 ? with_hidden(type_tag, std::integral_constant<int, 16>{})
                         : with_hidden(type_tag, std::integral_constant<int, 64>{});
  };
  const bool launched = dtype == at::kHalf ? with_dim(at::Half{}) : with_dim(at::BFloat16{});
  if (!launched) {
    return qassmax_scale_maths(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                               query_weight1, query_bias1, query_weight2, query_bias2);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) {
  m.impl("pad_to_bucket", &pad_to_bucket_cuda);
  m.impl("pad_labels", &pad_labels_cuda);
  m.impl("prefix_attention", &prefix_attention_cuda);
  // One fused kernel (the composite for shapes it does not take); n read on the device.
  m.impl("qassmax_scale", &qassmax_scale_cuda);
}

}  // namespace ops
}  // namespace tabserve
