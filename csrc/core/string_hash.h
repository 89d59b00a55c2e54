// Torch-free string hashing shared by the CPU and CUDA kernels.
//
// A label is a byte range [begin, end). It is read as little-endian 64-bit words w_k holding the
// bytes [8k, 8k + 8), zero-padded past the end. The hash is a sum of one term per word, each keyed
// by its position, then mixed:
//
//     x_k = w_k ^ key_k,   key_k = kWordKey * (2k + 1)
//     H(column, label) = mix( sum_k [ lo32(x_k) * hi32(x_k) + w_k ] + length * kLengthKey
//                             + column * kColumnKey )
//
// Any set of threads may hash disjoint words and add their partial sums in any order (a warp
// reduction on the GPU, a plain loop on the CPU) and get the same value bit for bit. The product
// of the keyed word's halves makes each term non-linear in the word's bytes, so labels that differ
// in several words do not cancel out: a term linear in w_k (w_k * key_k) gives the same sum to
// "3.......5......." and "6.......4......." (+3 * key_0 - 1 * key_1 = 0 since key_1 = 3 * key_0),
// and to every such pair of fixed-width numeric fields. The plain w_k keeps a word whose keyed
// half is zero from dropping out. The length term separates labels that differ only by trailing
// NUL bytes. The hash only chooses slots: every match is confirmed by comparing bytes, so a
// collision can cost a probe but never a wrong code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TABSERVE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TABSERVE_HOST_DEVICE inline
#endif

namespace tabserve {
namespace core {

constexpr uint64_t kWordKey = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kLengthKey = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kColumnKey = 0x165667B19E3779F9ull;
constexpr int kWordBytes = 8;

// The murmur3 64-bit finaliser: a bijection that spreads every input bit over the whole word.
TABSERVE_HOST_DEVICE uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}

// Position key of word k: odd, distinct for every k, and a running sum on the host
// (key_{k+1} = key_k + 2 * kWordKey).
TABSERVE_HOST_DEVICE uint64_t word_key(int64_t k) {
  return kWordKey * (2 * static_cast<uint64_t>(k) + 1);
}

// Contribution of word w under position key `key` (word_key(k) for word k): one 32 x 32 -> 64-bit
// product (a single instruction on the GPU and on x86) of the keyed word's halves, plus the word.
TABSERVE_HOST_DEVICE uint64_t keyed_term(uint64_t w, uint64_t key) {
  const uint64_t x = w ^ key;
  return uint64_t{static_cast<uint32_t>(x)} * static_cast<uint32_t>(x >> 32) + w;
}

TABSERVE_HOST_DEVICE uint64_t word_term(uint64_t w, int64_t k) { return keyed_term(w, word_key(k)); }

// Turns the sum of word terms into the label's hash, keeping the low `hash_bits` bits
// (64 in production; tests pass fewer bits to force collisions).
TABSERVE_HOST_DEVICE uint64_t finish_hash(uint64_t word_sum, int64_t length, int64_t column,
                                          int64_t hash_bits) {
  uint64_t h = mix64(word_sum + static_cast<uint64_t>(length) * kLengthKey +
                     static_cast<uint64_t>(column) * kColumnKey);
  return hash_bits >= 64 ? h : (h & ((uint64_t{1} << hash_bits) - 1));
}

// Number of words a label of `length` bytes occupies.
TABSERVE_HOST_DEVICE int64_t word_count(int64_t length) {
  return (length + kWordBytes - 1) / kWordBytes;
}

// Word k of a label, zero-padded, read without touching bytes outside the label (host path,
// little-endian hosts only). A whole word is one fixed-size load. A partial word of n bytes is
// built from two overlapping 4-byte loads (n >= 4) or three byte loads (n < 4) that together
// cover every byte; overlapping bytes hold equal values, so OR-ing them is exact. A word past the
// end is 0.
inline uint64_t load_word_host(const uint8_t* label, int64_t length, int64_t k) {
  const int64_t first = k * kWordBytes;
  const int64_t n = length - first;
  // First, so that `label + first` is only formed inside the label: past its end, and on the
  // null data pointer of an empty column, that pointer arithmetic is undefined behaviour.
  if (n <= 0) return 0;
  const uint8_t* p = label + first;
  if (n >= kWordBytes) {
    uint64_t w;
    std::memcpy(&w, p, kWordBytes);
    return w;
  }
  if (n >= 4) {
    uint32_t low, high;
    std::memcpy(&low, p, 4);
    std::memcpy(&high, p + n - 4, 4);
    return uint64_t{low} | (uint64_t{high} << (8 * (n - 4)));
  }
  return uint64_t{p[0]} | (uint64_t{p[n / 2]} << (8 * (n / 2))) |
         (uint64_t{p[n - 1]} << (8 * (n - 1)));
}

// Hash of one label, sequentially (host path; the CUDA kernels split the same sum over lanes).
// The loop keeps the position key as a running value and stays scalar: its vectorised form was
// slower on 512- and 4,096-byte labels (x86-64, GCC 12).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
inline uint64_t hash_label_host(const uint8_t* label, int64_t length, int64_t column,
                                int64_t hash_bits) {
  if (length <= 2 * kWordBytes) {  // most category labels: two loads, no loop
    uint64_t sum = length > 0 ? keyed_term(load_word_host(label, length, 0), kWordKey) : 0;
    if (length > kWordBytes) sum += keyed_term(load_word_host(label, length, 1), 3 * kWordKey);
    return finish_hash(sum, length, column, hash_bits);
  }
  uint64_t sum = 0;
  uint64_t key = kWordKey;
  const int64_t whole = length / kWordBytes;
  for (int64_t k = 0; k < whole; ++k, key += 2 * kWordKey) {
    uint64_t w;
    std::memcpy(&w, label + k * kWordBytes, kWordBytes);
    sum += keyed_term(w, key);
  }
  if (whole * kWordBytes < length) sum += keyed_term(load_word_host(label, length, whole), key);
  return finish_hash(sum, length, column, hash_bits);
}

// Smallest power of two >= 2 * labels, at least 16: a load factor of at most one half.
inline int64_t table_capacity(int64_t labels) {
  int64_t capacity = 16;
  while (capacity < 2 * labels) capacity *= 2;
  return capacity;
}

}  // namespace core
}  // namespace tabserve
