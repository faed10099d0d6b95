// Fault points: see fault_point.h for the variable and the points.
//
// Index: the point names, the spec parser, the armed spec (parsed once), the hooks.
#include "runtime/core/fault_point.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/core/check.h"

namespace fp8rt {
namespace {

constexpr std::array<std::string_view, 11> kNames = {
    "shard_open",     "shard_bytes", "shard_fsync",         "shard_rename",
    "shard_renamed",  "shard_acked", "commit_manifest",     "commit_manifest_written",
    "commit_renamed", "prune",       "controller_committed"};

enum class Action : uint8_t { kKill, kEnospc };

struct Spec {
  bool armed = false;
  FaultPoint point = FaultPoint::kShardOpen;
  Action action = Action::kKill;
  int rank = -1;      // -1: any process
  int64_t step = -1;  // -1: any save
  uint64_t after_bytes = 0;
};

bool EnospcAllowed(FaultPoint p) {
  return p == FaultPoint::kShardOpen || p == FaultPoint::kShardBytes ||
         p == FaultPoint::kShardFsync || p == FaultPoint::kCommitManifest;
}

// (This abseil's string_view is its own type: std::string at the absl calls.)
absl::StatusOr<Spec> Parse(const std::string& text) {
  Spec spec;
  if (text.empty()) return spec;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(kFaultPointVariable), "='", text,
                                                   "': ", why,
                                                   " (form: <point>:kill|enospc[:rank=R][:step=S]"
                                                   "[:after_bytes=B])"));
  };
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() < 2) return bad("needs a point and an action");
  size_t i = 0;
  while (i < kNames.size() && kNames[i] != parts[0]) ++i;
  if (i == kNames.size()) return bad(absl::StrCat("unknown point '", parts[0], "'"));
  spec.point = static_cast<FaultPoint>(i);
  if (parts[1] == "kill") {
    spec.action = Action::kKill;
  } else if (parts[1] == "enospc") {
    spec.action = Action::kEnospc;
    if (!EnospcAllowed(spec.point)) {
      return bad(absl::StrCat("enospc is not possible at ", parts[0],
                              " (shard_open, shard_bytes, shard_fsync, commit_manifest)"));
    }
  } else {
    return bad(absl::StrCat("unknown action '", parts[1], "'"));
  }
  bool have_bytes = false;
  for (size_t k = 2; k < parts.size(); ++k) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(parts[k], '=');
    int64_t value = 0;
    if (!absl::SimpleAtoi(kv.second, &value) || value < 0) {
      return bad(absl::StrCat("'", parts[k], "' needs a non-negative integer"));
    }
    if (kv.first == "rank") {
      spec.rank = static_cast<int>(value);
    } else if (kv.first == "step") {
      spec.step = value;
    } else if (kv.first == "after_bytes") {
      spec.after_bytes = static_cast<uint64_t>(value);
      have_bytes = true;
    } else {
      return bad(absl::StrCat("unknown field '", kv.first, "'"));
    }
  }
  if (spec.point == FaultPoint::kShardBytes && !have_bytes) {
    return bad("shard_bytes needs after_bytes=B");
  }
  if (spec.point != FaultPoint::kShardBytes && have_bytes) {
    return bad("after_bytes only goes with shard_bytes");
  }
  spec.armed = true;
  return spec;
}

int ProcessRank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    const char* v = std::getenv(var);
    int rank = 0;
    if (v != nullptr && absl::SimpleAtoi(v, &rank)) return rank;
  }
  return -1;
}

std::once_flag once;
Spec armed;  // fixed at the first hook (call_once) or by ArmFaultPoint
int process_rank = -1;
thread_local int64_t save_step = -1;  // the save this thread is doing

const Spec& Armed() {
  std::call_once(once, [] {
    process_rank = ProcessRank();
    const char* text = std::getenv(std::string(kFaultPointVariable).c_str());
    if (text == nullptr) return;
    absl::StatusOr<Spec> spec = Parse(text);
    FP8RT_CHECK(spec.ok()) << spec.status().message();
    armed = *spec;
  });
  return armed;
}

bool Matches(const Spec& spec, FaultPoint point, int64_t step) {
  if (!spec.armed || spec.point != point) return false;
  if (spec.rank >= 0 && spec.rank != process_rank) return false;
  if (step < 0) step = save_step;
  return spec.step < 0 || spec.step == step;
}

[[noreturn]] void Kill(FaultPoint point, int64_t step) {
  std::fprintf(stderr, "fp8rt: %s kills this process (pid %d, rank %d) at %s, step %lld\n",
               std::string(kFaultPointVariable).c_str(), static_cast<int>(::getpid()), process_rank,
               std::string(FaultPointName(point)).c_str(),
               static_cast<long long>(step < 0 ? save_step : step));
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached
}

}  // namespace

std::string_view FaultPointName(FaultPoint point) { return kNames[static_cast<size_t>(point)]; }

absl::Status InjectFault(FaultPoint point, int64_t step, std::string_view path) {
  const Spec& spec = Armed();
  if (!Matches(spec, point, step)) return absl::OkStatus();
  if (spec.action == Action::kKill) Kill(point, step);
  return absl::ErrnoToStatus(ENOSPC, absl::StrCat("write to ", std::string(path), " (injected by ",
                                                  std::string(kFaultPointVariable), " at ",
                                                  std::string(FaultPointName(point)), ")"));
}

void InjectKill(FaultPoint point, int64_t step) {
  const Spec& spec = Armed();
  if (Matches(spec, point, step) && spec.action == Action::kKill) Kill(point, step);
}

std::optional<uint64_t> FaultByteLimit(int64_t step) {
  const Spec& spec = Armed();
  if (!Matches(spec, FaultPoint::kShardBytes, step)) return std::nullopt;
  return spec.after_bytes;
}

void SetFaultStep(int64_t step) { save_step = step; }
int64_t FaultStep() { return save_step; }

absl::Status ArmFaultPoint(std::string_view text) {
  Armed();  // the environment is read first, so that a later first hook does not override this
  absl::StatusOr<Spec> spec = Parse(std::string(text));
  if (!spec.ok()) return spec.status();
  armed = *spec;
  return absl::OkStatus();
}

}  // namespace fp8rt
