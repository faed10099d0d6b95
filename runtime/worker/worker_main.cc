// fp8rt-worker: one rank of a training run, started by mpirun (directly or by `fp8rt launch`).
//
//   mpirun -np 2 fp8rt-worker --spec RUN.yaml [--set key=value ...] --run-dir DIR [--resume]
//                             [--controller HOST:PORT --token-file F [--run-id ID] [--tls-ca F]]
//
// With --controller every rank registers with fp8rt-controller, which then holds the run: its
// spec (rank 0's --spec creates the run), the resume point, live recipe updates, the metrics and
// the checkpoint commits (runtime/worker/trainer.h).
//
// Device (the spec's `device`): cpu ranks run the CPU op table and talk MPI. cuda ranks each take
// one CUDA device (its rank among the ranks of its host, as MPI groups them, whatever launched
// it; more ranks on a host than devices is refused on every rank), run the CUDA op table and talk
// NCCL, whose unique id is exchanged over the MPI world.
//
// Exit codes: 0 done; 2 bad input (spec, options, run folder, and device: cuda on a rank without
// a usable CUDA device or in a build without CUDA): every rank reaches the same verdict and exits
// without a collective left pending; 1 a failure during the run (NCCL set-up included), after
// which the rank tears the job down (MPI_Abort) so that no peer waits in a collective, once its
// peers have reported the same failure or after kReportGrace (2 s).
// Environment: FP8RT_FAULT (test faults, runtime/worker/trainer.h), FP8RT_COLLECTIVE_TIMEOUT_S
// (a collective that does not complete within it fails the run; default 300).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/ops.h"
#include "parallel/mpi/mpi_communicator.h"
#include "parallel/nccl/nccl_communicator.h"
#include "runtime/core/memory.h"
#include "runtime/core/program.h"
#include "runtime/core/status.h"
#include "runtime/spec/run_spec.h"
#include "runtime/worker/device_placement.h"
#include "runtime/worker/trainer.h"

namespace {

// How long a rank whose run failed waits for its peers to fail too before it tears the job down:
// a failure every rank agrees on (a checkpoint that could not be written, a bad data file) is then
// reported by each of them, not only by the first one to abort. A rank failing alone waits it out.
constexpr std::chrono::milliseconds kReportGrace(2000);

}  // namespace

