// Torch-free open-addressing table from string labels to vocabulary rows.
//
// The vocabulary is one Arrow-style string column (bytes + int64 offsets + optional validity)
// split into columns by `segments`: column c owns rows [segments[c], segments[c + 1]). Each slot
// of the table holds the full 64-bit hash of a label and the row of its *last* occurrence in its
// column (-1 marks an empty slot). Probing is linear with a power-of-two mask and the table is at
// most half full, so every probe sequence reaches an empty slot. A slot matches a query only when
// hash, column and bytes all agree: collisions can never produce a wrong row.
//
// The CPU kernels call these functions directly; the CUDA kernels reuse the hash and probing
// rules (string_hash.h) with warp-cooperative byte reads.
#pragma once

#include <cstdint>
#include <cstring>

#include "string_hash.h"

namespace tabserve {
namespace core {

// A string column in Arrow layout, plus the column boundaries of a packed vocabulary.
// Byte ranges are clamped into [0, data_size] so that even malformed offsets (which the operators
// reject before calling in) can never make a kernel read outside the data.
struct StringsView {
  const uint8_t* data = nullptr;
  int64_t data_size = 0;
  const int64_t* offsets = nullptr;  // [rows + 1], non-decreasing
  const bool* valid = nullptr;       // [rows] or nullptr (all valid)
  int64_t rows = 0;

  int64_t begin(int64_t row) const { return clamp(offsets[row], 0, data_size); }
  int64_t end(int64_t row) const { return clamp(offsets[row + 1], begin(row), data_size); }
  const uint8_t* label(int64_t row) const { return data + begin(row); }
  int64_t length(int64_t row) const { return end(row) - begin(row); }
  bool is_valid(int64_t row) const { return valid == nullptr || valid[row]; }

