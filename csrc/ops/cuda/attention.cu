// CUDA kernel of small_head_attention (schema and contract: ../attention.cpp).
//
// A head of dimension 16 is exactly the k = 16 of one m16n8k16 tensor-core product, so a warp
// takes 16 queries at a time (a query tile) and keeps everything of the softmax in registers, as
// FlashAttention-2 does: the scores of 16 queries against up to 128 keys are the accumulator
// fragments of the Q K^T products (4 fp32 per lane per 8 keys); each lane owns 2 columns of 2 rows
// of every 8-key tile, so the row max and the row sum take two shuffles among the 4 lanes of a
// row; the probabilities, packed to the input dtype, are already the A fragments of the P V
// products. Nothing of a score goes through shared memory.
//
// Keys and values are staged in shared memory, 16-byte halves of their rows swizzled so that the
// ldmatrix loads (plain for K, transposed for V) meet no bank conflict. Two kernels:
//   - one_chunk_kernel, every key in one chunk (<= 128: the row stage's ~70 tokens, the column
//     stage's 128 induced tokens): the work is cut into units (a batch entry; all of its heads
//     where the row stage's few query tiles allow, else one; a run of query tiles). As many
//     blocks as stay resident walk the units with the grid's stride through two staging buffers:
//     unit i + 1's keys and values are copied by cp.async while the 8 warps take unit i's (head,
//     tile) items in turn, each warp loading its next item's queries before it attends;
//   - streaming_kernel, past 128 keys (the column stage's train rows): a block owns up to 8 query
//     tiles of one head, one per warp, and streams the keys through shared memory 128 at a time
//     with an online softmax (running max and sum in fp32).
// Per score: the max over raw scores, one FMA that folds the scale into the exponent, one
// ex2.approx.ftz and the fp32 sum (with more per-score integer work, Nsight Compute finds the
// kernel issue-bound on it); the number of 16-key tiles of a chunk is a template argument, so the
// loops unroll without guards, and only the last tile masks keys.
// Keys past n (n read on the device, so nothing waits for the host and one CUDA graph serves every
// n) are never loaded; the zero rows that round a chunk up to 16 keys are masked to -inf.
// Copies use 16 bytes when every row is 16-byte aligned, 2-byte loads otherwise.
// With RoPE tables (the row stage) q is rotated as a lane loads it (it holds both halves of its
// rows' dims) and the staged keys are rotated in shared memory once they land, one row per
// thread; this is a separate instantiation (kRotate), so the plain kernel keeps its registers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../attention.h"
#include "tensor_core.cuh"

