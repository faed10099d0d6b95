// Internal: the CUDA kernels behind the GEMM ops that cuBLASLt does not run (kernels/cuda/
// gemm_cuda.cc decides): a tiled FP32-accumulating GEMM for shapes, alignments and type pairs
// cuBLASLt's FP8 kernels refuse, and the rearrangement of fp8rt's block scales into the layout
// cuBLASLt's VEC128 / BLK128x128 scale modes read.
#ifndef FP8RT_KERNELS_CUDA_GEMM_KERNELS_H_
#define FP8RT_KERNELS_CUDA_GEMM_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm.h"

namespace fp8rt::kernels::cuda_internal {

enum class OperandKind : uint8_t { kE4M3, kE5M2, kBF16 };

// D (M x N, row-major) = [D +] (A x B^T) with A M x K and B N x K row-major, decoded to FP32
// (exactly: FP8 and BF16 values are FP32 values) and multiplied with FP32 accumulation; every
// product is exact in FP32, so only the summation rounds. Scaling as kernels/gemm.h defines it:
//   kTensor: D = (sa * sb) * sum [+ D], sa and sb single device values (null: 1, the BF16 GEMM);
//   kBlock:  per 128-wide slice kb of K, sum_kb in FP32, then D += (sa(m, kb) * sb(n/128, kb)) *
//            sum_kb, in slice order, starting from 0 (or from D with accumulate);
//   kMx32:   each element times its 1x32 block's E8M0 scale 2^(e - 127) as it is loaded (exact),
//            then as kTensor with sa = sb = 1.
struct FallbackGemmParams {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  OperandKind a_kind = OperandKind::kE4M3;
  const void* b = nullptr;
  OperandKind b_kind = OperandKind::kE4M3;
  GemmScaling scaling = GemmScaling::kTensor;
  const float* a_scale_inv = nullptr;  // device
  const float* b_scale_inv = nullptr;  // device
  const uint8_t* a_e8m0 = nullptr;     // device, kMx32: M x ceil(K/32) E8M0 codes
  const uint8_t* b_e8m0 = nullptr;     // device, kMx32: N x ceil(K/32)
  OutputType out_type = OutputType::kF32;
  void* d = nullptr;
  bool accumulate = false;
};
cudaError_t LaunchFallbackGemm(const FallbackGemmParams& p, cudaStream_t stream);

// cuBLASLt's block-scale layouts (the "GEMM-ready" layout Transformer Engine hands to it):
//   VEC128_32F for our A (M x K, 1x128 tiles): a_out[kb * m_pad + m] = a_scale_inv[m * kb_count +
//     kb], M contiguous, m_pad = M rounded up to 4;
//   BLK128x128_32F for our B (N x K, 128x128 blocks): b_out[nb * kb_pad + kb] =
//     b_scale_inv[nb * kb_count + kb], kb_pad = kb_count rounded up to 4.
// Padding entries are written as 0 (never read for in-range blocks).
cudaError_t LaunchBlockScaleLayout(const float* a_scale_inv, int64_t m, int64_t kb_count,
                                   float* a_out, int64_t m_pad, const float* b_scale_inv,
                                   int64_t nb_count, float* b_out, int64_t kb_pad,
                                   cudaStream_t stream);

// mx32 scales for cuBLASLt's VEC32_UE8M0 mode: the row-major `rows` x `cols` E8M0 grid `src`
// (our layout: one code per 1x32 block along K) into `dst` in cuBLASLt's tiled layout
// (Mx32ScaleTileOffset in device_math.cuh), Mx32TiledBytes(rows, cols) bytes; padding entries are
// 127 (2^0), never read for in-range blocks.
inline int64_t Mx32TiledBytes(int64_t rows, int64_t cols) {
  return (rows + 127) / 128 * 128 * ((cols + 3) / 4 * 4);
}
cudaError_t LaunchMx32ScaleLayout(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst,
                                  cudaStream_t stream);

// FP32 -> BF16 bits, nearest even (FloatToBf16), for the operands of the BF16 GEMM.
cudaError_t LaunchRoundToBf16(const float* in, int64_t n, uint16_t* out, cudaStream_t stream);

}  // namespace fp8rt::kernels::cuda_internal

#endif  // FP8RT_KERNELS_CUDA_GEMM_KERNELS_H_
