// Committed checkpoint folders: see checkpoint_dir.h for the layout and the error contract.
//
// Index: names and step parsing, filesystem helpers (Exists, SyncFolder, RemoveFolder, HashFile),
// the manifest shape check shared by Commit and Verify, ParseManifest, then CheckpointDir's
// methods.
#include "runtime/checkpoint/checkpoint_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "runtime/checkpoint/checkpoint_io.h"
#include "runtime/core/fault_point.h"
#include "runtime/core/status.h"

namespace fp8rt {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kMaxStep = 99999999;  // the largest step with 8 digits
constexpr int kStepDigits = 8;
constexpr std::string_view kStepPrefix = "step-";
constexpr std::string_view kTempPrefix = ".tmp-step-";
// The one section of the MANIFEST file.
constexpr std::string_view kManifestSection = "manifest";

std::string Join(const std::string& dir, std::string_view name) {
  return (fs::path(dir) / fs::path(name)).string();
}

std::string Hex(uint64_t v) { return absl::StrCat("0x", absl::Hex(v, absl::kZeroPad16)); }

// The step of a folder named `prefix` followed by exactly 8 ASCII digits, or nullopt.
std::optional<int64_t> ParseStep(std::string_view name, std::string_view prefix) {
  if (name.size() != prefix.size() + kStepDigits || !name.starts_with(prefix)) return std::nullopt;
  int64_t step = 0;
  for (char c : name.substr(prefix.size())) {
    if (c < '0' || c > '9') return std::nullopt;
    step = step * 10 + (c - '0');
  }
  return step;
}

absl::Status StepInRange(int64_t step, std::string_view what) {
  if (step < 0 || step > kMaxStep) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": step ", step, " is outside [0, ", kMaxStep, "]"));
  }
  return absl::OkStatus();
}

absl::Status FromErrorCode(const std::error_code& ec, const std::string& what) {
  return absl::ErrnoToStatus(ec.value(), absl::StrCat(what, ": ", ec.message()));
}

// Whether `path` exists (without following a final symlink); errors other than "absent" are
// returned.
absl::StatusOr<bool> Exists(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return FromErrorCode(ec, absl::StrCat("checkpoint: stat ", path));
  }
  return fs::exists(st);
}

// fsyncs a folder, so that entries created or renamed in it survive a crash.
absl::Status SyncFolder(const std::string& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("checkpoint: open folder ", folder, " to fsync"));
  }
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (rc != 0) {
    return absl::ErrnoToStatus(fsync_errno, absl::StrCat("checkpoint: fsync folder ", folder));
  }
  return absl::OkStatus();
}

absl::Status RemoveFolder(const std::string& folder) {
  std::error_code ec;
  fs::remove_all(folder, ec);
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: remove ", folder));
  return absl::OkStatus();
}

absl::Status Rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint: rename ", from, " to ", to));
  }
  return absl::OkStatus();
}

struct FileDigest {
  uint64_t size = 0;
  uint64_t xxh64 = 0;
};

// Size and XXH64 (seed 0) of the whole file, streamed in 1 MiB reads so that a shard of any size
// is checked in bounded memory. NotFound if the file does not exist.
absl::StatusOr<FileDigest> HashFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint: open ", path));
  absl::Cleanup close_fd = [fd] { ::close(fd); };
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint: fstat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint: ", path, " is not a file"));
  }
  XXH64_state_t* state = XXH64_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("checkpoint: XXH64_createState");
  absl::Cleanup free_state = [state] { XXH64_freeState(state); };
  XXH64_reset(state, 0);
  std::vector<char> buffer(size_t{1} << 20);
  FileDigest digest;
  while (true) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("checkpoint: read ", path));
    }
    if (n == 0) break;
    XXH64_update(state, buffer.data(), static_cast<size_t>(n));
    digest.size += static_cast<uint64_t>(n);
  }
  digest.xxh64 = XXH64_digest(state);
  return digest;
}

// A name that stays inside the checkpoint folder and is not the manifest's.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name != kManifestFileName;
}

