// fp8rt-bench-step: the program behind `fp8rt bench step`. Times one optimizer step of the same
// spec in fp8, bf16 and fp32 precision, the three trainers built side by side and stepped in
// interleaved rounds, so that every mode sees the same machine noise. Prints one JSON object.
//
// CPU (the default; one rank started through mpirun): `ratio` is fp8 step time over fp32 step
// time (fastest step of each; DESIGN.md target <= 0.7 on CPU, where FP8 and BF16 GEMMs run on AMX
// and FP32 ones cannot). The default spec is a GEMM-dominated gpt2-family model (2 layers,
// d_model 1024, d_ff 4096, 16 x 64 tokens per step; before issue 18 the plain family, which
// --spec still takes) and trains on random bytes.
//
// CUDA (--device cuda, or a spec with device: cuda; run directly, without mpirun: one process on
// GPU 0, a one-rank NCCL world over a solo bootstrap, the CUDA op table): `ratio` is bf16 step time
// over fp8 step time, the FP8 speed-up (issue 22 target >= 1.5), on a GEMM-dominated default spec
// (1 layer, d_model 4096, d_ff 16384, 32 x 256 tokens per step).
//
// --spec takes any run spec instead (its parallel sizes must be 1).
//
// --peer torch (CPU; issue 18): the same model, shapes, micro-batch and thread count in PyTorch,
// scripts/bench-torch --serve, started as a child before MPI. Each round, after fp8rt's fp8, bf16
// and fp32 steps, the peer runs one FP32 step and one BF16-autocast step (it times them itself,
// without the pipe), so that all five see the same machine noise. The JSON gains "peer": its
// times and the ratios fp8rt fp8 / torch bf16 (target <= 0.7), fp8rt fp32 / torch fp32
// (<= 1.0) and fp8rt fp8 / fp8rt fp32 (<= 0.4), each of the fastest steps. Only the gpt2 and
// llama families have a twin (the plain family is refused, naming model.family), dense only.
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_join.h"
#include "kernels/ops.h"
#include "launcher/bench/subprocess.h"
#include "nlohmann/json.hpp"
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/nccl/nccl_communicator.h"
#include "parallel/solo_communicator.h"
#include "runtime/core/memory.h"
#include "runtime/spec/run_spec.h"
#include "runtime/worker/trainer.h"

namespace {

using namespace fp8rt;

// The CPU default: the gpt2 family, so that --peer torch has a twin to compare with.
constexpr const char* kDefaultSpec = R"(model:
  family: gpt2
  layers: 2
  d_model: 1024
  heads: 16
  d_ff: 4096
  seq_len: 64
  vocab: 256
train:
  steps: 1000
  micro_batch: 16
  lr: 1.0e-4
checkpoint:
  every: 0
metrics:
  every: 1000
data:
  path: PLACEHOLDER
)";

// The GPU default: one block large enough that its GEMMs dominate the step on an H100/H200.
constexpr const char* kDefaultCudaSpec = R"(model:
  layers: 1
  d_model: 4096
  heads: 32
  d_ff: 16384
  seq_len: 256
  vocab: 256
train:
  steps: 1000
  micro_batch: 32
  lr: 1.0e-4
checkpoint:
  every: 0
metrics:
  every: 1000
device: cuda
data:
  path: PLACEHOLDER
)";

int Fail(const std::string& message) {
  std::fprintf(stderr, "fp8rt-bench-step: %s\n", message.c_str());
  return 2;
}

#ifndef FP8RT_SOURCE_DIR
#define FP8RT_SOURCE_DIR ""
#endif

