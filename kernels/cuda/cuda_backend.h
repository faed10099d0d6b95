// What the CUDA op table (CudaOps() in kernels/ops.h) adds to the backend-independent contract.
// Only defined when fp8rt is built with FP8RT_CUDA=ON.
//
// Buffers. Every pointer in the argument structs of a CUDA op is device memory (cudaMalloc'd,
// managed, or mapped pinned host memory; a plain host pointer is refused with InvalidArgument
// before anything is launched): inputs, outputs, scale arrays, the QuantStats a quantize fills
// and the amax outputs. Plain values in the structs (QuantizeArgs::scale, shapes, flags) are
// read on the host when the op is called. Every op is enqueued on the given stream
// (Stream::handle is a cudaStream_t; null is the legacy default stream) and returns without
// waiting; its results are there once the stream has passed it. Ops run on the calling thread's
// current device. Nothing is allocated on the device behind the caller's back; the only state
// the backend keeps is one cuBLASLt handle per device and a cache of cuBLASLt algorithm choices
// per GEMM shape, both created on first use and kept for the life of the process.
//
// Numerics. quantize, dequantize, amax, convert and cast_transpose give bit for bit the CPU
// backend's results (codes, scales, every QuantStats field; a NaN output is the quiet NaN
// 0x7FC00000 in both). The GEMMs follow kernels/gemm.h; their FP32 sums are accumulated in a
// different order than on the CPU, and cuBLASLt's FP8 tensor cores add products with reduced
// precision inside each 128-wide slice of K before promoting to FP32 (FAST_ACCUM stays off), so
// GEMM results agree with the CPU within the bounds tests/gpu/ops_cuda_test.cc writes out.
//
// GEMM paths. gemm_fp8 runs cuBLASLt (TN layout, CUBLAS_COMPUTE_32F, scale pointers; block
// scaling through the CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F mode for A's 1x128 tiles and
// BLK128x128_32F for B's 128x128 blocks, Hopper only) when M, N and K are multiples of 16, the
// buffers 16-byte aligned, the format pair is not E5M2 x E5M2, for block scaling K is a multiple
// of 128 and the GPU is sm_90, and cuBLASLt's heuristic offers an algorithm; otherwise a tiled
// CUDA-core kernel with FP32 accumulation and the same scaling semantics
// (kernels/cuda/gemm_kernels.h). gemm_bf16 rounds FP32 operands to BF16 into the workspace, then
// runs cuBLASLt BF16 x BF16 -> FP32 accumulation (same fallback). gemm_f32 is cuBLASLt with
// CUBLAS_COMPUTE_32F: plain FP32, TF32 off.
#ifndef FP8RT_KERNELS_CUDA_CUDA_BACKEND_H_
#define FP8RT_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/gemm.h"

namespace fp8rt::kernels {

// Device workspace the CUDA GEMMs need for these arguments (64-byte aligned parts): block
// scaling carves its scales rearranged for cuBLASLt, the BF16 GEMM its operands rounded to BF16.
// The CUDA ops check Fp8GemmArgs/Bf16GemmArgs::workspace_bytes against this (not against
// GemmWorkspaceBytes, which sizes the CPU backend). Whatever the caller gives beyond it becomes
// cuBLASLt's own workspace; give kCublasLtWorkspaceBytes more to let it pick its fastest
// algorithms (with none, it picks among those that need no workspace).
size_t CudaGemmWorkspaceBytes(const Fp8GemmArgs& args);
size_t CudaGemmWorkspaceBytes(const Bf16GemmArgs& args);

// The cuBLASLt workspace NVIDIA recommends on Hopper (cuBLAS documentation, cublasLtMatmul).
inline constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;

namespace cuda_testing {

// How many FP8/BF16 GEMM calls each path has run in this process (all devices, all threads), so
// that tests and benchmarks can tell which one they measured.
struct GemmPathCounts {
  int64_t cublaslt = 0;
  int64_t fallback = 0;
};
GemmPathCounts GetGemmPathCounts();

// Sends every FP8 and BF16 GEMM to the CUDA-core fallback kernel instead of cuBLASLt, so that
// tests can compare the two paths on the same shapes. Not for production use.
void ForceGemmFallback(bool force);

// Runs the device FP32 -> FP8 encoder of the quantize kernels and NVIDIA's hardware conversion
// (__nv_cvt_float_to_fp8 with __NV_SATFINITE, cvt.rn.satfinite on sm_89+) on all 2^32 float bit
// patterns and returns the number of patterns whose codes differ (synchronous).
absl::StatusOr<int64_t> CountEncodeMismatchesWithHardware(Fp8Format format);

}  // namespace cuda_testing

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_CUDA_CUDA_BACKEND_H_
