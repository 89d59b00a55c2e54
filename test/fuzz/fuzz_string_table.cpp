// libFuzzer target: the torch-free string core (csrc/core/string_table.h) over arbitrary input.
//
// One input describes a packed vocabulary (bytes, offsets, validity, column segments), a hash
// width, a set of queries and an optional corruption of the built table. The target checks:
//   * first_bad_offset against a plain reference of the Arrow offset rules;
//   * on any offsets (well formed or not), build + lookup never read outside the buffers (every
//     buffer is an exact-size heap allocation, so AddressSanitizer sees one byte too far);
//   * lookups agree with a std::map of the clamped labels (the last valid row of a label in its
//     column wins), through lookup_label and the grouped lookup_rows alike;
//   * after arbitrary corruption of the table, a lookup still returns -1 or a row of the right
//     column holding the query's bytes (a wrong code is never possible), and terminates.
//
// Build and run: scripts/fuzz.sh [SECONDS]. The same file, linked with replay_main.cpp instead of
// libFuzzer, replays test/fuzz/corpus and test/fuzz/regressions under ctest (fuzz_corpus_replay).
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/string_table.h"

using namespace tabserve::core;

namespace {

// Reads the fuzz input front to back; past its end every read gives zeros, so any input parses.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  // A value in [0, bound) from one or two bytes (bound <= 65536).
  int64_t below(int64_t bound) {
    const int64_t raw = bound <= 256 ? byte() : (byte() | (int64_t{byte()} << 8));
    return bound <= 0 ? 0 : raw % bound;
  }
  int64_t any_int64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | byte();
    return static_cast<int64_t>(v);
  }
  std::string bytes(int64_t n) {
    std::string s;
    for (int64_t i = 0; i < n; ++i) s.push_back(static_cast<char>(byte()));
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// An exact-size heap copy: ASan flags a read of even one byte past `size`. Empty buffers are null,
// as the data pointer of an empty tensor may be.
template <typename T>
std::unique_ptr<T[]> exact_copy(const T* src, size_t size) {
  if (size == 0) return nullptr;
  std::unique_ptr<T[]> out(new T[size]);
  std::memcpy(out.get(), src, size * sizeof(T));
  return out;
}

// A string column owned in exact-size buffers.
struct Column {
  std::unique_ptr<uint8_t[]> data;
  std::unique_ptr<int64_t[]> offsets;
  std::unique_ptr<bool[]> valid;
  int64_t data_size = 0;
  int64_t rows = 0;

  StringsView view() const {
    StringsView v;
    v.data = data.get();
    v.data_size = data_size;
    v.offsets = offsets.get();
    v.valid = valid.get();
    v.rows = rows;
    return v;
  }
  // The label of a row under the documented clamping of offsets into [0, data_size].
  std::string label(int64_t row) const {
    const auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); };
    const int64_t b = clamp(offsets[row], 0, data_size);
    const int64_t e = clamp(offsets[row + 1], b, data_size);
    return std::string(reinterpret_cast<const char*>(data.get()) + b, static_cast<size_t>(e - b));
  }
  bool is_valid(int64_t row) const { return !valid || valid[row]; }
};

// Labels come from a short alphabet or from the input, and often repeat an earlier one, so
// duplicates, shared prefixes and word-boundary lengths (7, 8, 9, 16, 17 bytes) all occur.
std::string next_label(Input& in, const std::vector<std::string>& earlier) {
  const int64_t kind = in.below(4);
  if (kind == 0 && !earlier.empty()) return earlier[static_cast<size_t>(in.below(static_cast<int64_t>(earlier.size())))];
  if (kind == 1) return std::string(static_cast<size_t>(in.below(20)), static_cast<char>("a\0"[in.below(2)]));
  return in.bytes(in.below(kind == 2 ? 10 : 40));
}

