// Torch-free device code of the string-lookup operators: string views, word loads, and the
// tile-cooperative hash, probe and byte comparison. string_lookup.cu launches these kernels.
//
// A tile of kTile lanes (2 to 32 of one warp) owns one label. Its lanes read the label's
// 8-byte words k = lane, lane + kTile, ... and keep the first kCached of them in registers while
// adding their hash terms (string_hash.h; the tile's sum is the host's sequential sum). The tile
// then reads kTile consecutive slots at once (one round trip for nearly every query: the table is
// at most half full) and compares each candidate slot's label against the words it holds, so a
// query's bytes are read from memory once. Every load of a word is issued before any of them is
// used and no comparison exits early: a tile keeps all of its label's loads in flight.
#pragma once

#include <cstdint>

#include "../../core/string_hash.h"

namespace tabserve {
namespace ops {
namespace lookup_kernels {

using core::finish_hash;
using core::word_count;
using core::word_term;

constexpr int kWarp = 32;
constexpr int kThreadsPerBlock = 256;
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

// Word k of a label (bytes [8k, 8k + 8), zero-padded), any label: at most two aligned 8-byte
// loads inside the label's buffer, and byte loads where those would reach past either end of the
// buffer (the first or last label of a tensor that does not start or end on an 8-byte boundary),
// so no load touches memory outside the tensor (compute-sanitizer memcheck and initcheck).
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

// A label prepared for word reads. Whether every aligned 8-byte word holding one of its bytes lies
// inside its buffer (true for all labels but those at a misaligned edge of a tensor) and whether
// it starts on an 8-byte boundary are decided once per label, so the reads of such a label carry
// no per-word bounds test and can all be issued together.
struct LabelWords {
  Label label;
  const uint64_t* aligned;  // the aligned word holding the label's first byte
  int64_t words;
  unsigned shift;  // 8 * (address of the first byte mod 8)
  bool inside;
};

__device__ __forceinline__ LabelWords label_words(const Label& label) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(label.bytes);
  const uintptr_t first = start & ~uintptr_t{7};
  const uintptr_t end = (start + static_cast<uintptr_t>(label.length) + 7) & ~uintptr_t{7};
  return {label, reinterpret_cast<const uint64_t*>(first), word_count(label.length),
          8u * static_cast<unsigned>(start & 7u),
          first >= reinterpret_cast<uintptr_t>(label.buffer_begin) &&
              end <= reinterpret_cast<uintptr_t>(label.buffer_end)};
}

// Keeps the bytes of word k that belong to the label (only the last word can be partial).
__device__ __forceinline__ uint64_t clip_word(const LabelWords& l, int64_t k, uint64_t word) {
  const int64_t count = l.label.length - k * core::kWordBytes;
  return count < core::kWordBytes ? word & ((uint64_t{1} << (8 * count)) - 1) : word;
}

// A read-only 8-byte load of label bytes that skips L1: a query's label is read once and a
// candidate's once per query, so L1 only loses lines to them. On the H200 this alone took the
// lookup of 100,000 4,096-byte labels from 0.375 to 0.327 ms; 16-byte loads of word pairs were
// slower (0.69 ms: the pairs' registers spilled).
__device__ __forceinline__ uint64_t load_label_word(const uint64_t* p) {
  uint64_t word;
  asm("ld.global.nc.L1::no_allocate.u64 %0, [%1];" : "=l"(word) : "l"(p));
  return word;
}

// Word k < words of a label with `inside` set and shift 0: one load.
__device__ __forceinline__ uint64_t aligned_word(const LabelWords& l, int64_t k) {
  return clip_word(l, k, load_label_word(l.aligned + k));
}

// Word k < words of a label with `inside` set and shift != 0: the aligned word holding its first
// byte and, unless the label ends inside that one, the next.
__device__ __forceinline__ uint64_t shifted_word(const LabelWords& l, int64_t k) {
  const uint64_t* p = l.aligned + k;
  const int64_t count = l.label.length - k * core::kWordBytes;
  const uint64_t low = load_label_word(p) >> l.shift;
  const uint64_t high = l.shift / 8 + count > 8 ? load_label_word(p + 1) << (64u - l.shift) : 0;
  return clip_word(l, k, low | high);
}

__device__ __forceinline__ uint64_t any_word(const LabelWords& l, int64_t k) {
  if (!l.inside) return load_word(l.label, k);
  return l.shift == 0 ? aligned_word(l, k) : shifted_word(l, k);
}

// The word terms k, k + step, ... of a label, and whether two labels of one length agree in those
// words: the words no tile holds in registers (labels past a tile shape's cached words, labels at
// a misaligned tensor edge). Out of line, so that their loads' registers do not count against the
// kernels' cached words.
__device__ __noinline__ uint64_t hash_terms(const LabelWords& l, int64_t k, int step) {
  uint64_t sum = 0;
  for (; k < l.words; k += step) sum += word_term(any_word(l, k), k);
  return sum;
}

__device__ __noinline__ bool same_words(const LabelWords& a, const LabelWords& b, int64_t k,
                                        int step) {
  bool same = true;
  for (; k < a.words; k += step) same &= any_word(a, k) == any_word(b, k);
  return same;
}

// The lanes of one tile: kTile consecutive lanes of a warp, synchronised by their own mask, so
// that the tiles of a warp may probe and compare for different lengths of time.
template <int kTile>
struct Tile {
  static_assert(kTile >= 1 && kTile <= kWarp && (kTile & (kTile - 1)) == 0, "tile: 2^n lanes");
  int lane;   // lane inside the tile
  int first;  // the tile's first lane in the warp
  unsigned mask;