// scripts/bench-torch: installed in share/fp8rt beside bin/, or in the source tree this program
// was built from.
absl::StatusOr<std::string> FindBenchTorch() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::vector<std::string> tried;
  if (!ec) tried.push_back((self.parent_path().parent_path() / "share/fp8rt/bench-torch").string());
  if (std::string(FP8RT_SOURCE_DIR).size() > 0) {
    tried.push_back(std::string(FP8RT_SOURCE_DIR) + "/scripts/bench-torch");
  }
  for (const std::string& path : tried) {
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return absl::NotFoundError("--peer torch: scripts/bench-torch not found (looked for " +
                             absl::StrJoin(tried, " and ") + ")");
}

// The peer's command line: the spec's model with its family's defaults filled in, micro-batch,
// optimizer settings, and `threads` for torch.set_num_threads.
absl::StatusOr<std::vector<std::string>> TorchPeerArgv(const v1::RunSpec& spec,
                                                       const std::string& script, int threads) {
  using M = v1::RunSpec::Model;
  const M m = ResolveModel(spec.model());
  if (m.family() != M::FAMILY_GPT2 && m.family() != M::FAMILY_LLAMA) {
    return absl::InvalidArgumentError(
        "--peer torch: model.family is plain, which has no PyTorch twin (scripts/bench-torch "
        "builds the gpt2 and llama families; set model.family)");
  }
  if (spec.moe().experts() > 0) {
    return absl::InvalidArgumentError("--peer torch: moe.experts: the PyTorch twin is dense");
  }
  if (spec.device() == v1::RunSpec::DEVICE_CUDA) {
    return absl::InvalidArgumentError(
        "--peer torch: the PyTorch peer runs on the CPU (device: cuda)");
  }
  auto num = [](double x) {  // the shortest text that reads back as x
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof(buf), x);
    return std::string(buf, r.ptr);
  };
  const v1::RunSpec::Train& t = spec.train();
  std::vector<std::string> argv = {script, "--serve"};
  auto add = [&argv](const char* flag, std::string value) {
    argv.push_back(flag);
    argv.push_back(std::move(value));
  };
  add("--family", m.family() == M::FAMILY_GPT2 ? "gpt2" : "llama");
  add("--layers", std::to_string(m.layers()));
  add("--d-model", std::to_string(m.d_model()));
  add("--heads", std::to_string(m.heads()));
  add("--kv-heads", std::to_string(m.kv_heads()));
  add("--d-ff", std::to_string(m.d_ff()));
  add("--seq-len", std::to_string(m.seq_len()));
  add("--vocab", std::to_string(m.vocab()));
  add("--max-positions", std::to_string(m.max_positions()));
  add("--norm", m.norm() == M::NORM_LAYERNORM ? "layernorm" : "rmsnorm");
  add("--mlp", m.mlp() == M::MLP_SWIGLU ? "swiglu" : "gelu");
  add("--positions", m.positions() == M::POSITIONS_LEARNED ? "learned"
                     : m.positions() == M::POSITIONS_ROPE  ? "rope"
                                                           : "none");
  argv.push_back(m.bias() ? "--bias" : "--no-bias");
  argv.push_back(m.tie_embeddings() ? "--tie-embeddings" : "--no-tie-embeddings");
  add("--rope-theta", num(m.rope_theta()));
  add("--norm-eps", num(m.norm_eps()));
  add("--micro-batch", std::to_string(t.micro_batch()));
  add("--grad-accum", std::to_string(t.grad_accum()));
  add("--lr", num(t.lr()));
  add("--weight-decay", num(t.weight_decay()));
  add("--clip", num(t.clip()));
  add("--seed", std::to_string(t.seed()));
  add("--threads", std::to_string(threads));
  return argv;
}

// A line of the peer's as JSON; an {"error"} line, or a line that is not JSON (bench-torch's
// "SKIP: ..." when PyTorch is missing), is an error quoting it.
absl::StatusOr<nlohmann::json> PeerAnswer(bench::LineChild& peer, double timeout_s) {
  absl::StatusOr<std::string> line = peer.ReadLine(timeout_s);
  if (!line.ok())
    return absl::UnavailableError("--peer torch: " + std::string(line.status().message()));
  nlohmann::json j = nlohmann::json::parse(*line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    const std::string text = line->rfind("SKIP: ", 0) == 0 ? line->substr(6) : *line;
    return absl::UnavailableError("--peer torch: " + text);
  }
  if (j.contains("error")) return absl::InternalError("--peer torch: " + j["error"].dump());
  return j;
}

