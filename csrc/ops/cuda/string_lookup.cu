// CUDA kernels of the string-lookup operators (schemas and contracts: ../string_lookup.cpp).
//
// One warp owns one label: its lanes hash disjoint 8-byte words and add the position-keyed terms
// with a warp reduction (the same value as the host's sequential sum, string_hash.h), then probe
// the table in lockstep and compare candidate bytes word by word. Nothing here synchronises with
// the host except the optional offset checks, which are skipped while a CUDA graph is captured,
// and all memory comes from the caching allocator on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "../../core/string_hash.h"
#include "../string_lookup.h"

namespace tabserve {
namespace ops {
namespace {

using core::finish_hash;
using core::word_count;
using core::word_term;

constexpr int kWarp = 32;
constexpr int kThreadsPerBlock = 256;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxColumnsPerLaunch = 32;  // keeps QueryBatch well inside the kernel-parameter limit

// One label's bytes and the bounds of the buffer that holds them (the loads stay inside it).
struct Label {
  const uint8_t* bytes;
  int64_t length;
  const uint8_t* buffer_begin;
  const uint8_t* buffer_end;
};

struct DeviceStrings {
  const uint8_t* data;
  int64_t data_size;
  const int64_t* offsets;
  const bool* valid;  // nullptr: all valid
  int64_t rows;

  // Ranges are clamped into the data (see core::StringsView): malformed input cannot fault.
  __device__ int64_t begin(int64_t row) const {
    return min(max(offsets[row], int64_t{0}), data_size);
  }
  __device__ int64_t end(int64_t row) const {
    return min(max(offsets[row + 1], begin(row)), data_size);
  }
  __device__ bool is_valid(int64_t row) const { return valid == nullptr || valid[row]; }
  __device__ Label label(int64_t row) const {
    const int64_t b = begin(row);
    return {data + b, end(row) - b, data, data + data_size};
  }
};

DeviceStrings device_strings(const at::Tensor& data, const at::Tensor& offsets,
                             const std::optional<at::Tensor>& valid) {
  return {data.data_ptr<uint8_t>(), data.numel(), offsets.data_ptr<int64_t>(),
          valid.has_value() ? valid->data_ptr<bool>() : nullptr, offsets.numel() - 1};
}

// Word k of a label (bytes [8k, 8k + 8), zero-padded). Inside the label's buffer it comes from at
// most two aligned 8-byte loads; where those would reach past either end of the buffer (the first
// or last label of a tensor that does not start or end on an 8-byte boundary) it is read byte by
// byte, so no load touches memory outside the tensor (compute-sanitizer memcheck and initcheck).
__device__ __forceinline__ uint64_t load_word(const Label& label, int64_t k) {
  const uint8_t* start = label.bytes + k * core::kWordBytes;
  const int64_t count = min(label.length - k * core::kWordBytes, int64_t{core::kWordBytes});
  const unsigned misalignment = static_cast<unsigned>(reinterpret_cast<uintptr_t>(start) & 7u);
  const uint8_t* first = start - misalignment;
  const bool two_words = misalignment + count > 8;
  if (first < label.buffer_begin || first + (two_words ? 16 : 8) > label.buffer_end) {
    uint64_t word = 0;
    for (int64_t i = 0; i < count; ++i) word |= uint64_t{__ldg(start + i)} << (8 * i);
    return word;
  }
  const uint64_t* aligned = reinterpret_cast<const uint64_t*>(first);
  uint64_t word = __ldg(aligned) >> (8u * misalignment);
  if (two_words) word |= __ldg(aligned + 1) << (64u - 8u * misalignment);
  if (count < 8) word &= (uint64_t{1} << (8 * count)) - 1;
  return word;
}

__device__ uint64_t warp_hash(const Label& label, int64_t column, int64_t hash_bits, int lane) {
  uint64_t sum = 0;
  const int64_t words = word_count(label.length);
  for (int64_t k = lane; k < words; k += kWarp) sum += word_term(load_word(label, k), k);
  for (int step = kWarp / 2; step > 0; step /= 2) sum += __shfl_xor_sync(kFullMask, sum, step);
  return finish_hash(sum, label.length, column, hash_bits);
}

// a and b have the same length (the callers compare lengths first).
__device__ bool warp_same_bytes(const Label& a, const Label& b, int lane) {
  bool same = true;
  const int64_t words = word_count(a.length);
  for (int64_t k = lane; k < words && same; k += kWarp) same = load_word(a, k) == load_word(b, k);
  return __all_sync(kFullMask, same);
}

__device__ bool thread_same_bytes(const Label& a, const Label& b) {
  const int64_t words = word_count(a.length);
  for (int64_t k = 0; k < words; ++k) {
    if (load_word(a, k) != load_word(b, k)) return false;
  }
  return true;
}

// Column c of a packed vocabulary row: segments[c] <= row < segments[c + 1].
__device__ int64_t column_of(const int64_t* segments, int64_t columns, int64_t row) {
  int64_t lo = 0, hi = columns;  // invariant: segments[lo] <= row < segments[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (segments[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

__global__ void hash_rows_kernel(DeviceStrings vocabulary, const int64_t* segments,
                                 int64_t columns, int64_t hash_bits, int64_t* hashes) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
       row < vocabulary.rows; row += warps) {
    const uint64_t h =
        warp_hash(vocabulary.label(row), column_of(segments, columns, row), hash_bits, lane);
    if (lane == 0) hashes[row] = static_cast<int64_t>(h);
  }
}

// One thread per row. Slots go from empty to taken and never back, so equal labels follow the
// same probe sequence to the same slot; atomicMax then keeps the last of them.
__global__ void insert_rows_kernel(DeviceStrings vocabulary, const int64_t* segments,
                                   int64_t columns, const int64_t* hashes, int64_t* slot_row,
                                   int64_t capacity) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= vocabulary.rows || !vocabulary.is_valid(row)) return;
  const int64_t column = column_of(segments, columns, row);
  const int64_t first = segments[column];
  const int64_t last = segments[column + 1];
  const uint64_t h = static_cast<uint64_t>(hashes[row]);
  const Label label = vocabulary.label(row);
  const uint64_t mask = static_cast<uint64_t>(capacity - 1);
  for (uint64_t p = h & mask;; p = (p + 1) & mask) {
    auto* slot = reinterpret_cast<unsigned long long*>(slot_row + p);
    const auto held = static_cast<int64_t>(
        atomicCAS(slot, static_cast<unsigned long long>(-1LL), static_cast<unsigned long long>(row)));
    if (held < 0) return;
    if (static_cast<uint64_t>(hashes[held]) == h && held >= first && held < last) {
      const Label held_label = vocabulary.label(held);
      if (held_label.length == label.length && thread_same_bytes(held_label, label)) {
        atomicMax(reinterpret_cast<long long*>(slot_row + p), static_cast<long long>(row));
        return;
      }
    }
  }
}