  __device__ Tile() {
    const int warp_lane = static_cast<int>(threadIdx.x % kWarp);
    lane = warp_lane % kTile;
    first = warp_lane - lane;
    mask = kTile == kWarp ? kFullMask : ((1u << kTile) - 1u) << first;
  }
  __device__ uint64_t sum(uint64_t value) const {
    for (int step = kTile / 2; step > 0; step /= 2) {
      value += __shfl_xor_sync(mask, value, step, kTile);
    }
    return value;
  }
  // Bit i: lane i of the tile.
  __device__ unsigned ballot(bool predicate) const {
    return (__ballot_sync(mask, predicate) & mask) >> first;
  }
  __device__ bool all(bool predicate) const { return __all_sync(mask, predicate); }
  __device__ int64_t broadcast(int64_t value, int lane_in_tile) const {
    return __shfl_sync(mask, static_cast<long long>(value), lane_in_tile, kTile);
  }
};

// Words k = lane + kTile * i, i < kCached, of a label with `inside` set, 0 past its end; every
// load is issued before any word is used.
template <int kTile, int kCached>
__device__ __forceinline__ void load_cached(int lane, const LabelWords& l,
                                            uint64_t (&words)[kCached]) {
  if (l.shift == 0) {
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int k = lane + kTile * i;
      words[i] = k < l.words ? aligned_word(l, k) : 0;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int k = lane + kTile * i;
      words[i] = k < l.words ? shifted_word(l, k) : 0;
    }
  }
}

// The label's hash. For a label with `inside` set, its first kTile * kCached words are left in
// `cache` (the lane's words k = lane + kTile * i) for tile_same_bytes; later words, and every word
// of a label at a misaligned tensor edge, are read again there.
template <int kTile, int kCached>
__device__ __forceinline__ uint64_t tile_hash(const Tile<kTile>& tile, const LabelWords& l,
                                              int64_t column, int64_t hash_bits,
                                              uint64_t (&cache)[kCached]) {
  uint64_t sum = 0;
  int64_t k = tile.lane;
  if (l.inside) {
    load_cached<kTile, kCached>(tile.lane, l, cache);
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      if (tile.lane + kTile * i < l.words) sum += word_term(cache[i], tile.lane + kTile * i);
    }
    k += kTile * kCached;
  }
  if (k < l.words) sum += hash_terms(l, k, kTile);
  return finish_hash(tile.sum(sum), l.label.length, column, hash_bits);
}

