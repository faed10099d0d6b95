// Registration site of the CUDA backend: the op table, offered when a device fp8rt's kernels can
// run on is present (compute capability 9.0: the kernels are built for sm_90, and cuBLASLt's
// block-scaled FP8 modes are Hopper's), and an error saying why otherwise.
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/ops.h"

namespace fp8rt::kernels {

int CudaDeviceCount(std::string* why) { return cuda_internal::DeviceCount(why); }

absl::StatusOr<const OpTable*> CudaOps() {
  static constexpr OpTable kTable = {
      .backend = Backend::kCuda,
      .name = "cuda",
      .quantize = &cuda_internal::QuantizeCuda,
      .dequantize = &cuda_internal::DequantizeCuda,
      .amax = &cuda_internal::AmaxCuda,
      .convert = &cuda_internal::ConvertCuda,
      .gemm_fp8 = &cuda_internal::GemmFp8Cuda,
      .gemm_bf16 = &cuda_internal::GemmBf16Cuda,
      .gemm_f32 = &cuda_internal::GemmF32Cuda,
      .cast_transpose = &cuda_internal::CastTransposeCuda,
      .fp8_gemm_workspace_bytes = +[](const Fp8GemmArgs& args) -> size_t {
        return CudaGemmWorkspaceBytes(args) + kCublasLtWorkspaceBytes;
      },
      .bf16_gemm_workspace_bytes = +[](const Bf16GemmArgs& args) -> size_t {
        return CudaGemmWorkspaceBytes(args) + kCublasLtWorkspaceBytes;
      },
      .layer = &cuda_internal::kLayerOps,
  };
  std::string why;
  if (CudaDeviceCount(&why) == 0) return absl::UnavailableError("no CUDA device: " + why);
  absl::StatusOr<int> cc = cuda_internal::CurrentDeviceComputeCapability();
  if (!cc.ok()) return absl::UnavailableError(absl::StrCat("CUDA device: ", cc.status().message()));
  if (*cc < 90) {
    return absl::UnavailableError(
        absl::StrCat("the current CUDA device has compute capability ", *cc / 10, ".", *cc % 10,
                     "; fp8rt's CUDA kernels are built for sm_90 (Hopper) only"));
  }
  return &kTable;
}

}  // namespace fp8rt::kernels
