// Checkpoint faults (issue 9), on real training runs of tests/data/tiny-plain.yaml on 2 MPI ranks:
//   FaultPointSpec...    (in-process) FP8RT_FAULT_POINT's syntax is checked, and an injected
//                        ENOSPC fails ShardWriter::Write with nothing left behind.
//   KillDuringSave       a rank, or the controller, SIGKILLed at a random point of a random save
//                        (FP8RT_FAULT_POINT, runtime/core/fault_point.h); the resume through the
//                        controller starts from the newest committed checkpoint and continues
//                        bit-identically with an uninterrupted reference run; no partial
//                        checkpoint is ever listed (on disk or by the controller) or loaded.
//   CorruptionIsDetected one bit flipped at a random offset of a random file of a committed
//                        checkpoint (shards, MANIFEST, and explicitly inside scaling/ sections):
//                        Verify says DataLoss naming the file and an offset (and, inside a section,
//                        the section and its byte range), FindNewestValid falls back to the
//                        previous checkpoint.
//   DiskFullDuringSave   a shard or MANIFEST write fails with ENOSPC, standalone and under the
//                        controller: every rank reports it, no temp folder or file is left, the
//                        previous checkpoint stays committed and verifies (keep 1: retention must
//                        not delete it), and a resume finishes the run.
// Trial counts: short by default; FP8RT_FAULT_TRIALS=long for the long variants. The seed is
// printed (FP8RT_FAULT_SEED=N reruns the same trials), and so is each trial's choice.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp8rt/v1/control.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint/checkpoint_dir.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/fault_point.h"
#include "tests/support/test_support.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using test::ControllerProcess;
using test::ExitResult;
using test::ReadFile;
using test::ReadJsonl;
using test::RunToExit;
using test::TempDir;

const std::string kBin = FP8RT_BIN_DIR;
const std::string kSource = FP8RT_SOURCE_DIR;

bool LongVariant() {
  const char* v = std::getenv("FP8RT_FAULT_TRIALS");
  return v != nullptr && std::string(v) == "long";
}

uint64_t Seed(const char* test) {
  uint64_t seed =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count() ^
                            (static_cast<uint64_t>(getpid()) << 20));
  if (const char* v = std::getenv("FP8RT_FAULT_SEED")) seed = std::strtoull(v, nullptr, 10);
  std::printf("%s: seed %llu (FP8RT_FAULT_SEED=%llu reruns these trials)\n", test,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

// The run of every test: tiny.yaml (absolute data path), 2 ranks, short.
class Runs {
 public:
  Runs() {
    std::string spec = ReadFile(kSource + "/tests/data/tiny-plain.yaml");
    const std::string rel = "path: examples/data/kjv.txt";
    const size_t at = spec.find(rel);
    EXPECT_NE(at, std::string::npos);
    if (at != std::string::npos) {
      spec.replace(at, rel.size(), "path: " + kSource + "/examples/data/kjv.txt");
    }
    spec_ = dir_ / "tiny.yaml";
    test::WriteFile(spec_, spec);
  }

  const TempDir& dir() const { return dir_; }
  // Launches print nothing but failures unless this is set false (progress, controller events).
  void set_quiet(bool quiet) { quiet_ = quiet; }

  // `fp8rt launch` of `steps` steps, a checkpoint every `every` kept `keep`, under `controller`
  // (nullptr: --no-controller), with FP8RT_FAULT_POINT=`fault` (empty: unset).
  ExitResult Launch(const fs::path& run_dir, ControllerProcess* controller, bool resume,
                    const std::string& fault, int steps, int every, int keep,
                    const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {kBin + "/fp8rt", "launch", spec_.string(), "--np", "2",
                                     "--run-dir", run_dir.string()};
    if (quiet_) argv.push_back("--quiet");
    if (controller != nullptr) {
      argv.insert(argv.end(),
                  {"--controller", controller->grpc_address(), "--token-file",
                   controller->token_file().string(), "--run-id", run_dir.filename().string()});
    } else {
      argv.push_back("--no-controller");
    }
    for (const std::string& kv :
         {"train.steps=" + std::to_string(steps), std::string("train.warmup=2"),
          "checkpoint.every=" + std::to_string(every), "checkpoint.keep=" + std::to_string(keep),
          std::string("metrics.every=1"), std::string("metrics.per_rank_fp8_stats=false")}) {
      argv.insert(argv.end(), {"--set", kv});
    }
    if (resume) argv.push_back("--resume");
    argv.insert(argv.end(), extra.begin(), extra.end());
    const fs::path log = dir_ / ("launch-" + std::to_string(++launches_) + ".log");
    return RunToExit(argv, log, {{"FP8RT_FAULT_POINT", fault}, {"OMP_NUM_THREADS", "1"}},
                     std::chrono::minutes(4));
  }

  std::unique_ptr<ControllerProcess> StartController(const fs::path& state_dir,
                                                     const std::string& fault = "") {
    ControllerProcess::Options o;
    o.binary = kBin + "/fp8rt-controller";
    o.dir = dir_.path();
    o.state_dir = state_dir;
    o.env = {{"FP8RT_FAULT_POINT", fault}};
    return ControllerProcess::Start(o);
  }

 private:
  TempDir dir_{"fp8rt-ckpt-fault"};
  fs::path spec_;
  int launches_ = 0;
  bool quiet_ = true;
};

// Loss and grad_norm of each step in metrics.jsonl, as written (bit-exact doubles).
std::map<int64_t, std::pair<double, double>> Losses(const fs::path& run_dir) {
  std::map<int64_t, std::pair<double, double>> out;
  for (const Json& j : ReadJsonl(run_dir / "metrics.jsonl")) {
    out[j["step"].get<int64_t>()] = {
        j["loss"].get<double>(), j["grad_norm"].is_null() ? -1.0 : j["grad_norm"].get<double>()};
  }
  return out;
}

// Leftovers of a save: .tmp-step-* folders and *.tmp files under the checkpoints folder.
std::vector<std::string> Leftovers(const fs::path& run_dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!fs::exists(run_dir / "checkpoints")) return found;
  for (auto it = fs::recursive_directory_iterator(run_dir / "checkpoints", ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.starts_with(".tmp-step-") || name.ends_with(".tmp")) found.push_back(it->path());
  }
  return found;
}