namespace tabserve {
namespace ops {
namespace {

using tensor_core::ldmatrix_x4;
using tensor_core::ldmatrix_x4_trans;
using tensor_core::mma;
using tensor_core::pack_two;
using tensor_core::unpack_two;

constexpr int kD = 16;              // head dimension: the k of one m16n8k16 product
constexpr int kWarps = 8;           // query tiles in flight per block
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 128;         // keys per shared-memory chunk, scores held in registers
constexpr int64_t kMaxOneChunkTiles = 64;  // query tiles of one block when the keys fit a chunk
constexpr int64_t kStagingBytes = 48 * 1024;  // shared memory a launch gets without opting in
constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ __forceinline__ int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

// Element offset of half `half` (0: dims 0-7, 1: dims 8-15) of staged row `key`: the halves swap
// on every other run of 4 rows, so 8 consecutive rows' same halves fill all 32 banks.
__device__ __forceinline__ int swizzled(int key, int half) {
  return key * kD + ((half ^ ((key >> 2) & 1)) * 8);
}

struct Operand {
  const void* data;
  int64_t batch_stride, head_stride, row_stride;  // in elements; the last axis is contiguous
};

struct Params {
  Operand q, k, v;
  void* out;  // [B, Lq, heads, 16], contiguous
  int64_t heads, queries, keys;
  int64_t heads_per_block;   // 1, or every head (keys in one chunk, few query tiles)
  int64_t tiles_per_block;   // query tiles of one head in one block
  int64_t blocks_per_group;  // units per (batch entry, heads of a block)
  int64_t units;             // batch entries x head groups x blocks_per_group
  int staged_rows;           // rows of one head's keys a block stages at once (multiple of 16)
  const void* n_keys;        // nullptr: every key is used
  bool n_keys_long;
  int64_t n_keys_stride;  // 0 for one count shared by the batch
  float scale_log2;       // |softmax scale| * log2(e) (1 for a scale of 0)
  int query_sign;         // the scale's sign: -1 flips the queries' signs, 0 zeroes them
  bool aligned;           // every row of q, k and v starts on a 16-byte boundary
  const float* cos;       // nullptr, or RoPE tables [>= max(Lq, Lk), 16]: q and k are rotated
  const float* sin;
};

// Rotate-half RoPE of dims d, d + 1 (d even) and their partners d + 8, d + 9 of a row at
// `position`, in fp32 as the composite computes it (two products and a sum, each rounded: no
// contraction into an FMA):  lo' = lo cos[d] - hi sin[d],  hi' = hi cos[d + 8] + lo sin[d + 8].
__device__ __forceinline__ void rotate_two(const Params& p, int64_t position, int d, float2& lo,
                                           float2& hi) {
  const float2* c = reinterpret_cast<const float2*>(p.cos + position * kD + d);
  const float2* s = reinterpret_cast<const float2*>(p.sin + position * kD + d);
  const float2 c_lo = __ldg(c), c_hi = __ldg(c + 4), s_lo = __ldg(s), s_hi = __ldg(s + 4);
  const float2 new_lo = {__fadd_rn(__fmul_rn(lo.x, c_lo.x), __fmul_rn(-hi.x, s_lo.x)),
                         __fadd_rn(__fmul_rn(lo.y, c_lo.y), __fmul_rn(-hi.y, s_lo.y))};
  hi = {__fadd_rn(__fmul_rn(hi.x, c_hi.x), __fmul_rn(lo.x, s_hi.x)),
        __fadd_rn(__fmul_rn(hi.y, c_hi.y), __fmul_rn(lo.y, s_hi.y))};
  lo = new_lo;
}

// cp.async: a 16-byte global-to-shared copy that completes in the background (sm_80 and later),
// so a block stages its next keys and values while its warps attend over the current ones.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(src));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `kPending` of this thread's committed groups of copies are in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Rows [start, start + count) of keys and values of heads [h0, h0 + heads) into shared memory,
// zero rows up to `padded`; the block's threads split the 16-byte halves of the rows (rows of
// one token's heads are contiguous: consecutive threads read consecutive 16 bytes). Aligned rows
// go through cp.async (the caller commits and waits), others through registers.
// A thread walks its halves with a fixed step (a row and a remainder, carried), so no division
// runs per copy: per-copy divisions by `heads` are a sizeable part of the row stage's
// instructions, where a block stages a new unit for every 40 query tiles.
template <typename T>
__device__ __forceinline__ void stage(const Params& p, const T* k, const T* v, int64_t start,
                                      int count, int padded, int heads, T* keys, T* values) {
  const int per_row = 2 * heads;  // 16-byte halves of one token's heads
  const int row_step = kThreads / per_row, rest_step = kThreads % per_row;
  const int first_row = static_cast<int>(threadIdx.x) / per_row;
  const int first_rest = static_cast<int>(threadIdx.x) % per_row;
#pragma unroll
  for (int is_value = 0; is_value < 2; ++is_value) {
    const Operand& o = is_value ? p.v : p.k;
    const T* base = (is_value ? v : k) + start * o.row_stride;
    T* staged = is_value ? values : keys;
    for (int key = first_row, rest = first_rest; key < padded;) {
      const int half = rest & 1, head = rest >> 1;
      T* dst = staged + head * p.staged_rows * kD + swizzled(key, half);
      if (key >= count) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      } else {
        const T* src = base + head * o.head_stride + key * o.row_stride + half * 8;
        if (p.aligned) {
          copy_async_16(dst, src);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) dst[e] = src[e];
        }
      }
      key += row_step;  // rest + rest_step < 2 per_row: one carry at most
      rest += rest_step;
      if (rest >= per_row) rest -= per_row, ++key;
    }
  }
}

// RoPE of the staged keys, in place (after the block has waited for them): one thread per real
// row (consecutive threads on consecutive rows of a head: no bank conflict), both halves of the
// row in its registers, each at its position start + key.
template <typename T>
__device__ __forceinline__ void rotate_staged(const Params& p, int64_t start, int count,
                                              int heads, T* keys) {
  for (int i = static_cast<int>(threadIdx.x); i < count * heads; i += kThreads) {
    const int head = i / count, key = i % count;
    T* row = keys + head * p.staged_rows * kD;
    uint4* lo_half = reinterpret_cast<uint4*>(row + swizzled(key, 0));
    uint4* hi_half = reinterpret_cast<uint4*>(row + swizzled(key, 1));
    const uint4 lo4 = *lo_half, hi4 = *hi_half;
    uint32_t packed[8] = {lo4.x, lo4.y, lo4.z, lo4.w, hi4.x, hi4.y, hi4.z, hi4.w};  // 2e, 2e+1
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // dims 2e, 2e + 1 with their partners 2e + 8, 2e + 9
      float2 lo = unpack_two<T>(packed[e]), hi = unpack_two<T>(packed[e + 4]);
      rotate_two(p, start + key, 2 * e, lo, hi);
      packed[e] = pack_two<T>(lo.x, lo.y);
      packed[e + 4] = pack_two<T>(hi.x, hi.y);
    }
    *lo_half = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    *hi_half = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }
}