 private:
  static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }
};

struct TableView {
  int64_t* slot_hash = nullptr;  // [capacity], the label's hash as a two's complement int64
  int64_t* slot_row = nullptr;   // [capacity], vocabulary row or -1 for an empty slot
  int64_t capacity = 0;          // a power of two
};

// Byte equality; labels up to two words long (most category labels) skip the memcmp call.
inline bool same_bytes(const uint8_t* a, int64_t a_length, const uint8_t* b, int64_t b_length) {
  if (a_length != b_length) return false;
  if (a_length > 2 * kWordBytes) return std::memcmp(a, b, static_cast<size_t>(a_length)) == 0;
  for (int64_t k = 0; k < word_count(a_length); ++k) {
    if (load_word_host(a, a_length, k) != load_word_host(b, b_length, k)) return false;
  }
  return true;
}

// Hash of every vocabulary row in its column (rows of column c are [segments[c], segments[c+1])).
inline void hash_rows(const StringsView& vocabulary, const int64_t* segments, int64_t columns,
                      int64_t hash_bits, int64_t first_row, int64_t last_row, int64_t* hashes) {
  int64_t column = 0;
  for (int64_t row = first_row; row < last_row; ++row) {
    while (column + 1 < columns && row >= segments[column + 1]) ++column;
    hashes[row] = static_cast<int64_t>(
        hash_label_host(vocabulary.label(row), vocabulary.length(row), column, hash_bits));
  }
}

// Inserts every valid vocabulary row, given each row's hash from hash_rows; a label seen again in
// its column overwrites the row (the last one wins). `segments` has columns + 1 entries,
// non-decreasing, with segments[0] == 0 and segments[columns] == rows.
inline void build_table(const StringsView& vocabulary, const int64_t* segments, int64_t columns,
                        const int64_t* hashes, TableView table) {
  const uint64_t mask = static_cast<uint64_t>(table.capacity - 1);
  for (int64_t p = 0; p < table.capacity; ++p) {
    table.slot_hash[p] = 0;
    table.slot_row[p] = -1;
  }
  int64_t column = 0;
  for (int64_t row = 0; row < vocabulary.rows; ++row) {
    while (column + 1 < columns && row >= segments[column + 1]) ++column;
    if (!vocabulary.is_valid(row)) continue;
    const uint8_t* label = vocabulary.label(row);
    const int64_t length = vocabulary.length(row);
    const uint64_t h = static_cast<uint64_t>(hashes[row]);
    for (uint64_t p = h & mask;; p = (p + 1) & mask) {
      const int64_t held = table.slot_row[p];
      if (held < 0) {
        table.slot_hash[p] = static_cast<int64_t>(h);
        table.slot_row[p] = row;
        break;
      }
      // Rows of earlier columns precede this one, so `held >= segments[column]` means same column.
      if (static_cast<uint64_t>(table.slot_hash[p]) == h && held >= segments[column] &&
          same_bytes(vocabulary.label(held), vocabulary.length(held), label, length)) {
        table.slot_row[p] = row;
        break;
      }
    }
  }
}

// Code of one query label in vocabulary column `column`, given the label's hash `h`: its row
// relative to the column's first row, or -1 when the label is not there. Probing stops after
// `capacity` slots, and rows outside the column are never dereferenced, so even a corrupted table
// cannot hang or read out of bounds.
inline int64_t lookup_hashed(const StringsView& vocabulary, const int64_t* segments,
                             const int64_t* slot_hash, const int64_t* slot_row, int64_t capacity,
                             const uint8_t* label, int64_t length, int64_t column, uint64_t h) {
  const uint64_t mask = static_cast<uint64_t>(capacity - 1);
  const int64_t first = segments[column];
  const int64_t last = segments[column + 1];
  uint64_t p = h & mask;
  for (int64_t probe = 0; probe < capacity; ++probe, p = (p + 1) & mask) {
    const int64_t row = slot_row[p];
    if (row < 0) return -1;
    if (static_cast<uint64_t>(slot_hash[p]) == h && row >= first && row < last &&
        row < vocabulary.rows &&
        same_bytes(vocabulary.label(row), vocabulary.length(row), label, length)) {
      return row - first;
    }
  }
  return -1;
}

inline int64_t lookup_label(const StringsView& vocabulary, const int64_t* segments,
                            const int64_t* slot_hash, const int64_t* slot_row, int64_t capacity,
                            const uint8_t* label, int64_t length, int64_t column,
                            int64_t hash_bits) {
  return lookup_hashed(vocabulary, segments, slot_hash, slot_row, capacity, label, length, column,
                       hash_label_host(label, length, column, hash_bits));
}

// Codes of query rows [begin, end) of `query` in vocabulary column `column`, written to
// codes[begin..end); null rows give -1. Rows go in groups: all hashes of a group first, each
// with a prefetch of its first slot, so the slots' cache misses overlap instead of queueing.
inline void lookup_rows(const StringsView& vocabulary, const int64_t* segments,
                        const int64_t* slot_hash, const int64_t* slot_row, int64_t capacity,
                        const StringsView& query, int64_t column, int64_t hash_bits,
                        int64_t begin, int64_t end, int64_t* codes) {
  constexpr int64_t kGroup = 16;
  const uint64_t mask = static_cast<uint64_t>(capacity - 1);
  uint64_t hashes[kGroup];
  const uint8_t* labels[kGroup];
  int64_t lengths[kGroup];
  for (int64_t start = begin; start < end; start += kGroup) {
    const int64_t count = start + kGroup < end ? kGroup : end - start;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t first = query.begin(start + i);
      labels[i] = query.data + first;
      lengths[i] = query.end(start + i) - first;
      hashes[i] = hash_label_host(labels[i], lengths[i], column, hash_bits);
      __builtin_prefetch(slot_hash + (hashes[i] & mask));
      __builtin_prefetch(slot_row + (hashes[i] & mask));
    }
    for (int64_t i = 0; i < count; ++i) {
      codes[start + i] = query.is_valid(start + i)
                             ? lookup_hashed(vocabulary, segments, slot_hash, slot_row, capacity,
                                             labels[i], lengths[i], column, hashes[i])
                             : -1;
    }
  }
}

// Index of the first offset that breaks the Arrow rules (decreasing, negative, past `data_size`),
// or -1 when all are well formed.
inline int64_t first_bad_offset(const int64_t* offsets, int64_t count, int64_t data_size) {
  for (int64_t i = 0; i < count; ++i) {
    if (offsets[i] < 0 || offsets[i] > data_size || (i > 0 && offsets[i] < offsets[i - 1])) {
      return i;
    }
  }
  return -1;
}

}  // namespace core
}  // namespace tabserve
