// String-category lookup: schemas, argument checks and CPU kernels.
//
// A vocabulary is one Arrow-style string column (data, offsets, valid) holding the labels of one
// or more columns back to back; `vocabulary_segments` (int64 [columns + 1]) gives each column's
// rows. `string_index_build` turns it into an open-addressing table (slot_hash, slot_row) and the
// lookups map query labels of column c to the position of the label in column c's vocabulary:
// the last position when a label repeats, -1 for unknown labels, null queries and null
// vocabulary entries never match. Contracts: docs/reference/ops.md.
#include "string_lookup.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../core/string_table.h"

namespace tabserve {
namespace ops {

namespace {

core::StringsView strings_view(const at::Tensor& data, const at::Tensor& offsets,
                               const std::optional<at::Tensor>& valid) {
  core::StringsView view;
  view.data = data.data_ptr<uint8_t>();
  view.data_size = data.numel();
  view.offsets = offsets.data_ptr<int64_t>();
  view.valid = valid.has_value() ? valid->data_ptr<bool>() : nullptr;
  view.rows = offsets.numel() - 1;
  return view;
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// Query rows per parallel chunk: about 256 KiB of label bytes, so that 1,000 labels of 4,096
// bytes are shared between threads while 100,000 short labels still go in chunks of 4,096 rows.
int64_t lookup_grain(const core::StringsView& query) {
  const int64_t mean = query.rows > 0 ? query.data_size / query.rows : 0;
  return std::clamp<int64_t>((int64_t{256} << 10) / std::max<int64_t>(mean, 1), 16, 4096);
}

}  // namespace

void check_strings(const char* name, const at::Tensor& data, const at::Tensor& offsets,
                   const std::optional<at::Tensor>& valid, const at::Device& device) {
  TORCH_CHECK(data.scalar_type() == at::kByte, name, "_data must be a uint8 tensor, got ",
              data.scalar_type());
  TORCH_CHECK(data.dim() == 1, name, "_data must be 1-D, got ", data.dim(), " dimensions");
  TORCH_CHECK(offsets.scalar_type() == at::kLong, name, "_offsets must be an int64 tensor, got ",
              offsets.scalar_type());
  TORCH_CHECK(offsets.dim() == 1 && offsets.numel() >= 1, name,
              "_offsets must be 1-D with rows + 1 >= 1 entries, got shape ", offsets.sizes());
  TORCH_CHECK(data.device() == device, name, "_data is on ", data.device(), " but expected ",
              device);
  TORCH_CHECK(offsets.device() == device, name, "_offsets is on ", offsets.device(),
              " but expected ", device);
  if (valid.has_value()) {
    TORCH_CHECK(valid->scalar_type() == at::kBool, name, "_valid must be a bool tensor, got ",
                valid->scalar_type());
    TORCH_CHECK(valid->dim() == 1 && valid->numel() == offsets.numel() - 1, name,
                "_valid must have shape [", offsets.numel() - 1, "] (one entry per row), got ",
                valid->sizes());
    TORCH_CHECK(valid->device() == device, name, "_valid is on ", valid->device(),
                " but expected ", device);
  }
}

void check_offset_values(const char* name, const at::Tensor& offsets, int64_t data_size) {
  if (offsets.is_cpu()) {
    const at::Tensor o = offsets.contiguous();
    const int64_t bad = core::first_bad_offset(o.data_ptr<int64_t>(), o.numel(), data_size);
    TORCH_CHECK(bad < 0, name, "_offsets[", bad, "] = ", bad < 0 ? 0 : o.data_ptr<int64_t>()[bad],
                " is invalid: offsets must be non-decreasing and within [0, ", data_size,
                "] (the size of ", name, "_data)");
    return;
  }
  // Device tensors: one fused reduction and one host synchronisation (callers skip this while a
  // CUDA graph is being captured).
  const bool bad = ((offsets.min() < 0) | (offsets.max() > data_size) |
                    (offsets.narrow(0, 1, offsets.numel() - 1) <
                     offsets.narrow(0, 0, offsets.numel() - 1))
                        .any())
                       .item<bool>();
  TORCH_CHECK(!bad, name,
              "_offsets is invalid: offsets must be non-decreasing and within [0, ", data_size,
              "] (the size of ", name, "_data)");
}

void check_segments(const at::Tensor& segments, int64_t rows, const at::Device& device,
                    bool check_values) {
  TORCH_CHECK(segments.scalar_type() == at::kLong,
              "vocabulary_segments must be an int64 tensor, got ", segments.scalar_type());
  TORCH_CHECK(segments.dim() == 1 && segments.numel() >= 2,
              "vocabulary_segments must be 1-D with columns + 1 >= 2 entries, got shape ",
              segments.sizes());
  TORCH_CHECK(segments.device() == device, "vocabulary_segments is on ", segments.device(),
              " but expected ", device);
  if (!check_values) return;
  const at::Tensor s = segments.cpu().contiguous();
  const int64_t* p = s.data_ptr<int64_t>();
  const int64_t n = s.numel();
  TORCH_CHECK(p[0] == 0 && p[n - 1] == rows,
              "vocabulary_segments must start at 0 and end at the number of vocabulary rows (",
              rows, "), got ", p[0], " and ", p[n - 1]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(p[i] >= p[i - 1], "vocabulary_segments must be non-decreasing, but entry ", i,
                " (", p[i], ") < entry ", i - 1, " (", p[i - 1], ")");
  }
}

void check_table(const at::Tensor& slot_hash, const at::Tensor& slot_row,
                 const at::Device& device) {
  TORCH_CHECK(slot_hash.scalar_type() == at::kLong && slot_row.scalar_type() == at::kLong,
              "slot_hash and slot_row must be int64 tensors, got ", slot_hash.scalar_type(),
              " and ", slot_row.scalar_type());
  const int64_t capacity = slot_row.numel();
  TORCH_CHECK(slot_hash.dim() == 1 && slot_row.dim() == 1 && slot_hash.numel() == capacity,
              "slot_hash and slot_row must be 1-D of the same length, got shapes ",
              slot_hash.sizes(), " and ", slot_row.sizes());
  TORCH_CHECK(capacity > 0 && (capacity & (capacity - 1)) == 0,
              "slot_row must have a power-of-two length (a table from string_index_build), got ",
              capacity);
  TORCH_CHECK(slot_hash.device() == device && slot_row.device() == device,
              "slot_hash and slot_row must be on ", device, ", got ", slot_hash.device(), " and ",
              slot_row.device());
}

void check_hash_bits(int64_t hash_bits) {
  TORCH_CHECK(hash_bits >= 0 && hash_bits <= 64, "hash_bits must be in [0, 64], got ", hash_bits);
}

void check_column(const at::Tensor& segments, int64_t column) {
  const int64_t columns = segments.numel() - 1;
  TORCH_CHECK(column >= 0 && column < columns, "column must be in [0, ", columns,
              ") (the vocabulary's columns), got ", column);
}

void check_query_columns(const at::Tensor& segments, at::TensorList query_data,
                         at::TensorList query_offsets, size_t query_valid_count) {
  const int64_t columns = segments.numel() - 1;
  TORCH_CHECK(static_cast<int64_t>(query_data.size()) == columns &&
                  query_offsets.size() == query_data.size() &&
                  query_valid_count == query_data.size(),
              "query_data, query_offsets and query_valid must each hold one entry per vocabulary "
              "column (",
              columns, "), got ", query_data.size(), ", ", query_offsets.size(), " and ",
              query_valid_count);
}

void check_dictionary_codes(const at::Tensor& codes, const std::optional<at::IntArrayRef>& code_columns,
                            size_t columns, const at::Device& device) {
  TORCH_CHECK(codes.scalar_type() == at::kLong, "codes must be an int64 tensor, got ",
              codes.scalar_type());
  TORCH_CHECK(codes.dim() == 2, "codes must be 2-D [rows, code columns], got shape ",
              codes.sizes());
  TORCH_CHECK(codes.device() == device, "codes is on ", codes.device(), " but expected ", device);
  const int64_t available = codes.size(1);
  if (!code_columns.has_value()) {
    TORCH_CHECK(available == static_cast<int64_t>(columns), "codes must have one column per query ",
                "column (", columns, ") when code_columns is None, got shape ", codes.sizes());
    return;
  }
  TORCH_CHECK(code_columns->size() == columns, "code_columns must hold one entry per query column (",
              columns, "), got ", code_columns->size());
  for (size_t c = 0; c < columns; ++c) {
    const int64_t column = (*code_columns)[c];
    TORCH_CHECK(column >= 0 && column < available, "code_columns[", c, "] must be in [0, ",
                available, ") (the columns of codes), got ", column);
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor> string_index_build_cpu(
    const at::Tensor& vocabulary_data, const at::Tensor& vocabulary_offsets,
    const std::optional<at::Tensor>& vocabulary_valid, const at::Tensor& vocabulary_segments,
    int64_t hash_bits) {
  const at::Device device = vocabulary_data.device();
  check_strings("vocabulary", vocabulary_data, vocabulary_offsets, vocabulary_valid, device);
  check_offset_values("vocabulary", vocabulary_offsets, vocabulary_data.numel());
  const int64_t rows = vocabulary_offsets.numel() - 1;
  check_segments(vocabulary_segments, rows, device, /*check_values=*/true);
  check_hash_bits(hash_bits);

  const at::Tensor data = vocabulary_data.contiguous();
  const at::Tensor offsets = vocabulary_offsets.contiguous();
  const auto valid = contiguous(vocabulary_valid);
  const at::Tensor segments = vocabulary_segments.contiguous();
  const core::StringsView view = strings_view(data, offsets, valid);
  const int64_t columns = segments.numel() - 1;

  at::Tensor hashes = at::empty({rows}, offsets.options());
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    core::hash_rows(view, segments.data_ptr<int64_t>(), columns, hash_bits, begin, end,
                    hashes.data_ptr<int64_t>());
  });
  const int64_t capacity = core::table_capacity(rows);
  at::Tensor slot_hash = at::empty({capacity}, offsets.options());
  at::Tensor slot_row = at::empty({capacity}, offsets.options());
  core::build_table(view, segments.data_ptr<int64_t>(), columns, hashes.data_ptr<int64_t>(),
                    {slot_hash.data_ptr<int64_t>(), slot_row.data_ptr<int64_t>(), capacity});
  return {slot_hash, slot_row};
}

// Looks up query column i against vocabulary column first_column + i, for every query column.
at::Tensor lookup_columns_cpu(const at::Tensor& vocabulary_data,
                              const at::Tensor& vocabulary_offsets,
                              const at::Tensor& vocabulary_segments, const at::Tensor& slot_hash,
                              const at::Tensor& slot_row, at::TensorList query_data,
                              at::TensorList query_offsets,
                              const std::vector<std::optional<at::Tensor>>& query_valid,
                              int64_t first_column, int64_t hash_bits, bool check_offsets) {
  const at::Device device = vocabulary_data.device();
  check_strings("vocabulary", vocabulary_data, vocabulary_offsets, std::nullopt, device);
  check_segments(vocabulary_segments, vocabulary_offsets.numel() - 1, device, check_offsets);
  check_table(slot_hash, slot_row, device);
  check_hash_bits(hash_bits);

  const at::Tensor data = vocabulary_data.contiguous();
  const at::Tensor offsets = vocabulary_offsets.contiguous();
  const at::Tensor segments = vocabulary_segments.contiguous();
  const at::Tensor hashes = slot_hash.contiguous();
  const at::Tensor rows = slot_row.contiguous();
  const core::StringsView vocabulary = strings_view(data, offsets, std::nullopt);

  int64_t total = 0;
  for (const auto& o : query_offsets) total += o.numel() - 1;
  at::Tensor codes = at::empty({total}, offsets.options());
  int64_t written = 0;
  for (size_t i = 0; i < query_data.size(); ++i) {
    check_strings("query", query_data[i], query_offsets[i], query_valid[i], device);
    if (check_offsets) check_offset_values("query", query_offsets[i], query_data[i].numel());
    const at::Tensor q_data = query_data[i].contiguous();
    const at::Tensor q_offsets = query_offsets[i].contiguous();
    const auto q_valid = contiguous(query_valid[i]);
    const core::StringsView query = strings_view(q_data, q_offsets, q_valid);
    const int64_t column = first_column + static_cast<int64_t>(i);
    int64_t* out = codes.data_ptr<int64_t>() + written;
    at::parallel_for(0, query.rows, lookup_grain(query), [&](int64_t begin, int64_t end) {
      core::lookup_rows(vocabulary, segments.data_ptr<int64_t>(), hashes.data_ptr<int64_t>(),
                        rows.data_ptr<int64_t>(), rows.numel(), query, column, hash_bits, begin,
                        end, out);
    });
    written += query.rows;
  }
  return codes;
}

at::Tensor gather_codes_cpu(const at::Tensor& looked_up, const std::vector<int64_t>& row_start,
                            const at::Tensor& codes, const std::vector<int64_t>& code_column) {
  const int64_t rows = codes.size(0);
  const int64_t columns = static_cast<int64_t>(code_column.size());
  at::Tensor out = at::empty({rows, columns}, looked_up.options());
  const int64_t* found = looked_up.data_ptr<int64_t>();
  const int64_t* in = codes.data_ptr<int64_t>();
  const int64_t row_stride = codes.stride(0);
  const int64_t column_stride = codes.stride(1);
  int64_t* written = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < columns; ++c) {
        const int64_t k = in[r * row_stride + code_column[c] * column_stride];
        const int64_t size = row_start[c + 1] - row_start[c];
        written[r * columns + c] = (k >= 0 && k < size) ? found[row_start[c] + k] : -1;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tabserve, m) {
  // Builds the open-addressing table of a (packed, multi-column) string vocabulary.
  //   vocabulary_data uint8 [bytes]; vocabulary_offsets int64 [rows + 1];
  //   vocabulary_valid bool [rows] or None (null rows never match);
  //   vocabulary_segments int64 [columns + 1] (rows of column c: [segments[c], segments[c + 1]));
  //   hash_bits: low hash bits kept (64; fewer only to force collisions in tests).
  // Returns slot_hash, slot_row: int64 [capacity], capacity = max(16, next_pow2(2 * rows)).
  m.def(
      "string_index_build(Tensor vocabulary_data, Tensor vocabulary_offsets, "
      "Tensor? vocabulary_valid, Tensor vocabulary_segments, int hash_bits=64) "
      "-> (Tensor slot_hash, Tensor slot_row)",
      {at::Tag::pt2_compliant_tag});
  // Codes int64 [query rows] of one query column in vocabulary column `column`.
  m.def(
      "string_lookup(Tensor vocabulary_data, Tensor vocabulary_offsets, "
      "Tensor vocabulary_segments, Tensor slot_hash, Tensor slot_row, Tensor query_data, "
      "Tensor query_offsets, Tensor? query_valid, int column=0, int hash_bits=64, "
      "bool check_offsets=True) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Codes int64 [sum of query rows] of query column c in vocabulary column c, for every column,
  // concatenated in column order, in one call.
  m.def(
      "string_lookup_multi(Tensor vocabulary_data, Tensor vocabulary_offsets, "
      "Tensor vocabulary_segments, Tensor slot_hash, Tensor slot_row, Tensor[] query_data, "
      "Tensor[] query_offsets, Tensor?[] query_valid, int hash_bits=64, "
      "bool check_offsets=True) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Dictionary-encoded columns in one call: query column c holds the categories of a column
  // whose rows carry dictionary codes codes[:, code_columns[c]] (int64 [rows, code columns], any
  // strides; code_columns None: column c). Returns int64 [rows, query columns]: the vocabulary
  // code of each row's category in vocabulary column c; -1 for unknown categories and for codes
  // outside [0, query rows of column c) (nulls).
  m.def(
      "dictionary_lookup(Tensor vocabulary_data, Tensor vocabulary_offsets, "
      "Tensor vocabulary_segments, Tensor slot_hash, Tensor slot_row, Tensor[] query_data, "
      "Tensor[] query_offsets, Tensor?[] query_valid, Tensor codes, int[]? code_columns=None, "
      "int hash_bits=64, bool check_offsets=True) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(tabserve, CPU, m) {
  m.impl("string_index_build", &string_index_build_cpu);
  m.impl("string_lookup", &string_lookup_kernel<&lookup_columns_cpu>);
  m.impl("string_lookup_multi", &string_lookup_multi_kernel<&lookup_columns_cpu>);
  m.impl("dictionary_lookup", &dictionary_lookup_kernel<&lookup_columns_cpu, &gather_codes_cpu>);
}

}  // namespace ops
}  // namespace tabserve
