// GoogleTest: csrc/core/string_hash.h, the hash shared by the CPU and CUDA kernels.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/string_hash.h"

using namespace tabserve::core;

namespace {

// Word k assembled byte by byte (independent of the memcpy in load_word_host).
uint64_t word_by_bytes(const std::string& s, int64_t k) {
  uint64_t w = 0;
  for (int b = 0; b < 8; ++b) {
    const size_t i = static_cast<size_t>(k * 8 + b);
    if (i < s.size()) w |= static_cast<uint64_t>(static_cast<uint8_t>(s[i])) << (8 * b);
  }
  return w;
}

uint64_t hash_of(const std::string& s, int64_t column = 0, int64_t bits = 64) {
  return hash_label_host(reinterpret_cast<const uint8_t*>(s.data()),
                         static_cast<int64_t>(s.size()), column, bits);
}

std::string random_bytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

}  // namespace

TEST(StringHash, WordsMatchByteAssembly) {
  std::mt19937_64 rng(1);
  for (size_t n = 0; n <= 40; ++n) {
    const std::string s = random_bytes(rng, n);
    for (int64_t k = 0; k <= word_count(static_cast<int64_t>(n)); ++k) {  // one past: 0
      EXPECT_EQ(load_word_host(reinterpret_cast<const uint8_t*>(s.data()), n, k),
                word_by_bytes(s, k))
          << "length " << n << " word " << k;
    }
  }
}

// The CUDA kernels split the word sum over 32 lanes; any split must give the host's value.
TEST(StringHash, LaneSplitSumEqualsSequentialHash) {
  std::mt19937_64 rng(2);
  for (size_t n : {0, 5, 64, 255, 256, 257, 4096, 70001}) {
    const std::string s = random_bytes(rng, n);
    const int64_t words = word_count(static_cast<int64_t>(n));
    std::vector<uint64_t> lanes(32, 0);
    for (int64_t k = 0; k < words; ++k) lanes[k % 32] += word_term(word_by_bytes(s, k), k);
    std::shuffle(lanes.begin(), lanes.end(), rng);
    uint64_t sum = 0;
    for (uint64_t partial : lanes) sum += partial;
    EXPECT_EQ(finish_hash(sum, static_cast<int64_t>(n), 3, 64), hash_of(s, 3)) << "length " << n;
  }
}

TEST(StringHash, SeparatesLengthPositionAndColumn) {
  EXPECT_NE(hash_of(""), hash_of(std::string(1, '\0')));
  EXPECT_NE(hash_of("a"), hash_of(std::string("a\0", 2)));
  EXPECT_NE(hash_of("ab"), hash_of("ba"));
  EXPECT_NE(hash_of("abcdefgh12345678"), hash_of("12345678abcdefgh"));  // swapped words
  EXPECT_NE(hash_of("label", 0), hash_of("label", 1));
  std::string middle(4096, 'x'), other = middle;
  other[2048] = 'y';
  EXPECT_NE(hash_of(middle), hash_of(other));
}

// Labels whose words differ by small multiples of each other: a hash linear in the words
// (sum of w_k * key_k with key_k = K * (2k + 1)) gives "3.......5......." and "6.......4......."
// one value, and so every pair of two fixed-width numeric fields (a + 3, b - 1) and (a, b).
TEST(StringHash, WordsDoNotCancelAcrossPositions) {
  std::string a(16, '0'), b(16, '0');
  a[0] = '3';
  a[8] = '5';
  b[0] = '6';
  b[8] = '4';
  EXPECT_NE(hash_of(a), hash_of(b));
  std::vector<uint64_t> hashes;
  char label[24];
  for (int x = 0; x < 300; ++x) {
    for (int y = 0; y < 300; ++y) {
      std::snprintf(label, sizeof label, "%08d%08d", x, y);
      hashes.push_back(hash_of(label));
      std::snprintf(label, sizeof label, "%08d%08d%08d", x, y, x + y);
      hashes.push_back(hash_of(label));
    }
  }
  std::sort(hashes.begin(), hashes.end());
  EXPECT_EQ(std::unique(hashes.begin(), hashes.end()), hashes.end());
}

TEST(StringHash, HashBitsKeepsTheLowBits) {
  const uint64_t full = hash_of("some label");
  EXPECT_EQ(hash_of("some label", 0, 64), full);
  EXPECT_EQ(hash_of("some label", 0, 5), full & 31u);
  EXPECT_EQ(hash_of("some label", 0, 0), 0u);
}

TEST(StringHash, FewCollisionsOnDistinctLabels) {
  std::vector<uint64_t> hashes;
  for (int i = 0; i < 100000; ++i) hashes.push_back(hash_of("row-" + std::to_string(i)));
  std::sort(hashes.begin(), hashes.end());
  EXPECT_EQ(std::unique(hashes.begin(), hashes.end()), hashes.end());
}

TEST(StringHash, TableCapacityIsAtMostHalfFull) {
  EXPECT_EQ(table_capacity(0), 16);
  EXPECT_EQ(table_capacity(8), 16);
  EXPECT_EQ(table_capacity(9), 32);
  for (int64_t rows : {1, 100, 12345, 200000}) {
    const int64_t c = table_capacity(rows);
    EXPECT_EQ(c & (c - 1), 0);
    EXPECT_GE(c, 2 * rows);
    EXPECT_LT(c, 4 * rows + 16);
  }
}
