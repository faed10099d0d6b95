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
#include "kernels/layer_ops.h"
#include "kernels/quantize.h"

namespace fp8rt::kernels {

enum class Backend : uint8_t { kCpu, kCuda };

// A CUDA stream (cudaStream_t) or nothing on CPU.
struct Stream {
  void* handle = nullptr;
};

// Cast-transpose (Transformer Engine's name): quantizes a rows x cols FP32/BF16 matrix with one
// given tensor scale into its FP8 codes and, in the same pass, the codes of its transpose. The
// backward of an FP8 linear layer needs both: dgrad multiplies with W and wgrad with X^T, and
// the GEMM takes K-contiguous operands only (kernels/gemm.h). Codes are bit for bit those of
// quantize with granularity kTensor and has_scale (code = EncodeFp8(x * scale)); the statistics
// count every input value once, exactly as that quantize does.
struct CastTransposeArgs {
  Fp8Format format = Fp8Format::kE4M3;
  InputType input_type = InputType::kF32;
  const void* input = nullptr;  // rows x cols, row-major (float or BF16 bits)
  int64_t rows = 0;
  int64_t cols = 0;
  float scale = 1.0f;           // the tensor scale (delayed scaling): finite and > 0
  uint8_t* codes = nullptr;     // out: rows x cols FP8 codes
  uint8_t* codes_t = nullptr;   // out: cols x rows, codes_t[c * rows + r] == codes[r * cols + c]
  float* scale_inv = nullptr;   // out: 1 value, 1 / scale
  QuantStats* stats = nullptr;  // out, optional
};
// Checks shapes, pointers and the scale; the backends call it first. Errors name the field.
absl::Status ValidateCastTransposeArgs(const CastTransposeArgs& args);

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
  absl::Status (*cast_transpose)(const CastTransposeArgs& args, Stream stream);
  // Workspace the backend's gemm_fp8 / gemm_bf16 want for these arguments: GemmWorkspaceBytes on
  // the CPU; on CUDA, CudaGemmWorkspaceBytes plus cuBLASLt's own (kernels/cuda/cuda_backend.h).
  size_t (*fp8_gemm_workspace_bytes)(const Fp8GemmArgs& args);
  size_t (*bf16_gemm_workspace_bytes)(const Bf16GemmArgs& args);
  // The non-GEMM layer ops, the optimizer update and stream synchronisation (kernels/layer_ops.h).
  const LayerOps* layer;
  // gemm_fp8 takes Fp8GemmArgs::b_transposed (with tensor scaling).
  bool gemm_fp8_takes_b_transposed = false;
};

const OpTable& CpuOps();

// The CUDA table, or an error saying why it is not there (not built, no driver, no device).
absl::StatusOr<const OpTable*> CudaOps();

// Number of usable CUDA devices; 0 with `why` filled when there is none or CUDA is not built.
int CudaDeviceCount(std::string* why);

// Makes CUDA device `ordinal` the calling thread's current device (cudaSetDevice), which creates
// its context. InvalidArgument for an ordinal outside [0, CudaDeviceCount()); Unavailable when CUDA
// is not built or the runtime fails (the message carries the CUDA error).
[[nodiscard]] absl::Status UseCudaDevice(int ordinal);

// The PCI bus id of CUDA device `ordinal` as cudaDeviceGetPCIBusId writes it ("0000:3B:00.0"):
// one GPU's name on its host whatever each process's CUDA_VISIBLE_DEVICES made of its ordinal
// (NCCL tells ranks' devices apart by it too). Errors as UseCudaDevice's.
absl::StatusOr<std::string> CudaDevicePciBusId(int ordinal);

}  // namespace fp8rt::kernels

#endif  // FP8RT_KERNELS_OPS_H_
