// Shared argument checks of the string-lookup operators (CPU and CUDA kernels).
// The operator contracts are documented in docs/ops.md and next to the schemas in
// string_lookup.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace tabserve {
namespace ops {

// Checks a string column given as (data uint8 [bytes], offsets int64 [rows + 1], valid bool [rows]
// or none): dtypes, ranks and devices, naming the argument in every message. Offset values are
// checked by check_offset_values.
void check_strings(const char* name, const at::Tensor& data, const at::Tensor& offsets,
                   const std::optional<at::Tensor>& valid, const at::Device& device);

// Checks that offsets are non-decreasing and inside [0, data_size]. On CUDA this costs one
// reduction and one host synchronisation, so it is skipped while a CUDA graph is being captured.
void check_offset_values(const char* name, const at::Tensor& offsets, int64_t data_size);

// Checks a vocabulary's column boundaries: int64 [columns + 1], from 0 to rows, non-decreasing.
void check_segments(const at::Tensor& segments, int64_t rows, const at::Device& device,
                    bool check_values);

// Checks the two slot tensors of a built table.
void check_table(const at::Tensor& slot_hash, const at::Tensor& slot_row, const at::Device& device);

void check_hash_bits(int64_t hash_bits);

// Checks that `column` names one of the vocabulary's columns.
void check_column(const at::Tensor& segments, int64_t column);

// Checks that the multi-column lookup got one query column per vocabulary column.
void check_query_columns(const at::Tensor& segments, at::TensorList query_data,
                         at::TensorList query_offsets, size_t query_valid_count);

}  // namespace ops
}  // namespace tabserve
