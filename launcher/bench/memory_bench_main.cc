// fp8rt-bench-memory: the MPI side of `fp8rt bench memory --np N`. Every rank builds its model,
// optimizer and data loader as a training run does (worker::Trainer on a spec, in a temporary run
// folder), runs --steps optimizer steps, and reports the memory it used:
//   peak_bytes          the tracked peak of each kernels::MemCategory (kernels/memory_stats.h:
//                       every DeviceArray allocation, counted by the category its owner gave it)
//   total_peak_bytes    the tracked peak of all categories together (not the sum of the peaks)
//   peak_without_activations_bytes   the same with the saved activations left out
//   state_peak_bytes    param_shards + gradients + optimizer_state peaks (what FSDP must shard)
//   vm_hwm_bytes        the process's peak resident set (VmHWM in /proc/self/status)
// Every figure is the peak over the whole process (start-up included), as VmHWM is. Rank 0
// all-gathers every rank's figures over the world communicator and prints one JSON object.
//
// The spec: --spec FILE (with --set overrides), or the built-in GPT-2-small-sized default of issue
// 16 (kDefaultSpec; examples/bench/memory-gpt2-small.yaml is the same shape as a file), which
// trains on random bytes written to the run folder (the loader maps its file: the bytes do not
// count in the figures). Whatever the spec says, parallel.dp is the world size over parallel.tp,
// checkpoints are off (train.steps is raised to --steps if it is lower).
//
// CPU ranks only: a spec with device: cuda is refused (Unimplemented).
// Exit codes: 0 done; 2 bad input (every rank reaches the same verdict); 1 a failure while
// building or stepping (the job is torn down).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/memory_stats.h"
#include "kernels/ops.h"
#include "nlohmann/json.hpp"
#include "parallel/mpi/mpi_communicator.h"
#include "runtime/core/memory.h"
#include "runtime/core/program.h"
#include "runtime/spec/run_spec.h"
#include "runtime/worker/trainer.h"

namespace {

using namespace fp8rt;

// Issue 16's measuring spec: GPT-2-small sized (85M parameters with vocab 256), FP8.
constexpr const char* kDefaultSpec = R"(model:
  layers: 12
  d_model: 768
  heads: 12
  d_ff: 3072
  seq_len: 256
  vocab: 256
precision:
  mode: fp8
train:
  steps: 1000
  micro_batch: 1
checkpoint:
  every: 0
data:
  path: PLACEHOLDER
)";
constexpr const char* kDefaultSpecName = "built-in: GPT-2-small shape (12 layers, d_model 768)";

constexpr std::chrono::milliseconds kReportGrace(2000);

// One rank's figures, in the order of the all-gathered record.
constexpr int kFields = kernels::kNumMemCategories + 3;
using Record = std::array<int64_t, kFields>;

// VmHWM of this process in bytes (0 where /proc does not say).
int64_t PeakRssBytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return 1024 * std::stoll(line.substr(6));  // "... kB"
  }
  return 0;
}

Record Measure() {
  const kernels::MemoryStats stats = kernels::GetMemoryStats();
  Record r{};
  for (int c = 0; c < kernels::kNumMemCategories; ++c) r[static_cast<size_t>(c)] = stats.peak[c];
  r[kernels::kNumMemCategories] = stats.total_peak;
  r[kernels::kNumMemCategories + 1] = stats.peak_without_activations;
  r[kernels::kNumMemCategories + 2] = PeakRssBytes();
  return r;
}

nlohmann::ordered_json RecordJson(const Record& r) {
  using kernels::MemCategory;
  nlohmann::ordered_json peaks;
  for (int c = 0; c < kernels::kNumMemCategories; ++c) {
    peaks[std::string(kernels::MemCategoryName(static_cast<MemCategory>(c)))] =
        r[static_cast<size_t>(c)];
  }
  nlohmann::ordered_json j;
  j["peak_bytes"] = peaks;
  j["total_peak_bytes"] = r[kernels::kNumMemCategories];
  j["peak_without_activations_bytes"] = r[kernels::kNumMemCategories + 1];
  j["state_peak_bytes"] = r[static_cast<size_t>(MemCategory::kParamShards)] +
                          r[static_cast<size_t>(MemCategory::kGradients)] +
                          r[static_cast<size_t>(MemCategory::kOptimizerState)];
  j["vm_hwm_bytes"] = r[kernels::kNumMemCategories + 2];
  return j;
}

// The model's logical parameter count. Expert weights exist only on the ranks that hold the
// expert (the ep group splits them): those are summed over the ep group.
absl::StatusOr<int64_t> LogicalParams(worker::Trainer& trainer) {
  parallel::Mesh& mesh = trainer.mesh();
  int64_t dense = 0, experts = 0;
  for (const model::Param& p : trainer.model().params()) {
    (p.group == &mesh.dp() ? dense : experts) += p.rows * p.cols;
  }
  if (absl::Status s =
          mesh.ep().AllReduce(&experts, 1, parallel::DType::kI64, parallel::ReduceOp::kSum);
      !s.ok()) {
    return s;
  }
  return dense + experts;
}