// Every committed checkpoint on disk verifies; returns them (ascending).
std::vector<int64_t> CommittedAndVerified(const fs::path& run_dir, const std::string& trial) {
  const CheckpointDir dir(run_dir.string());
  absl::StatusOr<std::vector<int64_t>> steps = dir.ListCommitted();
  EXPECT_TRUE(steps.ok()) << trial << ": " << steps.status();
  if (!steps.ok()) return {};
  for (int64_t s : *steps) {
    absl::StatusOr<v1::CheckpointManifest> m = dir.Verify(s);
    EXPECT_TRUE(m.ok()) << trial << ": committed checkpoint of step " << s
                        << " does not verify (a partial checkpoint is listed): " << m.status();
  }
  return *steps;
}

// The controller's ListCheckpoints: every listed checkpoint is a committed folder that verifies.
// Returns how many listed ones were partial (not committed or not verifying).
int PartialListedByController(ControllerProcess& c, const std::string& run_id,
                              const fs::path& run_dir, const std::string& trial) {
  v1::ListCheckpointsRequest req;
  req.set_run_id(run_id);
  v1::ListCheckpointsResponse resp;
  const grpc::Status st = c.runs().ListCheckpoints(c.Context().get(), req, &resp);
  EXPECT_TRUE(st.ok()) << trial << ": ListCheckpoints: " << st.error_message();
  int partial = 0;
  const CheckpointDir dir(run_dir.string());
  for (const v1::CheckpointInfo& info : resp.checkpoints()) {
    const bool temp = info.dir().find(".tmp-step-") != std::string::npos;
    absl::StatusOr<v1::CheckpointManifest> m = dir.Verify(info.step());
    if (temp || !m.ok() || info.dir() != dir.CommittedDir(info.step())) {
      ++partial;
      ADD_FAILURE() << trial << ": the controller lists a partial checkpoint " << info.dir() << ": "
                    << m.status();
    }
  }
  return partial;
}

// The step the last "resuming after step N" line names in `log` (0 when it says it starts at
// step 1, -1 when neither).
int64_t ResumedFrom(const std::string& log) {
  const std::string key = "resuming after step ";
  const size_t at = log.rfind(key);
  if (at != std::string::npos) return std::strtoll(log.c_str() + at + key.size(), nullptr, 10);
  if (log.find("no checkpoint to resume from") != std::string::npos) return 0;
  return -1;
}

