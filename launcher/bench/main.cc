// fp8rt-bench (run as `fp8rt bench`): benchmarks that report a ratio against a baseline timed
// in the same run (these machines are noisy; absolute times alone mean little).
//   fp8rt bench quantize [--json] [--mib N] [--device cpu|cuda]
//   fp8rt bench gemm [--json] [--size N] [--device cpu|cuda]   (cuda: bench_cuda.h)
//   fp8rt bench attention [--json] [--batch B --seq T --heads H --kv-heads G --head-dim D]
//                                                (the CPU flash attention, forward + backward,
//                                                 vs the [T, T]-materialising one on OpenBLAS)
//   fp8rt bench comm --np N [--json]   (runs N MPI ranks of fp8rt-bench-comm through mpirun)
//   fp8rt bench step [--json] [--spec RUN.yaml] [--device cpu|cuda] [--peer torch]
//                    [--peer-modes fp32|fp32,bf16]
//                                                (fp8 vs bf16 vs fp32 training step: one rank of
//                                                 fp8rt-bench-step through mpirun; cuda: one
//                                                 process on GPU 0; --peer torch: PyTorch FP32
//                                                 and BF16 autocast steps of the same model in
//                                                 the same rounds, scripts/bench-torch)
//   fp8rt bench memory --np N [--spec RUN.yaml] [--set KEY=VALUE ...] [--steps K] [--no-baseline]
//                      [--json]   (per-rank tracked peak bytes by category and peak RSS of a
//                                  training run: N MPI ranks of fp8rt-bench-memory, and a one-rank
//                                  baseline with the ratios against it)
//   fp8rt bench convergence [--spec RUN.yaml] [--steps N] [--set KEY=VALUE ...] [--run-dir DIR]
//                           [--target R] [--seeds N] [--json]   (bf16 vs fp8 hybrid delayed: the
//                                  relative difference of the final validation losses, paired
//                                  over N seeds with a 95% interval; convergence.h. Exit 1 when
//                                  it exceeds the target: with N > 1, the whole interval)
//   fp8rt bench controller [--workers N] [--duration S] [--json] ...   (load on fp8rt-controller:
//                                                 runs fp8rt-bench-controller, which needs no
//                                                 kernels; its options: --help)
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "launcher/bench/bench_cuda.h"
#include "launcher/bench/bench_kernels.h"
#include "launcher/bench/convergence.h"
#include "runtime/core/program.h"

namespace {

#ifndef FP8RT_MPIEXEC
#define FP8RT_MPIEXEC "mpirun"
#endif

// Runs the benchmark program `program` (next to this executable) with `args`, on `np` ranks
// through mpirun, or directly with np 0 (the one-process GPU benchmarks), and returns the JSON it
// (rank 0) printed.
absl::StatusOr<nlohmann::ordered_json> MpiBench(const std::string& program, int np,
                                                const std::string& args) {
  if (np < 0 || np > 16) return absl::InvalidArgumentError("--np must be in [1, 16]");  // 0: direct
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path worker = self.parent_path() / program;
  if (ec || access(worker.c_str(), X_OK) != 0) {
    return absl::NotFoundError(program + " not found next to fp8rt-bench (" + worker.string() +
                               ")");
  }
  // Each rank gets its share of the cores for its OpenMP kernels (they would fight otherwise),
  // unbound as `fp8rt launch` runs them: mpirun binds up to 2 ranks to one core each by
  // default, which would put a rank's whole OpenMP team (and a --peer child) on one core.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads = std::max(1u, cores / static_cast<unsigned>(std::max(np, 1)));
  std::string cmd = np == 0 ? worker.string() + " " + args
                            : std::string(FP8RT_MPIEXEC) +
                                  (geteuid() == 0 ? " --allow-run-as-root" : "") +
                                  " --oversubscribe --bind-to none -np " + std::to_string(np) +
                                  " -x OMP_NUM_THREADS=" + std::to_string(threads) + " " +
                                  worker.string() + " " + args;
  std::fprintf(stderr, "running %s: %s\n",
               np == 0 ? "one process" : (std::to_string(np) + " MPI ranks").c_str(), cmd.c_str());
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot start " + cmd);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::InternalError("the MPI job failed (status " + std::to_string(status) +
                               "); its output: " + out);
  }
  const size_t start = out.rfind("{\"benchmark\"");
  if (start == std::string::npos)
    return absl::InternalError("no JSON in the MPI job's output: " + out);
  try {
    return nlohmann::ordered_json::parse(out.substr(start));
  } catch (const nlohmann::json::exception& e) {
    return absl::InternalError(std::string("bad JSON from the MPI job: ") + e.what());
  }
}