__global__ void fill_slot_hash_kernel(const int64_t* slot_row, const int64_t* hashes,
                                      int64_t* slot_hash, int64_t capacity) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < capacity) slot_hash[p] = slot_row[p] >= 0 ? hashes[slot_row[p]] : 0;
}

// Up to kMaxColumnsPerLaunch query columns, passed by value so that a captured graph holds them.
struct QueryBatch {
  const uint8_t* data[kMaxColumnsPerLaunch];
  int64_t data_size[kMaxColumnsPerLaunch];
  const int64_t* offsets[kMaxColumnsPerLaunch];
  const bool* valid[kMaxColumnsPerLaunch];
  int64_t row_start[kMaxColumnsPerLaunch + 1];  // query rows of column c: [row_start[c], +1)
  int64_t first_column;                          // vocabulary column of query column 0
  int count;
};

__global__ void lookup_kernel(DeviceStrings vocabulary, const int64_t* segments,
                              const int64_t* slot_hash, const int64_t* slot_row,
                              int64_t capacity, QueryBatch batch, int64_t hash_bits,
                              int64_t* codes) {
  const int lane = threadIdx.x % kWarp;
  const int64_t total = batch.row_start[batch.count];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const uint64_t mask = static_cast<uint64_t>(capacity - 1);
  for (int64_t g = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
       g < total; g += warps) {
    int c = 0;
    while (g >= batch.row_start[c + 1]) ++c;
    const int64_t r = g - batch.row_start[c];
    int64_t code = -1;
    if (batch.valid[c] == nullptr || batch.valid[c][r]) {
      const DeviceStrings query{batch.data[c], batch.data_size[c], batch.offsets[c], nullptr,
                                0};
      const Label label = query.label(r);
      const int64_t column = batch.first_column + c;
      const uint64_t h = warp_hash(label, column, hash_bits, lane);
      const int64_t first = segments[column];
      const int64_t last = segments[column + 1];
      uint64_t p = h & mask;
      for (int64_t probe = 0; probe < capacity; ++probe, p = (p + 1) & mask) {
        const int64_t row = slot_row[p];
        if (row < 0) break;
        if (static_cast<uint64_t>(slot_hash[p]) != h || row < first || row >= last ||
            row >= vocabulary.rows) {
          continue;
        }
        const Label candidate = vocabulary.label(row);
        if (candidate.length == label.length && warp_same_bytes(candidate, label, lane)) {
          code = row - first;
          break;
        }
      }
    }
    if (lane == 0) codes[g] = code;
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

int blocks_for(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 1 << 16));
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
    hash_rows_kernel<<<blocks_for(rows, kWarpsPerBlock), kThreadsPerBlock, 0, stream>>>(
        vocabulary, segments.data_ptr<int64_t>(), columns, hash_bits,
        hashes.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int insert_blocks = static_cast<int>((rows + kThreadsPerBlock - 1) / kThreadsPerBlock);
    insert_rows_kernel<<<insert_blocks, kThreadsPerBlock, 0, stream>>>(
        vocabulary, segments.data_ptr<int64_t>(), columns, hashes.data_ptr<int64_t>(),
        slot_row.data_ptr<int64_t>(), capacity);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int fill_blocks = static_cast<int>((capacity + kThreadsPerBlock - 1) / kThreadsPerBlock);
  fill_slot_hash_kernel<<<fill_blocks, kThreadsPerBlock, 0, stream>>>(
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
    batch.count = static_cast<int>(
        std::min<size_t>(kMaxColumnsPerLaunch, query_data.size() - start));
    batch.first_column = first_column + static_cast<int64_t>(start);
    batch.row_start[0] = 0;
    for (int c = 0; c < batch.count; ++c) {
      keep.push_back(query_data[start + c].contiguous());
      batch.data[c] = keep.back().data_ptr<uint8_t>();
      batch.data_size[c] = keep.back().numel();
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
      lookup_kernel<<<blocks_for(batch_rows, kWarpsPerBlock), kThreadsPerBlock, 0, stream>>>(
          vocabulary, segments.data_ptr<int64_t>(), hashes.data_ptr<int64_t>(),
          rows.data_ptr<int64_t>(), rows.numel(), batch, hash_bits,
          codes.data_ptr<int64_t>() + written);
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