// ---------------------------------------------------------------------------------------------
// 0. The fault points themselves, in-process (ArmFaultPoint instead of the environment)

TEST(CheckpointFaultTest, FaultPointSpecAndInjectedEnospcInTheWriter) {
  for (const char* bad :
       {"nowhere:kill", "shard_open", "shard_open:explode", "prune:enospc", "shard_bytes:kill",
        "shard_open:kill:after_bytes=3", "shard_open:kill:rank=x", "shard_open:kill:colour=1"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ArmFaultPoint(bad))) << bad;
  }
  TempDir dir("fp8rt-fault-point");
  const std::string path = (dir / "rank-00000.shard").string();
  ShardWriter writer;
  const std::vector<std::byte> bytes(1000, std::byte{7});
  ASSERT_TRUE(writer.Add("master/w", bytes).ok());
  ASSERT_TRUE(ArmFaultPoint("").ok());
  ASSERT_TRUE(writer.Write(path).ok());
  const std::string before = ReadFile(path);

  // ENOSPC in the middle of the bytes, at the open and before the fsync: the write fails with the
  // errno's kind naming the temp file, removes it, and leaves the existing file as it was.
  for (const char* spec : {"shard_bytes:enospc:after_bytes=100", "shard_open:enospc",
                           "shard_fsync:enospc", "shard_bytes:enospc:after_bytes=0"}) {
    ASSERT_TRUE(ArmFaultPoint(spec).ok()) << spec;
    const absl::StatusOr<ShardWriteResult> written = writer.Write(path);
    EXPECT_TRUE(absl::IsResourceExhausted(written.status())) << spec << ": " << written.status();
    EXPECT_NE(std::string(written.status().message()).find(path + ".tmp"), std::string::npos)
        << written.status();
    EXPECT_NE(std::string(written.status().message()).find("No space left on device"),
              std::string::npos)
        << written.status();
    EXPECT_FALSE(fs::exists(path + ".tmp")) << spec;
    EXPECT_EQ(ReadFile(path), before) << spec;
  }
  // Filters: another rank, another step, or bytes beyond the file do not fire.
  for (const char* spec : {"shard_open:enospc:rank=5", "shard_open:enospc:step=7",
                           "shard_bytes:enospc:after_bytes=100000"}) {
    ASSERT_TRUE(ArmFaultPoint(spec).ok()) << spec;
    SetFaultStep(6);
    EXPECT_TRUE(writer.Write(path).ok()) << spec;
  }
  SetFaultStep(-1);
  ASSERT_TRUE(ArmFaultPoint("").ok());
}

// ---------------------------------------------------------------------------------------------
// 1. Kill during a save

constexpr int kSteps = 12, kEvery = 3, kKeep = 2;