// The A fragment of 16 query rows (zeros past the last query): lane (g, t) = (lane / 4, lane % 4)
// holds dims 2t, 2t + 1 and 2t + 8, 2t + 9 of rows g and g + 8. Loads only: a warp issues the
// next tile's loads before it attends over the current tile.
template <typename T>
__device__ __forceinline__ void load_query(const T* q, int64_t row_stride, int64_t first,
                                           int64_t queries, bool aligned, uint32_t (&a)[4]) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t query = first + g + 8 * (i & 1);
    const int dim = 2 * t + 8 * (i >> 1);
    a[i] = 0;
    if (query >= queries) continue;
    const T* src = q + query * row_stride + dim;
    if (aligned) {
      a[i] = __ldg(reinterpret_cast<const unsigned int*>(src));
    } else {
      T pair[2] = {src[0], src[1]};
      a[i] = *reinterpret_cast<const uint32_t*>(pair);
    }
  }
}

// RoPE of a loaded A fragment: the lane's dims 2t, 2t + 1 and their partners 2t + 8, 2t + 9
// (both halves of a row sit in the same lane), each row at its position.
template <typename T>
__device__ __forceinline__ void rotate_query(const Params& p, int64_t first, uint32_t (&a)[4]) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t query = first + g + 8 * r;
    if (query >= p.queries) continue;
    float2 lo = unpack_two<T>(a[r]), hi = unpack_two<T>(a[r + 2]);
    rotate_two(p, query, 2 * t, lo, hi);
    a[r] = pack_two<T>(lo.x, lo.y);
    a[r + 2] = pack_two<T>(hi.x, hi.y);
  }
}