// Whether `candidate` holds the bytes of `query` (same length, checked by the caller), given the
// cache tile_hash left.
template <int kTile, int kCached>
__device__ __forceinline__ bool tile_same_bytes(const Tile<kTile>& tile,
                                                const LabelWords& candidate,
                                                const LabelWords& query,
                                                const uint64_t (&cache)[kCached]) {
  bool same = true;
  int64_t k = tile.lane;
  if (candidate.inside && query.inside) {
    uint64_t words[kCached];
    load_cached<kTile, kCached>(tile.lane, candidate, words);
#pragma unroll
    for (int i = 0; i < kCached; ++i) same &= words[i] == cache[i];
    k += kTile * kCached;
  }
  if (k < candidate.words) same &= same_words(candidate, query, k, kTile);
  return tile.all(same);
}

// Code of a query label (hash h, cached words) in the vocabulary column of rows [first, last):
// its row minus `first`, or -1. The tile reads kTile consecutive slots per step and considers the
// matching ones before the first empty slot in probe order, which is the host's linear probe
// (string_table.h). At most `capacity` slots are read and rows outside the column are never
// dereferenced, so even a corrupted table cannot hang or read out of bounds.
template <int kTile, int kCached>
__device__ __forceinline__ int64_t tile_probe(const Tile<kTile>& tile,
                                              const DeviceStrings& vocabulary, int64_t first,
                                              int64_t last, const int64_t* slot_hash,
                                              const int64_t* slot_row, int64_t capacity,
                                              uint64_t h, const LabelWords& query,
                                              const uint64_t (&cache)[kCached]) {
  const uint64_t mask = static_cast<uint64_t>(capacity - 1);
  const int64_t rows = min(last, vocabulary.rows);
  uint64_t p = h & mask;
  for (int64_t probed = 0; probed < capacity; probed += kTile, p = (p + kTile) & mask) {
    const uint64_t slot = (p + static_cast<uint64_t>(tile.lane)) & mask;
    const int64_t row = __ldg(slot_row + slot);
    const uint64_t held = static_cast<uint64_t>(__ldg(slot_hash + slot));
    const unsigned empty = tile.ballot(row < 0);
    unsigned candidates = tile.ballot(row >= first && row < rows && held == h);
    if (empty != 0) candidates &= (empty & (0u - empty)) - 1u;  // before the first empty slot
    while (candidates != 0) {
      const int64_t candidate = tile.broadcast(row, __ffs(candidates) - 1);
      candidates &= candidates - 1u;
      const Label label = vocabulary.label(candidate);
      if (label.length == query.label.length &&
          tile_same_bytes(tile, label_words(label), query, cache)) {
        return candidate - first;
      }
    }
    if (empty != 0) break;
  }
  return -1;
}

// Column c of a packed vocabulary row: segments[c] <= row < segments[c + 1].
__device__ __forceinline__ int64_t column_of(const int64_t* segments, int64_t columns,
                                             int64_t row) {
  int64_t lo = 0, hi = columns;  // invariant: segments[lo] <= row < segments[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (segments[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

template <int kTile, int kCached>
__global__ void __launch_bounds__(kThreadsPerBlock)
    hash_rows_kernel(DeviceStrings vocabulary, const int64_t* segments, int64_t columns,
                     int64_t hash_bits, int64_t* hashes) {
  const Tile<kTile> tile;
  const int64_t tiles = static_cast<int64_t>(gridDim.x) * (kThreadsPerBlock / kTile);
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x) / kTile;
       row < vocabulary.rows; row += tiles) {
    uint64_t cache[kCached];
    const uint64_t h = tile_hash(tile, label_words(vocabulary.label(row)),
                                 column_of(segments, columns, row), hash_bits, cache);
    if (tile.lane == 0) hashes[row] = static_cast<int64_t>(h);
  }
}