TEST(CheckpointFaultTest, KillDuringSave) {
  const int per_side = LongVariant() ? 20 : 3;
  std::mt19937_64 rng(Seed("kill-during-save"));
  Runs runs;

  // The reference: the same run, uninterrupted.
  const fs::path ref_dir = runs.dir() / "reference";
  std::unique_ptr<ControllerProcess> ref_controller =
      runs.StartController(runs.dir() / "ref-state");
  ASSERT_NE(ref_controller, nullptr);
  const ExitResult ref =
      runs.Launch(ref_dir, ref_controller.get(), false, "", kSteps, kEvery, kKeep);
  ASSERT_EQ(ref.exit_code, 0) << ref.log << ReadFile(ref_dir / "logs/launch.log");
  ref_controller.reset();
  const std::map<int64_t, std::pair<double, double>> reference = Losses(ref_dir);
  ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps));
  // File sizes, for after_bytes: a rank's shard and a MANIFEST.
  const CheckpointDir ref_ckpt(ref_dir.string());
  const uint64_t shard_size = fs::file_size(ref_ckpt.CommittedDir(kSteps) + "/rank-00001.shard");
  const uint64_t manifest_size = fs::file_size(ref_ckpt.CommittedDir(kSteps) + "/MANIFEST");

  const std::vector<std::string> rank_points = {"shard_open",   "shard_bytes",   "shard_fsync",
                                                "shard_rename", "shard_renamed", "shard_acked"};
  const std::vector<std::string> controller_points = {"shard_open",
                                                      "shard_bytes",
                                                      "shard_fsync",
                                                      "shard_rename",
                                                      "shard_renamed",
                                                      "commit_manifest",
                                                      "commit_manifest_written",
                                                      "commit_renamed",
                                                      "prune",
                                                      "controller_committed"};
  const size_t first_point = rng() % 60;
  int rank_trials = 0, controller_trials = 0, partial_listed = 0, identical = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < 2 * per_side; ++t) {
    const bool on_controller = t % 2 == 1;
    const std::vector<std::string>& points = on_controller ? controller_points : rank_points;
    // Each side walks its points from a random first one, so that every point gets its turn.
    const std::string point = points[(t / 2 + first_point) % points.size()];
    // Saves at 3, 6, 9 (the one at 12 ends the run: nothing would be left to resume); retention
    // first deletes a checkpoint at 9.
    const int64_t step = point == "prune" ? 9 : kEvery * static_cast<int64_t>(1 + rng() % 3);
    const int rank = static_cast<int>(rng() % 2);
    std::string fault = point + ":kill:step=" + std::to_string(step);
    if (!on_controller) fault += ":rank=" + std::to_string(rank);
    if (point == "shard_bytes") {
      fault +=
          ":after_bytes=" + std::to_string(rng() % (on_controller ? manifest_size : shard_size));
    }
    const std::string trial =
        "trial " + std::to_string(t) + " (" +
        (on_controller ? std::string("controller") : "rank " + std::to_string(rank)) +
        ", FP8RT_FAULT_POINT=" + fault + ")";
    std::printf("kill-during-save: %s\n", trial.c_str());
    std::fflush(stdout);
    SCOPED_TRACE(trial);
    (on_controller ? controller_trials : rank_trials)++;

    // The run dies at the fault: a rank SIGKILLs itself (mpirun stops the others), or the
    // controller does (the ranks' acknowledgement fails).
    const std::string run_id = "trial-" + std::to_string(t);
    const fs::path run_dir = runs.dir() / run_id;
    const fs::path state = runs.dir() / ("state-" + std::to_string(t));
    std::unique_ptr<ControllerProcess> controller =
        runs.StartController(state, on_controller ? fault : "");
    ASSERT_NE(controller, nullptr);
    const ExitResult killed = runs.Launch(run_dir, controller.get(), false,
                                          on_controller ? "" : fault, kSteps, kEvery, kKeep);
    ASSERT_NE(killed.exit_code, 0) << "the fault did not stop the run: " << killed.log;
    const std::string worker_log = ReadFile(run_dir / "logs/launch.log");
    if (on_controller) {
      ASSERT_FALSE(controller->running()) << "the controller was not killed: " << controller->log();
      EXPECT_NE(controller->log().find("FP8RT_FAULT_POINT kills this process"), std::string::npos);
      controller.reset();
      controller = runs.StartController(state);  // the same state folder, not armed
      ASSERT_NE(controller, nullptr);
    } else {
      EXPECT_NE(worker_log.find("FP8RT_FAULT_POINT kills this process"), std::string::npos)
          << worker_log;
    }

    // Before the resume: every committed checkpoint verifies, on disk and as listed.
    const std::vector<int64_t> before = CommittedAndVerified(run_dir, trial);
    const int64_t expected = before.empty() ? 0 : before.back();
    partial_listed += PartialListedByController(*controller, run_id, run_dir, trial);

    // The resume through the controller starts at the newest committed checkpoint and ends the
    // run with the reference's losses.
    const ExitResult resumed =
        runs.Launch(run_dir, controller.get(), true, "", kSteps, kEvery, kKeep);
    const std::string resume_log = ReadFile(run_dir / "logs/launch.log").substr(worker_log.size());
    ASSERT_EQ(resumed.exit_code, 0) << resumed.log << resume_log;
    EXPECT_EQ(ResumedFrom(resume_log), expected) << resume_log;
    const std::vector<int64_t> after = CommittedAndVerified(run_dir, trial);
    EXPECT_EQ(after, (std::vector<int64_t>{kSteps - kEvery, kSteps}));
    EXPECT_EQ(Leftovers(run_dir), std::vector<std::string>());
    partial_listed += PartialListedByController(*controller, run_id, run_dir, trial);
    const std::map<int64_t, std::pair<double, double>> losses = Losses(run_dir);
    EXPECT_EQ(losses.size(), static_cast<size_t>(kSteps));
    bool same = losses.size() == static_cast<size_t>(kSteps);
    for (int64_t s = expected + 1; s <= kSteps && same; ++s) {
      same = losses.contains(s) && losses.at(s) == reference.at(s);
      EXPECT_TRUE(same) << "step " << s << " after resuming from " << expected
                        << " differs from the reference";
    }
    identical += same ? 1 : 0;
    if (!HasFailure()) fs::remove_all(run_dir);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "kill-during-save: %d trials (rank %d, controller %d), %d partial checkpoints listed, "
      "%d/%d bit-identical resumes, %.0f s\n",
      rank_trials + controller_trials, rank_trials, controller_trials, partial_listed, identical,
      rank_trials + controller_trials, seconds);
  EXPECT_EQ(partial_listed, 0);
  EXPECT_EQ(identical, rank_trials + controller_trials);
}

