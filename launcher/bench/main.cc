// fp8rt-bench (run as `fp8rt bench`): benchmarks that report a ratio against a baseline timed
// in the same run (these machines are noisy; absolute times alone mean little).
//   fp8rt bench quantize [--json] [--mib N]
//   fp8rt bench gemm [--json] [--size N]
#include <cstdio>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "launcher/bench/bench_kernels.h"

namespace {

void PrintHuman(const nlohmann::ordered_json& j) {
  const std::string name = j["benchmark"].get<std::string>();
  if (name == "quantize") {
    std::cout << absl::StrFormat(
        "quantize FP32 -> E4M3 (tensor scale, stats in the same pass), %d MiB input, %d threads\n"
        "  quantize  %8.2f GB/s effective (5 B/element)\n"
        "  memcpy    %8.2f GB/s (read + write)\n"
        "  ratio     %8.3f  (target >= 0.8)\n",
        j["input_mib"].get<int>(), j["threads"].get<int>(), j["quantize_gb_per_s"].get<double>(),
        j["memcpy_gb_per_s"].get<double>(), j["ratio"].get<double>());
  } else {
    const auto& t = j["tflops"];
    std::cout << absl::StrFormat(
        "GEMM %dx%dx%d, %d threads (TFLOP/s)\n"
        "  fp8 (e4m3, tensor scales)  %7.3f\n"
        "  bf16                       %7.3f\n"
        "  f32 oneDNN                 %7.3f\n"
        "  f32 OpenBLAS sgemm         %7.3f\n"
        "  ratio fp8 / best fp32      %7.2f  (target >= 4)\n",
        j["m"].get<int>(), j["n"].get<int>(), j["k"].get<int>(), j["threads"].get<int>(),
        t["fp8"].get<double>(), t["bf16"].get<double>(), t["f32_onednn"].get<double>(),
        t["sgemm_openblas"].get<double>(), j["ratio"].get<double>());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp8rt benchmarks: ratios against a baseline measured in the same run",
               "fp8rt bench"};
  app.require_subcommand(1);
  bool json = false;
  fp8rt::bench::QuantizeBenchOptions qopt;
  fp8rt::bench::GemmBenchOptions gopt;
  auto* quantize = app.add_subcommand("quantize", "FP32 -> E4M3 quantize vs memcpy bandwidth");
  quantize->add_option("--mib", qopt.mib, "input size in MiB (default 256)");
  quantize->add_option("--rounds", qopt.rounds, "interleaved rounds (default 5)");
  quantize->add_option("--samples", qopt.samples, "samples of each case per round (default 6)");
  quantize->add_flag("--json", json, "print one JSON object");
  auto* gemm = app.add_subcommand("gemm", "FP8 GEMM vs FP32 GEMM throughput");
  gemm->add_option("--size", gopt.size, "M = N = K (default 2048)");
  gemm->add_option("--rounds", gopt.rounds, "interleaved rounds (default 5)");
  gemm->add_option("--samples", gopt.samples, "samples of each case per round (default 3)");
  gemm->add_flag("--json", json, "print one JSON object");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  absl::StatusOr<nlohmann::ordered_json> result =
      quantize->parsed() ? fp8rt::bench::QuantizeBench(qopt) : fp8rt::bench::GemmBench(gopt);
  if (!result.ok()) {
    std::fprintf(stderr, "fp8rt bench: %s\n", std::string(result.status().message()).c_str());
    return 2;
  }
  if (json) {
    std::cout << result->dump() << "\n";
  } else {
    PrintHuman(*result);
  }
  return 0;
}
