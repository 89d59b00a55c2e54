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
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>

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
// GEMMs per MLP, GELU, tanh, products): about a quarter of the GPU time of a small table's
// replayed graph (H200 profile of cell c33). For fp16 / bf16 q (the serving recipes; fp32 keeps
// the composite, see qassmax_scale_cuda) one block instead scales up to kQassmaxRows query rows
// of one (outer index, head): it stages the query MLP's weights in shared memory, computes the
// head's base vector from n, and each thread runs the query MLP of its row in registers. Every
// intermediate is rounded to q's dtype where the composite (the reference under autocast) rounds
// it; sums are fp32 like cuBLAS's.

constexpr int kQassmaxRows = 128;    // threads per block, one query row each
constexpr int kQassmaxMaxOuter = 6;  // q's leading dimensions before [heads, queries, head_dim]
constexpr int kQassmaxMaxHidden = 128;
constexpr size_t kQassmaxMaxShared = 48 * 1024;

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
  int64_t rows;
  int heads, head_dim, query_hidden, base_hidden;
  int query_out;  // head_dim (element-wise) or 1
  int base_out;   // head_dim (element-wise) or 1, per head
  const void* n_keys;
  bool n_is_int64, n_per_batch;
};

// x rounded to q's dtype and back (the composite's tensors between two ops).
template <typename scalar_t>
__device__ __forceinline__ float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

__device__ __forceinline__ float gelu_erf(float x) {
  return x * 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
}