// ---------------------------------------------------------------------------------------------
// 2. Corruption

// A section of a shard file, found by reading the format in checkpoint_io.h (not its code).
struct SectionSpan {
  std::string name;
  uint64_t begin = 0, end = 0;  // its bytes, [begin, end)
};

std::vector<SectionSpan> ParseSections(const std::string& bytes) {
  auto u32 = [&](uint64_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(bytes[at + i])} << (8 * i);
    return v;
  };
  auto u64 = [&](uint64_t at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(bytes[at + i])} << (8 * i);
    return v;
  };
  std::vector<SectionSpan> out;
  const uint32_t count = u32(12);
  uint64_t pos = 16;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t name_len = u32(pos);
    SectionSpan s;
    s.name = bytes.substr(pos + 4, name_len);
    pos += 4 + name_len;
    const uint64_t len = u64(pos);
    pos += 16;  // byte length, checksum
    s.begin = pos;
    s.end = pos + len;
    pos += len;
    out.push_back(s);
  }
  EXPECT_EQ(pos + 8, bytes.size()) << "the shard format is not as checkpoint_io.h says";
  return out;
}

void FlipBit(const std::string& path, uint64_t offset, int bit) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  unsigned char c = 0;
  ASSERT_EQ(::pread(fd, &c, 1, static_cast<off_t>(offset)), 1);
  c ^= static_cast<unsigned char>(1u << bit);
  ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

