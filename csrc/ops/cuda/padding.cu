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
#include <torch/library.h>

#include <algorithm>
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
  const at::Tensor counts = n_keys.clamp(1, keys).to(at::kInt).reshape({-1}).expand({batch});

  if (backend == AttentionBackend::kMasked) {
    const at::Tensor mask = at::arange(keys, counts.options()).view({1, 1, 1, keys}) <
                            counts.view({batch, 1, 1, 1});
    at::Tensor out = prefix_attention_output(q, v);
    out.copy_(at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale));
    return out;
  }
  TORCH_CHECK((batch + 1) * std::max(queries, keys) <= std::numeric_limits<int32_t>::max(),
              "prefix_attention: batch * length must fit in int32 for the fused kernels, got ",
              "batch ", batch, ", ", queries, " queries and ", keys, " keys");
  // Uniform sequence starts over the padded buffers; the used key counts come from `counts`.
  const auto int_options = counts.options();
  const at::Tensor starts_q = at::arange(0, (batch + 1) * queries, queries, int_options);
  const at::Tensor starts_k = at::arange(0, (batch + 1) * keys, keys, int_options);
  const at::Tensor used_k = counts.contiguous();
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

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) {
  m.impl("pad_to_bucket", &pad_to_bucket_cuda);
  m.impl("pad_labels", &pad_labels_cuda);
  m.impl("prefix_attention", &prefix_attention_cuda);
  // cuBLAS GEMMs and elementwise kernels, n read on the device: no host synchronisation.
  m.impl("qassmax_scale", &qassmax_scale_composite);
}

}  // namespace ops
}  // namespace tabserve