// Every figure of the rank objects, the maximum over the ranks (each field on its own).
nlohmann::ordered_json MaxOverRanks(const nlohmann::ordered_json& ranks) {
  nlohmann::ordered_json max = ranks.at(0);
  max.erase("rank");
  for (const auto& r : ranks) {
    for (auto& [key, value] : max.items()) {
      if (value.is_object()) {
        for (auto& [k, v] : value.items()) v = std::max(v.get<int64_t>(), r[key][k].get<int64_t>());
      } else {
        value = std::max(value.get<int64_t>(), r[key].get<int64_t>());
      }
    }
  }
  return max;
}

const char* ModeName(v1::RunSpec::Precision::Mode mode) {
  switch (mode) {
    case v1::RunSpec::Precision::MODE_FP8:
      return "fp8";
    case v1::RunSpec::Precision::MODE_BF16:
      return "bf16";
    case v1::RunSpec::Precision::MODE_FP32:
      return "fp32";
    default:
      return "unknown";
  }
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  KeepFreedMemory();  // as fp8rt-worker does: the same allocator policy, the same RSS
  CLI::App app{"MPI ranks of `fp8rt bench memory` (run it through that command)",
               "fp8rt-bench-memory"};
  std::string spec_path;
  std::vector<std::string> overrides;
  int steps = 3;
  app.add_option("--spec", spec_path, "run spec (default: the GPT-2-small-sized built-in one)");
  app.add_option("--set", overrides, "override a spec key: --set train.micro_batch=2 (repeatable)");
  app.add_option("--steps", steps, "optimizer steps to run (default 3)");
  if (std::optional<int> exit_code = ParseCommandLine(app, argc, argv)) return *exit_code;

  absl::StatusOr<int> world_size = parallel::InitMpi(&argc, &argv);
  if (!world_size.ok()) {
    std::fprintf(stderr, "fp8rt-bench-memory: %s\n", world_size.status().ToString().c_str());
    return 1;
  }
  auto factory = parallel::MpiCommunicatorFactory::Create();
  if (!factory.ok()) {
    std::fprintf(stderr, "fp8rt-bench-memory: %s\n", factory.status().ToString().c_str());
    return 1;
  }
  parallel::Communicator& world = (*factory)->World();
  const int rank = world.rank();
  std::error_code ec;
  std::filesystem::path tmp;
  auto cleanup = [&] {
    if (rank == 0 && !tmp.empty()) std::filesystem::remove_all(tmp, ec);
  };
  // Bad input: the same on every rank (every rank reads the same files), so each exits with 2.
  auto bad_input = [&](const absl::Status& status) {
    if (rank == 0) {
      std::fprintf(stderr, "fp8rt-bench-memory: %s\n", std::string(status.message()).c_str());
    }
    world.Barrier().IgnoreError();  // no rank removes the folder while another still reads it
    cleanup();
    factory->reset();
    parallel::FinalizeMpi();
    return 2;
  };
  // A failure once the ranks work together: tear the job down (a peer may wait in a collective).
  auto fail = [&](const std::string& what, const absl::Status& status) {
    std::fprintf(stderr, "fp8rt-bench-memory: rank %d: %s: %s\n", rank, what.c_str(),
                 status.ToString().c_str());
    std::fflush(nullptr);
    cleanup();
    parallel::AbortMpi(1, kReportGrace);
  };
  if (steps < 1) return bad_input(absl::InvalidArgumentError("--steps must be >= 1"));

  // One run folder for the job, named by rank 0 (as the ranks of a run share theirs); for the
  // default spec it also holds the random training bytes.
  int64_t id = rank == 0 ? static_cast<int64_t>(getpid()) : 0;
  if (rank == 0) {
    tmp = std::filesystem::temp_directory_path() / ("fp8rt-bench-memory-" + std::to_string(id));
    std::filesystem::remove_all(tmp, ec);
    std::filesystem::create_directories(tmp / "run", ec);
    if (spec_path.empty()) {
      std::ofstream out(tmp / "random.txt", std::ios::binary);
      std::mt19937 rng(1);
      std::string bytes(1 << 21, '\0');
      for (char& c : bytes) c = static_cast<char>(rng() & 0xff);
      out << bytes;
    }
  }
  if (absl::Status s = world.Broadcast(&id, 1, parallel::DType::kI64, 0); !s.ok()) {
    fail("broadcast", s);
  }
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("fp8rt-bench-memory-" + std::to_string(id));

  absl::StatusOr<v1::RunSpec> spec;
  if (spec_path.empty()) {
    std::string text = kDefaultSpec;
    text.replace(text.find("PLACEHOLDER"), 11, (dir / "random.txt").string());
    spec = ParseRunSpec(text, "bench-memory-default", overrides);
  } else {
    spec = LoadRunSpec(spec_path, overrides);
  }
  if (!spec.ok()) return bad_input(spec.status());
  if (spec->device() == v1::RunSpec::DEVICE_CUDA) {
    return bad_input(absl::UnimplementedError(
        "device: cuda: fp8rt bench memory measures CPU ranks only (not done yet for CUDA)"));
  }
  const int64_t tp = std::max<int64_t>(1, spec->parallel().tp());
  if (*world_size % tp != 0) {
    return bad_input(absl::InvalidArgumentError("--np " + std::to_string(*world_size) +
                                                " is not a multiple of parallel.tp (" +
                                                std::to_string(tp) + ")"));
  }
  spec->mutable_parallel()->set_dp(*world_size / tp);
  spec->mutable_checkpoint()->set_every(0);
  if (spec->train().steps() < steps) spec->mutable_train()->set_steps(steps);
  if (absl::Status v = ValidateRunSpec(*spec, *world_size); !v.ok()) return bad_input(v);

  const auto t0 = std::chrono::steady_clock::now();
  if (rank == 0) {
    std::fprintf(stderr, "fp8rt-bench-memory: %d ranks: building model, optimizer and data\n",
                 *world_size);
  }
  worker::TrainerOptions options{.run_dir = (dir / "run").string(),
                                 .resume = false,
                                 .print_progress = false,
                                 .controller = {}};
  absl::StatusOr<std::unique_ptr<worker::Trainer>> trainer =
      worker::Trainer::Create(*spec, options, **factory, kernels::CpuOps());
  if (!trainer.ok()) {
    const absl::StatusCode code = trainer.status().code();
    if (code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
        code == absl::StatusCode::kFailedPrecondition) {
      return bad_input(trainer.status());
    }
    fail("building the trainer", trainer.status());
  }
  absl::StatusOr<int64_t> params = LogicalParams(**trainer);
  if (!params.ok()) fail("counting parameters", params.status());
  if (rank == 0) {
    std::fprintf(stderr, "fp8rt-bench-memory: %lld parameters, built in %.1f s\n",
                 static_cast<long long>(*params),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  for (int s = 0; s < steps; ++s) {
    const auto s0 = std::chrono::steady_clock::now();
    absl::StatusOr<worker::StepRecord> rec = (*trainer)->Step();
    if (!rec.ok()) fail("step " + std::to_string(s + 1), rec.status());
    if (rank == 0) {
      std::fprintf(stderr,
                   "fp8rt-bench-memory: step %d/%d  %.2f s  loss %.4f  rank 0: tracked peak "
                   "%.1f MiB, VmHWM %.1f MiB\n",
                   s + 1, steps,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count(),
                   rec->loss, MiB(kernels::GetMemoryStats().total_peak), MiB(PeakRssBytes()));
    }
  }

  const Record mine = Measure();
  std::vector<int64_t> all(static_cast<size_t>(kFields * *world_size));
  if (absl::Status s = world.AllGather(mine.data(), kFields, all.data(), parallel::DType::kI64);
      !s.ok()) {
    fail("gathering the figures", s);
  }
  if (rank == 0) {
    nlohmann::ordered_json j;
    j["benchmark"] = "memory";
    j["np"] = *world_size;
    j["spec"] = spec_path.empty() ? kDefaultSpecName : spec_path;
    const v1::RunSpec::Model& m = spec->model();
    j["model"] = {{"layers", m.layers()},
                  {"d_model", m.d_model()},
                  {"heads", m.heads()},
                  {"d_ff", m.d_ff()},
                  {"seq_len", m.seq_len()},
                  {"vocab", m.vocab()},
                  {"micro_batch", spec->train().micro_batch()},
                  {"grad_accum", spec->train().grad_accum()},
                  {"precision", ModeName(spec->precision().mode())},
                  {"dp", spec->parallel().dp()},
                  {"tp", spec->parallel().tp()},
                  {"ep", spec->parallel().ep()}};
    j["params"] = *params;
    j["steps"] = steps;
    j["description"] =
        "per rank: tracked peak bytes of backend memory by category (kernels/memory_stats.h) "
        "and the process's peak RSS (VmHWM), over the whole process; max: over ranks";
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (int r = 0; r < *world_size; ++r) {
      Record rec;
      std::copy_n(all.begin() + static_cast<ptrdiff_t>(r) * kFields, kFields, rec.begin());
      nlohmann::ordered_json rj;
      rj["rank"] = r;
      rj.update(RecordJson(rec));
      ranks.push_back(rj);
    }
    j["ranks"] = ranks;
    j["max"] = MaxOverRanks(ranks);
    std::fflush(stderr);
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  trainer->reset();
  world.Barrier().IgnoreError();  // every rank is done with the run folder
  cleanup();
  factory->reset();
  parallel::FinalizeMpi();
  return 0;
}
