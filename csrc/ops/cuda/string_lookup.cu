// CUDA kernels of the string-lookup operators (schemas and contracts: ../string_lookup.cpp).
//
// The device code is in string_lookup_kernels.cuh (torch-free): a tile of lanes owns one label,
// hashes its words, probes the table and compares candidate bytes. This file checks arguments,
// picks the tile shape from the mean label length and launches. Nothing here synchronises with
// the host except the optional offset checks, which are skipped while a CUDA graph is captured,
// and all memory comes from the caching allocator on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../string_lookup.h"
#include "string_lookup_kernels.cuh"

namespace tabserve {
namespace ops {
namespace {

using lookup_kernels::DeviceStrings;
using lookup_kernels::kMaxColumnsPerLaunch;
using lookup_kernels::kThreadsPerBlock;
using lookup_kernels::kTileShapes;
using lookup_kernels::QueryBatch;

DeviceStrings device_strings(const at::Tensor& data, const at::Tensor& offsets,
                             const std::optional<at::Tensor>& valid) {
  return {data.data_ptr<uint8_t>(), data.numel(), offsets.data_ptr<int64_t>(),
          valid.has_value() ? valid->data_ptr<bool>() : nullptr, offsets.numel() - 1};
}

int blocks_for(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 1 << 16));
}

// Index into kTileShapes for labels of `bytes` bytes in all over `rows` rows (known on the host
// from the tensors' sizes, so choosing costs no synchronisation).
int tile_shape(int64_t bytes, int64_t rows) {
  const int64_t mean = rows > 0 ? bytes / rows : 0;
  int shape = 0;
  while (mean > kTileShapes[shape].max_mean_bytes) ++shape;
  return shape;
}

// Blocks of a tile shape's lookup kernel resident on the current device at once. The lookup
// runs that many, each tile looping over queries, rather than one tile per query: on the H200
// the 100,000-query lookups of 4,096-byte labels took 0.327 -> 0.299 ms (5% unknown) and
// 0.296 -> 0.258 ms (50% unknown), of 64-byte labels 0.024 ms either way.
template <int kTile, int kCached>
int resident_lookup_blocks() {
  static const int per_sm = [] {  // one per kernel: its registers decide it
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, lookup_kernels::lookup_kernel<kTile, kCached>, kThreadsPerBlock, 0));
    return std::max(blocks, 1);
  }();
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  return per_sm * std::max(sms, 1);
}

// Calls launch(kernel-template tag) with the tile shape's compile-time lanes and cached words.
template <int kShape = 0, typename Launch>
void with_tile_shape(int shape, Launch&& launch) {
  constexpr int kShapes = sizeof(kTileShapes) / sizeof(kTileShapes[0]);
  if constexpr (kShape < kShapes) {
    if (shape == kShape) {
      launch(std::integral_constant<int, kTileShapes[kShape].tile>{},
             std::integral_constant<int, kTileShapes[kShape].cached>{});
    } else {
      with_tile_shape<kShape + 1>(shape, std::forward<Launch>(launch));
    }
  }
}

// Up to kMaxGatherColumns columns of dictionary_lookup's row half, passed by value.
constexpr int kMaxGatherColumns = 128;  // about 2 KiB of kernel parameters
struct GatherBatch {
  int64_t row_start[kMaxGatherColumns + 1];  // looked-up codes of column c: [row_start[c], +1)
  int64_t code_column[kMaxGatherColumns];     // column of `codes` that column c reads
  int64_t first_column;                       // output column of batch column 0
  int count;
};