// a and b have the same length (the caller compares lengths first).
__device__ __forceinline__ bool thread_same_bytes(const Label& a, const Label& b) {
  const int64_t words = word_count(a.length);
  for (int64_t k = 0; k < words; ++k) {
    if (load_word(a, k) != load_word(b, k)) return false;
  }
  return true;
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
    const auto held = static_cast<int64_t>(atomicCAS(
        slot, static_cast<unsigned long long>(-1LL), static_cast<unsigned long long>(row)));
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

// Blocks per multiprocessor the lookup kernel is compiled for (a register budget): words held in
// registers trade against tiles in flight. The kernel is launched with as many blocks as fit on
// the device at once, each tile looping over queries (string_lookup.cu). An L2 prefetch of a
// tile's next label, issued before its current one, made the 4,096-byte kernel spill (1.0 ms).
constexpr int lookup_blocks_per_sm(int cached) { return cached >= 8 ? 2 : cached >= 4 ? 3 : 4; }

template <int kTile, int kCached>
__global__ void __launch_bounds__(kThreadsPerBlock, lookup_blocks_per_sm(kCached))
    lookup_kernel(DeviceStrings vocabulary, const int64_t* segments, const int64_t* slot_hash,
                  const int64_t* slot_row, int64_t capacity, QueryBatch batch, int64_t hash_bits,
                  int64_t* codes) {
  const Tile<kTile> tile;
  const int64_t total = batch.row_start[batch.count];
  const int64_t tiles = static_cast<int64_t>(gridDim.x) * (kThreadsPerBlock / kTile);
  for (int64_t g = (static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x) / kTile;
       g < total; g += tiles) {
    int c = 0;
    while (g >= batch.row_start[c + 1]) ++c;
    const int64_t r = g - batch.row_start[c];
    int64_t code = -1;
    if (batch.valid[c] == nullptr || batch.valid[c][r]) {
      const DeviceStrings query{batch.data[c], batch.data_size[c], batch.offsets[c], nullptr, 0};
      const LabelWords label = label_words(query.label(r));
      const int64_t column = batch.first_column + c;
      uint64_t cache[kCached];
      const uint64_t h = tile_hash(tile, label, column, hash_bits, cache);
      code = tile_probe(tile, vocabulary, segments[column], segments[column + 1], slot_hash,
                        slot_row, capacity, h, label, cache);
    }
    if (tile.lane == 0) codes[g] = code;
  }
}

// Tile shapes by mean label length (bytes): lanes per label and words each lane holds. Any shape
// gives the same codes for any label; only speed differs. Each row is the fastest shape measured
// on the H200 for 100,000 query labels (8 and 16 bytes: 2 lanes, 0.020 and 0.022 ms; 64 bytes:
// 4 lanes of 2 words, 0.026 ms; 512 bytes: 16 lanes of 4 words, 0.082 ms; 4,096 bytes: 32 lanes
// of 16 words, 0.380 ms with 200,000 fitted labels, 0.84 GB read from memory in 0.375 ms; 0.299
// ms since its loads skip L1 and its grid is resident).
struct TileShape {
  int64_t max_mean_bytes;
  int tile;
  int cached;
};
constexpr TileShape kTileShapes[] = {
    {16, 2, 1},           // up to 16 bytes held
    {96, 4, 2},           // up to 64 bytes
    {768, 16, 4},         // up to 512 bytes
    {INT64_MAX, 32, 16},  // up to 4,096 bytes; longer labels read their tail twice
};

}  // namespace lookup_kernels
}  // namespace ops
}  // namespace tabserve
