// `fp8rt k8s render` as a user runs it (through the fp8rt dispatcher): the folder it writes
// deploys the spec it was given. Expected values come from the spec (parallel.dp x parallel.tp,
// loaded with LoadRunSpec) and the flags, not from the renderer's own output:
//   - the files: run.yaml byte for byte, ranks = slotsPerWorker x Worker replicas = dp x tp =
//     FP8RT_WORLD_SIZE, names and image from the flags, a private random token kept across
//     renders, GPUs = slots for a `device: cuda` spec (with or without --gpu), the default pod
//     counts;
//   - `kubectl kustomize` of the folder passes tests/deploy/validate_manifests.js (schemas, types,
//     the stack working together, the cpu/gpu promises) and carries the spec in its ConfigMap
//     (skipped without kubectl >= 1.21 or node: the message says so);
//   - bad flags and specs exit 2 naming the flag or the field (--gpu with a device: cpu spec);
//   - --tls-cert/--tls-key/--tls-ca: the controller serves TLS from a Secret of the three files
//     (its probes read /metrics), the ranks verify it with the CA; Open MPI's TCP settings (the
//     same as tests/multihost's) in every folder;
//   - deploy/kubernetes/base/run.yaml is examples/tiny.yaml.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/spec/run_spec.h"
#include "tests/support/test_support.h"
#include "yaml-cpp/yaml.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using test::ReadFile;
using test::TempDir;
using test::WriteFile;
using ::testing::HasSubstr;

const std::string kBin = FP8RT_BIN_DIR;
const std::string kSource = FP8RT_SOURCE_DIR;

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs `argv` through the shell, output captured; the exit status.
Result RunCommand(const std::vector<std::string>& argv, const std::string& cwd = kSource) {
  std::string cmd = "cd " + Quote(cwd) + " &&";
  for (const std::string& a : argv) cmd += " " + Quote(a);
  cmd += " 2>&1";
  Result r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

Result Render(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kBin + "/fp8rt", "k8s", "render"};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv);
}

int World(const std::string& spec_path) {
  absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(spec_path, std::span<const std::string>());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? spec->parallel().dp() * spec->parallel().tp() : -1;
}

// The MPIJob's numbers as rendered.
struct Job {
  std::string name, image, world_env, controller;
  int slots = 0, workers = 0, gpus = 0, np = 0;
};

Job ReadJob(const fs::path& dir) {
  const YAML::Node job = YAML::LoadFile((dir / "mpijob.yaml").string());
  Job j;
  j.name = job["metadata"]["name"].as<std::string>();
  j.slots = job["spec"]["slotsPerWorker"].as<int>();
  const YAML::Node worker = job["spec"]["mpiReplicaSpecs"]["Worker"];
  j.workers = worker["replicas"].as<int>();
  const YAML::Node limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"];
  j.gpus = limits["nvidia.com/gpu"] ? limits["nvidia.com/gpu"].as<int>() : 0;
  const YAML::Node launcher =
      job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0];
  j.image = launcher["image"].as<std::string>();
  for (const YAML::Node& e : launcher["env"]) {
    if (e["name"].as<std::string>() == "FP8RT_WORLD_SIZE")
      j.world_env = e["value"].as<std::string>();
  }
  const YAML::Node args = launcher["args"];
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i].as<std::string>() == "--controller") j.controller = args[i + 1].as<std::string>();
  }
  return j;
}

// kubectl with a kustomize that reads these files (>= v4, kubectl >= 1.21) and node with the
// packages of tests/deploy; an empty string when both are there, else why not.
std::string ValidatorMissing() {
  const Result v = RunCommand({"kubectl", "version", "--client", "-o", "json"});
  if (v.status != 0) {
    return "kubectl not found: Debian 12 packages no recent kubectl (its kubernetes-client 1.20 "
           "has kustomize 2.0.3), so scripts/bootstrap cannot install it; install kubectl >= 1.21";
  }
  const size_t brace = v.output.find('{');
  const nlohmann::json j = nlohmann::json::parse(
      brace == std::string::npos ? std::string("{}") : v.output.substr(brace), nullptr, false);
  const std::string kv = j.is_object() ? j.value("kustomizeVersion", "") : "";
  if (kv.size() < 2 || std::atoi(kv.c_str() + (kv[0] == 'v' ? 1 : 0)) < 4) {
    return "kubectl's kustomize is '" + kv + "'; these kustomizations need kustomize >= v4";
  }
  if (RunCommand({"node", "--version"}).status != 0) return "node not found (scripts/bootstrap)";
  if (!fs::exists(fs::path(kSource) / "tests/deploy/node_modules/kubernetes-models")) {
    return "tests/deploy/node_modules missing (scripts/bootstrap runs npm ci there)";
  }
  return "";
}