// Online-softmax state of a warp's 16 query rows: lane (g, t) holds rows g and g + 8.
struct TileState {
  float max[2] = {-INFINITY, -INFINITY};  // running max of the raw scores
  // Running sum of the probabilities as the P V product takes them (rounded to T), summed by the
  // tensor cores: P times a 16 x 8 matrix of ones, so every column of the accumulator fragment
  // is the row's sum (sum[0] = sum[1]: row g, sum[2] = sum[3]: row g + 8). No shuffles, and no
  // fp32 add per score.
  float sum[4] = {};
  float out[2][4] = {};  // [dims 0-7 | 8-15] accumulator fragments
};

// 2^x with denormal results flushed to zero: one MUFU.EX2 (exp2f also rescales arguments below
// -126 to keep denormals, three more instructions per score). A probability below 2^-126 of the
// row's largest is zero once it is rounded to fp16 / bf16 for the P V product, and adds nothing
// to an fp32 sum that holds at least 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// One staged chunk of `count` keys, kTiles = ceil(count / 16) tiles of 16 (the last rounded up
// with zero rows), for the warp's queries. The tile count is a template argument so that every
// loop unrolls without guards; the scores stay raw (the max taken over them, the scale folded
// into the exponent's FMA: s * scale - max * scale), and only the last tile masks keys.
template <typename T, int kTiles>
__device__ __forceinline__ void attend_tiles(const uint32_t (&query)[4], const T* keys,
                                             const T* values, int count, float scale_log2,
                                             TileState& st) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int matrix = lane / 8, row = lane % 8;

  float s[2 * kTiles][4];
#pragma unroll
  for (int kt = 0; kt < kTiles; ++kt) {
    // Matrices: keys +0..7 / +8..15 (bit 1) x dims 0-7 / 8-15 (bit 0): B fragments of 2 tiles.
    uint32_t b[4];
    ldmatrix_x4(b, keys + swizzled(kt * 16 + row + 8 * (matrix >> 1), matrix & 1));
#pragma unroll
    for (int i = 0; i < 4; ++i) s[2 * kt][i] = s[2 * kt + 1][i] = 0.f;
    mma<T>(s[2 * kt], query, b[0], b[1]);
    mma<T>(s[2 * kt + 1], query, b[2], b[3]);
  }
  if (count < kTiles * 16) {  // the zero rows of the last tile
#pragma unroll
    for (int n = 2 * kTiles - 2; n < 2 * kTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (n * 8 + 2 * t + (i & 1) >= count) s[n][i] = -INFINITY;
      }
    }
  }

  // The row maxima as 4 independent chains per row (a tile's two columns x even / odd tiles),
  // joined at the end: a chain of 2 kTiles dependent FMNMX would stall on each one's latency.
  float partial[2][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[i >> 1][i & 1] = s[0][i], partial[i >> 1][2 + (i & 1)] = s[1][i];
#pragma unroll
  for (int n = 2; n < 2 * kTiles; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float& m = partial[i >> 1][(n & 1) * 2 + (i & 1)];
      m = fmaxf(m, s[n][i]);
    }
  }
  float chunk_max[2], rescale[2], offset[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    chunk_max[r] = fmaxf(fmaxf(partial[r][0], partial[r][1]), fmaxf(partial[r][2], partial[r][3]));
    chunk_max[r] = fmaxf(chunk_max[r], __shfl_xor_sync(0xffffffffu, chunk_max[r], 1));
    chunk_max[r] = fmaxf(chunk_max[r], __shfl_xor_sync(0xffffffffu, chunk_max[r], 2));
    const float new_max = fmaxf(st.max[r], chunk_max[r]);  // finite: the chunk has a used key
    rescale[r] = st.max[r] == -INFINITY ? 0.f : exp2_ftz((st.max[r] - new_max) * scale_log2);
    st.max[r] = new_max;
    offset[r] = new_max * scale_log2;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    st.sum[i] *= rescale[i >> 1];
    st.out[0][i] *= rescale[i >> 1];
    st.out[1][i] *= rescale[i >> 1];
  }
  const uint32_t ones = pack_two<T>(1.f, 1.f);  // B fragment of a matrix of ones