TEST(CheckpointFaultTest, CorruptionIsDetected) {
  const int trials = LongVariant() ? 5000 : 300;
  const int scaling_trials = trials / 4;  // of those, flips inside scaling/ sections
  std::mt19937_64 rng(Seed("corruption"));
  Runs runs;
  const fs::path run_dir = runs.dir() / "run";
  const ExitResult run = runs.Launch(run_dir, nullptr, false, "", 4, 2, 2);  // steps 2 and 4
  ASSERT_EQ(run.exit_code, 0) << run.log << ReadFile(run_dir / "logs/launch.log");
  const CheckpointDir dir(run_dir.string());
  ASSERT_TRUE(dir.Verify(2).ok());
  ASSERT_TRUE(dir.Verify(4).ok());

  struct File {
    std::string path;
    uint64_t size;
    std::vector<SectionSpan> sections;
  };
  std::vector<File> files;
  std::vector<std::pair<size_t, size_t>> scaling;  // (file, section) of every scaling/ section
  for (const std::string name : {"rank-00000.shard", "rank-00001.shard", "MANIFEST"}) {
    const std::string path = dir.CommittedDir(4) + "/" + name;
    const std::string bytes = ReadFile(path);
    files.push_back({path, bytes.size(), ParseSections(bytes)});
    for (size_t k = 0; k < files.back().sections.size(); ++k) {
      if (files.back().sections[k].name.starts_with("scaling/")) {
        scaling.emplace_back(files.size() - 1, k);
      }
    }
  }
  ASSERT_FALSE(scaling.empty()) << "the shards have no scaling/ sections";

  int detected = 0, fell_back = 0, in_section_named = 0, in_section = 0;
  std::map<std::string, int> per_file;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < trials; ++t) {
    size_t f = 0;
    uint64_t offset = 0;
    if (t < scaling_trials) {
      const auto [fi, si] = scaling[rng() % scaling.size()];
      const SectionSpan& s = files[fi].sections[si];
      if (s.end == s.begin) continue;
      f = fi;
      offset = s.begin + rng() % (s.end - s.begin);
    } else {
      f = rng() % files.size();
      offset = rng() % files[f].size;
    }
    const int bit = static_cast<int>(rng() % 8);
    const File& file = files[f];
    const std::string trial = "trial " + std::to_string(t) + ": bit " + std::to_string(bit) +
                              " of byte " + std::to_string(offset) + " of " + file.path;
    ++per_file[fs::path(file.path).filename().string()];
    FlipBit(file.path, offset, bit);

    const absl::StatusOr<v1::CheckpointManifest> verified = dir.Verify(4);
    const std::string message(verified.status().message());
    const bool named = absl::IsDataLoss(verified.status()) &&
                       message.find(file.path) != std::string::npos &&
                       message.find(" offset ") != std::string::npos;
    EXPECT_TRUE(named) << trial << ": " << verified.status();
    detected += named ? 1 : 0;
    for (const SectionSpan& s : file.sections) {
      if (offset < s.begin || offset >= s.end) continue;
      // Inside a section's bytes: the message names the section and its byte range.
      ++in_section;
      const std::string range = "[" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")";
      const bool both = message.find("section \"" + s.name + "\"") != std::string::npos &&
                        message.find(range) != std::string::npos;
      EXPECT_TRUE(both) << trial << " (section " << s.name << " " << range << "): " << message;
      in_section_named += both ? 1 : 0;
    }
    std::vector<std::string> refused;
    const absl::StatusOr<ResumePoint> point = dir.FindNewestValid(&refused);
    const bool back = point.ok() && point->step == 2 && refused.size() == 1;
    EXPECT_TRUE(back) << trial << ": " << point.status();
    fell_back += back ? 1 : 0;

    FlipBit(file.path, offset, bit);  // restore
    if (HasFailure()) break;
  }
  ASSERT_TRUE(dir.Verify(4).ok()) << "the restored checkpoint does not verify";
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int done =
      per_file["rank-00000.shard"] + per_file["rank-00001.shard"] + per_file["MANIFEST"];
  std::printf(
      "corruption: %d trials (rank-00000.shard %d, rank-00001.shard %d, MANIFEST %d; %d aimed "
      "inside scaling/ sections), %d/%d detected as DataLoss naming file and offset, %d/%d "
      "inside a section named it and its byte range, %d/%d fell back to the previous "
      "checkpoint, %.1f s\n",
      done, per_file["rank-00000.shard"], per_file["rank-00001.shard"], per_file["MANIFEST"],
      scaling_trials, detected, done, in_section_named, in_section, fell_back, done, seconds);
  EXPECT_EQ(detected, done);
  EXPECT_EQ(fell_back, done);
}