int main(int argc, char** argv) {
  using namespace fp8rt;
  KeepFreedMemory();
  CLI::App app{"One rank of an fp8rt training run (start it with mpirun or `fp8rt launch`)",
               "fp8rt-worker"};
  std::string spec_path, run_dir;
  std::vector<std::string> overrides;
  bool resume = false, quiet = false;
  std::string controller, token_file, run_id, tls_ca;
  app.add_option("--spec", spec_path, "run spec (YAML)")->required();
  app.add_option("--set", overrides, "override a spec key: --set train.steps=20 (repeatable)");
  app.add_option("--run-dir", run_dir, "run folder: metrics.jsonl, fp8_stats/, checkpoints/")
      ->required();
  app.add_flag("--resume", resume, "continue from the newest committed checkpoint in --run-dir");
  app.add_flag("--quiet", quiet, "no per-step progress lines");
  app.add_option("--controller", controller, "fp8rt-controller address (host:port)");
  app.add_option("--token-file", token_file,
                 "bearer token for the controller (default: $FP8RT_TOKEN_FILE)");
  app.add_option("--run-id", run_id, "run id at the controller (default: the run folder's name)");
  app.add_option("--tls-ca", tls_ca, "PEM root certificate: talk TLS to the controller");
  if (std::optional<int> exit_code = fp8rt::ParseCommandLine(app, argc, argv)) return *exit_code;

  absl::StatusOr<int> world_size = parallel::InitMpi(&argc, &argv);
  if (!world_size.ok()) {
    std::fprintf(stderr, "fp8rt-worker: %s\n", world_size.status().ToString().c_str());
    return 1;
  }
  parallel::MpiOptions mpi_options;
  if (const char* t = std::getenv("FP8RT_COLLECTIVE_TIMEOUT_S"); t != nullptr && std::atoi(t) > 0) {
    mpi_options.timeout = std::chrono::seconds(std::atoi(t));
  }
  auto factory = parallel::MpiCommunicatorFactory::Create(mpi_options);
  if (!factory.ok()) {
    std::fprintf(stderr, "fp8rt-worker: %s\n", factory.status().ToString().c_str());
    return 1;
  }
  const int rank = (*factory)->World().rank();
  const int world = (*factory)->World().size();
  std::unique_ptr<parallel::CommunicatorFactory> nccl;  // device: cuda
  // Bad input: the same on every rank (every rank reads the same files), so each exits with 2.
  auto bad_input = [&](const absl::Status& status) {
    if (rank == 0)
      std::fprintf(stderr, "fp8rt-worker: %s\n", std::string(status.message()).c_str());
    nccl.reset();
    factory->reset();
    parallel::FinalizeMpi();
    return 2;
  };
  absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(spec_path, overrides);
  if (!spec.ok()) return bad_input(spec.status());
  if (absl::Status v = ValidateRunSpec(*spec, *world_size); !v.ok()) return bad_input(v);

  worker::TrainerOptions options{
      .run_dir = run_dir, .resume = resume, .print_progress = !quiet, .controller = {}};
  if (!controller.empty()) {
    if (token_file.empty() && std::getenv("FP8RT_TOKEN_FILE") != nullptr) {
      token_file = std::getenv("FP8RT_TOKEN_FILE");
    }
    if (token_file.empty()) {
      return bad_input(absl::InvalidArgumentError(
          "--token-file: required with --controller (or set FP8RT_TOKEN_FILE)"));
    }
    absl::StatusOr<std::string> token = worker::ReadTokenFile(token_file);
    if (!token.ok()) return bad_input(token.status());
    options.controller.address = controller;
    options.controller.token = *token;
    if (!tls_ca.empty()) {
      std::ifstream in(tls_ca);
      std::stringstream pem;
      pem << in.rdbuf();
      if (!in || pem.str().empty()) {
        return bad_input(absl::InvalidArgumentError("--tls-ca: cannot read " + tls_ca));
      }
      options.controller.tls_ca = pem.str();
    }
    options.controller.run_id =
        !run_id.empty() ? run_id
                        : std::filesystem::absolute(run_dir).lexically_normal().filename().string();
    if (options.controller.run_id.empty()) {
      options.controller.run_id =
          std::filesystem::absolute(run_dir).lexically_normal().parent_path().filename().string();
    }
  }

  // The op table and the communicators of the spec's device.
  const kernels::OpTable* ops = &kernels::CpuOps();
  parallel::CommunicatorFactory* comms = factory->get();
  if (spec->device() == v1::RunSpec::DEVICE_CUDA) {
    // This rank's GPU, from its place among its host's ranks as MPI sees them, checked against
    // the other ranks' (no two of a host on one GPU). Collective over the world, on every rank
    // alike (the spec's device is the same everywhere).
    const absl::StatusOr<int> picked = worker::PickCudaDevice(
        (*factory)->World(), (*factory)->RanksOnThisHost(), worker::SystemCudaDevices());
    const int device = picked.ok() ? *picked : -1;
    absl::StatusOr<const kernels::OpTable*> cuda =
        picked.ok() ? kernels::CudaOps() : absl::StatusOr<const kernels::OpTable*>(picked.status());
    // Hosts may differ: agree on one verdict before any NCCL call, so that a rank without a GPU
    // stops every rank instead of leaving them in ncclCommInitRank. After the MAX: world - the
    // lowest failing rank (0: none failed), and whether any rank succeeded.
    int32_t verdict[2] = {cuda.ok() ? 0 : world - rank, cuda.ok() ? 1 : 0};
    if (absl::Status s = (*factory)->World().AllReduce(verdict, 2, parallel::DType::kI32,
                                                       parallel::ReduceOp::kMax);
        !s.ok()) {
      std::fprintf(stderr, "fp8rt-worker: rank %d: device: cuda: %s\n", rank, s.ToString().c_str());
      parallel::AbortMpi(1);
    }
    if (verdict[0] != 0) {
      // One line from the lowest failing rank, naming it when other ranks did find a device.
      if (rank == world - verdict[0]) {
        const std::string who = verdict[1] != 0 ? "rank " + std::to_string(rank) + ": " : "";
        std::fprintf(stderr, "fp8rt-worker: device: cuda: %s%s\n", who.c_str(),
                     std::string(cuda.status().message()).c_str());
      }
      factory->reset();
      parallel::FinalizeMpi();
      return 2;
    }
    ops = *cuda;
    absl::StatusOr<std::unique_ptr<parallel::CommunicatorFactory>> created =
        parallel::CreateNcclCommunicatorFactory((*factory)->World(), device,
                                                {.timeout = mpi_options.timeout});
    if (!created.ok()) {
      // Every rank gets an error (the factory agrees over the MPI world), but NCCL may have
      // half-connected: tear the job down.
      std::fprintf(stderr, "fp8rt-worker: rank %d: device: cuda: CUDA device %d: NCCL: %s\n", rank,
                   device, created.status().ToString().c_str());
      std::fflush(nullptr);
      parallel::AbortMpi(1);
    }
    nccl = *std::move(created);
    comms = nccl.get();
  }

  absl::StatusOr<std::unique_ptr<worker::Trainer>> trainer =
      worker::Trainer::Create(*spec, options, *comms, *ops);
  if (!trainer.ok()) {
    const absl::StatusCode code = trainer.status().code();
    if (code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
        code == absl::StatusCode::kFailedPrecondition ||
        code == absl::StatusCode::kUnauthenticated) {
      return bad_input(trainer.status());
    }
    std::fprintf(stderr, "fp8rt-worker: rank %d: %s\n", rank, trainer.status().ToString().c_str());
    std::fflush(nullptr);
    parallel::AbortMpi(1, kReportGrace);
  }
  if (absl::Status s = (*trainer)->Run(); !s.ok()) {
    std::fprintf(stderr, "fp8rt-worker: rank %d: step %lld: %s\n", rank,
                 static_cast<long long>((*trainer)->step() + 1), s.ToString().c_str());
    std::fflush(nullptr);
    parallel::AbortMpi(1, kReportGrace);
  }
  trainer->reset();
  nccl.reset();
  factory->reset();
  parallel::FinalizeMpi();
  return 0;
}