#pragma unroll
  for (int kt = 0; kt < kTiles; ++kt) {
    uint32_t a[4];  // P of keys kt*16 .. +15: the two 8-key score tiles, packed
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int n = 2 * kt + half;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[n][i] = exp2_ftz(fmaf(s[n][i], scale_log2, -offset[i >> 1]));  // 0 for masked keys
      }
      a[2 * half] = pack_two<T>(s[n][0], s[n][1]);      // row g
      a[2 * half + 1] = pack_two<T>(s[n][2], s[n][3]);  // row g + 8
    }
    // Matrices: keys +0..7 / +8..15 (bit 0) x dims 0-7 / 8-15 (bit 1), transposed: B fragments
    // of the two 8-dim output tiles.
    uint32_t b[4];
    ldmatrix_x4_trans(b, values + swizzled(kt * 16 + row + 8 * (matrix & 1), matrix >> 1));
    mma<T>(st.out[0], a, b[0], b[1]);
    mma<T>(st.out[1], a, b[2], b[3]);
    mma<T>(st.sum, a, ones, ones);
  }
}

// attend_tiles for a chunk of 1 to 128 keys (the count is uniform across the warp).
template <typename T>
__device__ __forceinline__ void attend(const uint32_t (&query)[4], const T* keys, const T* values,
                                       int count, float scale_log2, TileState& st) {
  switch ((count + 15) / 16) {
#define TABSERVE_TILES(N)                                                    \
  case N:                                                                    \
    attend_tiles<T, N>(query, keys, values, count, scale_log2, st);          \
    break;
    TABSERVE_TILES(1)
    TABSERVE_TILES(2)
    TABSERVE_TILES(3)
    TABSERVE_TILES(4)
    TABSERVE_TILES(5)
    TABSERVE_TILES(6)
    TABSERVE_TILES(7)
    TABSERVE_TILES(8)
#undef TABSERVE_TILES
    default:
      break;
  }
}

// The query fragment as the kernel multiplies it: rotated with RoPE tables, and for a scale
// that is not positive, signs flipped (negative: exact, and |scale| is used, so the running max
// over raw scores is the max of the scaled ones) or zeroed (0: every score 0, as the softmax of
// scores times 0 has them).
template <typename T, bool kRotate>
__device__ __forceinline__ void prepare_query(const Params& p, int64_t first, uint32_t (&a)[4]) {
  if constexpr (kRotate) rotate_query<T>(p, first, a);
  if (p.query_sign != 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = p.query_sign < 0 ? a[i] ^ 0x80008000u : 0u;
  }
}

// Output rows of the warp's tile: out[b, query, h, :] = accumulator / row sum.
template <typename T>
__device__ __forceinline__ void write_tile(const Params& p, int64_t b, int64_t h, int64_t first,
                                           TileState& st) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t query = first + g + 8 * r;
    if (query >= p.queries) continue;
    const float inverse = 1.f / st.sum[2 * r];
    T* dst = static_cast<T*>(p.out) + ((b * p.queries + query) * p.heads + h) * kD + 2 * t;
#pragma unroll
    for (int d = 0; d < 2; ++d) {
      *reinterpret_cast<uint32_t*>(dst + 8 * d) =
          pack_two<T>(st.out[d][2 * r] * inverse, st.out[d][2 * r + 1] * inverse);
    }
  }
}

// Work unit `unit` of the grid's units: a batch entry, its heads [h0, h0 + heads_per_block) and
// a run of query tiles; `used` is the entry's real key count.
struct Unit {
  int64_t b, h0, first_tile, tiles, used;
};

