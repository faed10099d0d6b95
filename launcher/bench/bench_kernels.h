// Kernel benchmarks of `fp8rt bench`: each returns a JSON object whose top-level `ratio` is the
// headline figure, measured against a baseline timed in the same run.
#ifndef FP8RT_LAUNCHER_BENCH_BENCH_KERNELS_H_
#define FP8RT_LAUNCHER_BENCH_BENCH_KERNELS_H_

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fp8rt::bench {

struct QuantizeBenchOptions {
  int mib = 256;    // FP32 input size in MiB
  int rounds = 5;   // interleaved rounds of (memcpy, quantize)
  int samples = 6;  // samples of each case per round
};
// FP32 -> E4M3, tensor granularity with a given scale, amax and statistics in the same pass
// (the delayed-scaling kernel), over a memcpy of the input, both on all cores.
absl::StatusOr<nlohmann::ordered_json> QuantizeBench(const QuantizeBenchOptions& options);

struct GemmBenchOptions {
  int size = 2048;  // M = N = K
  int rounds = 5;   // interleaved rounds of the four GEMMs
  int samples = 3;  // samples of each case per round
  std::string scaling = "tensor";  // the FP8 GEMM of the headline ratio: tensor or mx32
};
// FP8 GEMM (E4M3 x E4M3, FP32 out; tensor scales, or MXFP8's E8M0 scale per 1x32 block with
// --scaling mx32) over FP32 GEMM of the same shape; the FP32 baseline is the faster of OpenBLAS
// sgemm and oneDNN's f32 matmul. Both FP8 GEMMs are timed in the same rounds either way.
absl::StatusOr<nlohmann::ordered_json> GemmBench(const GemmBenchOptions& options);

struct AttentionBenchOptions {
  int batch = 16, seq = 64, heads = 16, kv_heads = 16, head_dim = 64;  // bench step's default
  int rounds = 5;   // interleaved rounds of the two implementations
  int samples = 3;  // samples of each per round
};
// The CPU table's flash attention (forward + backward, kernels/cpu/attention_cpu.h) over the
// textbook attention that materialises the [T, T] probabilities of every head (PyTorch eager's
// way): per head, S = Q K^T, P = softmax(S) and O = P V, then dP = dO V^T, dS and the three
// gradient GEMMs, each GEMM an OpenBLAS sgemm, heads spread over the OpenMP team. Reports the
// time ratio and the bytes each keeps from the forward to the backward.
absl::StatusOr<nlohmann::ordered_json> AttentionBench(const AttentionBenchOptions& options);
// InvalidArgument naming the flag unless every size is >= 1 and --kv-heads divides --heads (the
// CPU and CUDA attention benchmarks' shapes).
absl::Status CheckAttentionShape(int batch, int seq, int heads, int kv_heads, int head_dim);

}  // namespace fp8rt::bench

#endif  // FP8RT_LAUNCHER_BENCH_BENCH_KERNELS_H_