// Builds a column of `rows` labels. Offsets are well formed, or (mode != 0) partly or wholly
// arbitrary: negative, decreasing, past the data.
Column make_column(Input& in, int64_t rows, bool with_valid, int64_t mode, std::vector<std::string>& pool) {
  std::string bytes;
  std::vector<int64_t> offsets{0};
  for (int64_t r = 0; r < rows; ++r) {
    const std::string s = next_label(in, pool);
    pool.push_back(s);
    bytes += s;
    offsets.push_back(static_cast<int64_t>(bytes.size()));
  }
  const int64_t size = static_cast<int64_t>(bytes.size());
  if (mode == 1) {  // a few entries moved to nearby (often invalid) values
    for (int64_t k = in.below(4); k > 0; --k) {
      offsets[static_cast<size_t>(in.below(rows + 1))] = in.below(size + 17) - 8;
    }
  } else if (mode == 2) {  // every entry arbitrary, extremes included
    for (auto& o : offsets) o = in.any_int64();
  }
  Column c;
  c.data_size = size;
  c.rows = rows;
  c.data = exact_copy(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  c.offsets = exact_copy(offsets.data(), offsets.size());
  if (with_valid) {
    c.valid.reset(rows ? new bool[static_cast<size_t>(rows)] : nullptr);
    for (int64_t r = 0; r < rows; ++r) c.valid[r] = in.below(5) != 0;  // about 1 in 5 null
  }
  return c;
}

int64_t reference_first_bad_offset(const int64_t* offsets, int64_t count, int64_t data_size) {
  for (int64_t i = 0; i < count; ++i) {
    const bool negative = offsets[i] < 0;
    const bool past = offsets[i] > data_size;
    const bool decreasing = i > 0 && offsets[i] < offsets[i - 1];
    if (negative || past || decreasing) return i;
  }
  return -1;
}

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_string_table: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t size) {
  Input in(input, size);
  const int64_t hash_bits = in.below(2) ? 64 : in.below(65);  // few bits force collisions
  const int64_t columns = 1 + in.below(4);
  const int64_t rows = in.below(80);
  const int64_t mode = in.below(3);
  std::vector<std::string> pool;
  const Column vocabulary = make_column(in, rows, in.below(2) != 0, mode, pool);
  const StringsView v = vocabulary.view();

  check(first_bad_offset(vocabulary.offsets.get(), rows + 1, v.data_size) ==
            reference_first_bad_offset(vocabulary.offsets.get(), rows + 1, v.data_size),
        "first_bad_offset disagrees with the reference");

  // Segments as the operators accept them: non-decreasing, from 0 to rows (empty columns allowed).
  std::vector<int64_t> cuts{0};
  for (int64_t c = 1; c < columns; ++c) cuts.push_back(in.below(rows + 1));
  cuts.push_back(rows);
  std::sort(cuts.begin() + 1, cuts.end() - 1);
  const auto segments = exact_copy(cuts.data(), cuts.size());

  std::vector<int64_t> hash_storage(static_cast<size_t>(rows));
  const auto hashes = exact_copy(hash_storage.data(), hash_storage.size());
  hash_rows(v, segments.get(), columns, hash_bits, 0, rows, hashes.get());
  const int64_t capacity = table_capacity(rows);
  std::unique_ptr<int64_t[]> slot_hash(new int64_t[static_cast<size_t>(capacity)]);
  std::unique_ptr<int64_t[]> slot_row(new int64_t[static_cast<size_t>(capacity)]);
  build_table(v, segments.get(), columns, hashes.get(), {slot_hash.get(), slot_row.get(), capacity});

  std::vector<std::map<std::string, int64_t>> reference(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    for (int64_t r = cuts[static_cast<size_t>(c)]; r < cuts[static_cast<size_t>(c) + 1]; ++r) {
      if (vocabulary.is_valid(r)) reference[static_cast<size_t>(c)][vocabulary.label(r)] = r - cuts[static_cast<size_t>(c)];
    }
  }

  // Queries: one column each, labels mostly from the vocabulary's pool; their offsets follow the
  // same modes, so malformed query offsets are exercised too.
  const bool corrupt = in.below(8) == 0;
  if (corrupt) {
    for (int64_t k = 1 + in.below(8); k > 0; --k) {
      const int64_t p = in.below(capacity);
      slot_row[p] = in.below(2) ? in.any_int64() : in.below(rows + 3) - 1;
      if (in.below(2)) slot_hash[p] = in.any_int64();
    }
  }
  for (int64_t c = 0; c < columns; ++c) {
    const int64_t query_rows = in.below(24);
    const Column query = make_column(in, query_rows, in.below(2) != 0, in.below(3), pool);
    const StringsView q = query.view();
    std::vector<int64_t> code_storage(static_cast<size_t>(query_rows), -7);
    const auto codes = exact_copy(code_storage.data(), code_storage.size());
    lookup_rows(v, segments.get(), slot_hash.get(), slot_row.get(), capacity, q, c, hash_bits, 0,
                query_rows, codes.get());
    const int64_t first = cuts[static_cast<size_t>(c)];
    const int64_t last = cuts[static_cast<size_t>(c) + 1];
    for (int64_t r = 0; r < query_rows; ++r) {
      const std::string label = query.label(r);
      const int64_t single = lookup_label(v, segments.get(), slot_hash.get(), slot_row.get(),
                                          capacity, reinterpret_cast<const uint8_t*>(label.data()),
                                          static_cast<int64_t>(label.size()), c, hash_bits);
      if (!query.is_valid(r)) {
        check(codes[r] == -1, "a null query row did not give -1");
        continue;
      }
      check(codes[r] == single, "lookup_rows and lookup_label disagree");
      if (corrupt) {  // any answer must still be a row of this column holding the same bytes
        check(codes[r] == -1 || (codes[r] >= 0 && codes[r] < last - first &&
                                 vocabulary.label(first + codes[r]) == label),
              "a corrupted table produced a wrong code");
      } else {
        const auto& ref = reference[static_cast<size_t>(c)];
        const auto it = ref.find(label);
        check(codes[r] == (it == ref.end() ? -1 : it->second), "lookup disagrees with std::map");
      }
    }
  }
  return 0;
}
