// The op table: one per backend (CPU, CUDA), the only way the rest of fp8rt runs kernels.
//
// A backend is this table plus one registration site (kernels/cpu/ops_cpu.cc,
// kernels/cuda/ops_cuda.cc). When the CUDA backend is not built, CudaOps() comes from one stub
// file and fails loudly. Tables are immutable after static initialisation and thread-safe; the
// ops take caller-provided buffers and an explicit stream (CPU ops run on the calling thread's
// OpenMP team and ignore it).
#ifndef FP8RT_KERNELS_OPS_H_
#define FP8RT_KERNELS_OPS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/gemm.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {

enum class Backend : uint8_t { kCpu, kCuda };

// A CUDA stream (cudaStream_t) or nothing on CPU.
struct Stream {
  void* handle = nullptr;
};

struct OpTable {
  Backend backend;
  const char* name;
  absl::Status (*quantize)(const QuantizeArgs& args, Stream stream);
  absl::Status (*dequantize)(const DequantizeArgs& args, Stream stream);
  absl::Status (*amax)(const AmaxArgs& args, Stream stream);
  absl::Status (*convert)(const ConvertArgs& args, Stream stream);
  absl::Status (*gemm_fp8)(const Fp8GemmArgs& args, Stream stream);
  absl::Status (*gemm_bf16)(const Bf16GemmArgs& args, Stream stream);
  absl::Status (*gemm_f32)(const F32GemmArgs& args, Stream stream);
};

const OpTable& CpuOps();

// The CUDA table, or an error saying why it is not there (not built, no driver, no device).
absl::StatusOr<const OpTable*> CudaOps();

// Number of usable CUDA devices; 0 with `why` filled when there is none or CUDA is not built.
int CudaDeviceCount(std::string* why);

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_OPS_H_