// In 32-bit arithmetic (the host checks that the units fit): a 64-bit division is a long
// software routine on the GPU.
__device__ __forceinline__ Unit unit_at(const Params& p, int64_t unit) {
  Unit u;
  const auto index = static_cast<uint32_t>(unit);
  const auto blocks_per_group = static_cast<uint32_t>(p.blocks_per_group);
  const uint32_t group = index / blocks_per_group;  // (batch entry, head group)
  const auto groups_per_entry = static_cast<uint32_t>(p.heads / p.heads_per_block);
  u.b = group / groups_per_entry;
  u.h0 = static_cast<int64_t>(group % groups_per_entry) * p.heads_per_block;
  u.first_tile = static_cast<int64_t>(index % blocks_per_group) * p.tiles_per_block;
  u.tiles = smaller(p.tiles_per_block, (p.queries + 15) / 16 - u.first_tile);
  u.used = p.keys;
  if (p.n_keys != nullptr) {
    const int64_t index = u.b * p.n_keys_stride;
    const int64_t raw = p.n_keys_long ? static_cast<const int64_t*>(p.n_keys)[index]
                                      : static_cast<const int32_t*>(p.n_keys)[index];
    u.used = smaller(raw < 1 ? int64_t{1} : raw, p.keys);
  }
  return u;
}

template <typename T>
__device__ __forceinline__ const T* head_base(const Operand& o, const Unit& u) {
  return static_cast<const T*>(o.data) + u.b * o.batch_stride + u.h0 * o.head_stride;
}

// Keys of a unit in one chunk (<= 128).
template <typename T, bool kRotate>
__global__ void __launch_bounds__(kThreads, 2) one_chunk_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) unsigned char staging[];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int heads = static_cast<int>(p.heads_per_block);
  const int64_t buffer = 2 * heads * p.staged_rows * kD;  // elements: keys, then values
  T* const buffers = reinterpret_cast<T*>(staging);
  {
    // Every key of a unit fits one staging buffer. Blocks stay resident and walk the units with
    // the grid's stride, staging unit i + 1 into the other buffer (cp.async) while the warps
    // take unit i's (head, tile) items in turn, each warp loading its next item's queries
    // before it attends over the current one.
    const auto issue = [&](int64_t unit, int slot) {
      const Unit u = unit_at(p, unit);
      const int count = static_cast<int>(u.used);
      T* keys = buffers + slot * buffer;
      stage<T>(p, head_base<T>(p.k, u), head_base<T>(p.v, u), 0, count, (count + 15) & ~15,
               heads, keys, keys + buffer / 2);
    };
    if (blockIdx.x < p.units) issue(blockIdx.x, 0);
    commit_copies();
    int slot = 0;
    for (int64_t unit = blockIdx.x; unit < p.units; unit += gridDim.x, slot ^= 1) {
      if (unit + gridDim.x < p.units) issue(unit + gridDim.x, slot ^ 1);
      commit_copies();  // (an empty group on the last unit keeps the count of groups uniform)
      wait_copies<1>();  // this unit's copies have landed, the next unit's may be in flight
      __syncthreads();
      const Unit u = unit_at(p, unit);
      const int count = static_cast<int>(u.used);
      T* const keys = buffers + slot * buffer;
      T* const values = keys + buffer / 2;
      if constexpr (kRotate) {
        rotate_staged<T>(p, 0, count, heads, keys);
        __syncthreads();
      }
      const T* q = head_base<T>(p.q, u);
      const int tiles = static_cast<int>(u.tiles);  // <= kMaxOneChunkTiles
      // The warp's items are warp, warp + kWarps, ...: item = head * tiles + tile, walked with a
      // carried (head, tile) pair rather than a division per item.
      int head = warp / tiles, tile = warp % tiles;
      const auto first_query = [&](int at) { return (u.first_tile + at) * 16; };
      uint32_t next[4];
      if (head < heads) {
        load_query<T>(q + head * p.q.head_stride, p.q.row_stride, first_query(tile), p.queries,
                      p.aligned, next);
      }
      while (head < heads) {
        uint32_t query[4] = {next[0], next[1], next[2], next[3]};
        int later_head = head, later_tile = tile + kWarps;
        while (later_tile >= tiles) later_tile -= tiles, ++later_head;
        if (later_head < heads) {
          load_query<T>(q + later_head * p.q.head_stride, p.q.row_stride,
                        first_query(later_tile), p.queries, p.aligned, next);
        }
        const int64_t first = first_query(tile);
        prepare_query<T, kRotate>(p, first, query);
        TileState st;
        attend<T>(query, keys + head * p.staged_rows * kD, values + head * p.staged_rows * kD,
                  count, p.scale_log2, st);
        write_tile<T>(p, u.b, u.h0 + head, first, st);
        head = later_head;
        tile = later_tile;
      }
      __syncthreads();  // every warp is done with this buffer before it is staged into again
    }
  }