// kubectl kustomize DIR, then the validator; its verdict, and the built manifests in `built`.
Result KustomizeAndValidate(const fs::path& dir, const std::vector<std::string>& flags,
                            const fs::path& built) {
  const Result k = RunCommand({"kubectl", "kustomize", dir.string()});
  if (k.status != 0) return k;
  WriteFile(built, k.output);
  std::vector<std::string> argv = {"node", kSource + "/tests/deploy/validate_manifests.js"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(built.string());
  return RunCommand(argv);
}

TEST(K8sRenderTest, CpuFolderCarriesTheSpecAndItsWorldSize) {
  TempDir tmp("fp8rt-k8s-render");
  const fs::path out = tmp / "tiny-k8s";
  const std::string spec = kSource + "/examples/tiny.yaml";
  const Result r = Render(
      {"examples/tiny.yaml", "--image", "registry.example/fp8rt:cpu", "--out", out.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("new random token"));

  for (const char* f : {"kustomization.yaml", "controller.yaml", "data-pvc.yaml", "mpijob.yaml",
                        "run.yaml", "token"}) {
    EXPECT_TRUE(fs::exists(out / f)) << f;
  }
  EXPECT_EQ(ReadFile(out / "run.yaml"), ReadFile(spec));
  const int world = World(spec);
  ASSERT_EQ(world, 2);
  const Job job = ReadJob(out);
  EXPECT_EQ(job.name, "tiny");  // the spec file's name
  EXPECT_EQ(job.slots * job.workers, world);
  EXPECT_EQ(job.slots, 1);  // CPU default: one rank per pod
  EXPECT_EQ(job.world_env, std::to_string(world));
  EXPECT_EQ(job.gpus, 0);
  EXPECT_EQ(job.image, "registry.example/fp8rt:cpu");
  EXPECT_EQ(job.controller, "tiny-controller:50051");

  // The token: 64 hex digits, readable by the owner only, kept when rendering again.
  const std::string token = ReadFile(out / "token");
  EXPECT_THAT(token, ::testing::MatchesRegex("[0-9a-f]{64}\n"));
  struct stat st {};
  ASSERT_EQ(stat((out / "token").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const Result again = Render(
      {"examples/tiny.yaml", "--image", "registry.example/fp8rt:cpu", "--out", out.string()});
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("kept the token"));
  EXPECT_EQ(ReadFile(out / "token"), token);

  const std::string missing = ValidatorMissing();
  if (!missing.empty()) GTEST_SKIP() << "manifests not validated: " << missing;
  const fs::path built = tmp / "built.yaml";
  const Result v = KustomizeAndValidate(out, {"--flavor", "cpu", "--any-image"}, built);
  EXPECT_EQ(v.status, 0) << v.output;
  // The ConfigMap of the built manifests holds the spec.
  bool found = false;
  for (const YAML::Node& doc : YAML::LoadAllFromFile(built.string())) {
    if (doc["kind"].as<std::string>() != "ConfigMap") continue;
    EXPECT_EQ(doc["metadata"]["name"].as<std::string>(), "tiny-spec");
    EXPECT_EQ(doc["data"]["run.yaml"].as<std::string>(), ReadFile(spec));
    found = true;
  }
  EXPECT_TRUE(found);
}

// TLS from the three PEM files: copied into the folder (the key owner-only), a Secret <name>-tls,
// the controller's --tls-cert/--tls-key and httpGet probes (Kubernetes' gRPC probe has no TLS),
// the ranks' --tls-ca, the Secret mounted where both read it. Open MPI's TCP settings are in the
// Launcher's environment (forwarded to the ranks) with or without TLS. Half the files: exit 2.
TEST(K8sRenderTest, TlsAndTcpSettingsReachTheControllerAndTheRanks) {
  TempDir tmp("fp8rt-k8s-render-tls");
  const std::string pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
  const std::string key = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n";
  WriteFile(tmp / "head.pem", pem);
  WriteFile(tmp / "head.key", key);
  WriteFile(tmp / "ca.pem", pem);
  const fs::path out = tmp / "tiny-k8s";
  const Result r = Render({"examples/tiny.yaml", "--image", "registry.example/fp8rt:cpu", "--out",
                           out.string(), "--tls-cert", (tmp / "head.pem").string(), "--tls-key",
                           (tmp / "head.key").string(), "--tls-ca", (tmp / "ca.pem").string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(ReadFile(out / "tls.crt"), pem);
  EXPECT_EQ(ReadFile(out / "tls.key"), key);
  EXPECT_EQ(ReadFile(out / "ca.crt"), pem);
  struct stat st {};
  ASSERT_EQ(stat((out / "tls.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  const YAML::Node kust = YAML::LoadFile((out / "kustomization.yaml").string());
  bool secret = false;
  for (const YAML::Node& g : kust["secretGenerator"]) {
    if (g["name"].as<std::string>() != "tiny-tls") continue;
    secret = true;
    std::vector<std::string> files;
    for (const YAML::Node& f : g["files"]) files.push_back(f.as<std::string>());
    EXPECT_THAT(files, ::testing::ElementsAre("tls.crt", "tls.key", "ca.crt"));
  }
  EXPECT_TRUE(secret) << "no Secret tiny-tls in kustomization.yaml";

  auto strings = [](const YAML::Node& seq) {
    std::vector<std::string> v;
    for (const YAML::Node& n : seq) v.push_back(n.as<std::string>());
    return v;
  };
  auto has_pair = [](const std::vector<std::string>& args, const std::string& flag,
                     const std::string& value) {
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == flag && args[i + 1] == value) return true;
    }
    return false;
  };
  auto mounts_tls = [](const YAML::Node& container, const YAML::Node& pod) {
    bool mounted = false, volume = false;
    for (const YAML::Node& m : container["volumeMounts"]) {
      mounted |= m["name"].as<std::string>() == "tls" &&
                 m["mountPath"].as<std::string>() == "/etc/fp8rt/tls";
    }
    for (const YAML::Node& v : pod["volumes"]) {
      volume |= v["name"].as<std::string>() == "tls" &&
                v["secret"]["secretName"].as<std::string>() == "tiny-tls";
    }
    return mounted && volume;
  };
  for (const YAML::Node& doc : YAML::LoadAllFromFile((out / "controller.yaml").string())) {
    if (doc["kind"].as<std::string>() != "Deployment") continue;
    const YAML::Node pod = doc["spec"]["template"]["spec"];
    const YAML::Node c = pod["containers"][0];
    const std::vector<std::string> args = strings(c["args"]);
    EXPECT_TRUE(has_pair(args, "--tls-cert", "/etc/fp8rt/tls/tls.crt"));
    EXPECT_TRUE(has_pair(args, "--tls-key", "/etc/fp8rt/tls/tls.key"));
    for (const char* probe : {"readinessProbe", "livenessProbe"}) {
      EXPECT_EQ(c[probe]["httpGet"]["path"].as<std::string>(), "/metrics") << probe;
      EXPECT_EQ(c[probe]["httpGet"]["port"].as<int>(), 9464) << probe;
      EXPECT_FALSE(c[probe]["grpc"]) << probe;
    }
    EXPECT_TRUE(mounts_tls(c, pod));
  }
  const YAML::Node job = YAML::LoadFile((out / "mpijob.yaml").string());
  const YAML::Node launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"];
  const std::vector<std::string> args = strings(launcher["containers"][0]["args"]);
  EXPECT_TRUE(has_pair(args, "--tls-ca", "/etc/fp8rt/tls/ca.crt"));
  std::map<std::string, std::string> env;
  for (const YAML::Node& e : launcher["containers"][0]["env"]) {
    env[e["name"].as<std::string>()] = e["value"].as<std::string>();
  }
  EXPECT_EQ(env["OMPI_MCA_btl"], "self,vader,tcp");
  EXPECT_EQ(env["OMPI_MCA_btl_tcp_if_include"], "eth0");
  EXPECT_EQ(env["OMPI_MCA_oob_tcp_if_include"], "eth0");
  const YAML::Node worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"];
  EXPECT_TRUE(mounts_tls(worker["containers"][0], worker)) << "the ranks run in the Worker pods";

  // Half the files, and a file that is not PEM: exit 2 naming the flag.
  Result bad = Render({"examples/tiny.yaml", "--image", "fp8rt", "--out", (tmp / "b1").string(),
                       "--tls-cert", (tmp / "head.pem").string()});
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("go together"));
  WriteFile(tmp / "junk.pem", "not a certificate");
  bad = Render({"examples/tiny.yaml", "--image", "fp8rt", "--out", (tmp / "b2").string(),
                "--tls-cert", (tmp / "head.pem").string(), "--tls-key",
                (tmp / "head.key").string(), "--tls-ca", (tmp / "junk.pem").string()});
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("--tls-ca"));
  EXPECT_THAT(bad.output, HasSubstr("not a PEM file"));
}

// examples/tiny.yaml with `device: cuda` added, written into `dir` under its own name.
fs::path CudaTiny(const TempDir& dir) {
  const fs::path spec = dir / "tiny.yaml";
  WriteFile(spec, ReadFile(kSource + "/examples/tiny.yaml") + "\ndevice: cuda\n");
  return spec;
}

TEST(K8sRenderTest, GpuFolderHasOneRankPerGpuInTheNamespace) {
  TempDir tmp("fp8rt-k8s-render");
  const fs::path spec = CudaTiny(tmp);
  const fs::path out = tmp / "out";
  const Result r = Render({spec.string(), "--image", "fp8rt:cuda13.0", "--gpu", "--name",
                           "tiny-gpu", "--namespace", "ml", "--out", out.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("GPU worker pod"));
  EXPECT_EQ(ReadFile(out / "run.yaml"), ReadFile(spec));
  const Job job = ReadJob(out);
  EXPECT_EQ(job.name, "tiny-gpu");
  EXPECT_EQ(job.workers, 1);  // up to 8 GPUs in one pod by default
  EXPECT_EQ(job.slots, 2);
  EXPECT_EQ(job.gpus, job.slots);
  EXPECT_EQ(job.controller, "tiny-gpu-controller:50051");

  // The spec's device decides: the same folder without --gpu.
  const fs::path implied = tmp / "implied";
  const Result r2 = Render({spec.string(), "--image", "fp8rt:cuda13.0", "--name", "tiny-gpu",
                            "--namespace", "ml", "--out", implied.string()});
  ASSERT_EQ(r2.status, 0) << r2.output;
  EXPECT_EQ(ReadFile(implied / "mpijob.yaml"), ReadFile(out / "mpijob.yaml"));

  const std::string missing = ValidatorMissing();
  if (!missing.empty()) GTEST_SKIP() << "manifests not validated: " << missing;
  const fs::path built = tmp / "built.yaml";
  const Result v = KustomizeAndValidate(out, {"--flavor", "gpu"}, built);
  EXPECT_EQ(v.status, 0) << v.output;
  for (const YAML::Node& doc : YAML::LoadAllFromFile(built.string())) {
    EXPECT_EQ(doc["metadata"]["namespace"].as<std::string>(""), "ml")
        << doc["kind"].as<std::string>();
  }
}

TEST(K8sRenderTest, WorkersSplitALargerWorld) {
  TempDir tmp("fp8rt-k8s-render");
  // tiny.yaml on dp 8 x tp 2 = 16 ranks; its data.path exists only in the pods.
  std::string text = ReadFile(kSource + "/examples/tiny.yaml");
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"  dp: 2\n", "  dp: 8\n"},
           {"  tp: 1\n", "  tp: 2\n"},
           {"path: examples/data/kjv.txt", "path: /data/datasets/only-in-the-pods.txt"}}) {
    ASSERT_NE(text.find(from), std::string::npos) << from;
    text.replace(text.find(from), from.size(), to);
  }
  const fs::path spec = tmp / "big.yaml";
  WriteFile(spec, text);
  ASSERT_EQ(World(spec.string()), 16);
  // The same on GPUs (device: cuda), same file name.
  fs::create_directories(tmp / "cuda");
  const fs::path cuda_spec = tmp / "cuda/big.yaml";
  WriteFile(cuda_spec, text + "\ndevice: cuda\n");

  struct Case {
    bool cuda;
    std::vector<std::string> flags;
    int workers, slots, gpus;
  } cases[] = {
      {false, {}, 16, 1, 0},                 // CPU: one rank per pod
      {false, {"--workers", "4"}, 4, 4, 0},  // 4 ranks per pod
      {true, {}, 2, 8, 8},                   // 8 GPUs per pod
      {true, {"--gpu"}, 2, 8, 8},
      {true, {"--gpu", "--workers", "4"}, 4, 4, 4},
  };
  int n = 0;
  for (const Case& c : cases) {
    const fs::path out = tmp / ("out-" + std::to_string(++n));
    std::vector<std::string> args = {(c.cuda ? cuda_spec : spec).string(), "--image", "x", "--out",
                                     out.string()};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const Result r = Render(args);
    ASSERT_EQ(r.status, 0) << r.output;
    const Job job = ReadJob(out);
    EXPECT_EQ(job.name, "big");
    EXPECT_EQ(job.workers, c.workers) << r.output;
    EXPECT_EQ(job.slots, c.slots);
    EXPECT_EQ(job.gpus, c.gpus);
    EXPECT_EQ(job.world_env, "16");
  }
}

TEST(K8sRenderTest, BadFlagsAndSpecsExit2NamingTheProblem) {
  TempDir tmp("fp8rt-k8s-render");
  const fs::path typo = tmp / "typo.yaml";
  std::string text = ReadFile(kSource + "/examples/tiny.yaml");
  text.replace(text.find("  scaling: delayed"), 18, "  scalng: delayed");
  WriteFile(typo, text);
  const fs::path tp3 = tmp / "tp3.yaml";
  text = ReadFile(kSource + "/examples/tiny.yaml");
  text.replace(text.find("  tp: 1\n"), 8, "  tp: 3\n");
  WriteFile(tp3, text);
  const fs::path upper = tmp / "Tiny_Run.yaml";
  WriteFile(upper, ReadFile(kSource + "/examples/tiny.yaml"));
  const std::string out = (tmp / "out").string();

  struct Case {
    std::vector<std::string> args;
    std::string expected;
  } cases[] = {
      {{"examples/tiny.yaml", "--out", out}, "--image"},
      {{"examples/tiny.yaml", "--image", "has space", "--out", out}, "--image"},
      {{"examples/tiny.yaml", "--image", "x", "--workers", "3", "--out", out}, "--workers"},
      {{"examples/tiny.yaml", "--image", "x", "--workers", "-1", "--out", out}, "--workers"},
      {{"examples/tiny.yaml", "--image", "x", "--name", "Bad_Name", "--out", out}, "--name"},
      {{"examples/tiny.yaml", "--image", "x", "--namespace", "-ns", "--out", out}, "--namespace"},
      {{upper.string(), "--image", "x", "--out", out}, "give --name"},
      {{typo.string(), "--image", "x", "--out", out}, "precision.scalng: unknown key"},
      {{tp3.string(), "--image", "x", "--out", out}, "parallel.tp 3"},
      // GPU pods for ranks that would run on CPU.
      {{"examples/tiny.yaml", "--image", "x", "--gpu", "--out", out},
       "--gpu: the spec's ranks run on CPU (device: cpu"},
      {{(tmp / "none.yaml").string(), "--image", "x", "--out", out}, "none.yaml"},
  };
  for (const Case& c : cases) {
    const Result r = Render(c.args);
    EXPECT_EQ(r.status, 2) << c.expected << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.expected));
  }
  EXPECT_FALSE(fs::exists(out)) << "nothing is written for a bad input";

  // `fp8rt k8s` without a subcommand, and the dispatcher's usage names the command.
  EXPECT_EQ(RunCommand({kBin + "/fp8rt", "k8s"}).status, 2);
  EXPECT_THAT(RunCommand({kBin + "/fp8rt", "help"}).output,
              HasSubstr("k8s render RUN.yaml --image"));
}

TEST(K8sRenderTest, BaseRunSpecIsTheTinyExample) {
  const auto load = [](const std::string& path) {
    absl::StatusOr<v1::RunSpec> spec = LoadRunSpec(path, std::span<const std::string>());
    EXPECT_TRUE(spec.ok()) << spec.status();
    return spec.ok() ? *spec : v1::RunSpec();
  };
  const v1::RunSpec base = load(kSource + "/deploy/kubernetes/base/run.yaml");
  const v1::RunSpec tiny = load(kSource + "/examples/tiny.yaml");
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differ.Compare(base, tiny)) << diff;
}

}  // namespace
}  // namespace fp8rt