// Empty if the manifest's world size and shard list are consistent, else what is wrong: shards
// cover ranks 0..world_size-1 exactly once, with plain, distinct file names.
std::string ShapeProblem(const v1::CheckpointManifest& manifest) {
  if (manifest.world_size() < 1) {
    return absl::StrCat("world_size ", manifest.world_size(), " is < 1");
  }
  // Sized by the shards listed, never by world_size: a corrupt world_size of 2^31 - 1 in a
  // 60-byte MANIFEST must not cost 256 MiB (found by tests/fuzz/manifest_fuzzer).
  std::set<int32_t> seen;
  std::set<std::string> files;
  for (const v1::CheckpointShard& shard : manifest.shards()) {
    if (shard.rank() < 0 || shard.rank() >= manifest.world_size()) {
      return absl::StrCat("shard rank ", shard.rank(), " is outside [0, ", manifest.world_size(),
                          ")");
    }
    if (!seen.insert(shard.rank()).second) {
      return absl::StrCat("rank ", shard.rank(), " has more than one shard");
    }
    if (!IsPlainFileName(shard.file())) {
      return absl::StrCat("rank ", shard.rank(), "'s shard file name \"",
                          absl::CEscape(shard.file()), "\" is not a plain file name");
    }
    if (!files.insert(shard.file()).second) {
      return absl::StrCat("shard file ", shard.file(), " is listed for more than one rank");
    }
  }
  // The first missing rank is at most seen.size(), so this stops early whatever world_size says.
  for (int32_t r = 0; r < manifest.world_size(); ++r) {
    if (!seen.contains(r)) {
      return absl::StrCat("rank ", r, " has no shard (world_size ", manifest.world_size(), ")");
    }
  }
  return "";
}

// `status` (when not OK) with `prefix` in front of its message.
absl::Status Prefixed(const absl::Status& status, const std::string& prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, std::string(status.message())));
}

}  // namespace

std::string CheckpointName(int64_t step) {
  return absl::StrFormat("%s%08d", std::string(kStepPrefix), step);
}

std::string ShardFileName(int rank) { return absl::StrFormat("rank-%05d.shard", rank); }

CheckpointDir::CheckpointDir(std::string run_dir)
    : root_((fs::path(std::move(run_dir)) / "checkpoints").string()) {}

std::string CheckpointDir::TempDir(int64_t step) const {
  return Join(root_, absl::StrCat(std::string(".tmp-"), CheckpointName(step)));
}

std::string CheckpointDir::CommittedDir(int64_t step) const {
  return Join(root_, CheckpointName(step));
}

absl::StatusOr<std::string> CheckpointDir::PrepareTemp(int64_t step) const {
  FP8RT_RETURN_IF_ERROR(StepInRange(step, absl::StrCat("checkpoint: prepare in ", root_)));
  FP8RT_ASSIGN_OR_RETURN(const bool committed, Exists(CommittedDir(step)));
  if (committed) {
    return absl::AlreadyExistsError(
        absl::StrCat("checkpoint: ", CommittedDir(step), " is already committed"));
  }
  std::error_code ec;
  fs::create_directories(root_, ec);
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: create folder ", root_));
  const std::string temp = TempDir(step);
  FP8RT_RETURN_IF_ERROR(RemoveFolder(temp));
  fs::create_directory(temp, ec);
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: create folder ", temp));
  return temp;
}

