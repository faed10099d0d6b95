// The GPU benchmarks when fp8rt is built without CUDA (FP8RT_CUDA=OFF): they say so.
#include "launcher/bench/bench_cuda.h"

namespace fp8rt::bench {

absl::StatusOr<nlohmann::ordered_json> CudaQuantizeBench(const CudaQuantizeBenchOptions&) {
  return absl::UnavailableError(
      "--device cuda: this fp8rt was built without CUDA (configure with -DFP8RT_CUDA=ON)");
}

absl::StatusOr<nlohmann::ordered_json> CudaGemmBench(const CudaGemmBenchOptions&) {
  return absl::UnavailableError(
      "--device cuda: this fp8rt was built without CUDA (configure with -DFP8RT_CUDA=ON)");
}

absl::StatusOr<nlohmann::ordered_json> CudaAttentionBench(const CudaAttentionBenchOptions&) {
  return absl::UnavailableError(
      "--device cuda: this fp8rt was built without CUDA (configure with -DFP8RT_CUDA=ON)");
}

}  // namespace fp8rt::bench
