// GoogleTest: csrc/core/string_table.h (table build and probing) against std::map.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/string_table.h"

using namespace tabserve::core;

namespace {

// A packed vocabulary of several columns in Arrow layout.
struct Strings {
  std::string bytes;
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> valid;  // bool storage without std::vector<bool>

  void add(const std::optional<std::string>& s) {
    if (s) bytes += *s;
    offsets.push_back(static_cast<int64_t>(bytes.size()));
    valid.push_back(s.has_value());
  }
  StringsView view() const {
    StringsView v;
    v.data = reinterpret_cast<const uint8_t*>(bytes.data());
    v.data_size = static_cast<int64_t>(bytes.size());
    v.offsets = offsets.data();
    v.valid = reinterpret_cast<const bool*>(valid.data());
    v.rows = static_cast<int64_t>(offsets.size()) - 1;
    return v;
  }
};

struct Built {
  std::vector<int64_t> slot_hash, slot_row;
};

Built build(const Strings& vocabulary, const std::vector<int64_t>& segments, int64_t bits) {
  const StringsView v = vocabulary.view();
  const int64_t columns = static_cast<int64_t>(segments.size()) - 1;
  std::vector<int64_t> hashes(v.rows);
  hash_rows(v, segments.data(), columns, bits, 0, v.rows, hashes.data());
  Built t;
  const int64_t capacity = table_capacity(v.rows);
  t.slot_hash.resize(capacity);
  t.slot_row.resize(capacity);
  build_table(v, segments.data(), columns, hashes.data(),
              {t.slot_hash.data(), t.slot_row.data(), capacity});
  return t;
}

int64_t lookup(const Strings& vocabulary, const std::vector<int64_t>& segments, const Built& t,
               const std::string& label, int64_t column, int64_t bits) {
  return lookup_label(vocabulary.view(), segments.data(), t.slot_hash.data(), t.slot_row.data(),
                      static_cast<int64_t>(t.slot_row.size()),
                      reinterpret_cast<const uint8_t*>(label.data()),
                      static_cast<int64_t>(label.size()), column, bits);
}

std::string random_label(std::mt19937& rng) {
  static const std::string alphabet("ab\0c", 4);
  std::string s(rng() % 6, 'a');
  for (auto& c : s) c = alphabet[rng() % alphabet.size()];
  if (rng() % 4 == 0) s = std::string(200, 'p') + s;  // long shared prefix
  return s;
}

}  // namespace

class StringTable : public ::testing::TestWithParam<int64_t> {};

TEST_P(StringTable, MatchesMapWithLastDuplicateWinningPerColumn) {
  const int64_t bits = GetParam();
  for (unsigned seed = 0; seed < 30; ++seed) {
    std::mt19937 rng(seed);
    const int columns = 1 + rng() % 4;
    Strings vocabulary;
    std::vector<int64_t> segments{0};
    std::vector<std::map<std::string, int64_t>> reference(columns);
    for (int c = 0; c < columns; ++c) {
      const int rows = rng() % 40;  // empty columns included
      for (int r = 0; r < rows; ++r) {
        if (rng() % 10 == 0) {
          vocabulary.add(std::nullopt);
        } else {
          const std::string s = random_label(rng);
          vocabulary.add(s);
          reference[c][s] = r;  // the last position wins
        }
      }
      segments.push_back(segments.back() + rows);
    }
    const Built table = build(vocabulary, segments, bits);
    for (int c = 0; c < columns; ++c) {
      for (int q = 0; q < 60; ++q) {
        const std::string label = random_label(rng);
        const auto it = reference[c].find(label);
        const int64_t expected = it == reference[c].end() ? -1 : it->second;
        EXPECT_EQ(lookup(vocabulary, segments, table, label, c, bits), expected)
            << "seed " << seed << " column " << c << " bits " << bits;
      }
    }
  }
}

// 64 bits: real hashes; 2 and 0 bits: every label collides, so only byte checks separate them.
INSTANTIATE_TEST_SUITE_P(HashBits, StringTable, ::testing::Values(64, 2, 0));

TEST(StringTableProbe, CorruptedFullTableNeitherHangsNorReadsOutside) {
  Strings vocabulary;
  vocabulary.add(std::string("a"));
  const std::vector<int64_t> segments{0, 1};
  Built table;
  table.slot_hash.assign(16, 0);
  table.slot_row.assign(16, 12345);  // no empty slot, rows past the vocabulary
  EXPECT_EQ(lookup(vocabulary, segments, table, "a", 0, 64), -1);
}

TEST(StringTableProbe, MalformedOffsetsAreClamped) {
  Strings vocabulary;
  vocabulary.add(std::string("abc"));
  vocabulary.offsets[1] = 1000;  // past the data
  const StringsView v = vocabulary.view();
  EXPECT_EQ(v.length(0), 3);
}

TEST(StringTableChecks, FirstBadOffset) {
  const std::vector<int64_t> good{0, 2, 2, 5}, down{0, 3, 2}, past{0, 6}, negative{-1, 0};
  EXPECT_EQ(first_bad_offset(good.data(), 4, 5), -1);
  EXPECT_EQ(first_bad_offset(down.data(), 3, 5), 2);
  EXPECT_EQ(first_bad_offset(past.data(), 2, 5), 1);
  EXPECT_EQ(first_bad_offset(negative.data(), 2, 5), 0);
}