// One thread per (row, column): the row's dictionary code replaced by its category's code.
__global__ void gather_codes_kernel(const int64_t* __restrict__ looked_up,
                                    const int64_t* __restrict__ codes, int64_t rows,
                                    int64_t row_stride, int64_t column_stride, GatherBatch batch,
                                    int64_t out_columns, int64_t* __restrict__ out) {
  const int64_t items = rows * batch.count;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / batch.count;
    const int c = static_cast<int>(i - r * batch.count);
    const int64_t k = codes[r * row_stride + batch.code_column[c] * column_stride];
    const int64_t start = batch.row_start[c];
    out[r * out_columns + batch.first_column + c] =
        (k >= 0 && k < batch.row_start[c + 1] - start) ? looked_up[start + k] : -1;
  }
}

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> string_index_build_cuda(
    const at::Tensor& vocabulary_data, const at::Tensor& vocabulary_offsets,
    const std::optional<at::Tensor>& vocabulary_valid, const at::Tensor& vocabulary_segments,
    int64_t hash_bits) {
  const at::Device device = vocabulary_data.device();
  check_strings("vocabulary", vocabulary_data, vocabulary_offsets, vocabulary_valid, device);
  const int64_t rows = vocabulary_offsets.numel() - 1;
  check_hash_bits(hash_bits);
  const bool check_values = !capturing();
  check_segments(vocabulary_segments, rows, device, check_values);
  if (check_values) {
    check_offset_values("vocabulary", vocabulary_offsets, vocabulary_data.numel());
  }
  const c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream();

  const at::Tensor data = vocabulary_data.contiguous();
  const at::Tensor offsets = vocabulary_offsets.contiguous();
  const auto valid = contiguous(vocabulary_valid);
  const at::Tensor segments = vocabulary_segments.contiguous();
  const int64_t columns = segments.numel() - 1;
  const DeviceStrings vocabulary = device_strings(data, offsets, valid);

  const int64_t capacity = core::table_capacity(rows);
  at::Tensor hashes = at::empty({rows}, offsets.options());
  at::Tensor slot_row = at::full({capacity}, -1, offsets.options());
  at::Tensor slot_hash = at::empty({capacity}, offsets.options());
  if (rows > 0) {
    with_tile_shape(tile_shape(data.numel(), rows), [&](auto tile, auto cached) {
      lookup_kernels::hash_rows_kernel<tile(), cached()>
          <<<blocks_for(rows, kThreadsPerBlock / tile()), kThreadsPerBlock, 0, stream>>>(
              vocabulary, segments.data_ptr<int64_t>(), columns, hash_bits,
              hashes.data_ptr<int64_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int insert_blocks = static_cast<int>((rows + kThreadsPerBlock - 1) / kThreadsPerBlock);
    lookup_kernels::insert_rows_kernel<<<insert_blocks, kThreadsPerBlock, 0, stream>>>(
        vocabulary, segments.data_ptr<int64_t>(), columns, hashes.data_ptr<int64_t>(),
        slot_row.data_ptr<int64_t>(), capacity);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int fill_blocks = static_cast<int>((capacity + kThreadsPerBlock - 1) / kThreadsPerBlock);
  lookup_kernels::fill_slot_hash_kernel<<<fill_blocks, kThreadsPerBlock, 0, stream>>>(
      slot_row.data_ptr<int64_t>(), hashes.data_ptr<int64_t>(), slot_hash.data_ptr<int64_t>(),
      capacity);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {slot_hash, slot_row};
}

at::Tensor lookup_columns_cuda(const at::Tensor& vocabulary_data,
                               const at::Tensor& vocabulary_offsets,
                               const at::Tensor& vocabulary_segments,
                               const at::Tensor& slot_hash, const at::Tensor& slot_row,
                               at::TensorList query_data, at::TensorList query_offsets,
                               const std::vector<std::optional<at::Tensor>>& query_valid,
                               int64_t first_column, int64_t hash_bits, bool check_offsets) {
  const at::Device device = vocabulary_data.device();
  check_strings("vocabulary", vocabulary_data, vocabulary_offsets, std::nullopt, device);
  const bool check_values = check_offsets && !capturing();
  check_segments(vocabulary_segments, vocabulary_offsets.numel() - 1, device, check_values);
  check_table(slot_hash, slot_row, device);
  check_hash_bits(hash_bits);
  const c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream();

  const at::Tensor data = vocabulary_data.contiguous();
  const at::Tensor offsets = vocabulary_offsets.contiguous();
  const at::Tensor segments = vocabulary_segments.contiguous();
  const at::Tensor hashes = slot_hash.contiguous();
  const at::Tensor rows = slot_row.contiguous();
  const DeviceStrings vocabulary = device_strings(data, offsets, std::nullopt);

  // Contiguous copies of the query tensors stay alive until every launch is queued.
  std::vector<at::Tensor> keep;
  int64_t total = 0;
  for (size_t i = 0; i < query_data.size(); ++i) {
    check_strings("query", query_data[i], query_offsets[i], query_valid[i], device);
    if (check_values) check_offset_values("query", query_offsets[i], query_data[i].numel());
    total += query_offsets[i].numel() - 1;
  }
  at::Tensor codes = at::empty({total}, offsets.options());
  int64_t written = 0;
  for (size_t start = 0; start < query_data.size(); start += kMaxColumnsPerLaunch) {
    QueryBatch batch{};
    int64_t batch_bytes = 0;
    batch.count = static_cast<int>(
        std::min<size_t>(kMaxColumnsPerLaunch, query_data.size() - start));
    batch.first_column = first_column + static_cast<int64_t>(start);
    batch.row_start[0] = 0;
    for (int c = 0; c < batch.count; ++c) {
      keep.push_back(query_data[start + c].contiguous());
      batch.data[c] = keep.back().data_ptr<uint8_t>();
      batch.data_size[c] = keep.back().numel();
      batch_bytes += batch.data_size[c];
      keep.push_back(query_offsets[start + c].contiguous());
      batch.offsets[c] = keep.back().data_ptr<int64_t>();
      batch.row_start[c + 1] = batch.row_start[c] + keep.back().numel() - 1;
      batch.valid[c] = nullptr;
      if (query_valid[start + c].has_value()) {
        keep.push_back(query_valid[start + c]->contiguous());
        batch.valid[c] = keep.back().data_ptr<bool>();
      }
    }
    const int64_t batch_rows = batch.row_start[batch.count];
    if (batch_rows > 0) {
      with_tile_shape(tile_shape(batch_bytes, batch_rows), [&](auto tile, auto cached) {
        const int blocks = std::min(blocks_for(batch_rows, kThreadsPerBlock / tile()),
                                    resident_lookup_blocks<tile(), cached()>());
        lookup_kernels::lookup_kernel<tile(), cached()><<<blocks, kThreadsPerBlock, 0, stream>>>(
            vocabulary, segments.data_ptr<int64_t>(), hashes.data_ptr<int64_t>(),
            rows.data_ptr<int64_t>(), rows.numel(), batch, hash_bits,
            codes.data_ptr<int64_t>() + written);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    written += batch_rows;
  }
  return codes;
}

at::Tensor gather_codes_cuda(const at::Tensor& looked_up, const std::vector<int64_t>& row_start,
                             const at::Tensor& codes, const std::vector<int64_t>& code_column) {
  const c10::cuda::CUDAGuard guard(looked_up.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = codes.size(0);
  const int64_t columns = static_cast<int64_t>(code_column.size());
  at::Tensor out = at::empty({rows, columns}, looked_up.options());
  for (int64_t start = 0; start < columns && rows > 0; start += kMaxGatherColumns) {
    GatherBatch batch{};
    batch.count = static_cast<int>(std::min<int64_t>(kMaxGatherColumns, columns - start));
    batch.first_column = start;
    for (int c = 0; c <= batch.count; ++c) batch.row_start[c] = row_start[start + c];
    for (int c = 0; c < batch.count; ++c) batch.code_column[c] = code_column[start + c];
    gather_codes_kernel<<<blocks_for(rows * batch.count, kThreadsPerBlock), kThreadsPerBlock, 0,
                          stream>>>(looked_up.data_ptr<int64_t>(), codes.data_ptr<int64_t>(), rows,
                                    codes.stride(0), codes.stride(1), batch, columns,
                                    out.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) {
  m.impl("string_index_build", &string_index_build_cuda);
  m.impl("string_lookup", &string_lookup_kernel<&lookup_columns_cuda>);
  m.impl("string_lookup_multi", &string_lookup_multi_kernel<&lookup_columns_cuda>);
  m.impl("dictionary_lookup", &dictionary_lookup_kernel<&lookup_columns_cuda, &gather_codes_cuda>);
}

}  // namespace ops
}  // namespace tabserve
