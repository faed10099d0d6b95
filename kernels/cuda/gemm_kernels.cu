// CUDA kernels behind the GEMM ops that are not cuBLASLt itself (see gemm_kernels.h).
//
// FallbackGemmKernel: 64 x 64 output tiles, 256 threads of 4 x 4 outputs each, K in steps of 32
// through shared memory. Not fast (CUDA-core FMAs, a few TFLOP/s); it runs where cuBLASLt's FP8
// kernels do not: K, M or N not multiples of 16, E5M2 x E5M2 (no cuBLASLt FP8 kernel takes it),
// block scaling where the installed cuBLASLt or the GPU lacks the scale modes, and any problem
// the cuBLASLt heuristic declines.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/gemm_kernels.h"
#include "kernels/cuda/launch.cuh"

namespace fp8rt::kernels::cuda_internal {
namespace {

constexpr int kTile = 64;
constexpr int kStepK = 32;
constexpr int kThreads = 256;

template <OperandKind K>
__device__ __forceinline__ float LoadOperand(const void* p, int64_t i) {
  if constexpr (K == OperandKind::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  } else {
    return DecodeFp8(static_cast<const uint8_t*>(p)[i], K == OperandKind::kE4M3);
  }
}

// The E8M0 scale 2^(e - 127) of an MX block (e = 255: NaN), built from its bits.
__device__ __forceinline__ float E8m0Scale(uint8_t e) {
  if (e == 255) return __int_as_float(0x7fc00000);
  if (e == 0) return __int_as_float(0x00400000);  // 2^-127, a subnormal
  return __int_as_float(static_cast<int>(e) << 23);
}

template <OperandKind KA, OperandKind KB>
__global__ void __launch_bounds__(kThreads) FallbackGemmKernel(FallbackGemmParams p) {
  FP8RT_STATIC_SHARED(float, as, [kStepK][kTile + 4]);  // as[kk][row of the tile]
  FP8RT_STATIC_SHARED(float, bs, [kStepK][kTile + 4]);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const bool block = p.scaling == GemmScaling::kBlock;
  const bool mx = p.scaling == GemmScaling::kMx32;
  const int64_t kb_count = (p.k + 127) / 128;
  float part[4][4] = {};  // FP32 partial sums (of the current 128-slice with block scaling)
  float acc[4][4] = {};   // block scaling: the scaled sum of the finished slices
  if (block && p.accumulate) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t gm = m0 + ty * 4 + i, gn = n0 + tx * 4 + j;
        if (gm < p.m && gn < p.n) acc[i][j] = static_cast<const float*>(p.d)[gm * p.n + gn];
      }
    }
  }
  for (int64_t k0 = 0; k0 < p.k; k0 += kStepK) {
    for (int i = threadIdx.x; i < kTile * kStepK; i += kThreads) {
      const int row = i / kStepK, kk = i % kStepK;  // consecutive threads: consecutive k
      const int64_t gk = k0 + kk;
      const int64_t gm = m0 + row, gn = n0 + row;
      as[kk][row] = (gm < p.m && gk < p.k) ? LoadOperand<KA>(p.a, gm * p.k + gk) : 0.0f;
      bs[kk][row] = (gn < p.n && gk < p.k) ? LoadOperand<KB>(p.b, gn * p.k + gk) : 0.0f;
      if (mx) {  // exact: a power of two
        const int64_t kb32 = (p.k + 31) / 32;
        if (gm < p.m && gk < p.k) as[kk][row] *= E8m0Scale(p.a_e8m0[gm * kb32 + gk / 32]);
        if (gn < p.n && gk < p.k) bs[kk][row] *= E8m0Scale(p.b_e8m0[gn * kb32 + gk / 32]);
      }
    }
    __syncthreads();
    // Unrolled by 4: by 8, the BF16 x BF16 kernel spilled 40 bytes of registers at sm_90.
#pragma unroll 4
    for (int kk = 0; kk < kStepK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = as[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = bs[kk][tx * 4 + j];
        // The products are exact in FP32, so the FMA rounds exactly as a multiply-then-add would.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = fmaf(a[i], b[j], part[i][j]);
      }
    }
    __syncthreads();
    const bool slice_done = (k0 + kStepK) % 128 == 0 || k0 + kStepK >= p.k;
    if (block && slice_done) {
      const int64_t kb = k0 / 128;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t gm = m0 + ty * 4 + i;
        const float sa = gm < p.m ? p.a_scale_inv[gm * kb_count + kb] : 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t gn = n0 + tx * 4 + j;
          if (gm < p.m && gn < p.n) {
            const float s = __fmul_rn(sa, p.b_scale_inv[(gn / 128) * kb_count + kb]);
            acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(s, part[i][j]));
          }
          part[i][j] = 0.0f;
        }
      }
    }
  }
  float alpha = 1.0f;
  if (!block && p.a_scale_inv != nullptr) alpha = __fmul_rn(p.a_scale_inv[0], p.b_scale_inv[0]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t gm = m0 + ty * 4 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t gn = n0 + tx * 4 + j;
      if (gm >= p.m || gn >= p.n) continue;
      float v;
      if (block) {
        v = acc[i][j];
      } else {
        v = __fmul_rn(alpha, part[i][j]);
        if (p.accumulate) v = __fadd_rn(static_cast<const float*>(p.d)[gm * p.n + gn], v);
      }
      if (p.out_type == OutputType::kF32) {
        static_cast<float*>(p.d)[gm * p.n + gn] = v;
      } else {
        static_cast<uint16_t*>(p.d)[gm * p.n + gn] = FloatToBf16(v);
      }
    }
  }
}