absl::Status CheckpointDir::Commit(const v1::CheckpointManifest& manifest) const {
  const int64_t step = manifest.step();
  FP8RT_RETURN_IF_ERROR(StepInRange(step, absl::StrCat("checkpoint: commit in ", root_)));
  SetFaultStep(step);  // the MANIFEST write and a following Prune are this save's (fault_point.h)
  const std::string temp = TempDir(step);
  const std::string final_dir = CommittedDir(step);
  const std::string where = absl::StrCat("checkpoint commit of ", temp, ": ");
  if (const std::string problem = ShapeProblem(manifest); !problem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "bad manifest: ", problem));
  }
  FP8RT_ASSIGN_OR_RETURN(const bool committed, Exists(final_dir));
  if (committed) {
    return absl::AlreadyExistsError(absl::StrCat(where, final_dir, " already exists"));
  }
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(temp, ec))) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "the folder does not exist (no PrepareTemp, or it was removed)"));
  }

  for (const v1::CheckpointShard& shard : manifest.shards()) {
    const std::string path = Join(temp, shard.file());
    absl::StatusOr<FileDigest> digest = HashFile(path);
    if (absl::IsNotFound(digest.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, "shard file ", path, " of rank ", shard.rank(), " is missing"));
    }
    if (!digest.ok()) return Prefixed(digest.status(), where);
    if (digest->size != shard.size() || digest->xxh64 != shard.xxh64()) {
      return absl::DataLossError(
          absl::StrCat(where, "shard file ", path, " of rank ", shard.rank(), " is ", digest->size,
                       " bytes with XXH64 ", Hex(digest->xxh64), ", the manifest says ",
                       shard.size(), " bytes with XXH64 ", Hex(shard.xxh64())));
    }
  }

  ShardWriter writer;
  FP8RT_RETURN_IF_ERROR(writer.AddProto(kManifestSection, manifest));
  const std::string manifest_path = Join(temp, kManifestFileName);
  FP8RT_RETURN_IF_ERROR(
      Prefixed(InjectFault(FaultPoint::kCommitManifest, step, manifest_path), where));
  FP8RT_RETURN_IF_ERROR(Prefixed(writer.Write(manifest_path).status(), where));
  FP8RT_RETURN_IF_ERROR(Prefixed(SyncFolder(temp), where));
  InjectKill(FaultPoint::kCommitManifestWritten, step);
  FP8RT_RETURN_IF_ERROR(Prefixed(Rename(temp, final_dir), where));
  const absl::Status synced = SyncFolder(root_);
  if (!synced.ok()) {
    return Prefixed(
        synced, absl::StrCat(where, final_dir, " is committed but may not survive a power loss: "));
  }
  InjectKill(FaultPoint::kCommitRenamed, step);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> CheckpointDir::ListCommitted() const {
  std::vector<int64_t> steps;
  std::error_code ec;
  fs::directory_iterator it(root_, ec);
  if (ec == std::errc::no_such_file_or_directory) return steps;
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: list ", root_));
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const std::optional<int64_t> step = ParseStep(it->path().filename().string(), kStepPrefix);
    if (!step.has_value()) continue;
    std::error_code st_ec;
    if (!fs::is_directory(it->symlink_status(st_ec))) continue;
    if (!fs::is_regular_file(fs::symlink_status(it->path() / kManifestFileName, st_ec))) continue;
    steps.push_back(*step);
  }
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: list ", root_));
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<v1::CheckpointManifest> ParseManifest(const ShardReader& manifest_file,
                                                     int64_t step) {
  const std::string& manifest_path = manifest_file.path();
  v1::CheckpointManifest manifest;
  if (const absl::Status parsed = manifest_file.ParseProto(kManifestSection, &manifest);
      !parsed.ok()) {
    // A MANIFEST without its section is as corrupt as one that does not parse.
    return absl::DataLossError(std::string(parsed.message()));
  }
  if (manifest.step() != step) {
    return absl::DataLossError(absl::StrCat("corrupt checkpoint manifest ", manifest_path,
                                            ": it is of step ", manifest.step(),
                                            ", the folder of step ", step));
  }
  if (const std::string problem = ShapeProblem(manifest); !problem.empty()) {
    return absl::DataLossError(
        absl::StrCat("corrupt checkpoint manifest ", manifest_path, ": ", problem));
  }
  return manifest;
}

absl::StatusOr<v1::CheckpointManifest> CheckpointDir::Verify(int64_t step) const {
  const std::string dir = CommittedDir(step);
  FP8RT_ASSIGN_OR_RETURN(const bool exists, Exists(dir));
  if (!exists) return absl::NotFoundError(absl::StrCat("checkpoint ", dir, " does not exist"));

  const std::string manifest_path = Join(dir, kManifestFileName);
  FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> manifest_file,
                         ShardReader::Open(manifest_path));
  FP8RT_ASSIGN_OR_RETURN(v1::CheckpointManifest manifest, ParseManifest(*manifest_file, step));

  for (const v1::CheckpointShard& shard : manifest.shards()) {
    const std::string path = Join(dir, shard.file());
    // Open reads the whole file and verifies every section checksum and the trailer.
    FP8RT_ASSIGN_OR_RETURN(std::unique_ptr<ShardReader> reader, ShardReader::Open(path));
    if (reader->file_size() != shard.size() || reader->file_xxh64() != shard.xxh64()) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint shard ", path, " of rank ", shard.rank(), " is ", reader->file_size(),
          " bytes with XXH64 ", Hex(reader->file_xxh64()), ", its manifest ", manifest_path,
          " says ", shard.size(), " bytes with XXH64 ", Hex(shard.xxh64())));
    }
  }
  return manifest;
}

bool SameLayout(const v1::CheckpointManifest& m, const v1::RunSpec& spec) {
  const v1::RunSpec::Parallel& p = spec.parallel();
  return m.dp() == p.dp() && m.tp() == p.tp() && std::max(1, m.ep()) == std::max(1, p.ep());
}