// `text` as one word for the shell (single quotes; a quote inside becomes '\'').
std::string ShellQuote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct MemoryBenchOptions {
  int np = 0;                          // MPI ranks, in [1, 16]; parallel.dp = np / parallel.tp
  int steps = 3;                       // optimizer steps per rank
  std::string spec;                    // run spec file; empty: the built-in GPT-2-small shape
  std::vector<std::string> overrides;  // --set KEY=VALUE, in order
  bool baseline = true;                // with np > 1, also run np 1 and report the ratios
};

// The figure at np ranks (its max over ranks) over the one-rank baseline's; null without a
// baseline figure (a category nothing is attributed to).
nlohmann::ordered_json Ratio(const nlohmann::ordered_json& max, const nlohmann::ordered_json& base,
                             const std::string& field, const std::string& category = "") {
  const int64_t a =
      category.empty() ? max[field].get<int64_t>() : max[field][category].get<int64_t>();
  const int64_t b =
      category.empty() ? base[field].get<int64_t>() : base[field][category].get<int64_t>();
  if (b <= 0) return nullptr;
  return static_cast<double>(a) / static_cast<double>(b);
}

// `fp8rt bench memory`: the np-rank job and, with np > 1, the one-rank baseline of the same spec
// (memory figures are deterministic enough that two jobs compare; the ratios are issue 16's).
absl::StatusOr<nlohmann::ordered_json> MemoryBench(const MemoryBenchOptions& o) {
  if (o.np < 1 || o.np > 16) {
    return absl::InvalidArgumentError("--np must be in [1, 16] (got " + std::to_string(o.np) + ")");
  }
  if (o.steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  std::string args = "--steps " + std::to_string(o.steps);
  if (!o.spec.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(o.spec, ec)) {
      return absl::NotFoundError("--spec: no such file: " + o.spec);
    }
    args += " --spec " + ShellQuote(std::filesystem::absolute(o.spec, ec).string());
  }
  for (const std::string& kv : o.overrides) args += " --set " + ShellQuote(kv);
  std::optional<nlohmann::ordered_json> base;
  if (o.baseline && o.np > 1) {
    absl::StatusOr<nlohmann::ordered_json> b = MpiBench("fp8rt-bench-memory", 1, args);
    if (!b.ok()) {
      return absl::Status(b.status().code(), "the one-rank baseline (--no-baseline skips it): " +
                                                 std::string(b.status().message()));
    }
    base = *std::move(b);
  }
  absl::StatusOr<nlohmann::ordered_json> j = MpiBench("fp8rt-bench-memory", o.np, args);
  if (!j.ok() || !base) return j;
  const nlohmann::ordered_json& max = (*j)["max"];
  const nlohmann::ordered_json& b = (*base)["max"];
  (*j)["baseline"] = {{"np", 1}, {"max", b}};
  (*j)["ratios"] = {{"state", Ratio(max, b, "state_peak_bytes")},
                    {"param_shards", Ratio(max, b, "peak_bytes", "param_shards")},
                    {"peak_without_activations", Ratio(max, b, "peak_without_activations_bytes")},
                    {"total_peak", Ratio(max, b, "total_peak_bytes")},
                    {"vm_hwm", Ratio(max, b, "vm_hwm_bytes")}};
  (*j)["ratio_definition"] =
      "each: the largest rank's figure at np ranks over the same figure at np 1 (same spec, "
      "parallel.dp = np / tp); state = param_shards + gradients + optimizer_state peaks; null "
      "where the baseline figure is 0";
  return j;
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

void PrintMemory(const nlohmann::ordered_json& j) {
  const auto& md = j["model"];
  std::cout << absl::StrFormat(
      "memory per rank, %d MPI ranks (dp %d, tp %d), after %d optimizer steps: %d layers, d_model "
      "%d, d_ff %d, "
      "seq_len %d, micro_batch %d, %s, %d parameters\n"
      "  tracked peaks of backend memory by category, and the process's peak RSS (MiB)\n",
      j["np"].get<int>(), md["dp"].get<int>(), md["tp"].get<int>(), j["steps"].get<int>(),
      md["layers"].get<int>(), md["d_model"].get<int>(), md["d_ff"].get<int>(),
      md["seq_len"].get<int>(), md["micro_batch"].get<int>(), md["precision"].get<std::string>(),
      j["params"].get<int64_t>());
  // Columns: every rank, the max over ranks, and the one-rank baseline when there is one.
  std::vector<std::pair<std::string, const nlohmann::ordered_json*>> cols;
  for (const auto& r : j["ranks"])
    cols.push_back({"rank " + std::to_string(r["rank"].get<int>()), &r});
  if (cols.size() > 1) cols.push_back({"max", &j["max"]});
  if (j.contains("baseline")) cols.push_back({"np 1", &j["baseline"]["max"]});
  std::cout << absl::StrFormat("  %-26s", "");
  for (const auto& [name, _] : cols) std::cout << absl::StrFormat(" %10s", name);
  std::cout << "\n";
  auto row = [&](const std::string& label, const std::string& field, const std::string& category) {
    std::cout << absl::StrFormat("  %-26s", label);
    for (const auto& [_, c] : cols) {
      const int64_t v =
          category.empty() ? (*c)[field].get<int64_t>() : (*c)[field][category].get<int64_t>();
      std::cout << absl::StrFormat(" %10.1f", MiB(v));
    }
    std::cout << "\n";
  };
  for (const auto& [category, _] : j["max"]["peak_bytes"].items()) {
    row(category, "peak_bytes", category);
  }
  row("total (peak)", "total_peak_bytes", "");
  row("without activations (peak)", "peak_without_activations_bytes", "");
  row("state (shards+grads+optim)", "state_peak_bytes", "");
  row("VmHWM (peak RSS)", "vm_hwm_bytes", "");
  if (j.contains("ratios")) {
    auto text = [](const nlohmann::ordered_json& v) {
      return v.is_null() ? std::string("n/a (nothing attributed)")
                         : absl::StrFormat("%.3f", v.get<double>());
    };
    const auto& r = j["ratios"];
    std::cout << absl::StrFormat(
        "  np %d vs np 1 (largest rank): state %s, param_shards %s, without activations %s, "
        "total %s, VmHWM %s\n",
        j["np"].get<int>(), text(r["state"]), text(r["param_shards"]),
        text(r["peak_without_activations"]), text(r["total_peak"]), text(r["vm_hwm"]));
  }
}

// `fp8rt bench convergence`: a row per mode (means over the seeds), each seed's pair when there
// are several, and the verdict.
void PrintConvergence(const nlohmann::ordered_json& j) {
  const size_t n = j["seeds"].size();
  std::cout << absl::StrFormat("convergence, %d steps on %d ranks, %d seed%s: %s\n",
                               j["steps"].get<int>(), j["np"].get<int>(), n, n == 1 ? "" : "s",
                               j["spec"].get<std::string>());
  std::cout << absl::StrFormat("  %-22s %14s %12s %12s %9s\n", n == 1 ? "" : "(means)",
                               "final val_loss", "loss 1-10", "last 10", "wall");
  for (const char* mode : {"bf16", "fp8"}) {
    const auto& m = j["modes"][mode];
    std::cout << absl::StrFormat("  %-22s %14.5f %12.4f %12.4f %8.0fs\n",
                                 std::string(mode) == "fp8" ? "fp8 (hybrid, delayed)" : "bf16",
                                 m["final_val_loss"].get<double>(), m["first10_loss"].get<double>(),
                                 m["last10_loss"].get<double>(), m["wall_s"].get<double>());
  }
  const double target = 100.0 * j["target"].get<double>();
  if (n > 1) {
    const auto& p = j["paired"];
    for (size_t i = 0; i < n; ++i) {
      std::cout << absl::StrFormat(
          "  seed %-4d bf16 %.5f  fp8 %.5f  (fp8 - bf16) / bf16 %+.4f%%\n",
          j["seeds"][i].get<int64_t>(),
          j["modes"]["bf16"]["per_seed"][i]["final_val_loss"].get<double>(),
          j["modes"]["fp8"]["per_seed"][i]["final_val_loss"].get<double>(),
          100.0 * p["differences"][i].get<double>());
    }
    std::cout << absl::StrFormat(
        "  paired relative difference: mean %+.4f%%, 95%% interval [%+.4f%%, %+.4f%%] "
        "(t %.3f x standard error %.4f%%); bf16's spread over the seeds %.4f%%\n",
        100.0 * p["mean"].get<double>(), 100.0 * p["interval"][0].get<double>(),
        100.0 * p["interval"][1].get<double>(), p["t95"].get<double>(),
        100.0 * p["standard_error"].get<double>(), 100.0 * p["bf16_spread"].get<double>());
  }
  const std::string verdict = j["verdict"].get<std::string>();
  std::cout << absl::StrFormat(
      "  relative difference of the final validation loss (fp8 - bf16) / bf16: %+.4f%% "
      "(target |x| <= %.4g%%: %s)\n",
      100.0 * j["relative_difference"].get<double>(), target,
      verdict == "within"     ? "within"
      : verdict == "exceeded" ? "EXCEEDED"
                              : absl::StrCat("unresolved by ", n,
                                             " seeds: the interval straddles "
                                             "the target"));
  std::cout << "  run folders: " << j["run_dir"].get<std::string>() << "\n";
}

void PrintHuman(const nlohmann::ordered_json& j) {
  const std::string name = j["benchmark"].get<std::string>();
  if (j.contains("device") && j["device"] == "cuda") {
    if (name == "quantize") {
      std::cout << absl::StrFormat(
          "quantize FP32 -> E4M3 on %s (tensor scale, stats in the same pass), %d MiB input\n"
          "  quantize  %8.1f GB/s effective (5 B/element)\n"
          "  memcpy    %8.1f GB/s (device to device, read + write)\n"
          "  ratio     %8.3f  (target >= 0.9)\n",
          j["gpu"].get<std::string>(), j["input_mib"].get<int>(),
          j["quantize_gb_per_s"].get<double>(), j["memcpy_gb_per_s"].get<double>(),
          j["ratio"].get<double>());
    } else {
      const auto& t = j["tflops"];
      std::cout << absl::StrFormat(
          "GEMM %dx%dx%d on %s, cuBLASLt (TFLOP/s)\n"
          "  fp8 (e4m3, tensor scales)   %7.1f  [%s]\n"
          "  fp8, fast accumulation      %7.1f  [%s]  (rel. RMS change %.2g)\n"
          "  fp8 (1x128 x 128x128)       %7.1f  [%s]\n"
          "  bf16                        %7.1f  [%s]\n"
          "  ratio fp8 / bf16            %7.2f  (target >= 1.8)\n",
          j["m"].get<int>(), j["n"].get<int>(), j["k"].get<int>(), j["gpu"].get<std::string>(),
          t["fp8"].get<double>(), j["paths"]["fp8_e4m3_tensor"].get<std::string>(),
          t["fp8_fast_accum"].get<double>(),
          j["paths"]["fp8_e4m3_tensor_fast_accum"].get<std::string>(),
          j["fast_accum_vs_promoted_rel_rms_diff"].get<double>(), t["fp8_block"].get<double>(),
          j["paths"]["fp8_e4m3_block"].get<std::string>(), t["bf16"].get<double>(),
          j["paths"]["bf16"].get<std::string>(), j["ratio"].get<double>());
    }
    return;
  }
  if (name == "convergence") {
    PrintConvergence(j);
  } else if (name == "memory") {
    PrintMemory(j);
  } else if (name == "comm") {
    const auto& g = j["fsdp_gather"];
    const auto& m = j["moe_dispatch"];
    const auto& r = j["grad_reduce_scatter"];
    std::cout << absl::StrFormat(
        "communication, %d MPI ranks (bytes sent per rank; time of the slowest rank)\n"
        "  FSDP gather, %d params    fp8 %.1f MiB %.1f ms | bf16 %.1f MiB %.1f ms | bytes x%.3f "
        "(target <= 0.52), time x%.3f (target <= 0.65)\n"
        "    128x128 block scales    fp8 %.1f MiB %.1f ms | bytes x%.3f, time x%.3f\n"
        "    training step's gather  fp8 shards %.1f ms (quantized once per step, outside the "
        "gather) | bf16 started %.1f ms, blocking %.1f ms | time x%.3f vs the faster (target "
        "<= 0.65)\n"
        "  MoE dispatch              fp8 %.1f MiB %.1f ms | bf16 %.1f MiB %.1f ms | bytes x%.3f, "
        "time x%.3f\n"
        "  grad reduce-scatter       bf16 %.1f MiB %.1f ms | fp32 %.1f MiB %.1f ms | bytes x%.3f, "
        "time x%.3f\n",
        j["np"].get<int>(), j["params"].get<int64_t>(), g["fp8_bytes"].get<double>() / 1048576,
        1e3 * g["fp8_s"].get<double>(), g["bf16_bytes"].get<double>() / 1048576,
        1e3 * g["bf16_s"].get<double>(), g["byte_ratio"].get<double>(),
        g["time_ratio"].get<double>(), g["fp8_block_bytes"].get<double>() / 1048576,
        1e3 * g["fp8_block_s"].get<double>(), g["fp8_block_byte_ratio"].get<double>(),
        g["fp8_block_time_ratio"].get<double>(),
        1e3 * j["fsdp_gather_step"]["fp8_shard_s"].get<double>(),
        1e3 * j["fsdp_gather_step"]["bf16_started_s"].get<double>(),
        1e3 * j["fsdp_gather_step"]["bf16_blocking_s"].get<double>(),
        j["fsdp_gather_step"]["time_ratio"].get<double>(), m["fp8_bytes"].get<double>() / 1048576,
        1e3 * m["fp8_s"].get<double>(), m["bf16_bytes"].get<double>() / 1048576,
        1e3 * m["bf16_s"].get<double>(), m["byte_ratio"].get<double>(),
        m["time_ratio"].get<double>(), r["bf16_bytes"].get<double>() / 1048576,
        1e3 * r["bf16_s"].get<double>(), r["fp32_bytes"].get<double>() / 1048576,
        1e3 * r["fp32_s"].get<double>(), r["byte_ratio"].get<double>(),
        r["time_ratio"].get<double>());
  } else if (name == "step") {
    const auto& m = j["modes"];
    const auto& md = j["model"];
    const bool cuda = j.value("device", "cpu") == "cuda";
    std::cout << absl::StrFormat(
        "training step, one rank (%s): %d layers, d_model %d, d_ff %d, %d tokens per step\n"
        "  fp8   %7.1f ms  %9.0f tokens/s\n"
        "  bf16  %7.1f ms  %9.0f tokens/s\n"
        "  fp32  %7.1f ms  %9.0f tokens/s\n"
        "  ratio %s step time  %.3f  (target %s)\n",
        cuda ? "GPU" : "CPU", md["layers"].get<int>(), md["d_model"].get<int>(),
        md["d_ff"].get<int>(), static_cast<int>(j["tokens_per_step"].get<double>()),
        1e3 * m["fp8"]["best_s"].get<double>(), m["fp8"]["tokens_per_s"].get<double>(),
        1e3 * m["bf16"]["best_s"].get<double>(), m["bf16"]["tokens_per_s"].get<double>(),
        1e3 * m["fp32"]["best_s"].get<double>(), m["fp32"]["tokens_per_s"].get<double>(),
        cuda ? "bf16 / fp8" : "fp8 / fp32", j["ratio"].get<double>(), cuda ? ">= 1.5" : "<= 0.7");
    if (m["fp8"].contains("cpu_busy")) {
      std::cout << absl::StrFormat(
          "  threads busy during the steps (CPU time / wall x %d threads): fp8 %.0f%%, bf16 "
          "%.0f%%, fp32 %.0f%%\n",
          j.value("threads", 0), 100 * m["fp8"]["cpu_busy"].get<double>(),
          100 * m["bf16"]["cpu_busy"].get<double>(), 100 * m["fp32"]["cpu_busy"].get<double>());
    }
    if (j.contains("peer")) {
      const auto& p = j["peer"];
      const auto& pm = p["modes"];
      const auto& r = p["ratios"];
      const auto& t = p["targets"];
      std::cout << absl::StrFormat(
          "  PyTorch %s, %d threads (fp8rt %d), the same model and micro-batch in the same "
          "rounds:\n"
          "  torch fp32  %7.1f ms  %9.0f tokens/s\n",
          p["torch"].get<std::string>(), p["threads"].get<int>(), j.value("threads", 0),
          1e3 * pm["fp32"]["best_s"].get<double>(), pm["fp32"]["tokens_per_s"].get<double>());
      if (pm.contains("bf16")) {
        std::cout << absl::StrFormat(
            "  torch bf16  %7.1f ms  %9.0f tokens/s  (autocast)\n"
            "  ratio fp8 / torch bf16 step time   %.3f  (target <= %.2g)\n",
            1e3 * pm["bf16"]["best_s"].get<double>(), pm["bf16"]["tokens_per_s"].get<double>(),
            r["fp8_over_torch_bf16"].get<double>(), t["fp8_over_torch_bf16"].get<double>());
      } else {
        std::cout << "  torch bf16  left out (--peer-modes fp32)\n";
      }
      std::cout << absl::StrFormat(
          "  ratio fp32 / torch fp32 step time  %.3f  (target <= %.2g)\n"
          "  ratio fp8 / fp32 step time         %.3f  (target <= %.2g, issue 18)\n",
          r["fp32_over_torch_fp32"].get<double>(), t["fp32_over_torch_fp32"].get<double>(),
          r["fp8_over_fp32"].get<double>(), t["fp8_over_fp32"].get<double>());
      if (p.contains("cpu_bf16") && p["cpu_bf16"].empty()) {
        std::cout << "  note: this CPU has no AVX512-BF16 or AMX-BF16: PyTorch's BF16 matmuls run "
                     "without hardware support, so fp8 / torch bf16 says little here\n";
      }
    }
  } else if (name == "attention") {
    const auto& sh = j["shape"];
    std::cout << absl::StrFormat(
        "attention forward + backward, batch %d, seq %d, %d heads (%d kv), head dim %d, %d "
        "threads\n"
        "  flash (tiles, lse saved)        %9.2f ms   saves %10.3f MiB\n"
        "  materialised (sgemm, [T, T])    %9.2f ms   saves %10.3f MiB\n"
        "  ratio materialised / flash      %9.3f      (outputs differ by <= %.3g, largest %.3g)\n",
        sh["batch"].get<int>(), sh["seq"].get<int>(), sh["heads"].get<int>(),
        sh["kv_heads"].get<int>(), sh["head_dim"].get<int>(), j["threads"].get<int>(),
        1e3 * j["flash"]["best_s"].get<double>(),
        j["saved_bytes"]["flash_lse"].get<double>() / 1048576,
        1e3 * j["materialised"]["best_s"].get<double>(),
        j["saved_bytes"]["materialised_probs"].get<double>() / 1048576, j["ratio"].get<double>(),
        j["check"]["max_abs_out_difference"].get<double>(),
        j["check"]["max_abs_out"].get<double>());
  } else if (name == "quantize") {
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
        "  fp8 (e4m3, mx32 E8M0)      %7.3f  (mx32 / tensor time ratio %.2f)\n"
        "  bf16                       %7.3f\n"
        "  f32 oneDNN                 %7.3f\n"
        "  f32 OpenBLAS sgemm         %7.3f\n"
        "  ratio fp8 (%s) / best fp32 %7.2f  (target >= 4)\n",
        j["m"].get<int>(), j["n"].get<int>(), j["k"].get<int>(), j["threads"].get<int>(),
        t["fp8"].get<double>(), t["fp8_mx32"].get<double>(), j["mx32_over_tensor"].get<double>(),
        t["bf16"].get<double>(), t["f32_onednn"].get<double>(), t["sgemm_openblas"].get<double>(),
        j["scaling"].get<std::string>(), j["ratio"].get<double>());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // `controller` is its own program (gRPC only): hand over its arguments unparsed.
  if (argc >= 2 && std::string(argv[1]) == "controller") {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    const std::string program = (self.parent_path() / "fp8rt-bench-controller").string();
    std::vector<char*> args = {const_cast<char*>(program.c_str())};
    for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    execv(program.c_str(), args.data());
    std::fprintf(stderr, "fp8rt bench: cannot run %s: %s\n", program.c_str(), std::strerror(errno));
    return 2;
  }
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
  std::string device = "cpu";
  fp8rt::bench::CudaQuantizeBenchOptions cqopt;
  fp8rt::bench::CudaGemmBenchOptions cgopt;
  quantize->add_option("--device", device, "cpu (default) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  quantize->add_option("--iterations", cqopt.iterations,
                       "cuda: calls per timed sample (default 10)");
  auto* gemm = app.add_subcommand("gemm", "FP8 GEMM vs FP32 GEMM throughput");
  gemm->add_option("--size", gopt.size, "M = N = K (default 2048)");
  gemm->add_option("--rounds", gopt.rounds, "interleaved rounds (default 5)");
  gemm->add_option("--samples", gopt.samples, "samples of each case per round (default 3)");
  gemm->add_option("--scaling", gopt.scaling,
                   "tensor (default) or mx32: the FP8 GEMM of the headline ratio (both are timed)")
      ->check(CLI::IsMember({"tensor", "mx32"}));
  gemm->add_flag("--json", json, "print one JSON object");
  gemm->add_option("--device", device, "cpu (default) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  gemm->add_option("--iterations", cgopt.iterations, "cuda: calls per timed sample (default 5)");
  int np = 2, comm_repeats = 3;
  fp8rt::bench::AttentionBenchOptions aopt;
  auto* attention =
      app.add_subcommand("attention", "CPU flash attention vs materialised attention");
  attention->add_option("--batch", aopt.batch, "batch rows (default 16)");
  attention->add_option("--seq", aopt.seq, "sequence length (default 64)");
  attention->add_option("--heads", aopt.heads, "query heads (default 16)");
  attention->add_option("--kv-heads", aopt.kv_heads, "kv heads (default 16)");
  attention->add_option("--head-dim", aopt.head_dim, "head dimension (default 64)");
  attention->add_option("--rounds", aopt.rounds, "interleaved rounds (default 5)");
  attention->add_option("--samples", aopt.samples, "samples of each per round (default 3)");
  attention->add_flag("--json", json, "print one JSON object");
  attention
      ->add_option("--device", device,
                   "cpu (default) or cuda: the fused BF16 tensor-core attention vs the FP32 "
                   "kernels (default shape 4 x 2048, 16 heads of 128)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  fp8rt::bench::CudaAttentionBenchOptions caopt;
  auto* comm = app.add_subcommand("comm", "FP8 vs BF16 collectives over N MPI ranks");
  comm->add_option("--np", np, "MPI ranks (default 2)");
  comm->add_option("--repeats", comm_repeats, "repeats of each measurement (default 3)");
  comm->add_flag("--json", json, "print one JSON object");
  std::string step_spec;
  int step_rounds = 3;
  auto* step = app.add_subcommand("step", "FP8 vs BF16 vs FP32 training step time (one rank)");
  step->add_option("--spec", step_spec, "run spec to time (default: a GEMM-dominated model)");
  step->add_option("--rounds", step_rounds, "timed steps of each mode (default 3)");
  step->add_option("--device", device, "cpu (default; the spec's device with --spec) or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  std::string step_peer;
  step->add_option("--peer", step_peer,
                   "torch: also time the same model in PyTorch (FP32 and BF16 autocast; "
                   "scripts/bench-torch, needs python3-torch)")
      ->check(CLI::IsMember({"torch"}));
  std::string step_peer_modes;
  step->add_option("--peer-modes", step_peer_modes,
                   "fp32,bf16 (default) or fp32: leave out PyTorch's BF16-autocast step (no fast "
                   "path on a CPU without BF16 instructions)")
      ->check(CLI::IsMember({"fp32,bf16", "fp32"}));
  bool step_mx32 = false;
  step->add_flag("--mx32", step_mx32,
                 "also time the FP8 step with precision.scaling mx32 (MXFP8) in the same rounds");
  step->add_flag("--json", json, "print one JSON object");
  MemoryBenchOptions mopt;
  bool no_baseline = false;
  auto* memory = app.add_subcommand(
      "memory", "per-rank peak memory of a training run by category, and peak RSS (N MPI ranks)");
  memory->add_option("--np", mopt.np, "MPI ranks, 1 to 16 (parallel.dp = np / parallel.tp)")
      ->required();
  memory->add_option("--spec", mopt.spec,
                     "run spec (default: GPT-2-small shape, 12 layers, d_model 768, seq_len 256)");
  memory->add_option("--set", mopt.overrides,
                     "override a spec key: --set train.micro_batch=2 (repeatable)");
  memory->add_option("--steps", mopt.steps, "optimizer steps per rank (default 3)");
  memory->add_flag("--no-baseline", no_baseline, "with --np > 1: skip the one-rank baseline run");
  memory->add_flag("--json", json, "print one JSON object");
  fp8rt::bench::ConvergenceBenchOptions copt;
  auto* convergence = app.add_subcommand(
      "convergence",
      "train a spec in bf16 and in fp8 (hybrid, delayed): relative difference of the final "
      "validation losses");
  convergence->add_option("--spec", copt.spec, "run spec (default examples/llama-tiny.yaml)");
  convergence->add_option("--steps", copt.steps, "train.steps of both runs (default: the spec's)");
  convergence->add_option("--set", copt.overrides,
                          "override a spec key for both runs (repeatable)");
  convergence->add_option("--run-dir", copt.run_dir,
                          "folder for the bf16/ and fp8/ run folders (default: a new temp folder)");
  convergence->add_option("--target", copt.target,
                          "bound on |fp8 - bf16| / bf16 (default 0.0025; exit 1 above it)");
  convergence->add_option("--seeds", copt.seeds,
                          "train each mode at N seeds (train.seed, +1, ...) and compare them in "
                          "pairs with a 95% interval (default 1)");
  convergence->add_flag("--json", json, "print one JSON object");
  // Listed for --help only (dispatched above).
  app.add_subcommand("controller",
                     "load on fp8rt-controller from simulated workers: p99 RPC latency, RSS "
                     "(`fp8rt bench controller --help`)");
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;
  absl::StatusOr<nlohmann::ordered_json> result;
  if (quantize->parsed() && device == "cuda") {
    // The CPU defaults do not carry over: the GPU input must be several times its L2.
    if (quantize->count("--mib") > 0) cqopt.mib = qopt.mib;
    if (quantize->count("--rounds") > 0) cqopt.rounds = qopt.rounds;
    if (quantize->count("--samples") > 0) cqopt.samples = qopt.samples;
    result = fp8rt::bench::CudaQuantizeBench(cqopt);
  } else if (gemm->parsed() && device == "cuda") {
    if (gemm->count("--size") > 0) cgopt.size = gopt.size;
    if (gemm->count("--rounds") > 0) cgopt.rounds = gopt.rounds;
    if (gemm->count("--samples") > 0) cgopt.samples = gopt.samples;
    result = fp8rt::bench::CudaGemmBench(cgopt);
  } else if (attention->parsed() && device == "cuda") {
    // The CPU defaults do not carry over: a GPU wants long sequences and full heads.
    for (auto [flag, from, to] : {std::tuple{"--batch", &aopt.batch, &caopt.batch},
                                  std::tuple{"--seq", &aopt.seq, &caopt.seq},
                                  std::tuple{"--heads", &aopt.heads, &caopt.heads},
                                  std::tuple{"--kv-heads", &aopt.kv_heads, &caopt.kv_heads},
                                  std::tuple{"--head-dim", &aopt.head_dim, &caopt.head_dim},
                                  std::tuple{"--rounds", &aopt.rounds, &caopt.rounds},
                                  std::tuple{"--samples", &aopt.samples, &caopt.samples}}) {
      if (attention->count(flag) > 0) *to = *from;
    }
    result = fp8rt::bench::CudaAttentionBench(caopt);
  } else if (quantize->parsed()) {
    result = fp8rt::bench::QuantizeBench(qopt);
  } else if (gemm->parsed()) {
    result = fp8rt::bench::GemmBench(gopt);
  } else if (attention->parsed()) {
    result = fp8rt::bench::AttentionBench(aopt);
  } else if (comm->parsed()) {
    result = np < 1 ? absl::InvalidArgumentError("--np must be in [1, 16]")
                    : MpiBench("fp8rt-bench-comm", np, "--repeats " + std::to_string(comm_repeats));
  } else if (convergence->parsed()) {
    result = fp8rt::bench::ConvergenceBench(copt);
  } else if (memory->parsed()) {
    mopt.baseline = !no_baseline;
    result = MemoryBench(mopt);
  } else {
    std::string args = "--rounds " + std::to_string(step_rounds);
    if (!step_spec.empty()) {
      std::error_code ec;
      args += " --spec '" + std::filesystem::absolute(step_spec, ec).string() + "'";
    }
    // On a GPU the step runs in one process (a one-rank NCCL world), without mpirun.
    const bool cuda = step->count("--device") > 0 && device == "cuda";
    if (step->count("--device") > 0) args += " --device " + device;
    if (!step_peer.empty()) args += " --peer " + step_peer;
    if (!step_peer_modes.empty()) args += " --peer-modes " + step_peer_modes;
    if (step_mx32) args += " --mx32";
    result = MpiBench("fp8rt-bench-step", cuda ? 0 : 1, args);
  }
  if (!result.ok()) {
    std::fprintf(stderr, "fp8rt bench: %s\n", std::string(result.status().message()).c_str());
    return 2;
  }
  if (json) {
    std::cout << result->dump() << "\n";
  } else {
    PrintHuman(*result);
  }
  // The convergence bench fails when FP8 misses its target (a CI test relies on the exit code).
  if (convergence->parsed() && (*result)["verdict"].get<std::string>() == "exceeded") return 1;
  return 0;
}