// One launch of kThreads-thread blocks through launch.cuh (so that tests/gpu/gemm_host_test runs
// this file on the CPU), then the launch's error.
template <class Kernel, class... Args>
cudaError_t LaunchKernel(Kernel kernel, dim3 grid, cudaStream_t stream, Args... args) {
  FP8RT_LAUNCH(kernel, grid, dim3(kThreads), 0, stream)(args...);
  return cudaGetLastError();
}

template <OperandKind KA>
cudaError_t LaunchWithA(const FallbackGemmParams& p, dim3 grid, cudaStream_t stream) {
  switch (p.b_kind) {
    case OperandKind::kE4M3:
      return LaunchKernel(FallbackGemmKernel<KA, OperandKind::kE4M3>, grid, stream, p);
    case OperandKind::kE5M2:
      return LaunchKernel(FallbackGemmKernel<KA, OperandKind::kE5M2>, grid, stream, p);
    case OperandKind::kBF16:
      return LaunchKernel(FallbackGemmKernel<KA, OperandKind::kBF16>, grid, stream, p);
  }
  return cudaErrorInvalidValue;
}

__global__ void BlockScaleLayoutKernel(const float* __restrict__ a_si, int64_t m, int64_t kb_count,
                                       float* __restrict__ a_out, int64_t m_pad,
                                       const float* __restrict__ b_si, int64_t nb_count,
                                       float* __restrict__ b_out, int64_t kb_pad) {
  const int64_t a_total = kb_count * m_pad, total = a_total + nb_count * kb_pad;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    if (i < a_total) {
      const int64_t kb = i / m_pad, row = i % m_pad;
      a_out[i] = row < m ? a_si[row * kb_count + kb] : 0.0f;
    } else {
      const int64_t j = i - a_total, nb = j / kb_pad, kb = j % kb_pad;
      b_out[j] = kb < kb_count ? b_si[nb * kb_count + kb] : 0.0f;
    }
  }
}

__global__ void RoundToBf16Kernel(const float* __restrict__ in, int64_t n,
                                  uint16_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = FloatToBf16(in[i]);
  }
}

}  // namespace

cudaError_t LaunchFallbackGemm(const FallbackGemmParams& p, cudaStream_t stream) {
  const int64_t grid_n = (p.n + kTile - 1) / kTile, grid_m = (p.m + kTile - 1) / kTile;
  if (grid_m > 65535 || grid_n > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(grid_n), static_cast<unsigned>(grid_m));
  switch (p.a_kind) {
    case OperandKind::kE4M3:
      return LaunchWithA<OperandKind::kE4M3>(p, grid, stream);
    case OperandKind::kE5M2:
      return LaunchWithA<OperandKind::kE5M2>(p, grid, stream);
    case OperandKind::kBF16:
      return LaunchWithA<OperandKind::kBF16>(p, grid, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchBlockScaleLayout(const float* a_scale_inv, int64_t m, int64_t kb_count,
                                   float* a_out, int64_t m_pad, const float* b_scale_inv,
                                   int64_t nb_count, float* b_out, int64_t kb_pad,
                                   cudaStream_t stream) {
  const int64_t total = kb_count * m_pad + nb_count * kb_pad;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 4096);
  return LaunchKernel(BlockScaleLayoutKernel, dim3(static_cast<unsigned>(blocks)), stream,
                      a_scale_inv, m, kb_count, a_out, m_pad, b_scale_inv, nb_count, b_out, kb_pad);
}

__global__ void Mx32ScaleLayoutKernel(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst,
                                      int64_t rows_pad, int64_t cols_pad) {
  const int64_t total = rows_pad * cols_pad;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols_pad, c = i % cols_pad;
    dst[Mx32ScaleTileOffset(r, c, cols_pad)] =
        r < rows && c < cols ? src[r * cols + c] : uint8_t{127};
  }
}

cudaError_t LaunchMx32ScaleLayout(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst,
                                  cudaStream_t stream) {
  const int64_t rows_pad = (rows + 127) / 128 * 128, cols_pad = (cols + 3) / 4 * 4;
  const int64_t total = rows_pad * cols_pad;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 4096);
  return LaunchKernel(Mx32ScaleLayoutKernel, dim3(static_cast<unsigned>(blocks)), stream, src, rows,
                      cols, dst, rows_pad, cols_pad);
}

cudaError_t LaunchRoundToBf16(const float* in, int64_t n, uint16_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 8192);
  return LaunchKernel(RoundToBf16Kernel, dim3(static_cast<unsigned>(blocks)), stream, in, n, out);
}

}  // namespace fp8rt::kernels::cuda_internal
