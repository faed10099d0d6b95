// GPU variants of `fp8rt bench quantize|gemm` (--device cuda): each times its kernel and a
// baseline on the same GPU in the same run with CUDA events, and returns a JSON object whose
// top-level `ratio` is the headline figure (the CPU variants are in bench_kernels.h).
// Without a usable CUDA device (or in a build without FP8RT_CUDA) they return Unavailable with
// the CUDA runtime's reason, and `fp8rt bench` exits with status 2.
#ifndef FP8RT_LAUNCHER_BENCH_BENCH_CUDA_H_
#define FP8RT_LAUNCHER_BENCH_BENCH_CUDA_H_

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fp8rt::bench {

struct CudaQuantizeBenchOptions {
  int mib = 1024;       // FP32 input in MiB (several times the H200's 60 MB L2)
  int rounds = 5;       // interleaved rounds of (cudaMemcpy, quantize)
  int samples = 5;      // samples of each case per round
  int iterations = 10;  // kernel calls between the two events of one sample
};
// FP32 -> E4M3, tensor granularity with a given scale, amax and statistics in the same pass
// (the delayed-scaling kernel), effective bandwidth (5 bytes per element) over that of a
// device-to-device cudaMemcpy of the input (8 bytes per element: read + write). Target >= 0.9.
absl::StatusOr<nlohmann::ordered_json> CudaQuantizeBench(const CudaQuantizeBenchOptions& options);

struct CudaGemmBenchOptions {
  int size = 8192;     // M = N = K
  int rounds = 5;      // interleaved rounds of the GEMMs
  int samples = 3;     // samples of each case per round
  int iterations = 5;  // GEMM calls between the two events of one sample
};
// FP8 GEMM (E4M3 x E4M3, tensor scales, BF16 output, cuBLASLt with FP32 promotion) over the BF16
// GEMM (BF16 operands and output, FP32 accumulation, cuBLASLt) of the same shape, both through
// the CUDA op table. Target >= 1.8. Also reports the block-scaled FP8 GEMM (1x128 x 128x128).
absl::StatusOr<nlohmann::ordered_json> CudaGemmBench(const CudaGemmBenchOptions& options);

struct CudaAttentionBenchOptions {
  int batch = 4, seq = 2048, heads = 16, kv_heads = 16, head_dim = 128;
  int rounds = 3;      // interleaved rounds of the two implementations
  int samples = 2;     // samples of each per round
  int iterations = 1;  // forward + backward calls between the two events of one sample
};
// Causal attention, forward + backward, through the CUDA op table: the fused tensor-core entries
// (attention_forward_bf16 / attention_backward_bf16, kernels/cuda/flash_attention_cuda.cu) over
// the FP32 warp-per-row entries (attention_forward / attention_backward) on the same inputs.
// Reports the speed ratio, each one's TFLOP/s (4 B H T^2 Dh for the causal forward's two
// products, 2.5 times that for the backward's five) and the largest |out| difference.
absl::StatusOr<nlohmann::ordered_json> CudaAttentionBench(const CudaAttentionBenchOptions& options);

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_BENCH_CUDA_H_
