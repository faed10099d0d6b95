// GEMM arguments: D = (A * sa) x (B * sb)^T with FP32 accumulation.
//
// A is M x K and B is N x K, both row-major (the "TN" layout FP8 tensor cores use), D is M x N
// row-major. FP8 is the operand format, never the accumulator: products of FP8 values are exact
// in FP32 and the sum is accumulated in FP32.
//   kTensor scaling: one scale_inv for A and one for B; D = sa * sb * (A x B^T).
//   kBlock scaling (DeepSeek-V3): A has one scale_inv per 1x128 tile (grid M x ceil(K/128)), B one
//     per 128x128 block (grid ceil(N/128) x ceil(K/128)); each 128-wide slice of K is multiplied
//     out in FP32, scaled by sa(m, kb) * sb(n/128, kb) and added into the FP32 result.
//   kMx32 scaling (OCP MX v1.0, MXFP8): A and B each have one E8M0 scale per 1x32 block along K
//     (grids M x ceil(K/32) and N x ceil(K/32) of codes, a_e8m0 / b_e8m0; the scale of code e is
//     2^(e - 127), code 255 is NaN). Each element is multiplied by its own block's scale, which
//     is exact (a power of two), and the products are summed in FP32. scale_inv is not read.
// The `bf16` precision mode GEMM takes FP32 (or BF16) operands, rounds FP32 ones to BF16 (nearest
// even) and multiplies them with FP32 accumulation, as a BF16 tensor core does.
//
// Work buffers come from the caller (GemmWorkspaceBytes bytes, 64-byte aligned); the kernels
// never allocate.
#ifndef FP8RT_KERNELS_GEMM_H_
#define FP8RT_KERNELS_GEMM_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/formats.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {

enum class GemmScaling : uint8_t { kTensor, kBlock, kMx32 };
enum class OutputType : uint8_t { kF32, kBF16 };

struct Fp8GemmArgs {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  const uint8_t* a = nullptr;  // M x K FP8 codes
  Fp8Format a_format = Fp8Format::kE4M3;
  const uint8_t* b = nullptr;  // N x K FP8 codes (K x N with b_transposed)
  Fp8Format b_format = Fp8Format::kE4M3;
  // B given transposed: K x N row-major (B^T), so that a caller holding B^T (a weight in the
  // backward's dgrad, an input in its wgrad) need not transpose it first. Tensor scaling only,
  // and only on a backend whose OpTable::gemm_fp8_takes_b_transposed is set (the CPU; cuBLASLt's
  // FP8 GEMMs take B as N x K only).
  bool b_transposed = false;
  GemmScaling scaling = GemmScaling::kTensor;
  const float* a_scale_inv = nullptr;  // 1 value, or M x ceil(K/128) for kBlock
  const float* b_scale_inv = nullptr;  // 1 value, or ceil(N/128) x ceil(K/128) for kBlock
  const uint8_t* a_e8m0 = nullptr;     // kMx32: M x ceil(K/32) E8M0 codes
  const uint8_t* b_e8m0 = nullptr;     // kMx32: N x ceil(K/32) E8M0 codes
  OutputType out_type = OutputType::kF32;
  void* d = nullptr;        // M x N, float or BF16 bits
  bool accumulate = false;  // D += result instead of D = result (FP32 output only)
  // CUDA, tensor scaling: let the tensor cores accumulate the FP8 products at their own reduced
  // precision instead of promoting the partial sums to FP32 every few K steps (cuBLASLt
  // FAST_ACCUM; faster, less exact). Ignored by block and mx32 scaling, which always promote,
  // and by the CPU, which always sums in FP32. The training forward GEMM takes it from
  // precision.fp8_fast_accum_forward; dgrad and wgrad never set it.
  bool fast_accum = false;
  void* workspace = nullptr;  // GemmWorkspaceBytes(*this) bytes, 64-byte aligned
  size_t workspace_bytes = 0;
};

struct Bf16GemmArgs {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  InputType a_type = InputType::kF32;
  const void* a = nullptr;  // M x K
  InputType b_type = InputType::kF32;
  const void* b = nullptr;  // N x K
  OutputType out_type = OutputType::kF32;
  void* d = nullptr;          // M x N
  bool accumulate = false;    // FP32 output only
  void* workspace = nullptr;  // GemmWorkspaceBytes(*this) bytes, 64-byte aligned
  size_t workspace_bytes = 0;
};

// The `fp32` precision mode GEMM: D = A x B^T in FP32 (A M x K, B N x K, D M x N, all row-major
// FP32), no workspace. The baseline FP8 and BF16 GEMMs are measured against.
struct F32GemmArgs {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  const float* a = nullptr;  // M x K
  const float* b = nullptr;  // N x K
  float* d = nullptr;        // M x N
  bool accumulate = false;   // D += A x B^T
};

// Bytes of workspace the CPU backend needs for these shapes (decoded BF16 operands, and the
// per-K-slice FP32 partial products of block scaling).
size_t GemmWorkspaceBytes(const Fp8GemmArgs& args);
size_t GemmWorkspaceBytes(const Bf16GemmArgs& args);

// Shape, pointer and workspace checks shared by the backends. Errors name the field.
absl::Status ValidateGemmArgs(const Fp8GemmArgs& args, size_t required_workspace);
absl::Status ValidateGemmArgs(const Bf16GemmArgs& args, size_t required_workspace);
absl::Status ValidateGemmArgs(const F32GemmArgs& args);

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_GEMM_H_