// A resume that cannot work is refused before any rank trains, with exit code 2, under the
// controller and standalone, and `--max-restarts` does not retry it (issue 19 point 2): the
// model differs; the newest checkpoint is intact but in a shard format this build cannot read
// (no fall-back to an older one, which would lose its steps); every committed checkpoint is
// corrupt (nothing is moved aside, and the run does not silently start afresh). Once repaired,
// the same resume works.
TEST(CheckpointFaultTest, ResumesThatCannotWorkAreRefusedUpFront) {
  using ::testing::HasSubstr;
  using ::testing::Not;
  Runs runs;
  std::unique_ptr<ControllerProcess> controller = runs.StartController(runs.dir() / "state");
  ASSERT_NE(controller, nullptr);
  const fs::path run_dir = runs.dir() / "refuse";
  const ExitResult first = runs.Launch(run_dir, controller.get(), false, "", 4, 2, 2);
  ASSERT_EQ(first.exit_code, 0) << first.log << ReadFile(run_dir / "logs/launch.log");
  const CheckpointDir dir(run_dir.string());
  const std::vector<std::string> retries = {"--max-restarts", "2"};
  auto expect_refused = [&](const ExitResult& r, const std::string& why) {
    EXPECT_EQ(r.exit_code, 2) << r.log;
    EXPECT_THAT(r.log, HasSubstr(why));
    EXPECT_THAT(r.log, Not(HasSubstr("restarting"))) << r.log;
    EXPECT_THAT(ReadFile(run_dir / "logs/launch.log"), Not(HasSubstr("resuming after step")));
    const absl::StatusOr<std::vector<int64_t>> committed = dir.ListCommitted();
    ASSERT_TRUE(committed.ok());
    EXPECT_EQ(*committed, (std::vector<int64_t>{2, 4})) << "a refused resume moves nothing";
  };

  // 1. Another model: the field is named.
  std::vector<std::string> other_model = retries;
  other_model.insert(other_model.end(), {"--set", "model.d_ff=256"});
  SCOPED_TRACE("different model");
  expect_refused(runs.Launch(run_dir, controller.get(), true, "", 6, 2, 2, other_model),
                 "was written for a different model");

  // 2. Step 4's rank-1 shard intact but in shard format version 99 (trailer recomputed).
  const std::string shard = dir.CommittedDir(4) + "/rank-00001.shard";
  const std::string original = ReadFile(shard);
  {
    std::string bytes = original;
    const uint32_t version = 99;
    std::memcpy(bytes.data() + 8, &version, 4);
    const uint64_t trailer = XXH64(bytes.data(), bytes.size() - 8, 0);
    std::memcpy(bytes.data() + bytes.size() - 8, &trailer, 8);
    test::WriteFile(shard, bytes);
  }
  expect_refused(runs.Launch(run_dir, controller.get(), true, "", 6, 2, 2, retries),
                 "shard format version 99");
  expect_refused(runs.Launch(run_dir, nullptr, true, "", 6, 2, 2, retries),
                 "shard format version 99");
  test::WriteFile(shard, original);

  // 3. Every committed checkpoint corrupt: one bit of each rank-0 shard's body.
  for (const int64_t step : {2, 4}) {
    const std::string path = dir.CommittedDir(step) + "/rank-00000.shard";
    FlipBit(path, fs::file_size(path) / 2, 3);
  }
  expect_refused(runs.Launch(run_dir, controller.get(), true, "", 6, 2, 2, retries),
                 "every committed checkpoint in " + dir.root() + " is refused");
  expect_refused(runs.Launch(run_dir, nullptr, true, "", 6, 2, 2, retries),
                 "no committed checkpoint in " + dir.root() + " verifies");
  for (const int64_t step : {2, 4}) {
    const std::string path = dir.CommittedDir(step) + "/rank-00000.shard";
    FlipBit(path, fs::file_size(path) / 2, 3);
  }

  // Repaired but for step 4: the resume falls back to step 2, and the launcher's terminal says
  // why, naming the file and the checksum (the controller's checkpoint_refused event).
  const std::string newest = dir.CommittedDir(4) + "/rank-00000.shard";
  FlipBit(newest, fs::file_size(newest) / 2, 3);
  runs.set_quiet(false);
  const ExitResult resumed = runs.Launch(run_dir, controller.get(), true, "", 6, 2, 2, retries);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.log;
  EXPECT_THAT(resumed.log, HasSubstr("fp8rt launch: controller: step 4: checkpoint refused: "));
  EXPECT_THAT(resumed.log, HasSubstr(newest));
  EXPECT_THAT(resumed.log, HasSubstr("checksum mismatch"));
  EXPECT_THAT(resumed.log, HasSubstr("fp8rt launch: controller: step 6: run finished"));
  EXPECT_THAT(ReadFile(run_dir / "logs/launch.log"), HasSubstr("resuming after step 2"));
}

// ---------------------------------------------------------------------------------------------
// 3. Disk full

