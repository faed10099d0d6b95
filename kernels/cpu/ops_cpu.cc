// Registration site of the CPU backend.
#include "kernels/cpu/cpu_ops.h"

namespace fp8rt::kernels {

const OpTable& CpuOps() {
  static constexpr OpTable kTable = {
      .backend = Backend::kCpu,
      .name = "cpu",
      .quantize = &cpu_internal::QuantizeCpu,
      .dequantize = &cpu_internal::DequantizeCpu,
      .amax = &cpu_internal::AmaxCpu,
      .convert = &cpu_internal::ConvertCpu,
      .gemm_fp8 = &cpu_internal::GemmFp8Cpu,
      .gemm_bf16 = &cpu_internal::GemmBf16Cpu,
      .gemm_f32 = &cpu_internal::GemmF32Cpu,
      .cast_transpose = &cpu_internal::CastTransposeCpu,
      .fp8_gemm_workspace_bytes = static_cast<size_t (*)(const Fp8GemmArgs&)>(&GemmWorkspaceBytes),
      .bf16_gemm_workspace_bytes =
          static_cast<size_t (*)(const Bf16GemmArgs&)>(&GemmWorkspaceBytes),
      .layer = &cpu_internal::kLayerOps,
      .gemm_fp8_takes_b_transposed = true,
  };
  return kTable;
}

}  // namespace fp8rt::kernels
