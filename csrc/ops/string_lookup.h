// Shared argument checks of the string-lookup operators (CPU and CUDA kernels).
// The operator contracts are documented in docs/reference/ops.md and next to the schemas in
// string_lookup.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

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

// Checks dictionary_lookup's codes (int64 [rows, code columns], any strides) and code_columns (one
// column of `codes` per query column, each inside it; none: query column c reads column c).
void check_dictionary_codes(const at::Tensor& codes, const std::optional<at::IntArrayRef>& code_columns,
                            size_t columns, const at::Device& device);

// The device half of both lookup operators: the codes of every query column (query column i
// against vocabulary column first_column + i), concatenated. One per backend.
using LookupColumns = at::Tensor (*)(const at::Tensor& vocabulary_data,
                                     const at::Tensor& vocabulary_offsets,
                                     const at::Tensor& vocabulary_segments,
                                     const at::Tensor& slot_hash, const at::Tensor& slot_row,
                                     at::TensorList query_data, at::TensorList query_offsets,
                                     const std::vector<std::optional<at::Tensor>>& query_valid,
                                     int64_t first_column, int64_t hash_bits, bool check_offsets);

// The row half of dictionary_lookup, one per backend: out int64 [rows, columns] with
// out[r, c] = looked_up[row_start[c] + k] for k = codes[r, code_column[c]] when
// 0 <= k < row_start[c + 1] - row_start[c], else -1.
using GatherCodes = at::Tensor (*)(const at::Tensor& looked_up, const std::vector<int64_t>& row_start,
                                   const at::Tensor& codes, const std::vector<int64_t>& code_column);

// string_lookup on a backend: one query column against vocabulary column `column`.
template <LookupColumns lookup_columns>
at::Tensor string_lookup_kernel(const at::Tensor& vocabulary_data,
                                const at::Tensor& vocabulary_offsets,
                                const at::Tensor& vocabulary_segments, const at::Tensor& slot_hash,
                                const at::Tensor& slot_row, const at::Tensor& query_data,
                                const at::Tensor& query_offsets,
                                const std::optional<at::Tensor>& query_valid, int64_t column,
                                int64_t hash_bits, bool check_offsets) {
  check_column(vocabulary_segments, column);
  return lookup_columns(vocabulary_data, vocabulary_offsets, vocabulary_segments, slot_hash,
                        slot_row, {query_data}, {query_offsets}, {query_valid}, column, hash_bits,
                        check_offsets);
}

// string_lookup_multi on a backend: query column c against vocabulary column c, for every c.
template <LookupColumns lookup_columns>
at::Tensor string_lookup_multi_kernel(const at::Tensor& vocabulary_data,
                                      const at::Tensor& vocabulary_offsets,
                                      const at::Tensor& vocabulary_segments,
                                      const at::Tensor& slot_hash, const at::Tensor& slot_row,
                                      at::TensorList query_data, at::TensorList query_offsets,
                                      const c10::List<std::optional<at::Tensor>>& query_valid,
                                      int64_t hash_bits, bool check_offsets) {
  check_query_columns(vocabulary_segments, query_data, query_offsets, query_valid.size());
  const std::vector<std::optional<at::Tensor>> valid(query_valid.begin(), query_valid.end());
  return lookup_columns(vocabulary_data, vocabulary_offsets, vocabulary_segments, slot_hash,
                        slot_row, query_data, query_offsets, valid, 0, hash_bits, check_offsets);
}

// dictionary_lookup on a backend: every query column's categories looked up in their vocabulary
// column, then each row's dictionary code replaced by its category's vocabulary code.
template <LookupColumns lookup_columns, GatherCodes gather_codes>
at::Tensor dictionary_lookup_kernel(const at::Tensor& vocabulary_data,
                                    const at::Tensor& vocabulary_offsets,
                                    const at::Tensor& vocabulary_segments,
                                    const at::Tensor& slot_hash, const at::Tensor& slot_row,
                                    at::TensorList query_data, at::TensorList query_offsets,
                                    const c10::List<std::optional<at::Tensor>>& query_valid,
                                    const at::Tensor& codes,
                                    at::OptionalIntArrayRef code_columns, int64_t hash_bits,
                                    bool check_offsets) {
  check_query_columns(vocabulary_segments, query_data, query_offsets, query_valid.size());
  const std::optional<at::IntArrayRef> chosen =
      code_columns.has_value() ? std::optional<at::IntArrayRef>(*code_columns) : std::nullopt;
  check_dictionary_codes(codes, chosen, query_data.size(), vocabulary_data.device());
  const std::vector<std::optional<at::Tensor>> valid(query_valid.begin(), query_valid.end());
  const at::Tensor looked_up =
      lookup_columns(vocabulary_data, vocabulary_offsets, vocabulary_segments, slot_hash,
                     slot_row, query_data, query_offsets, valid, 0, hash_bits, check_offsets);
  std::vector<int64_t> row_start(query_offsets.size() + 1, 0);
  std::vector<int64_t> code_column(query_offsets.size());
  for (size_t c = 0; c < query_offsets.size(); ++c) {
    row_start[c + 1] = row_start[c] + query_offsets[c].numel() - 1;
    code_column[c] = chosen.has_value() ? (*chosen)[c] : static_cast<int64_t>(c);
  }
  return gather_codes(looked_up, row_start, codes, code_column);
}

}  // namespace ops
}  // namespace tabserve