// The fastest and the median of `seconds` (not empty).
std::pair<double, double> BestAndMedian(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  return {seconds.front(), seconds[seconds.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"FP8 vs BF16 vs FP32 training step (one rank)", "fp8rt-bench-step"};
  fp8rt::KeepFreedMemory();
  std::string spec_path;
  int rounds = 3, warmup = 1;
  app.add_option("--spec", spec_path, "run spec to time (default: a GEMM-dominated model)");
  app.add_option("--rounds", rounds, "timed steps of each mode (default 3)");
  bool mx32 = false;
  app.add_flag("--mx32", mx32,
               "also time the FP8 step with precision.scaling mx32 (MXFP8) in the same rounds "
               "(mode fp8_mx32, ratio mx32_over_fp8)");
  app.add_option("--warmup", warmup, "untimed steps of each mode first (default 1)");
  std::string device_flag;
  app.add_option("--device", device_flag, "cpu or cuda (default: the spec's device; cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  std::string peer_name;
  app.add_option("--peer", peer_name,
                 "torch: also time the same model in PyTorch, FP32 and BF16 autocast (CPU)")
      ->check(CLI::IsMember({"torch"}));
  std::string peer_modes_flag = "fp32,bf16";
  app.add_option("--peer-modes", peer_modes_flag,
                 "fp32,bf16 (default) or fp32: leave out the BF16-autocast step, which has no "
                 "fast path on a CPU without BF16 instructions (tens of times the FP32 step)")
      ->check(CLI::IsMember({"fp32,bf16", "fp32"}));
  CLI11_PARSE(app, argc, argv);
  if (rounds < 1 || warmup < 0) return Fail("--rounds must be >= 1 and --warmup >= 0");

  std::error_code ec;
  const std::filesystem::path tmp =
      std::filesystem::temp_directory_path() / ("fp8rt-bench-step-" + std::to_string(getpid()));
  std::filesystem::remove_all(tmp, ec);
  std::filesystem::create_directories(tmp, ec);
  absl::StatusOr<v1::RunSpec> base;
  if (spec_path.empty()) {
    const std::string data = (tmp / "random.txt").string();
    std::ofstream out(data, std::ios::binary);
    std::mt19937 rng(1);
    std::string bytes(1 << 21, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() & 0xff);
    out << bytes;
    out.close();
    std::string text = device_flag == "cuda" ? kDefaultCudaSpec : kDefaultSpec;
    text.replace(text.find("PLACEHOLDER"), 11, data);
    base = ParseRunSpec(text, "bench-step-spec", {});
  } else {
    base = LoadRunSpec(spec_path, {});
  }
  if (!base.ok()) return Fail(base.status().ToString());
  if (device_flag == "cuda") base->set_device(v1::RunSpec::DEVICE_CUDA);
  if (device_flag == "cpu") base->set_device(v1::RunSpec::DEVICE_CPU);
  const bool cuda = base->device() == v1::RunSpec::DEVICE_CUDA;
  base->mutable_checkpoint()->set_every(0);
  base->mutable_metrics()->set_per_rank_fp8_stats(false);
  if (absl::Status v = ValidateRunSpec(*base, 1); !v.ok()) return Fail(v.ToString());

  // The PyTorch peer, started before MPI (no fork under an initialised MPI); it builds its models
  // while ours are built below, and says when it is ready.
  const int threads = omp_get_max_threads();
  std::unique_ptr<bench::LineChild> peer;
  std::string peer_script;
  if (!peer_name.empty()) {
    absl::StatusOr<std::string> script = FindBenchTorch();
    if (!script.ok()) return Fail(std::string(script.status().message()));
    peer_script = *script;
    absl::StatusOr<std::vector<std::string>> peer_argv = TorchPeerArgv(*base, *script, threads);
    if (!peer_argv.ok()) return Fail(std::string(peer_argv.status().message()));
    std::fprintf(stderr, "fp8rt-bench-step: peer: %s\n", absl::StrJoin(*peer_argv, " ").c_str());
    absl::StatusOr<std::unique_ptr<bench::LineChild>> child = bench::LineChild::Start(*peer_argv);
    if (!child.ok()) return Fail("--peer torch: " + child.status().ToString());
    peer = std::move(*child);
  }

  // The communicators and op table of the device: MPI (one rank) and the CPU table, or a
  // one-rank NCCL world on GPU 0 and the CUDA table.
  std::unique_ptr<parallel::CommunicatorFactory> factory;
  parallel::SoloCommunicatorFactory solo;
  const kernels::OpTable* ops = &kernels::CpuOps();
  if (cuda) {
    if (absl::Status s = kernels::UseCudaDevice(0); !s.ok()) {
      return Fail("device: cuda: " + std::string(s.message()));
    }
    absl::StatusOr<const kernels::OpTable*> table = kernels::CudaOps();
    if (!table.ok()) return Fail("device: cuda: " + std::string(table.status().message()));
    ops = *table;
    auto nccl = parallel::CreateNcclCommunicatorFactory(solo.World(), 0, {});
    if (!nccl.ok()) return Fail("device: cuda: " + nccl.status().ToString());
    factory = std::move(*nccl);
  } else {
    absl::StatusOr<int> world = parallel::InitMpi(&argc, &argv);
    if (!world.ok()) return Fail(world.status().ToString());
    if (*world != 1)
      return Fail("fp8rt-bench-step times one rank (started on " + std::to_string(*world) + ")");
    auto mpi = parallel::MpiCommunicatorFactory::Create();
    if (!mpi.ok()) return Fail(mpi.status().ToString());
    factory = std::move(*mpi);
  }

  struct Mode {
    const char* name;
    v1::RunSpec::Precision::Mode mode;
    std::unique_ptr<worker::Trainer> trainer;
    std::vector<double> seconds;
    double last_loss = 0.0;
    double cpu_s = 0.0, wall_s = 0.0;  // of the timed steps: this process's CPU and wall time
    bool mx32 = false;                 // precision.scaling mx32 instead of the spec's
  };
  std::vector<Mode> modes;
  modes.push_back({"fp8", v1::RunSpec::Precision::MODE_FP8, nullptr, {}, 0.0});
  modes.push_back({"bf16", v1::RunSpec::Precision::MODE_BF16, nullptr, {}, 0.0});
  modes.push_back({"fp32", v1::RunSpec::Precision::MODE_FP32, nullptr, {}, 0.0});
  if (mx32) {
    modes.push_back({"fp8_mx32", v1::RunSpec::Precision::MODE_FP8, nullptr, {}, 0.0});
    modes.back().mx32 = true;
  }
  // CPU seconds of this process so far, every thread (the scheduler's run time; the other
  // threads' share is brought up to date at each scheduler tick, so a reading can lag by about a
  // tick per thread: noise on millisecond steps, nothing on real ones; not the peer's, a child).
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  for (Mode& m : modes) {
    v1::RunSpec spec = *base;
    spec.mutable_precision()->set_mode(m.mode);
    if (m.mx32) spec.mutable_precision()->set_scaling(v1::RunSpec::Precision::SCALING_MX32);
    worker::TrainerOptions options{.run_dir = (tmp / m.name).string(),
                                   .resume = false,
                                   .print_progress = false,
                                   .controller = {}};
    auto trainer = worker::Trainer::Create(spec, options, *factory, *ops);
    if (!trainer.ok()) return Fail(std::string(m.name) + ": " + trainer.status().ToString());
    m.trainer = std::move(*trainer);
  }
  // The peer's FP32 and BF16-autocast models; an hour bounds a step (or its start) of any
  // model this machine can hold, so that a hung peer ends the bench instead of stalling it.
  constexpr double kPeerTimeoutS = 3600.0;
  struct PeerMode {
    const char* name;
    std::vector<double> seconds;
    double last_loss = 0.0;
  };
  std::vector<PeerMode> peer_modes = {{"fp32", {}, 0.0}};
  if (peer_modes_flag == "fp32,bf16") peer_modes.push_back({"bf16", {}, 0.0});
  nlohmann::json peer_ready;
  if (peer) {
    absl::StatusOr<nlohmann::json> ready = PeerAnswer(*peer, kPeerTimeoutS);
    if (!ready.ok()) return Fail(std::string(ready.status().message()));
    peer_ready = *ready;
  }
  for (int r = 0; r < warmup + rounds; ++r) {
    for (Mode& m : modes) {
      const double c0 = cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<worker::StepRecord> rec = m.trainer->Step();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double c = cpu_seconds() - c0;
      if (!rec.ok()) return Fail(std::string(m.name) + ": " + rec.status().ToString());
      m.last_loss = rec->loss;
      if (r >= warmup) {
        m.seconds.push_back(s);
        m.cpu_s += c;
        m.wall_s += s;
      }
    }
    for (PeerMode& pm : peer_modes) {
      if (!peer) break;
      if (absl::Status w = peer->WriteLine(pm.name); !w.ok()) {
        return Fail("--peer torch: " + std::string(w.message()));
      }
      absl::StatusOr<nlohmann::json> a = PeerAnswer(*peer, kPeerTimeoutS);
      if (!a.ok()) return Fail(std::string(a.status().message()));
      pm.last_loss = a->value("loss", std::nan(""));
      if (r >= warmup) pm.seconds.push_back(a->value("seconds", std::nan("")));
    }
  }
  if (peer) {
    if (absl::Status w = peer->WriteLine("quit"); !w.ok()) {
      return Fail("--peer torch: " + std::string(w.message()));
    }
    if (absl::Status f = peer->Finish(); !f.ok()) {
      return Fail("--peer torch: " + std::string(f.message()));
    }
  }
  const v1::RunSpec::Model& model = base->model();
  const double tokens = static_cast<double>(base->train().micro_batch()) *
                        base->train().grad_accum() * model.seq_len();
  nlohmann::ordered_json j;
  j["benchmark"] = "step";
  nlohmann::ordered_json per_mode;
  std::vector<double> best(modes.size()), median(modes.size());
  for (size_t i = 0; i < modes.size(); ++i) {
    std::vector<double> s = modes[i].seconds;
    std::sort(s.begin(), s.end());
    best[i] = s.front();
    median[i] = s[s.size() / 2];
    per_mode[modes[i].name] = {{"best_s", best[i]},
                               {"median_s", median[i]},
                               {"tokens_per_s", tokens / best[i]},
                               {"loss", modes[i].last_loss}};
    // How busy the OpenMP team was during the timed steps: CPU time over wall time x threads
    // (OpenMP's spin-waiting counts as busy; perf separates it, docs/perf.md).
    if (!cuda && modes[i].wall_s > 0.0) {
      per_mode[modes[i].name]["cpu_busy"] = modes[i].cpu_s / (modes[i].wall_s * threads);
      per_mode[modes[i].name]["cpu_s"] = modes[i].cpu_s;
      per_mode[modes[i].name]["wall_s"] = modes[i].wall_s;
    }
  }
  j["device"] = cuda ? "cuda" : "cpu";
  // CPU: fp8 over fp32 time (target <= 0.7). CUDA: bf16 over fp8 time, the speed-up (issue 22:
  // >= 1.5).
  j["ratio"] = cuda ? best[1] / best[0] : best[0] / best[2];
  j["ratio_median"] = cuda ? median[1] / median[0] : median[0] / median[2];
  j["target"] = cuda ? 1.5 : 0.7;  // CUDA: at least; CPU: at most
  j["bf16_over_fp32"] = best[1] / best[2];
  j["fp8_over_bf16"] = best[0] / best[1];
  if (mx32) j["mx32_over_fp8"] = best[3] / best[0];  // the spec's FP8 scaling
  j["description"] =
      cuda ? "training step time in bf16 over fp8 on one GPU (fastest of interleaved rounds), "
             "same spec and data"
           : "training step time in fp8 over fp32 (fastest of interleaved rounds), same spec and "
             "data";
  j["modes"] = per_mode;
  j["model"] = {{"layers", model.layers()}, {"d_model", model.d_model()}, {"heads", model.heads()},
                {"d_ff", model.d_ff()},     {"seq_len", model.seq_len()}, {"vocab", model.vocab()}};
  j["tokens_per_step"] = tokens;
  j["rounds"] = rounds;
  if (!cuda) j["threads"] = threads;
  if (peer) {
    // Each ratio of the fastest steps (and of the medians); the targets are issue 18's.
    nlohmann::ordered_json p, pm_json;
    std::vector<double> peer_best, peer_median;
    for (const PeerMode& pm : peer_modes) {
      const auto [b, med] = BestAndMedian(pm.seconds);
      peer_best.push_back(b);
      peer_median.push_back(med);
      pm_json[pm.name] = {
          {"best_s", b}, {"median_s", med}, {"tokens_per_s", tokens / b}, {"loss", pm.last_loss}};
    }
    p["name"] = "torch";
    p["torch"] = peer_ready.value("torch", "");
    p["threads"] = peer_ready.value("threads", 0);
    p["params"] = peer_ready.value("params", int64_t{0});
    p["script"] = peer_script;
    // The CPU's BF16 instructions as the peer saw them; without any, PyTorch's BF16 matmuls have
    // no hardware path and the fp8 / torch bf16 ratio says little.
    p["cpu_bf16"] = peer_ready.value("cpu_bf16", nlohmann::json::array());
    p["modes"] = pm_json;
    // Without the BF16 peer step (--peer-modes fp32) its ratio is null.
    const bool peer_bf16 = peer_best.size() > 1;
    p["ratios"] = {{"fp8_over_torch_bf16",
                    peer_bf16 ? nlohmann::json(best[0] / peer_best[1]) : nlohmann::json()},
                   {"fp32_over_torch_fp32", best[2] / peer_best[0]},
                   {"fp8_over_fp32", best[0] / best[2]}};
    p["ratio_medians"] = {{"fp8_over_torch_bf16",
                           peer_bf16 ? nlohmann::json(median[0] / peer_median[1]) : nlohmann::json()},
                          {"fp32_over_torch_fp32", median[2] / peer_median[0]},
                          {"fp8_over_fp32", median[0] / median[2]}};
    p["targets"] = {{"fp8_over_torch_bf16", 0.7},  // each: at most
                    {"fp32_over_torch_fp32", 1.0},
                    {"fp8_over_fp32", 0.4}};
    p["description"] =
        "PyTorch (scripts/bench-torch) training the same model, micro-batch and thread count in "
        "FP32 and in BF16 autocast, a step of each after fp8rt's in every round; ratios are "
        "fp8rt's fastest step time over the peer's";
    j["peer"] = p;
  }
  for (Mode& m : modes) m.trainer.reset();
  std::filesystem::remove_all(tmp, ec);
  std::cout << j.dump() << std::endl;
  factory.reset();
  if (!cuda) parallel::FinalizeMpi();
  return std::isfinite(modes[0].last_loss) ? 0 : 1;
}
