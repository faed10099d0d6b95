// Internal: the CPU backend's op entry points, collected into the table in ops_cpu.cc.
#ifndef FP8RT_KERNELS_CPU_CPU_OPS_H_
#define FP8RT_KERNELS_CPU_CPU_OPS_H_

#include "kernels/ops.h"

namespace fp8rt::kernels::cpu_internal {

absl::Status QuantizeCpu(const QuantizeArgs& args, Stream stream);
absl::Status DequantizeCpu(const DequantizeArgs& args, Stream stream);
absl::Status GemmFp8Cpu(const Fp8GemmArgs& args, Stream stream);
absl::Status GemmBf16Cpu(const Bf16GemmArgs& args, Stream stream);

}  // namespace fp8rt::kernels::cpu_internal

#endif  // FP8RT_KERNELS_CPU_CPU_OPS_H_