TEST(CheckpointFaultTest, DiskFullDuringSave) {
  std::mt19937_64 rng(Seed("disk-full"));
  Runs runs;
  struct Case {
    bool controller;  // under fp8rt-controller (else --no-controller: rank 0 commits)
    std::string point;
    int rank;  // -1: the controller (commit_manifest under a controller)
  };
  std::vector<Case> cases = {{false, "shard_bytes", 1},
                             {false, "commit_manifest", 0},
                             {true, "shard_bytes", 0},
                             {true, "commit_manifest", -1}};
  if (LongVariant()) {
    cases.clear();
    const std::vector<std::string> points = {"shard_open", "shard_bytes", "shard_fsync",
                                             "commit_manifest"};
    for (int i = 0; i < 20; ++i) {
      Case c{i % 2 == 1, points[rng() % points.size()], static_cast<int>(rng() % 2)};
      if (c.point == "commit_manifest") c.rank = c.controller ? -1 : 0;  // where Commit runs
      cases.push_back(c);
    }
  }
  // 6 steps, a checkpoint every 3 and keep 1: the save of step 6 fails, so retention must keep 3.
  constexpr int kDiskSteps = 6;
  uint64_t shard_size = 0;
  int reported = 0, clean = 0, kept = 0, resumed_ok = 0;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::string fault = c.point + ":enospc:step=6";
    if (c.rank >= 0) fault += ":rank=" + std::to_string(c.rank);
    if (c.point == "shard_bytes") {
      fault += ":after_bytes=" + std::to_string(shard_size > 0 ? rng() % shard_size : 4096);
    }
    const std::string trial = "case " + std::to_string(i) + " (" +
                              (c.controller ? "controller" : "standalone") +
                              ", FP8RT_FAULT_POINT=" + fault + ")";
    std::printf("disk-full: %s\n", trial.c_str());
    std::fflush(stdout);
    SCOPED_TRACE(trial);
    const std::string run_id = "disk-" + std::to_string(i);
    const fs::path run_dir = runs.dir() / run_id;
    std::unique_ptr<ControllerProcess> controller;
    if (c.controller) {
      controller = runs.StartController(runs.dir() / ("disk-state-" + std::to_string(i)),
                                        c.rank < 0 ? fault : "");
      ASSERT_NE(controller, nullptr);
    }
    const ExitResult failed =
        runs.Launch(run_dir, controller.get(), false, c.rank < 0 ? "" : fault, kDiskSteps, 3, 1);
    EXPECT_EQ(failed.exit_code, 1) << failed.log;
    const std::string log = ReadFile(run_dir / "logs/launch.log");
    // Every rank reports it: its error names the step and the full disk (its own, or the failing
    // rank's / the commit's, which it quotes).
    bool all = true;
    for (int r = 0; r < 2; ++r) {
      const std::string prefix = "fp8rt-worker: rank " + std::to_string(r) + ": ";
      size_t at = log.find(prefix);
      bool found = false;
      for (; at != std::string::npos && !found; at = log.find(prefix, at + 1)) {
        const std::string line = log.substr(at, log.find('\n', at) - at);
        found = line.find("checkpoint step 6") != std::string::npos &&
                line.find("No space left on device") != std::string::npos;
      }
      EXPECT_TRUE(found) << "rank " << r << " does not report the full disk:\n" << log;
      all = all && found;
    }
    reported += all ? 1 : 0;
    const std::vector<std::string> left = Leftovers(run_dir);
    EXPECT_EQ(left, std::vector<std::string>());
    clean += left.empty() ? 1 : 0;
    const std::vector<int64_t> committed = CommittedAndVerified(run_dir, trial);
    EXPECT_EQ(committed, std::vector<int64_t>{3});
    bool previous_kept = committed == std::vector<int64_t>{3};
    if (controller) {
      previous_kept =
          previous_kept && PartialListedByController(*controller, run_id, run_dir, trial) == 0;
    }
    kept += previous_kept ? 1 : 0;
    if (shard_size == 0 && !committed.empty()) {
      shard_size =
          fs::file_size(CheckpointDir(run_dir.string()).CommittedDir(3) + "/rank-00000.shard");
    }

    // What an operator does next (or `fp8rt launch --max-restarts`): resume, from step 3.
    if (c.controller && c.rank < 0) {
      controller.reset();  // disarm: the same state, without the fault
      controller = runs.StartController(runs.dir() / ("disk-state-" + std::to_string(i)));
      ASSERT_NE(controller, nullptr);
    }
    const ExitResult resumed = runs.Launch(run_dir, controller.get(), true, "", kDiskSteps, 3, 1);
    const std::string resume_log = ReadFile(run_dir / "logs/launch.log").substr(log.size());
    EXPECT_EQ(resumed.exit_code, 0) << resumed.log << resume_log;
    EXPECT_EQ(ResumedFrom(resume_log), 3) << resume_log;
    const bool finished = resumed.exit_code == 0 &&
                          CommittedAndVerified(run_dir, trial) == std::vector<int64_t>{6} &&
                          Leftovers(run_dir).empty();
    EXPECT_TRUE(finished);
    resumed_ok += finished ? 1 : 0;
    if (!HasFailure()) fs::remove_all(run_dir);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int n = static_cast<int>(cases.size());
  std::printf(
      "disk-full: %d saves failed with ENOSPC, %d/%d reported by every rank, %d/%d left no temp "
      "folder or file, %d/%d kept the previous checkpoint (keep 1), %d/%d resumed and finished, "
      "%.0f s\n",
      n, reported, n, clean, n, kept, n, resumed_ok, n, seconds);
}

}  // namespace
}  // namespace fp8rt