template <typename scalar_t, int kMaxDim>
__global__ void __launch_bounds__(kQassmaxRows)
    qassmax_scale_kernel(const scalar_t* __restrict__ q, QassmaxShape s, QassmaxWeights w,
                         scalar_t* __restrict__ out) {
  extern __shared__ float shared[];
  const int hidden = s.query_hidden, dim = s.head_dim;
  float* w1 = shared;                       // [hidden][kMaxDim]: query_weight1
  float* w2t = w1 + hidden * kMaxDim;       // [hidden][kMaxDim]: query_weight2 transposed
  float* b1 = w2t + hidden * kMaxDim;       // [hidden]
  float* b2 = b1 + hidden;                  // [kMaxDim]
  float* base_hidden = b2 + kMaxDim;        // [base_hidden]
  float* base = base_hidden + s.base_hidden;  // [kMaxDim]: this head's base vector

  // Columns past head_dim (query_out) stay zero: they meet the zero dims of a row's registers.
  for (int i = threadIdx.x; i < hidden * kMaxDim; i += blockDim.x) {
    const int j = i / kMaxDim, d = i % kMaxDim;
    w1[i] = d < dim ? rounded<scalar_t>(w.data[kQueryW1][j * dim + d]) : 0.0f;
    w2t[i] = d < s.query_out ? rounded<scalar_t>(w.data[kQueryW2][d * hidden + j]) : 0.0f;
  }
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    b1[i] = rounded<scalar_t>(w.data[kQueryB1][i]);
  }
  for (int i = threadIdx.x; i < s.query_out; i += blockDim.x) {
    b2[i] = rounded<scalar_t>(w.data[kQueryB2][i]);
  }

  const int head = blockIdx.y;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQassmaxRows + threadIdx.x;
  for (int64_t outer = blockIdx.z; outer < s.outer_count; outer += gridDim.z) {
    int64_t q_offset = head * s.q_head_stride + row * s.q_row_stride;
    int64_t out_offset = head * s.out_head_stride + row * s.out_row_stride;
    int64_t rest = outer, batch = 0;
    for (int d = s.outer_dims - 1; d >= 0; --d) {
      const int64_t coordinate = rest % s.outer_sizes[d];
      rest /= s.outer_sizes[d];
      q_offset += coordinate * s.q_outer_strides[d];
      out_offset += coordinate * s.out_outer_strides[d];
      batch = coordinate;  // ends as the coordinate of dimension 0
    }
    // Base vector of (n, head): ln max(n, 1) in double, to float, to q's dtype (PyTorch's
    // double -> half conversion goes through float too), then Linear(1, h), GELU, Linear(h, .).
    const int64_t n_index = s.n_per_batch ? batch : 0;
    const int64_t n = s.n_is_int64 ? static_cast<const int64_t*>(s.n_keys)[n_index]
                                   : static_cast<const int32_t*>(s.n_keys)[n_index];
    const float log_n =
        rounded<scalar_t>(static_cast<float>(log(static_cast<double>(n < 1 ? 1 : n))));
    __syncthreads();  // the previous outer index's base is no longer read
    for (int j = threadIdx.x; j < s.base_hidden; j += blockDim.x) {
      const float pre = rounded<scalar_t>(
          rounded<scalar_t>(w.data[kBaseW1][j]) * log_n +
          rounded<scalar_t>(w.data[kBaseB1][j]));
      base_hidden[j] = rounded<scalar_t>(gelu_erf(pre));
    }
    __syncthreads();
    for (int d = threadIdx.x; d < s.base_out; d += blockDim.x) {
      const int64_t base_row = static_cast<int64_t>(head) * s.base_out + d;
      const float* weight_row = w.data[kBaseW2] + base_row * s.base_hidden;
      float sum = 0.0f;
#pragma unroll 8
      for (int j = 0; j < s.base_hidden; ++j) {
        sum = fmaf(rounded<scalar_t>(__ldg(weight_row + j)), base_hidden[j], sum);
      }
      base[d] = rounded<scalar_t>(sum + rounded<scalar_t>(w.data[kBaseB2][base_row]));
    }
    __syncthreads();
    if (row >= s.rows) continue;

    float x[kMaxDim], m[kMaxDim];
#pragma unroll
    for (int d = 0; d < kMaxDim; ++d) {
      x[d] = d < dim ? static_cast<float>(q[q_offset + d]) : 0.0f;
      m[d] = 0.0f;
    }
    // kUnits hidden units at a time: their dot products are independent chains (each summed
    // over d in the same order as one at a time), which hides the FMA latency.
    constexpr int kUnits = 4;
    int j = 0;
    for (; j + kUnits <= hidden; j += kUnits) {
      float sums[kUnits];
#pragma unroll
      for (int u = 0; u < kUnits; ++u) sums[u] = 0.0f;
#pragma unroll
      for (int d = 0; d < kMaxDim; ++d) {
#pragma unroll
        for (int u = 0; u < kUnits; ++u) sums[u] = fmaf(w1[(j + u) * kMaxDim + d], x[d], sums[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        const float g = rounded<scalar_t>(gelu_erf(rounded<scalar_t>(sums[u] + b1[j + u])));
#pragma unroll
        for (int d = 0; d < kMaxDim; ++d) m[d] = fmaf(w2t[(j + u) * kMaxDim + d], g, m[d]);
      }
    }
    for (; j < hidden; ++j) {
      float sum = 0.0f;
#pragma unroll
      for (int d = 0; d < kMaxDim; ++d) sum = fmaf(w1[j * kMaxDim + d], x[d], sum);
      const float g = rounded<scalar_t>(gelu_erf(rounded<scalar_t>(sum + b1[j])));
#pragma unroll
      for (int d = 0; d < kMaxDim; ++d) m[d] = fmaf(w2t[j * kMaxDim + d], g, m[d]);
    }
#pragma unroll
    for (int d = 0; d < kMaxDim; ++d) {
      if (d >= dim) break;
      const float modulation = s.query_out == 1 ? m[0] + b2[0] : m[d] + b2[d];
      const float t = rounded<scalar_t>(tanhf(rounded<scalar_t>(modulation)));
      const float scale = rounded<scalar_t>(base[s.base_out == 1 ? 0 : d] * rounded<scalar_t>(t + 1.0f));
      out[out_offset + d] = static_cast<scalar_t>(x[d] * scale);
    }
  }
}

at::Tensor qassmax_scale_cuda(const at::Tensor& q, const at::Tensor& n_keys,
                              const at::Tensor& base_weight1, const at::Tensor& base_bias1,
                              const at::Tensor& base_weight2, const at::Tensor& base_bias2,
                              const at::Tensor& query_weight1, const at::Tensor& query_bias1,
                              const at::Tensor& query_weight2, const at::Tensor& query_bias2) {
  check_qassmax_scale(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                      query_weight1, query_bias1, query_weight2, query_bias2);
  const int64_t head_dim = q.size(-1), hidden = query_weight1.size(0);
  const int max_dim = head_dim <= 16 ? 16 : 64;
  const size_t shared_bytes =
      sizeof(float) * (2 * hidden * max_dim + hidden + 2 * max_dim + base_weight1.size(0));
  // fp16 / bf16 only: in fp32 the composite's cuBLAS sums equal the unpadded model's own
  // QASSMax bit for bit, which keeps fp32 padded inference equal to unpadded inference.
  const auto dtype = q.scalar_type();
  const bool fused = (dtype == at::kHalf || dtype == at::kBFloat16) && head_dim <= 64 &&
                     hidden <= kQassmaxMaxHidden && shared_bytes <= kQassmaxMaxShared &&
                     q.dim() - 3 <= kQassmaxMaxOuter && q.size(-3) <= 65535 &&
                     q.size(-2) <= std::numeric_limits<int32_t>::max() / 2;
  if (!fused) {
    return qassmax_scale_maths(q, n_keys, base_weight1, base_bias1, base_weight2, base_bias2,
                               query_weight1, query_bias1, query_weight2, query_bias2);
  }
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty_like(q);
  if (q.numel() == 0) return out;
  const at::Tensor x = q.stride(-1) == 1 ? q : q.contiguous();
  TORCH_INTERNAL_ASSERT(out.stride(-1) == 1);

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
  s.head_dim = static_cast<int>(head_dim);
  s.query_hidden = static_cast<int>(hidden);
  s.base_hidden = static_cast<int>(base_weight1.size(0));
  s.query_out = static_cast<int>(query_weight2.size(0));
  s.base_out = static_cast<int>(base_weight2.size(0) / q.size(-3));
  s.n_is_int64 = n_keys.scalar_type() == at::kLong;
  s.n_per_batch = n_keys.dim() == 1;

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

  const dim3 grid(static_cast<unsigned>((s.rows + kQassmaxRows - 1) / kQassmaxRows),
                  static_cast<unsigned>(s.heads),
                  static_cast<unsigned>(std::min<int64_t>(s.outer_count, 65535)));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // c10's Half / BFloat16 convert to and from float on the device with round-to-nearest.
  const auto launch = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* q_data = x.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    if (max_dim == 16) {
      qassmax_scale_kernel<scalar_t, 16><<<grid, kQassmaxRows, shared_bytes, stream>>>(
          q_data, s, w, out_data);
    } else {
      qassmax_scale_kernel<scalar_t, 64><<<grid, kQassmaxRows, shared_bytes, stream>>>(
          q_data, s, w, out_data);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (q.scalar_type() == at::kHalf) {
    launch(at::Half{});
  } else {
    launch(at::BFloat16{});
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