absl::Status CheckResumable(const ResumePoint& point, const v1::RunSpec& spec) {
  const v1::CheckpointManifest& m = point.manifest;
  const v1::RunSpec::Parallel& p = spec.parallel();
  if (!SameLayout(m, spec)) {
    const std::string layouts =
        absl::StrCat("checkpoint ", point.dir, " was written at dp=", m.dp(), " tp=", m.tp(),
                     " ep=", m.ep(), " on ", m.world_size(), " ranks; this run has dp=", p.dp(),
                     " tp=", p.tp(), " ep=", std::max(1, p.ep()));
    // The data order is defined over global sequences per optimizer step (data_loader.h): the
    // stream continues with nothing skipped or repeated only at the same global batch.
    const auto global = [](const v1::RunSpec& s) {
      return static_cast<int64_t>(s.parallel().dp()) * s.train().micro_batch() *
             s.train().grad_accum();
    };
    if (global(m.spec()) != global(spec)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "train: ", layouts,
          "; a resume at another layout needs the same global batch "
          "parallel.dp x train.micro_batch x train.grad_accum: the checkpoint's is ",
          m.spec().parallel().dp(), " x ", m.spec().train().micro_batch(), " x ",
          m.spec().train().grad_accum(), " = ", global(m.spec()), ", this run's ", p.dp(), " x ",
          spec.train().micro_batch(), " x ", spec.train().grad_accum(), " = ", global(spec)));
    }
  }
  google::protobuf::util::MessageDifferencer differ;
  std::string diff;
  differ.ReportDifferencesToString(&diff);
  if (!differ.Compare(m.spec().model(), spec.model())) {
    constexpr size_t kMaxDiff = 256;
    if (diff.size() > kMaxDiff) diff = absl::StrCat(diff.substr(0, kMaxDiff), "...");
    for (char& c : diff) c = c == '\n' ? ';' : c;
    return absl::FailedPreconditionError(
        absl::StrCat("model: checkpoint ", point.dir,
                     " was written for a different model (checkpoint -> this run): ", diff));
  }
  return absl::OkStatus();
}

absl::StatusOr<ResumePoint> CheckpointDir::FindNewestValid(
    std::vector<std::string>* refused) const {
  FP8RT_ASSIGN_OR_RETURN(const std::vector<int64_t> steps, ListCommitted());
  int refusals = 0;
  std::string newest_refusal;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    absl::StatusOr<v1::CheckpointManifest> manifest = Verify(*it);
    if (manifest.ok()) return ResumePoint{*it, CommittedDir(*it), *std::move(manifest)};
    // Intact but in a format this build cannot read: resuming from an older checkpoint would
    // silently lose progress, so the whole resume is refused.
    if (absl::IsFailedPrecondition(manifest.status())) return manifest.status();
    const std::string message(manifest.status().message());
    if (refusals++ == 0) newest_refusal = message;
    if (refused != nullptr) refused->push_back(message);
  }
  if (refusals == 0) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", root_));
  }
  return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", root_, " verifies (",
                                          refusals, " refused; the newest: ", newest_refusal, ")"));
}

absl::StatusOr<std::vector<int64_t>> CheckpointDir::Prune(int keep) const {
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint: prune of ", root_, ": keep ", keep, " is < 1"));
  }
  FP8RT_ASSIGN_OR_RETURN(const std::vector<int64_t> steps, ListCommitted());
  std::vector<int64_t> deleted;
  if (steps.size() <= static_cast<size_t>(keep)) return deleted;
  const size_t doomed = steps.size() - static_cast<size_t>(keep);
  for (size_t i = 0; i < doomed; ++i) {
    // Renamed to its temp name first: the checkpoint vanishes at once, and a crash part-way
    // through the delete leaves a .tmp-step-* folder rather than a torn committed one.
    const std::string temp = TempDir(steps[i]);
    FP8RT_RETURN_IF_ERROR(RemoveFolder(temp));
    FP8RT_RETURN_IF_ERROR(Rename(CommittedDir(steps[i]), temp));
    FP8RT_RETURN_IF_ERROR(SyncFolder(root_));
    InjectKill(FaultPoint::kPrune, -1);
    FP8RT_RETURN_IF_ERROR(RemoveFolder(temp));
    deleted.push_back(steps[i]);
  }
  return deleted;
}

absl::StatusOr<int> CheckpointDir::RemoveStaleTemps() const {
  std::vector<std::string> temps;
  std::error_code ec;
  fs::directory_iterator it(root_, ec);
  if (ec == std::errc::no_such_file_or_directory) return 0;
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: list ", root_));
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (!it->path().filename().string().starts_with(kTempPrefix)) continue;
    std::error_code st_ec;
    if (!fs::is_directory(it->symlink_status(st_ec))) continue;
    temps.push_back(it->path().string());
  }
  if (ec) return FromErrorCode(ec, absl::StrCat("checkpoint: list ", root_));
  for (const std::string& temp : temps) FP8RT_RETURN_IF_ERROR(RemoveFolder(temp));
  return static_cast<int>(temps.size());
}

}  // namespace fp8rt