#endif
}

// Past 128 keys: one unit per block (one head, warp w owns query tile w), keys streamed 128 at a
// time through the buffer with an online softmax.
template <typename T, bool kRotate>
__global__ void __launch_bounds__(kThreads, 2) streaming_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) unsigned char staging[];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t buffer = 2 * p.staged_rows * kD;  // elements: keys, then values
  T* const buffers = reinterpret_cast<T*>(staging);
  const Unit u = unit_at(p, blockIdx.x);
  T* const keys = buffers;
  T* const values = keys + buffer / 2;
  const T* k = head_base<T>(p.k, u);
  const T* v = head_base<T>(p.v, u);
  const bool active = warp < u.tiles;
  const int64_t first = (u.first_tile + warp) * 16;
  uint32_t query[4];
  if (active) {
    load_query<T>(head_base<T>(p.q, u), p.q.row_stride, first, p.queries, p.aligned, query);
    prepare_query<T, kRotate>(p, first, query);
  }
  TileState st;
  for (int64_t start = 0; start < u.used; start += kChunk) {
    const int count = static_cast<int>(smaller(int64_t{kChunk}, u.used - start));
    if (start > 0) __syncthreads();  // every warp is done with the previous chunk
    stage<T>(p, k, v, start, count, (count + 15) & ~15, 1, keys, values);
    commit_copies();
    wait_copies<0>();
    __syncthreads();
    if constexpr (kRotate) {
      rotate_staged<T>(p, start, count, 1, keys);
      __syncthreads();
    }
    if (active) attend<T>(query, keys, values, count, p.scale_log2, st);
  }
  if (active) write_tile<T>(p, u.b, u.h0, first, st);
#endif
}

