// fp8rt: the user-facing command line.
//
// Commands implemented by other executables are found next to this one as fp8rt-<command>
// (like git), so that this binary links no kernels or CUDA libraries:
//   fp8rt quantize ...   -> fp8rt-quantize ...   (what FP8 does to a tensor)
//   fp8rt bench ...      -> fp8rt-bench ...      (benchmarks, ratios against a baseline)
//   fp8rt launch ...     -> fp8rt-launch ...     (a training run through mpirun, with progress)
//   fp8rt k8s ...        -> fp8rt-k8s ...        (Kubernetes manifests for a run spec)
// The commands that talk to fp8rt-controller (runs, layers, recipe, checkpoints) run in this
// process: they need only gRPC and the proto (launcher/client/commands.h).
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "launcher/client/commands.h"
#include "launcher/report/report.h"

namespace {

constexpr const char* kUsageHead =
    "usage: fp8rt <command> [options]\n"
    "\n"
    "commands:\n"
    "  quantize IN.npy [--format e4m3|e5m2] [--granularity tensor|row|1x128|128x128|mx32]\n"
    "                  [--scale S] [--margin M] [--out DEQ.npy] [--codes CODES.npy] [--json]\n"
    "                  what FP8 does to a tensor: error, underflow, saturation\n"
    "  bench quantize|gemm|comm|step [--json]\n"
    "                  benchmarks reporting a ratio against a baseline measured in the same run\n"
    "  bench controller [--workers N] [--hz H] [--duration S] [--json]\n"
    "                  load on fp8rt-controller from N simulated workers: p99 RPC latency, RSS\n"
    "  launch RUN.yaml --np N --run-dir DIR [--set key=value]... [--resume]\n"
    "                  [--threads-per-rank T] [--quiet]\n"
    "                  train: N ranks of fp8rt-worker through mpirun, progress from\n"
    "                  DIR/metrics.jsonl, output in DIR/logs/launch.log\n"
    "  k8s render RUN.yaml --image IMG [--name NAME] [--namespace NS] [--gpu] [--workers N]\n"
    "                  [--out DIR]\n"
    "                  Kubernetes manifests (kustomization: controller, volume, token, spec,\n"
    "                  MPIJob) for the run, sized from its parallel.dp x parallel.tp\n";
constexpr const char* kUsageModel =
    "  export RUN_DIR [--step N] --out DIR [--dtype f32|bf16]\n"
    "                  Hugging Face model.safetensors + config.json (GPT2LMHeadModel,\n"
    "                  LlamaForCausalLM, MixtralForCausalLM) from a checkpoint written at\n"
    "                  any layout\n"
    "  eval (--run-dir DIR [--step N] | --weights F.safetensors --spec S) [--data F]\n"
    "       [--format text|u16|u32|llmc] [--batches N] [--json]\n"
    "                  mean loss over non-overlapping windows of seq_len + 1 tokens\n"
    "  generate (--run-dir DIR | --weights F --spec S) --prompt TEXT --tokens N\n"
    "           [--temperature T] [--top-k K] [--seed S]\n"
    "                  sample a byte-level model; the same seed gives the same text\n"
    "  report RUN_DIR [--out FILE]\n"
    "                  one self-contained HTML file of the run (loss, tokens/s, recipes,\n"
    "                  events, checkpoints, per-site FP8 heatmaps); default RUN_DIR/report.html\n";
constexpr const char* kUsageTail =
    "  help            this text\n"
    "\n"
    "`fp8rt <command> --help` shows the options of one command.\n";

void PrintUsage(std::FILE* out) {
  std::fputs(kUsageHead, out);
  std::fputs(kUsageModel, out);
  std::fputs(fp8rt::cli::kControlCommandsUsage, out);
  std::fputs(kUsageTail, out);
}

// Directory holding this executable (for its sibling fp8rt-<command> programs).
std::filesystem::path SelfDir() {
  std::error_code ec;
  std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path() : self.parent_path();
}

// Runs fp8rt-<command> with argv[first..] as its arguments.
int ExecSibling(const std::string& command, int argc, char** argv, int first = 2) {
  const std::string program = "fp8rt-" + command;
  std::vector<char*> args;
  args.push_back(const_cast<char*>(program.c_str()));
  for (int i = first; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  const std::filesystem::path sibling = SelfDir() / program;
  if (!sibling.empty() && access(sibling.c_str(), X_OK) == 0) {
    execv(sibling.c_str(), args.data());
  } else {
    execvp(program.c_str(), args.data());  // installed elsewhere on PATH
  }
  std::fprintf(stderr, "fp8rt: cannot run %s (looked next to fp8rt in %s, then on PATH): %s\n",
               program.c_str(), SelfDir().c_str(), std::strerror(errno));
  return 127;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintUsage(stderr);
    return 2;
  }
  const std::string command = argv[1];
  if (command == "help" || command == "--help" || command == "-h") {
    PrintUsage(stdout);
    return 0;
  }
  if (command == "quantize" || command == "bench" || command == "launch" || command == "k8s") {
    return ExecSibling(command, argc, argv);
  }
  if (command == "export" || command == "eval" || command == "generate") {
    // One program for the three (fp8rt-model), which takes the command as its first argument.
    return ExecSibling("model", argc, argv, /*first=*/1);
  }
  if (command == "report") return fp8rt::report::RunReportCommand(argc - 1, argv + 1);
  if (fp8rt::cli::IsControlCommand(command)) return fp8rt::cli::RunControlCommand(argc, argv);
  std::fprintf(stderr, "fp8rt: unknown command '%s'\n\n", command.c_str());
  PrintUsage(stderr);
  return 2;
}
