// Warp-level tensor-core building blocks shared by the CUDA kernels that multiply on tensor cores
// (attention.cu, feed_forward.cu): the m16n8k16 product, ldmatrix loads from shared memory and
// packing of two floats into one register of the input dtype (fp16 or bf16); and on the host,
// the check that a GPU has those tiles.
//
// Fragment layout of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t:
//   A (16 x 16, row-major): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
//                           a3 = A[g+8][2t+8, 2t+9];
//   B (16 x 8, "col"):      b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
//   C / D (16 x 8, fp32):   c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1].
// So the accumulators of two neighbouring 8-column tiles, packed to the input dtype, are the A
// fragment of the next product over those 16 columns (FlashAttention-2's trick).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace tabserve {
namespace ops {
namespace tensor_core {

// Checks that `device` has the fp16 / bf16 tensor-core tiles these kernels use (sm80 or newer),
// naming `op` in the error; returns its number of multiprocessors (for grids of resident blocks).
inline int tensor_core_multiprocessors(const char* op, int device) {
  int major = 0, minor = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TORCH_CHECK(major >= 8, op, " needs a GPU of compute capability 8.0 or newer ",
              "(bf16 / fp16 tensor-core tiles), got ", major, ".", minor);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Two floats rounded into T (round to nearest even), packed as one register (first in the low
// half).
template <typename T>
__device__ __forceinline__ uint32_t pack_two(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Two packed T values as floats.
template <typename T>
__device__ __forceinline__ float2 unpack_two(uint32_t packed) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
  }
}

// One T value as a float (torch builds with __CUDA_NO_HALF_CONVERSIONS__: no implicit cast).
template <typename T>
__device__ __forceinline__ float to_float(T value) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(value);
  } else {
    return __bfloat162float(value);
  }
}

// d += a b: one m16n8k16 tensor-core product of T operands, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#define TABSERVE_MMA(TYPE)                                                                  \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                        \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (std::is_same_v<T, __half>) {
    TABSERVE_MMA("f16");
  } else {
    TABSERVE_MMA("bf16");
  }
#undef TABSERVE_MMA
}

// Four 8 x 8 matrices of 16-bit elements from shared memory: lanes 8i..8i+7 give the addresses of
// matrix i's rows (16 bytes each); register i of a lane holds 2 elements of matrix i's row
// lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The same, each matrix transposed (register i holds 2 elements of matrix i's column lane / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

}  // namespace tensor_core
}  // namespace ops
}  // namespace tabserve