Operand operand(const at::Tensor& t) {
  return {t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

bool rows_aligned(const at::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
}

at::Tensor small_head_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                     const at::Tensor& v_in,
                                     const std::optional<at::Tensor>& n_keys,
                                     std::optional<double> scale,
                                     const std::optional<at::Tensor>& rotary_cos,
                                     const std::optional<at::Tensor>& rotary_sin) {
  check_small_head_attention(q_in, k_in, v_in, n_keys, rotary_cos, rotary_sin);
  TORCH_CHECK(q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16,
              "small_head_attention on CUDA takes float16 or bfloat16 q, k and v (tensor cores), "
              "got ", q_in.scalar_type(), "; fp32 attention runs through SDPA");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int multiprocessors =
      tensor_core::tensor_core_multiprocessors("small_head_attention", q_in.get_device());
  at::Tensor out = small_head_attention_output(q_in);
  if (out.numel() == 0) return out;
  const auto unit_last = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in);

  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), keys = k.size(2);
  const int64_t tiles = (queries + 15) / 16;
  Params params{};
  params.heads_per_block = 1;
  if (keys <= kChunk) {
    params.staged_rows = static_cast<int>((keys + 15) & ~int64_t{15});
    const int64_t head_bytes = 2 * params.staged_rows * kD * q.element_size();
    // Few query tiles per head (the row stage): one block takes every head of a batch entry.
    if (heads * tiles <= kMaxOneChunkTiles && heads * head_bytes <= kStagingBytes) {
      params.heads_per_block = heads;
    }
    params.tiles_per_block = std::min(tiles, kMaxOneChunkTiles);
  } else {
    params.staged_rows = kChunk;
    params.tiles_per_block = std::min<int64_t>(tiles, kWarps);
  }
  // Even split of a head's tiles over its blocks (640 tiles: 10 blocks of 64, not 9 + 1 of 64).
  params.blocks_per_group = (tiles + params.tiles_per_block - 1) / params.tiles_per_block;
  params.tiles_per_block = (tiles + params.blocks_per_group - 1) / params.blocks_per_group;
  params.units = batch * (heads / params.heads_per_block) * params.blocks_per_group;
  const bool one_chunk = keys <= kChunk;
  // Both kernels split unit indices in 32-bit arithmetic (and the streaming grid has one block
  // per unit).
  TORCH_CHECK(params.units <= std::numeric_limits<int32_t>::max(),
              "small_head_attention: batch * heads * query blocks must fit the grid (2^31 - 1), ",
              "got ", params.units);

  params.q = operand(q);
  params.k = operand(k);
  params.v = operand(v);
  params.out = out.data_ptr();
  params.heads = heads;
  params.queries = queries;
  params.keys = keys;
  params.n_keys = nullptr;
  if (n_keys.has_value()) {
    params.n_keys = n_keys->const_data_ptr();
    params.n_keys_long = n_keys->scalar_type() == at::kLong;
    params.n_keys_stride = n_keys->dim() == 0 ? 0 : n_keys->stride(0);
  }
  const double softmax_scale = scale.value_or(0.25);
  params.query_sign = softmax_scale > 0 ? 1 : (softmax_scale < 0 ? -1 : 0);
  params.scale_log2 =
      static_cast<float>(softmax_scale == 0 ? 1.0 : std::abs(softmax_scale)) * kLog2e;
  params.aligned = rows_aligned(q) && rows_aligned(k) && rows_aligned(v);
  // Contiguous tables (a copy only for a strided view: they are [L, 16] floats).
  at::Tensor cos, sin;
  if (rotary_cos.has_value()) {
    cos = rotary_cos->contiguous();
    sin = rotary_sin->contiguous();
    params.cos = cos.const_data_ptr<float>();
    params.sin = sin.const_data_ptr<float>();
  }

  // One chunk of keys: two staging buffers (a unit's keys land while the previous unit's are
  // attended over), and as many blocks as stay resident, each walking the units.
  const int64_t buffer_bytes =
      2 * params.heads_per_block * params.staged_rows * kD * q.element_size();
  const auto shared = static_cast<size_t>((one_chunk ? 2 : 1) * buffer_bytes);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto kernel) {
    int64_t grid = params.units;
    if (one_chunk) {
      if (shared > kStagingBytes) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(shared)));
      }
      int blocks_per_sm = 0;
      C10_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, shared));
      grid = std::min<int64_t>(
          grid, static_cast<int64_t>(std::max(blocks_per_sm, 1)) * multiprocessors);
    }
    kernel<<<static_cast<unsigned int>(grid), kThreads, shared, stream>>>(params);
  };
  const bool rotate = params.cos != nullptr;
  const auto dispatch = [&](auto element) {
    using T = decltype(element);
    if (one_chunk) {
      launch(rotate ? one_chunk_kernel<T, true> : one_chunk_kernel<T, false>);
    } else {
      launch(rotate ? streaming_kernel<T, true> : streaming_kernel<T, false>);
    }
  };
  if (q.scalar_type() == at::kHalf) {
    dispatch(__half{});
  } else {
    dispatch(__nv_bfloat16{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tabserve, CUDA, m) {
  m.impl("small_head_attention", &small_head_attention_cuda);
}

}  // namespace ops
}  // namespace tabserve
